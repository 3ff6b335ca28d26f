#include <actorpipe/profile.hpp>

#include <algorithm>
#include <chrono>

#include <torch/torch.h>

namespace actorpipe {
namespace {

double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  return xs.empty() ? 0 : xs[xs.size() / 2];
}

double ms_between(std::chrono::steady_clock::time_point a,
                  std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

} // namespace

std::vector<layer_profile> profile_layers(const layer_list& layers, const torch::Tensor& sample,
                                          int repeats) {
  ACTORPIPE_CHECK(repeats >= 1, "profile repeats (", repeats, ") must be >= 1");
  std::vector<torch::Tensor> saved_buffers;
  {
    torch::NoGradGuard no_grad;
    for (const auto& l : layers) {
      if (auto m = l.module()) {
        m->train(true);
        for (auto& b : m->buffers()) {
          saved_buffers.push_back(b.clone());
        }
      }
    }
  }
  std::vector<layer_profile> result;
  bundle x(sample.detach());
  for (const auto& l : layers) {
    layer_profile p;
    p.name = l.name();
    p.parameters = l.parameter_count();
    std::vector<double> forward;
    std::vector<double> backward;
    bundle y;
    for (int r = 0; r <= repeats; ++r) {
      // Float inputs take a gradient, as they do between stages.
      auto input = x;
      for (auto& t : input.tensors()) {
        t = t.is_floating_point() ? t.detach().requires_grad_(true) : t;
      }
      auto t0 = std::chrono::steady_clock::now();
      y = l.forward(input);
      auto t1 = std::chrono::steady_clock::now();
      std::vector<torch::Tensor> roots;
      std::vector<torch::Tensor> gradients;
      for (const auto& t : y.tensors()) {
        if (t.defined() && t.requires_grad()) {
          roots.push_back(t);
          gradients.push_back(torch::randn_like(t));
        }
      }
      if (!roots.empty()) {
        torch::autograd::backward(roots, gradients);
      }
      auto t2 = std::chrono::steady_clock::now();
      if (r > 0) { // the first run warms caches and allocators
        forward.push_back(ms_between(t0, t1));
        backward.push_back(ms_between(t1, t2));
      }
    }
    p.forward_ms = median(forward);
    p.backward_ms = median(backward);
    p.output_bytes = y.nbytes();
    result.push_back(p);
    x = y;
    for (auto& t : x.tensors()) {
      t = t.detach();
    }
  }
  torch::NoGradGuard no_grad;
  std::size_t i = 0;
  for (const auto& l : layers) {
    if (auto m = l.module()) {
      for (auto& param : m->parameters()) {
        param.mutable_grad().reset();
      }
      for (auto& b : m->buffers()) {
        b.copy_(saved_buffers[i++]);
      }
    }
  }
  return result;
}

partition partition_by_time(const std::vector<layer_profile>& profile, std::size_t stages) {
  std::vector<double> times;
  for (const auto& layer : profile) {
    times.push_back(layer.forward_ms + layer.backward_ms);
  }
  return partition_by_cost(times, stages);
}

std::vector<action_costs> costs_of(const std::vector<layer_profile>& profile, const partition& cut,
                                   double scale) {
  ACTORPIPE_CHECK(cut.stages() >= 1 && cut.bounds.back() == profile.size(), "costs_of: partition ",
                  cut.to_string(), " does not cover the ", profile.size(), " profiled layers");
  std::vector<action_costs> costs;
  for (std::size_t s = 0; s < cut.stages(); ++s) {
    action_costs c{0, 0, 0};
    double backward = 0;
    for (std::size_t i = cut.begin(s); i < cut.end(s); ++i) {
      c.forward += profile[i].forward_ms * scale;
      backward += profile[i].backward_ms * scale;
    }
    c.backward = s == 0 ? 0 : backward / 2;
    c.weight = backward - c.backward;
    costs.push_back(c);
  }
  return costs;
}

} // namespace actorpipe
