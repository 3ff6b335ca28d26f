#include "stages/stage.hpp"

#include <torch/autograd.h>
#include <torch/nn/module.h>

#include <actorpipe/errors.hpp>

namespace actorpipe::stages {
namespace {

std::string shape_of(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

// First line of a libtorch message: the rest is a C++ backtrace users cannot act on.
std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

} // namespace

stage::stage(stage_config config, layer_list layers) : config_(config), layers_(std::move(layers)) {
  ACTORPIPE_CHECK(!layers_.empty(), "stage ", config_.index, " has no layers");
  for (auto& l : layers_) {
    if (auto m = l.module()) {
      m->to(config_.device);
    }
  }
}

void stage::attach_optimizer(const optimizer_factory& make) {
  std::lock_guard<std::mutex> guard{mutex_};
  auto params = parameters();
  if (!params.empty()) {
    optimizer_ = make(std::move(params));
  }
}

std::vector<torch::Tensor> stage::parameters() const {
  std::vector<torch::Tensor> result;
  for (const auto& l : layers_) {
    if (auto m = l.module()) {
      for (auto& p : m->parameters()) {
        result.push_back(p);
      }
    }
  }
  return result;
}

std::vector<torch::Tensor> stage::buffers() const {
  std::vector<torch::Tensor> result;
  for (const auto& l : layers_) {
    if (auto m = l.module()) {
      for (auto& b : m->buffers()) {
        result.push_back(b);
      }
    }
  }
  return result;
}

std::string stage::where(int32_t microbatch) const {
  return detail::concat("stage ", config_.index, ", microbatch ", microbatch);
}

void stage::begin_step(bool train) {
  std::lock_guard<std::mutex> guard{mutex_};
  train_ = train;
  stash_.clear();
  peak_stash_ = 0;
  for (auto& l : layers_) {
    if (auto m = l.module()) {
      m->train(train);
    }
  }
  for (auto& p : parameters()) {
    p.mutable_grad().reset();
  }
  buffer_snapshot_.clear();
  if (train) {
    torch::NoGradGuard no_grad;
    for (auto& b : buffers()) {
      buffer_snapshot_.push_back(b.clone());
    }
  }
}

torch::Tensor stage::run(int32_t microbatch, const torch::Tensor& input) const {
  auto x = input;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const auto& l = layers_[i];
    try {
      x = l.forward(x);
    } catch (const std::exception& e) {
      std::string what = dynamic_cast<const c10::Error*>(&e) != nullptr
                           ? static_cast<const c10::Error&>(e).what_without_backtrace()
                           : e.what();
      std::string source;
      if (i > 0) {
        source = detail::concat("the output of layer '", layers_[i - 1].name(), "'");
      } else if (is_first()) {
        source = "the input";
      } else {
        source = detail::concat("the activation from stage ", config_.index - 1);
      }
      auto expected = l.expected_input();
      throw pipeline_error(detail::concat(
        where(microbatch), ": layer '", l.name(), "' (model layer ", config_.first_layer + i,
        ") cannot take ", source, " of shape ", shape_of(x),
        expected.empty() ? "" : "; it expects ", expected, ". libtorch: ", first_line(what)));
    }
  }
  return x;
}

torch::Tensor stage::forward(int32_t microbatch, const torch::Tensor& input) {
  std::lock_guard<std::mutex> guard{mutex_};
  auto x = input.to(config_.device);
  if (!train_) {
    torch::NoGradGuard no_grad;
    return run(microbatch, x);
  }
  torch::AutoGradMode grad_mode{true};
  ACTORPIPE_ASSERT(stash_.count(microbatch) == 0);
  x = x.detach();
  if (!is_first() && x.is_floating_point()) {
    x.requires_grad_(true);
  }
  auto y = run(microbatch, x);
  stash_[microbatch] = stash_entry{x, y};
  peak_stash_ = std::max(peak_stash_, stash_.size());
  return y.detach();
}

double stage::forward_loss(int32_t microbatch, const torch::Tensor& input,
                           const torch::Tensor& target, const loss_function& loss, double scale) {
  std::lock_guard<std::mutex> guard{mutex_};
  ACTORPIPE_ASSERT(train_ && is_last());
  torch::AutoGradMode grad_mode{true};
  ACTORPIPE_ASSERT(stash_.count(microbatch) == 0);
  auto x = input.to(config_.device).detach();
  if (!is_first() && x.is_floating_point()) {
    x.requires_grad_(true);
  }
  auto y = run(microbatch, x);
  torch::Tensor value;
  try {
    value = loss(y, target.to(config_.device));
  } catch (const c10::Error& e) {
    throw pipeline_error(detail::concat(where(microbatch), ": the loss function failed on output ",
                                        shape_of(y), " and target ", shape_of(target),
                                        ". libtorch: ", first_line(e.what_without_backtrace())));
  }
  if (value.numel() != 1) {
    throw pipeline_error(detail::concat(
      where(microbatch), ": the loss function must return a scalar, got shape ", shape_of(value)));
  }
  stash_[microbatch] = stash_entry{x, value * scale};
  peak_stash_ = std::max(peak_stash_, stash_.size());
  return value.item<double>();
}

torch::Tensor stage::backward(int32_t microbatch, const torch::Tensor& output_gradient) {
  std::lock_guard<std::mutex> guard{mutex_};
  auto it = stash_.find(microbatch);
  if (it == stash_.end()) {
    throw pipeline_error(detail::concat(where(microbatch), ": backward without a stashed forward"));
  }
  auto entry = std::move(it->second);
  stash_.erase(it);
  torch::AutoGradMode grad_mode{true};
  if (entry.output.requires_grad()) {
    if (is_last()) {
      torch::autograd::backward({entry.output});
    } else {
      auto g = output_gradient.to(config_.device);
      if (!g.sizes().equals(entry.output.sizes())) {
        throw pipeline_error(detail::concat(
          where(microbatch), ": the gradient from stage ", config_.index + 1, " has shape ",
          shape_of(g), " but the stage's output has shape ", shape_of(entry.output)));
      }
      torch::autograd::backward({entry.output}, {g});
    }
  }
  if (is_first() || !entry.input.requires_grad()) {
    return {};
  }
  auto grad = entry.input.grad();
  return grad.defined() ? grad.detach() : torch::zeros_like(entry.input);
}

void stage::abort_step() {
  std::lock_guard<std::mutex> guard{mutex_};
  stash_.clear();
  for (auto& p : parameters()) {
    p.mutable_grad().reset();
  }
  if (!buffer_snapshot_.empty()) {
    torch::NoGradGuard no_grad;
    auto current = buffers();
    ACTORPIPE_ASSERT(current.size() == buffer_snapshot_.size());
    for (std::size_t i = 0; i < current.size(); ++i) {
      current[i].copy_(buffer_snapshot_[i]);
    }
  }
}

void stage::optimizer_step() {
  std::lock_guard<std::mutex> guard{mutex_};
  if (optimizer_) {
    optimizer_->step();
  }
}

std::size_t stage::stash_size() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return stash_.size();
}

std::size_t stage::peak_stash() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return peak_stash_;
}

int64_t stage::parameter_count() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return actorpipe::parameter_count(layers_, 0, layers_.size());
}

std::vector<std::pair<std::string, torch::Tensor>> stage::named_tensors(bool gradients) const {
  std::lock_guard<std::mutex> guard{mutex_};
  std::vector<std::pair<std::string, torch::Tensor>> result;
  torch::NoGradGuard no_grad;
  for (const auto& l : layers_) {
    if (auto m = l.module()) {
      for (const auto& item : m->named_parameters()) {
        auto t = gradients ? item.value().grad() : item.value();
        result.emplace_back(l.name() + "." + item.key(), t.defined() ? t.detach().clone() : t);
      }
    }
  }
  return result;
}

} // namespace actorpipe::stages
