/// \file
/// The layer list: the one representation of a model that actorpipe cuts into stages.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <actorpipe/bundle.hpp>

namespace actorpipe {

/// A function layer: parameter-free, e.g. flatten.
using layer_function = std::function<torch::Tensor(const torch::Tensor&)>;

/// A function layer over bundles: parameter-free, e.g. one that splits or joins tensors.
using bundle_function = std::function<bundle(const bundle&)>;

/// One named layer of a model: either a module (with parameters and buffers) or a plain
/// function, over one tensor or over bundles (<actorpipe/bundle.hpp>). Copies alias the same
/// module, like libtorch's module holders.
class layer {
public:
  /// A module layer; `module` may be any libtorch module holder with `Tensor forward(Tensor)`.
  layer(std::string name, torch::nn::AnyModule module);

  /// A function layer.
  layer(std::string name, layer_function fn);

  /// A function layer over bundles.
  layer(std::string name, bundle_function fn);

  /// A module layer over bundles: `module` has `bundle forward(const bundle&)`.
  static layer over_bundles(std::string name, torch::nn::AnyModule module);

  /// A module layer over bundles whose module registers its parameters and buffers under their
  /// model-wide names (a segment of an exported graph: `layers.0.attn.wq.weight`, as the Python
  /// module names it), so that qualified(key) is the key itself.
  static layer model_wide(std::string name, torch::nn::AnyModule module);

  const std::string& name() const noexcept { return name_; }

  /// True for a plain function layer (no module, no parameters).
  bool is_function() const noexcept { return fn_ || bundle_fn_; }

  /// The module, or nullptr for a function layer.
  std::shared_ptr<torch::nn::Module> module() const;

  /// The model-wide name of the parameter or buffer `key` of this layer's module:
  /// "<layer>.<key>", or `key` for a model_wide layer. Checkpoints, ties and named_parameters
  /// name tensors so.
  std::string qualified(const std::string& key) const {
    return model_wide_ ? key : name_ + "." + key;
  }

  /// True for a layer over bundles; the others take and give one tensor.
  bool takes_bundles() const noexcept { return bundles_; }

  /// Runs the layer. Thread-safety: as the module's own forward.
  torch::Tensor forward(const torch::Tensor& x) const;

  /// Runs the layer on a bundle; a one-tensor layer takes a bundle of one (invalid_argument
  /// naming the layer otherwise).
  bundle forward(const bundle& x) const;

  /// Number of parameter elements (0 for a function layer).
  int64_t parameter_count() const;

  /// A short description of the input this layer takes, e.g. "[*, 512]" for Linear(512, 10),
  /// or an empty string when actorpipe cannot tell. Used in shape-mismatch errors.
  std::string expected_input() const;

private:
  std::string name_;
  // AnyModule::forward is not const; running a layer does not change which module it holds.
  mutable torch::nn::AnyModule module_;
  layer_function fn_;
  bundle_function bundle_fn_;
  bool bundles_ = false;
  bool model_wide_ = false;
};

/// An ordered model: layer i feeds layer i + 1.
using layer_list = std::vector<layer>;

/// A parameter that several layers hold: the same tensor registered in two modules, as a GPT's
/// token embedding and its LM head (see tie_parameter). Named "<layer>.<parameter>" by its
/// first holder in model order; `aliases` are the names the later holders give it.
struct tied_parameter {
  std::string name;
  std::vector<std::string> aliases;
};

/// The tied parameters of `layers`, in model order (none for most models).
std::vector<tied_parameter> tied_parameters(const layer_list& layers);

/// Makes `holder`'s parameter `parameter` (a path inside its module, e.g. "weight" or
/// "proj.weight") the tensor `tensor`: to tie it to another layer's parameter, pass that
/// parameter; actorpipe passes a copy when the two holders land on different stages (each
/// stage then keeps a copy and their gradients are summed before the optimizer steps). The
/// module that registers the parameter must be a torch::nn::Linear, a torch::nn::Embedding or
/// a tied_module; invalid_argument names the layer and parameter otherwise.
void tie_parameter(const layer& holder, const std::string& parameter, const torch::Tensor& tensor);

/// A module of your own that can say what input it takes, as layer::expected_input reports it
/// in shape-mismatch errors (e.g. "[*, 512]"); an empty string when it cannot tell.
class described_input {
public:
  virtual ~described_input() = default;
  virtual std::string expected_input() const = 0;
};

/// A module of your own whose forward draws random numbers (as dropout does) without being one
/// of libtorch's dropout modules: a stage that recomputes it replays the generator's draws.
class random_source {
public:
  virtual ~random_source() = default;
  virtual bool draws_random() const = 0;
};

/// A module of your own that can hold a tied parameter: it registers `name` and keeps any
/// member that refers to it pointing at `tensor` (tie_parameter has replaced the registration).
class tied_module {
public:
  virtual ~tied_module() = default;
  virtual void parameter_replaced(const std::string& name, const torch::Tensor& tensor) = 0;
};

/// The layers of a Sequential, named as its children are ("0", "1", ... unless named).
layer_list to_layer_list(const torch::nn::Sequential& model);

/// Total parameter elements of `layers[begin, end)`.
int64_t parameter_count(const layer_list& layers, std::size_t begin, std::size_t end);

/// Runs all layers in order: the plain, unpipelined model.
torch::Tensor run_layers(const layer_list& layers, const torch::Tensor& x);

/// Runs all layers in order on a bundle.
bundle run_layers(const layer_list& layers, const bundle& x);

} // namespace actorpipe
