#include <actorpipe/memory.hpp>
#include <actorpipe/profile.hpp>

#include <algorithm>
#include <chrono>

#include <torch/torch.h>

#include "stages/device.hpp"
#include "stages/weight_pass.hpp"

namespace actorpipe {
namespace {

using clock = std::chrono::steady_clock;

double ms_between(clock::time_point a, clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Median and the interquartile range relative to it.
std::pair<double, double> median_and_spread(std::vector<double> xs) {
  if (xs.empty()) {
    return {0, 0};
  }
  std::sort(xs.begin(), xs.end());
  auto n = xs.size();
  auto median = n % 2 == 1 ? xs[n / 2] : (xs[n / 2 - 1] + xs[n / 2]) / 2;
  auto low = xs[n / 4];
  auto high = xs[n - 1 - n / 4];
  return {median, median > 0 ? (high - low) / median : 0};
}

// One layer's place in a round: what it gave, what takes a gradient, and its timings.
struct layer_run {
  bundle output;
  std::vector<torch::Tensor> inputs_with_grad;
  std::vector<torch::Tensor> roots;
  std::vector<torch::Tensor> gradients; // drawn once, reused every round
  std::vector<double> forward, backward, input_backward, weight_backward;
  // What each timed forward kept (layer_profile::retained_bytes), and what it and the fused
  // backward needed besides (forward_working_bytes, backward_working_bytes).
  std::vector<double> retained, forward_work, backward_work;
  // What B kept for W in each timed split backward (layer_profile::weight_kept_bytes).
  std::vector<double> weight_kept;
  // The count of what the latest forward kept, which its backward counts on.
  std::shared_ptr<memory::tally_count> kept;
};

void forward_layer(const layer& l, const bundle& x, bool first, layer_run& run) {
  bundle input = x;
  run.inputs_with_grad.clear();
  for (auto& t : input.tensors()) {
    t = t.detach();
    // Float inputs take a gradient between stages; the model's own input does not.
    if (!first && t.is_floating_point()) {
      t.requires_grad_(true);
      run.inputs_with_grad.push_back(t);
    }
  }
  run.output = l.forward(input);
  run.roots.clear();
  for (const auto& t : run.output.tensors()) {
    if (t.defined() && t.requires_grad()) {
      run.roots.push_back(t);
    }
  }
  if (run.gradients.size() != run.roots.size()) {
    run.gradients.clear();
    for (const auto& t : run.roots) {
      run.gradients.push_back(torch::randn_like(t));
    }
  }
}

std::vector<torch::Tensor> trainable(const layer& l) {
  std::vector<torch::Tensor> params;
  if (auto m = l.module()) {
    for (auto& p : m->parameters()) {
      if (p.requires_grad()) {
        params.push_back(p);
      }
    }
  }
  return params;
}

// The time now, once `device` has run what it was given (a GPU's kernels run after the host
// queued them).
clock::time_point done_on(c10::Device device) {
  stages::cuda::wait_for_current_stream(device);
  return clock::now();
}

// The layers' modules on `device` for the profile, and back where they were afterwards.
class on_device {
public:
  on_device(const layer_list& layers, c10::Device device) {
    if (device.is_cpu()) {
      return;
    }
    for (const auto& l : layers) {
      if (auto m = l.module()) {
        auto params = m->parameters();
        auto buffers = m->buffers();
        auto from = !params.empty()    ? params.front().device()
                    : !buffers.empty() ? buffers.front().device()
                                       : c10::Device(c10::kCPU);
        moved_.emplace_back(m, from);
        m->to(device);
      }
    }
  }
  ~on_device() {
    for (auto& [m, from] : moved_) {
      m->to(from);
    }
  }
  on_device(const on_device&) = delete;
  on_device& operator=(const on_device&) = delete;

private:
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, c10::Device>> moved_;
};

// Runs every layer forward in order (input -> output), timing each when `timed`.
void forward_all(const layer_list& layers, const bundle& sample, std::vector<layer_run>& runs,
                 bool timed, c10::Device device) {
  bundle x = sample;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    stages::memory_tally tally{device}; // what the forward keeps, as a stage's stash counts it
    auto t0 = clock::now();
    forward_layer(layers[i], x, i == 0, runs[i]);
    auto t1 = done_on(device);
    runs[i].kept = tally.count();
    if (timed) {
      runs[i].forward.push_back(ms_between(t0, t1));
      runs[i].retained.push_back(static_cast<double>(tally.live_bytes()));
      runs[i].forward_work.push_back(static_cast<double>(tally.peak_bytes() - tally.live_bytes()));
    }
    x = runs[i].output;
  }
}

// What a layer's backward needs above what was alive when it began (backward_working_bytes).
// On the CPU, where libtorch runs the graph on the calling thread, its allocations (the input
// gradient, temporaries) count with what the layer's forward kept, as a stage counts them, so
// that what it frees of that is subtracted: the peak of that count above its start. On a GPU,
// whose graphs run on autograd's device thread, the caching allocator's peak above what it held
// at the start (the device is the profile's alone).
class backward_working_set {
public:
  backward_working_set(c10::Device device, const std::shared_ptr<memory::tally_count>& kept)
    : device_(device), tally_(device, kept ? kept : std::make_shared<memory::tally_count>()) {
    if (device_.is_cuda()) {
      stages::cuda::wait_for_current_stream(device_);
      start_ = stages::cuda::allocated_bytes(device_);
      stages::cuda::reset_peak_allocated(device_);
    } else {
      tally_.reset_peak();
      start_ = tally_.live_bytes();
    }
  }
  int64_t bytes() const {
    return (device_.is_cuda() ? stages::cuda::peak_allocated_bytes(device_) : tally_.peak_bytes()) -
           start_;
  }

private:
  c10::Device device_;
  stages::memory_tally tally_;
  int64_t start_ = 0;
};

// What a layer's forward and backward leave allocated on a GPU once their tensors are gone, run
// after cuBLAS's workspaces were given back: the workspaces it makes, one for the thread of the
// forward and one for autograd's (layer_profile::workspace_bytes). 0 for a layer that
// multiplies no matrices.
int64_t workspaces_made(const layer& l, const bundle& x, bool first, c10::Device device) {
  stages::cuda::release_blas_workspaces(device);
  auto before = stages::cuda::allocated_bytes(device);
  {
    layer_run run;
    forward_layer(l, x, first, run);
    if (!run.roots.empty()) {
      torch::autograd::backward(run.roots, run.gradients);
    }
    stages::cuda::wait_for_current_stream(device);
  }
  return std::max<int64_t>(0, stages::cuda::allocated_bytes(device) - before);
}

// One untimed forward of the layers chained, as a stage runs them, holding only the latest
// output: per layer, what of its input was freed once it ran (nothing's graph saved it).
std::vector<int64_t> chained_frees(const layer_list& layers, const bundle& sample,
                                   c10::Device device) {
  std::vector<int64_t> freed(layers.size(), 0);
  stages::memory_tally tally{device};
  bundle x = sample;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    auto y = layers[i].forward(x);
    auto before = tally.live_bytes();
    x = std::move(y); // the previous output's last reference outside the graph
    freed[i] = std::max<int64_t>(0, before - tally.live_bytes());
  }
  return freed;
}

// One forward of the layers chained without autograd, as a recomputing stage runs its first
// forward: per layer, the most it had allocated at once (its output included).
std::vector<int64_t> no_grad_peaks(const layer_list& layers, const bundle& sample,
                                   c10::Device device) {
  std::vector<int64_t> peaks(layers.size(), 0);
  torch::NoGradGuard no_grad;
  bundle x = sample;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    stages::memory_tally tally{device};
    auto y = layers[i].forward(x);
    peaks[i] = tally.peak_bytes();
    x = std::move(y);
  }
  return peaks;
}

// The medians of every layer's rounds, its sizes, and what it keeps and frees.
std::vector<layer_profile> profiles_of(const layer_list& layers, const std::vector<layer_run>& runs,
                                       const bundle& input, c10::Device device) {
  auto freed = chained_frees(layers, input, device);
  auto no_grad = no_grad_peaks(layers, input, device);
  std::vector<layer_profile> result;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const auto& r = runs[i];
    layer_profile p;
    p.name = layers[i].name();
    p.parameters = layers[i].parameter_count();
    std::tie(p.forward_ms, p.forward_spread) = median_and_spread(r.forward);
    std::tie(p.backward_ms, p.backward_spread) = median_and_spread(r.backward);
    p.input_backward_ms = median_and_spread(r.input_backward).first;
    p.weight_backward_ms = median_and_spread(r.weight_backward).first;
    p.output_bytes = r.output.nbytes();
    p.input_bytes = i == 0 ? input.nbytes() : runs[i - 1].output.nbytes();
    p.retained_bytes = static_cast<int64_t>(median_and_spread(r.retained).first);
    p.forward_working_bytes = static_cast<int64_t>(median_and_spread(r.forward_work).first);
    p.backward_working_bytes = static_cast<int64_t>(median_and_spread(r.backward_work).first);
    p.freed_input_bytes = freed[i];
    p.no_grad_forward_bytes = no_grad[i];
    if (!r.weight_kept.empty()) {
      p.weight_kept_bytes = static_cast<int64_t>(median_and_spread(r.weight_kept).first);
    }
    result.push_back(std::move(p));
  }
  return result;
}

// Every layer in training mode; a copy of their buffers, which profiling changes.
std::vector<torch::Tensor> train_and_save_buffers(const layer_list& layers) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> saved;
  for (const auto& l : layers) {
    if (auto m = l.module()) {
      m->train(true);
      for (auto& b : m->buffers()) {
        saved.push_back(b.clone());
      }
    }
  }
  return saved;
}

// The layers as they were before profiling: no gradients, their buffers back.
void restore_layers(const layer_list& layers, const std::vector<torch::Tensor>& saved) {
  torch::NoGradGuard no_grad;
  std::size_t i = 0;
  for (const auto& l : layers) {
    if (auto m = l.module()) {
      for (auto& param : m->parameters()) {
        param.mutable_grad().reset();
      }
      for (auto& b : m->buffers()) {
        b.copy_(saved[i++]);
      }
    }
  }
}

// The fused backward, last layer first, each from its own output gradient.
void time_fused_backward(std::vector<layer_run>& runs, bool timed, c10::Device device) {
  for (std::size_t k = runs.size(); k-- > 0;) {
    auto& r = runs[k];
    backward_working_set working{device, r.kept};
    auto t0 = clock::now();
    if (!r.roots.empty()) {
      torch::autograd::backward(r.roots, r.gradients);
    }
    auto t1 = done_on(device);
    if (timed) {
      r.backward.push_back(ms_between(t0, t1));
      r.backward_work.push_back(static_cast<double>(working.bytes()));
    }
  }
}

// The backward split as a stage runs B and W (stage::backward_input, backward_weight): W is the
// weight pass on what B kept where it applies, else a second walk of the graph.
void time_split_backward(const layer_list& layers, std::vector<layer_run>& runs, bool timed,
                         c10::Device device) {
  for (std::size_t k = layers.size(); k-- > 0;) {
    auto& r = runs[k];
    auto params = trainable(layers[k]);
    double input_ms = 0; // nothing to time: a layer without input gradients or weights
    double weight_ms = 0;
    int64_t kept = 0;
    std::shared_ptr<stages::weight_pass> pass;
    if (!r.roots.empty() && !r.inputs_with_grad.empty()) {
      auto t0 = clock::now();
      pass = stages::weight_pass::prepare(r.roots, r.inputs_with_grad, params);
      stages::input_backward(r.roots, r.inputs_with_grad, r.gradients, pass.get());
      input_ms = ms_between(t0, done_on(device));
      kept = pass ? pass->kept_bytes() : 0;
    }
    if (!r.roots.empty() && !params.empty()) {
      auto t0 = clock::now();
      stages::weight_backward(r.roots, r.gradients, params, pass.get());
      weight_ms = ms_between(t0, done_on(device));
    }
    if (timed) {
      r.input_backward.push_back(input_ms);
      r.weight_backward.push_back(weight_ms);
      r.weight_kept.push_back(static_cast<double>(kept));
    }
  }
}

} // namespace

std::vector<layer_profile> profile_layers(const layer_list& layers, const torch::Tensor& sample,
                                          const profile_options& options) {
  ACTORPIPE_CHECK(options.repeats >= 1, "profile repeats (", options.repeats, ") must be >= 1");
  ACTORPIPE_CHECK(options.warmup >= 0, "profile warm-up passes (", options.warmup,
                  ") must be >= 0");
  auto saved_buffers = train_and_save_buffers(layers);
  const auto device = options.device;
  on_device placed(layers, device);
  std::vector<layer_run> runs(layers.size());
  const bundle input(sample.detach().to(device));
  torch::AutoGradMode grad_mode{true};
  for (int round = 0; round < options.warmup + options.repeats; ++round) {
    bool timed = round >= options.warmup;
    forward_all(layers, input, runs, timed, device);
    time_fused_backward(runs, timed, device);
    if (options.split_backward) {
      forward_all(layers, input, runs, /*timed=*/false, device);
      time_split_backward(layers, runs, timed, device);
    }
  }
  auto result = profiles_of(layers, runs, input, device);
  if (device.is_cuda()) {
    for (std::size_t i = 0; i < layers.size(); ++i) {
      result[i].workspace_bytes =
        workspaces_made(layers[i], i == 0 ? input : runs[i - 1].output, i == 0, device);
    }
    stages::cuda::release_blas_workspaces(device);
  }
  runs.clear();
  restore_layers(layers, saved_buffers);
  return result;
}

std::vector<layer_profile> profile_layers(const layer_list& layers, const torch::Tensor& sample,
                                          int repeats) {
  profile_options options;
  options.repeats = repeats;
  return profile_layers(layers, sample, options);
}

double profile_update(const layer_list& layers, int repeats, c10::Device device) {
  ACTORPIPE_CHECK(repeats >= 1, "profile repeats (", repeats, ") must be >= 1");
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> params;
  std::vector<torch::Tensor> grads;
  for (const auto& l : layers) {
    for (const auto& p : trainable(l)) {
      params.push_back(torch::empty_like(p, p.options().device(device)).fill_(1));
      grads.push_back(torch::empty_like(p, p.options().device(device)).fill_(1));
    }
  }
  std::vector<double> times;
  for (int r = 0; r <= repeats; ++r) {
    auto t0 = clock::now();
    for (std::size_t i = 0; i < params.size(); ++i) {
      params[i].add_(grads[i], -1e-3);
      grads[i].zero_();
    }
    if (r > 0) {
      times.push_back(ms_between(t0, done_on(device)));
    }
  }
  return median_and_spread(times).first;
}

double profile_spread(const std::vector<layer_profile>& profile, double floor_share) {
  double total = 0;
  for (const auto& l : profile) {
    total += l.forward_ms + l.backward_ms;
  }
  double spread = 0;
  for (const auto& l : profile) {
    if (l.forward_ms + l.backward_ms >= floor_share * total) {
      spread = std::max({spread, l.forward_spread, l.backward_spread});
    }
  }
  return spread;
}

partition partition_by_time(const std::vector<layer_profile>& profile, std::size_t stages) {
  std::vector<double> times;
  for (const auto& layer : profile) {
    times.push_back(layer.forward_ms + layer.backward_ms);
  }
  return partition_by_cost(times, stages);
}

partition partition_by_spec(const std::string& spec, const layer_list& layers, std::size_t parts,
                            const std::vector<layer_profile>& profile) {
  return spec == "time" ? partition_by_time(profile, parts) : parse_partition(spec, layers, parts);
}

std::vector<action_costs> costs_of(const std::vector<layer_profile>& profile, const partition& cut,
                                   double scale) {
  ACTORPIPE_CHECK(cut.stages() >= 1 && cut.bounds.back() == profile.size(), "costs_of: partition ",
                  cut.to_string(), " does not cover the ", profile.size(), " profiled layers");
  std::vector<action_costs> costs;
  for (std::size_t s = 0; s < cut.stages(); ++s) {
    action_costs c{0, 0, 0, 0};
    double input = 0;
    double weight = 0;
    double inner_input = 0; // input gradients of every layer but the part's first
    bool split_profiled = false;
    for (std::size_t i = cut.begin(s); i < cut.end(s); ++i) {
      const auto& l = profile[i];
      c.forward += l.forward_ms * scale;
      c.fused += l.backward_ms * scale;
      input += l.input_backward_ms * scale;
      weight += l.weight_backward_ms * scale;
      inner_input += i > cut.begin(s) ? l.input_backward_ms * scale : 0;
      split_profiled = split_profiled || l.input_backward_ms + l.weight_backward_ms > 0;
    }
    if (!split_profiled) { // halves of the fused backward
      c.backward = c.fused / 2;
      c.weight = c.fused - c.backward;
    } else {
      // B computes the part's input gradient; W reaches every layer's weights from the part's
      // output, so it walks through the inner layers' input gradients again.
      c.backward = input;
      c.weight = weight + inner_input;
    }
    if (s == 0) { // the model's first part computes no input gradient: W does all the work
      c.backward = 0;
      c.weight = c.fused;
    }
    costs.push_back(c);
  }
  return costs;
}

} // namespace actorpipe
