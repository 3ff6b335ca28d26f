#include <actorpipe/layers.hpp>

#include <actorpipe/batch_norm.hpp>

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <actorpipe/errors.hpp>

namespace actorpipe {

layer::layer(std::string name, torch::nn::AnyModule module)
  : name_(std::move(name)), module_(std::move(module)) {
  ACTORPIPE_CHECK(!module_.is_empty(), "layer '", name_, "': module is empty");
}

layer::layer(std::string name, layer_function fn) : name_(std::move(name)), fn_(std::move(fn)) {
  ACTORPIPE_CHECK(static_cast<bool>(fn_), "layer '", name_, "': function is empty");
}

layer::layer(std::string name, bundle_function fn)
  : name_(std::move(name)), bundle_fn_(std::move(fn)), bundles_(true) {
  ACTORPIPE_CHECK(static_cast<bool>(bundle_fn_), "layer '", name_, "': function is empty");
}

layer layer::over_bundles(std::string name, torch::nn::AnyModule module) {
  layer result(std::move(name), std::move(module));
  result.bundles_ = true;
  return result;
}

std::shared_ptr<torch::nn::Module> layer::module() const {
  return is_function() ? nullptr : module_.ptr();
}

torch::Tensor layer::forward(const torch::Tensor& x) const {
  if (bundles_) {
    auto y = forward(bundle(x));
    // The name is only spelt out when it is needed: this runs per layer and micro-batch.
    return y.size() == 1 ? y[0] : y.single(detail::concat("the output of layer '", name_, "'"));
  }
  if (fn_) {
    return fn_(x);
  }
  return module_.forward<torch::Tensor>(x);
}

bundle layer::forward(const bundle& x) const {
  if (!bundles_) {
    return forward(x.size() == 1 ? x[0] : x.single(detail::concat("layer '", name_, "'")));
  }
  if (bundle_fn_) {
    return bundle_fn_(x);
  }
  return module_.forward<bundle>(x);
}

int64_t layer::parameter_count() const {
  int64_t total = 0;
  if (!is_function()) {
    for (const auto& p : module_.ptr()->parameters()) {
      total += p.numel();
    }
  }
  return total;
}

std::string layer::expected_input() const {
  if (is_function()) {
    return {};
  }
  // The first parameterised submodule in definition order takes the layer's input (true for
  // the built-in models and for most sequential blocks).
  for (const auto& m : module_.ptr()->modules(/*include_self=*/true)) {
    if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(m.get())) {
      return detail::concat("[*, ", linear->options.in_features(), "]");
    }
    if (auto* conv = dynamic_cast<torch::nn::Conv2dImpl*>(m.get())) {
      return detail::concat("[N, ", conv->options.in_channels(), ", H, W]");
    }
    if (auto* conv = dynamic_cast<torch::nn::Conv1dImpl*>(m.get())) {
      return detail::concat("[N, ", conv->options.in_channels(), ", L]");
    }
    if (auto* bn = dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.get())) {
      return detail::concat("[N, ", bn->options.num_features(), ", H, W]");
    }
    if (auto* bn = dynamic_cast<DeferredBatchNorm2dImpl*>(m.get())) {
      return detail::concat("[N, ", bn->options.num_features(), ", H, W]");
    }
  }
  return {};
}

layer_list to_layer_list(const torch::nn::Sequential& model) {
  layer_list result;
  auto children = model->named_children();
  ACTORPIPE_CHECK(children.size() == model->size(), "to_layer_list: the Sequential has ",
                  model->size(), " entries but ", children.size(), " named children");
  std::size_t i = 0;
  for (const auto& entry : *model) {
    result.emplace_back(children[i].key(), entry);
    ++i;
  }
  return result;
}

int64_t parameter_count(const layer_list& layers, std::size_t begin, std::size_t end) {
  int64_t total = 0;
  for (std::size_t i = begin; i < end && i < layers.size(); ++i) {
    total += layers[i].parameter_count();
  }
  return total;
}

torch::Tensor run_layers(const layer_list& layers, const torch::Tensor& x) {
  return run_layers(layers, bundle(x)).single("run_layers: the model's output");
}

bundle run_layers(const layer_list& layers, const bundle& x) {
  auto y = x;
  for (const auto& l : layers) {
    y = l.forward(y);
  }
  return y;
}

} // namespace actorpipe
