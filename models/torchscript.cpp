#include <actorpipe/torchscript.hpp>

#include <torch/csrc/jit/serialization/import.h>
#include <torch/script.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>

#include <unistd.h>

#include <actorpipe/errors.hpp>

namespace actorpipe {

namespace {

// One loaded file: its bytes (export starts from a fresh copy of them) and where it came from.
struct script_source {
  std::string bytes;
  std::string what;
  bool training = true;
  std::size_t layers = 0;
};

// "__torch__.torch.nn.modules.linear.___torch_mangle_3.Linear" -> "Linear".
std::string short_type(const torch::jit::Module& m) {
  auto name = m.type()->name() ? m.type()->name()->name() : std::string("module");
  return name;
}

bool is_sequential(const torch::jit::Module& m) {
  auto qualified = m.type()->name() ? m.type()->name()->qualifiedName() : std::string{};
  return short_type(m) == "Sequential" &&
         qualified.find("torch.nn.modules.container.") != std::string::npos;
}

// A scripted module seen as a libtorch C++ module: the same parameter and buffer tensors
// registered under the same names, its children mirrored likewise. Training, checkpoints, ties
// and the optimizer work on the registrations; the scripted forward uses the same tensors.
class script_mirror : public torch::nn::Module, public tied_module {
public:
  explicit script_mirror(torch::jit::Module m)
    : torch::nn::Module(short_type(m)), jit_(std::move(m)) {
    for (const auto& p : jit_.named_parameters(/*recurse=*/false)) {
      if (p.value.defined()) {
        register_parameter(p.name, p.value, p.value.requires_grad());
      }
    }
    for (const auto& b : jit_.named_buffers(/*recurse=*/false)) {
      if (b.value.defined()) {
        register_buffer(b.name, b.value);
      }
    }
    for (const auto& c : jit_.named_children()) {
      register_module(c.name, std::make_shared<script_mirror>(c.value));
    }
  }

  void parameter_replaced(const std::string& name, const torch::Tensor& tensor) override {
    jit_.setattr(name, tensor);
  }

protected:
  torch::jit::Module jit_;
};

// How a child's forward takes its inputs.
enum class input_kind { tensor, tensors, tuple };

// A libtorch error from the TorchScript interpreter reads "The following operation failed in
// the TorchScript interpreter", a TorchScript traceback, then what failed ("RuntimeError: mat1
// and mat2 shapes cannot be multiplied ..."): the last is what a person needs, first.
std::string interpreter_failure(const std::string& text, const std::string& layer) {
  std::string reason;
  std::size_t start = 0;
  while (start < text.size()) {
    auto end = text.find('\n', start);
    auto line = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
    auto colon = line.find("Error: ");
    if (colon != std::string::npos && line.find(' ') > colon) {
      reason = line.substr(colon + 7);
    }
    start = end == std::string::npos ? text.size() : end + 1;
  }
  if (reason.empty()) {
    return text;
  }
  return detail::concat(reason, " (in the scripted forward of '", layer, "')\n", text);
}

// What a child's forward takes and returns; invalid_argument naming the child when it is not
// tensors in and tensors out.
struct forward_signature {
  c10::optional<torch::jit::Method> method;
  input_kind inputs = input_kind::tensor;
  std::size_t arity = 1;
  bool tuple_out = false;

  bool one_tensor() const { return inputs == input_kind::tensor && !tuple_out; }
};

bool is_tensor(const c10::TypePtr& t) {
  return t->kind() == c10::TypeKind::TensorType;
}

forward_signature signature_of(const torch::jit::Module& child, const std::string& name,
                               const std::string& what) {
  forward_signature sig;
  auto method = child.find_method("forward");
  ACTORPIPE_CHECK(method.has_value(), what, ": child '", name, "' (", short_type(child),
                  ") has no forward method; actorpipe runs the children of the Sequential in "
                  "order, so each must be callable");
  sig.method = *method;
  const auto& schema = sig.method->function().getSchema();
  auto tensor_tuple = [&](const c10::TypePtr& t) -> std::size_t {
    auto tuple = t->cast<c10::TupleType>();
    if (!tuple) {
      return 0;
    }
    for (const auto& e : tuple->elements()) {
      if (!is_tensor(e)) {
        return 0;
      }
    }
    return tuple->elements().size();
  };
  auto refuse = [&](const std::string& problem) {
    throw invalid_argument(detail::concat(
      what, ": child '", name, "' (", short_type(child), ") has ", schema, ", but ", problem,
      ": a layer takes tensors (one, several, or a tuple of them) and returns a tensor or a "
      "tuple of tensors"));
  };
  const auto& arguments = schema.arguments();
  std::vector<c10::TypePtr> taken;
  for (std::size_t i = 1; i < arguments.size(); ++i) {
    if (!arguments[i].default_value()) {
      taken.push_back(arguments[i].type());
    }
  }
  if (taken.empty()) {
    refuse("it takes no input");
  }
  if (taken.size() == 1 && tensor_tuple(taken[0]) > 0) {
    sig.inputs = input_kind::tuple;
    sig.arity = tensor_tuple(taken[0]);
  } else {
    for (const auto& t : taken) {
      if (!is_tensor(t)) {
        refuse(detail::concat("an input is a ", t->repr_str()));
      }
    }
    sig.inputs = taken.size() == 1 ? input_kind::tensor : input_kind::tensors;
    sig.arity = taken.size();
  }
  ACTORPIPE_CHECK(schema.returns().size() == 1, what, ": child '", name, "' returns ",
                  schema.returns().size(), " values");
  const auto& out = schema.returns()[0].type();
  if (tensor_tuple(out) > 0) {
    sig.tuple_out = true;
  } else if (!is_tensor(out)) {
    refuse(detail::concat("it returns a ", out->repr_str()));
  }
  return sig;
}

// A top-level child: runs its scripted forward.
class script_layer : public script_mirror, public described_input {
public:
  script_layer(torch::jit::Module m, std::string name, std::shared_ptr<const script_source> source,
               forward_signature sig)
    : script_mirror(std::move(m)), name_(std::move(name)), source_(std::move(source)),
      forward_(std::move(*sig.method)), inputs_(sig.inputs), arity_(sig.arity) {}

  const std::shared_ptr<const script_source>& source() const { return source_; }

  // The first submodule (the child itself included) with a Linear's, a convolution's or an
  // Embedding's attributes takes the input, as for C++ modules.
  std::string expected_input() const override {
    for (const auto& m : jit_.modules()) {
      if (m.hasattr("in_features") && m.attr("in_features").isInt()) {
        return detail::concat("[*, ", m.attr("in_features").toInt(), "]");
      }
      if (m.hasattr("in_channels") && m.attr("in_channels").isInt() && m.hasattr("weight") &&
          m.attr("weight").isTensor()) {
        auto dims = m.attr("weight").toTensor().dim();
        return detail::concat("[N, ", m.attr("in_channels").toInt(),
                              dims == 3   ? ", L]"
                              : dims == 5 ? ", D, H, W]"
                                          : ", H, W]");
      }
      if (m.hasattr("num_embeddings") && m.attr("num_embeddings").isInt()) {
        return detail::concat("integer ids below ", m.attr("num_embeddings").toInt());
      }
    }
    return {};
  }

  void train(bool on) override {
    torch::nn::Module::train(on);
    jit_.train(on);
  }

protected:
  torch::Tensor run_tensor(const torch::Tensor& x) { return call({x}).toTensor(); }

  bundle run_bundle(const bundle& x) {
    ACTORPIPE_CHECK(x.size() == arity_, "layer '", name_, "' (", short_type(jit_), ") takes ",
                    arity_, inputs_ == input_kind::tuple ? "-tensor tuple" : " tensors",
                    " but was given ", x.size());
    std::vector<c10::IValue> args;
    if (inputs_ == input_kind::tuple) {
      std::vector<c10::IValue> elements(x.tensors().begin(), x.tensors().end());
      args.emplace_back(c10::ivalue::Tuple::create(std::move(elements)));
    } else {
      args.assign(x.tensors().begin(), x.tensors().end());
    }
    auto y = call(std::move(args));
    if (!y.isTuple()) {
      return bundle(y.toTensor());
    }
    std::vector<torch::Tensor> tensors;
    for (const auto& e : y.toTupleRef().elements()) {
      tensors.push_back(e.toTensor());
    }
    return bundle(std::move(tensors));
  }

private:
  c10::IValue call(std::vector<c10::IValue> args) {
    try {
      return forward_(std::move(args));
    } catch (const c10::Error& e) {
      // Still a c10::Error: the stage reads libtorch refusing a tensor as a shape mismatch.
      throw c10::Error(interpreter_failure(e.what_without_backtrace(), name_), {});
    } catch (const std::exception& e) {
      // The interpreter rethrows what an operation threw as a std::runtime_error with its
      // TorchScript traceback; it is libtorch refusing the input all the same.
      throw c10::Error(interpreter_failure(e.what(), name_), {});
    }
  }

  std::string name_;
  std::shared_ptr<const script_source> source_;
  torch::jit::Method forward_;
  input_kind inputs_;
  std::size_t arity_;
};

class script_tensor_layer : public script_layer {
public:
  using script_layer::script_layer;
  torch::Tensor forward(const torch::Tensor& x) { return run_tensor(x); }
};

class script_bundle_layer : public script_layer {
public:
  using script_layer::script_layer;
  bundle forward(const bundle& x) { return run_bundle(x); }
};

torch::jit::Module load_module(const std::string& bytes, const std::string& what) {
  std::istringstream in(bytes);
  try {
    return torch::jit::load(in, c10::Device(c10::kCPU));
  } catch (const std::exception& e) {
    throw invalid_argument(
      detail::concat(what,
                     " is not a TorchScript file (one written by Python's torch.jit.save(torch.jit."
                     "script(model))), or it is truncated: ",
                     detail::first_line(e.what())));
  }
}

// Children of `m` in order, nested Sequentials flattened, named by their path.
void flatten(const torch::jit::Module& m, const std::string& prefix,
             std::vector<std::pair<std::string, torch::jit::Module>>& out) {
  for (const auto& c : m.named_children()) {
    auto name = prefix.empty() ? c.name : prefix + "." + c.name;
    if (is_sequential(c.value)) {
      flatten(c.value, name, out);
    } else {
      out.emplace_back(name, c.value);
    }
  }
}

const script_layer* as_script(const layer& l) {
  return dynamic_cast<const script_layer*>(l.module().get());
}

} // namespace

layer_list load_torchscript_bytes(const std::string& bytes, const std::string& what) {
  auto root = load_module(bytes, what);
  ACTORPIPE_CHECK(is_sequential(root), what, ": the model is a ", short_type(root),
                  ", not an nn.Sequential; actorpipe cuts a model between the children of a "
                  "Sequential (wrap the layers in nn.Sequential(...) before torch.jit.script)");
  std::vector<std::pair<std::string, torch::jit::Module>> children;
  flatten(root, "", children);
  ACTORPIPE_CHECK(!children.empty(), what, ": the Sequential has no children to cut");
  auto source = std::make_shared<script_source>();
  source->bytes = bytes;
  source->what = what;
  source->training = root.is_training();
  source->layers = children.size();
  layer_list layers;
  for (auto& [name, child] : children) {
    auto sig = signature_of(child, name, what);
    if (sig.one_tensor()) {
      layers.emplace_back(name, torch::nn::AnyModule(std::make_shared<script_tensor_layer>(
                                  child, name, source, std::move(sig))));
    } else {
      layers.push_back(
        layer::over_bundles(name, torch::nn::AnyModule(std::make_shared<script_bundle_layer>(
                                    child, name, source, std::move(sig)))));
    }
  }
  return layers;
}

std::function<torch::Tensor(const torch::Tensor&)>
load_torchscript_function(const std::string& bytes, const std::string& what) {
  auto module = load_module(bytes, what);
  auto found = module.find_method("forward");
  ACTORPIPE_CHECK(found.has_value(), what, ": the module (", short_type(module),
                  ") has no forward method");
  const auto& schema = found->function().getSchema();
  std::size_t taken = 0;
  bool tensors_only = true;
  for (std::size_t i = 1; i < schema.arguments().size(); ++i) {
    if (!schema.arguments()[i].default_value()) {
      ++taken;
      tensors_only = tensors_only && is_tensor(schema.arguments()[i].type());
    }
  }
  ACTORPIPE_CHECK(taken == 1 && tensors_only && schema.returns().size() == 1 &&
                    is_tensor(schema.returns()[0].type()),
                  what, ": the module (", short_type(module), ") has ", schema,
                  ", but a hook's forward(x: Tensor) -> Tensor takes one tensor and returns one");
  module.eval();
  auto method = *found;
  return [method, what](const torch::Tensor& x) {
    torch::NoGradGuard no_grad;
    auto y = method({x});
    ACTORPIPE_CHECK(y.isTensor(), what, " returned a ", y.tagKind(), ", not a tensor");
    return y.toTensor();
  };
}

layer_list load_torchscript(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  ACTORPIPE_CHECK(in.good(), "cannot read the TorchScript file '", path, "'");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return load_torchscript_bytes(bytes, "'" + path + "'");
}

bool is_torchscript(const layer_list& layers) {
  if (layers.empty()) {
    return false;
  }
  const auto* first = as_script(layers.front());
  if (first == nullptr || first->source()->layers != layers.size()) {
    return false;
  }
  for (const auto& l : layers) {
    const auto* s = as_script(l);
    if (s == nullptr || s->source() != first->source()) {
      return false;
    }
  }
  return true;
}

void save_torchscript(const layer_list& layers, const std::map<std::string, torch::Tensor>& state,
                      const std::string& path) {
  ACTORPIPE_CHECK(is_torchscript(layers), "save_torchscript: the model was not loaded by "
                                          "load_torchscript (only a TorchScript model can be "
                                          "written back as TorchScript)");
  const auto& source = *as_script(layers.front())->source();
  // A fresh copy of the file (its ties as Python made them), then every tensor from `state`.
  auto model = load_module(source.bytes, source.what);
  // Every parameter and buffer by name; a tensor shared by several names needs one of them.
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& p : model.named_parameters()) {
    tensors.emplace_back(p.name, p.value);
  }
  for (const auto& b : model.named_buffers()) {
    tensors.emplace_back(b.name, b.value);
  }
  std::map<const c10::TensorImpl*, bool> written;
  for (auto& [name, tensor] : tensors) {
    auto& done = written[tensor.unsafeGetTensorImpl()];
    auto it = state.find(name);
    if (it == state.end()) {
      continue;
    }
    ACTORPIPE_CHECK(it->second.sizes() == tensor.sizes(), "save_torchscript: '", name,
                    "' has shape ", it->second.sizes(), " in the trained state but ",
                    tensor.sizes(), " in ", source.what);
    torch::NoGradGuard no_grad;
    tensor.copy_(it->second);
    done = true;
  }
  for (const auto& [name, tensor] : tensors) {
    ACTORPIPE_CHECK(written[tensor.unsafeGetTensorImpl()],
                    "save_torchscript: the trained state has no '", name, "'");
  }
  model.train(source.training);
  auto temporary = path + ".tmp-" + std::to_string(::getpid());
  try {
    model.save(temporary);
  } catch (const std::exception& e) {
    std::filesystem::remove(temporary);
    throw pipeline_error(
      detail::concat("save_torchscript: cannot write '", path, "': ", detail::first_line(e.what())),
      error_details{error_kind::io});
  }
  std::error_code ec;
  std::filesystem::rename(temporary, path, ec);
  if (ec) {
    std::filesystem::remove(temporary);
    throw pipeline_error(
      detail::concat("save_torchscript: cannot write '", path, "': ", ec.message()),
      error_details{error_kind::io});
  }
}

} // namespace actorpipe
