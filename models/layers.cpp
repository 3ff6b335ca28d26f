#include <actorpipe/layers.hpp>

#include <actorpipe/batch_norm.hpp>

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <map>

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

layer layer::model_wide(std::string name, torch::nn::AnyModule module) {
  auto result = over_bundles(std::move(name), std::move(module));
  result.model_wide_ = true;
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
  if (const auto* own = dynamic_cast<const described_input*>(module_.ptr().get())) {
    return own->expected_input();
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

namespace {

// A module's registered parameters, which libtorch keeps protected: registering a name twice
// throws, and tying replaces a registration.
struct registrations : torch::nn::Module {
  static torch::OrderedDict<std::string, torch::Tensor>& of(torch::nn::Module& m) {
    return m.*(&registrations::parameters_);
  }
};

} // namespace

std::vector<tied_parameter> tied_parameters(const layer_list& layers) {
  std::vector<tied_parameter> result;
  std::map<const c10::TensorImpl*, std::size_t> seen;
  for (const auto& l : layers) {
    auto m = l.module();
    if (!m) {
      continue;
    }
    for (const auto& item : m->named_parameters()) {
      auto name = l.qualified(item.key());
      auto [it, first] = seen.emplace(item.value().unsafeGetTensorImpl(), result.size());
      if (first) {
        result.push_back({name, {}});
      } else {
        result[it->second].aliases.push_back(name);
      }
    }
  }
  result.erase(std::remove_if(result.begin(), result.end(),
                              [](const tied_parameter& t) { return t.aliases.empty(); }),
               result.end());
  return result;
}

void tie_parameter(const layer& holder, const std::string& parameter, const torch::Tensor& tensor) {
  auto root = holder.module();
  ACTORPIPE_CHECK(root != nullptr, "tie_parameter: layer '", holder.name(),
                  "' is a function and holds no parameter '", parameter, "'");
  auto dot = parameter.rfind('.');
  auto path = dot == std::string::npos ? std::string{} : parameter.substr(0, dot);
  auto leaf = dot == std::string::npos ? parameter : parameter.substr(dot + 1);
  std::shared_ptr<torch::nn::Module> owner = root;
  if (!path.empty()) {
    owner.reset();
    for (const auto& item : root->named_modules()) {
      if (item.key() == path) {
        owner = item.value();
      }
    }
  }
  ACTORPIPE_CHECK(owner && owner->named_parameters(/*recurse=*/false).contains(leaf),
                  "tie_parameter: layer '", holder.name(), "' has no parameter '", parameter, "'");
  auto& slot = registrations::of(*owner)[leaf];
  ACTORPIPE_CHECK(slot.sizes() == tensor.sizes(), "tie_parameter: layer '", holder.name(),
                  "' parameter '", parameter, "' has shape ", slot.sizes(), " but the tensor has ",
                  tensor.sizes());
  auto* linear = dynamic_cast<torch::nn::LinearImpl*>(owner.get());
  auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(owner.get());
  auto* custom = dynamic_cast<tied_module*>(owner.get());
  ACTORPIPE_CHECK(((linear || embedding) && leaf == "weight") || custom != nullptr,
                  "tie_parameter: layer '", holder.name(), "' parameter '", parameter,
                  "' belongs to a ", owner->name(),
                  ", which keeps its own reference to it: only Linear and Embedding weights and "
                  "modules derived from actorpipe::tied_module can be tied");
  slot = tensor;
  if (linear) {
    linear->weight = tensor;
  } else if (embedding) {
    embedding->weight = tensor;
  } else {
    custom->parameter_replaced(leaf, tensor);
  }
}

} // namespace actorpipe
