// A torch.export program cut into segments, each a layer of a layer list
// (<actorpipe/exported.hpp>). The PyTorch 2.x line only; exported_files.cpp holds what both
// lines share (telling the formats apart, the 1.13 line's refusal).
#include <actorpipe/exported.hpp>

#include <torch/nn/module.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>

#include <actorpipe/errors.hpp>

#include "models/exported_program.hpp"
#include "models/exported_segments.hpp"

namespace actorpipe {

namespace exported {

using detail::concat;

// A submodule of a segment's tree: it holds the parameters and buffers registered under its
// path, and tells the segment when a tie replaces one.
class state_node : public torch::nn::Module, public tied_module {
public:
  state_node(std::string path, std::function<void(const std::string&, const at::Tensor&)> replaced)
    : torch::nn::Module(path.empty() ? std::string("exported") : path), path_(std::move(path)),
      replaced_(std::move(replaced)) {}

  std::shared_ptr<state_node> child(const std::string& name) {
    for (const auto& c : named_children()) {
      if (c.key() == name) {
        return std::dynamic_pointer_cast<state_node>(c.value());
      }
    }
    return register_module(
      name, std::make_shared<state_node>(path_.empty() ? name : path_ + "." + name, replaced_));
  }

  void parameter_replaced(const std::string& name, const torch::Tensor& tensor) override {
    replaced_(path_.empty() ? name : path_ + "." + name, tensor);
  }

private:
  std::string path_;
  std::function<void(const std::string&, const at::Tensor&)> replaced_;
};

// One segment: nodes [begin, end) of the program, the state they read, the values live at
// either end.
class segment_module : public state_node, public random_source {
public:
  segment_module(std::shared_ptr<const source> from, segment_plan plan)
    : state_node("", [this](const std::string& fqn, const at::Tensor& t) { replace(fqn, t); }),
      source_(std::move(from)), plan_(std::move(plan)) {
    for (auto index : plan_.registered) {
      const auto& s = source_->program.state[index];
      bindings_.push_back({index, s.tensor, true});
      register_state(s);
    }
    for (auto index : plan_.borrowed) {
      bindings_.push_back({index, source_->program.state[index].tensor, false});
    }
  }

  const std::shared_ptr<const source>& origin() const { return source_; }
  const segment_plan& plan() const { return plan_; }

  bool draws_random() const override { return plan_.draws_random; }

  bundle forward(const bundle& x);

  // Tensors that are not registered (constants, non-persistent buffers, a buffer another segment
  // registers) move with the module too.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    torch::nn::Module::to(device, dtype, non_blocking);
    move_borrowed([&](const at::Tensor& t) { return t.to(device, dtype, non_blocking); });
    device_ = device;
  }
  void to(torch::Device device, bool non_blocking = false) override {
    torch::nn::Module::to(device, non_blocking);
    move_borrowed([&](const at::Tensor& t) { return t.to(device, non_blocking); });
    device_ = device;
  }
  void to(torch::Dtype dtype, bool non_blocking = false) override {
    torch::nn::Module::to(dtype, non_blocking);
    move_borrowed([&](const at::Tensor& t) { return t.to(dtype, non_blocking); });
  }

private:
  struct binding {
    std::size_t state;
    at::Tensor tensor;
    bool registered;
  };

  void register_state(const state_tensor& s) {
    std::shared_ptr<state_node> owner;
    auto dot = s.name.rfind('.');
    std::string leaf = dot == std::string::npos ? s.name : s.name.substr(dot + 1);
    torch::nn::Module* target = this;
    if (dot != std::string::npos) {
      std::size_t start = 0;
      std::shared_ptr<state_node> at_path;
      while (start <= dot) {
        auto next = s.name.find('.', start);
        auto part = s.name.substr(start, next - start);
        at_path = at_path ? at_path->child(part) : child(part);
        start = next + 1;
        if (next == dot) {
          break;
        }
      }
      owner = at_path;
      target = owner.get();
    }
    if (s.role == state_tensor::kind::parameter) {
      target->register_parameter(leaf, s.tensor, /*requires_grad=*/true);
    } else {
      target->register_buffer(leaf, s.tensor);
    }
  }

  void replace(const std::string& fqn, const at::Tensor& tensor) {
    for (auto& b : bindings_) {
      if (source_->program.state[b.state].name == fqn) {
        b.tensor = tensor;
      }
    }
  }

  template <class Move>
  void move_borrowed(Move&& move) {
    for (auto& b : bindings_) {
      if (!b.registered) {
        b.tensor = move(b.tensor);
      }
    }
  }

  void bind_inputs(const bundle& x, values& table) const;
  void check_batch(const values& table) const;
  bundle outputs(values& table) const;

  std::shared_ptr<const source> source_;
  segment_plan plan_;
  std::vector<binding> bindings_;
  c10::Device device_ = c10::Device(c10::kCPU);
};

namespace {

at::Tensor as_tensor(const c10::IValue& v) {
  if (v.isTensor()) {
    return v.toTensor();
  }
  // A size (SymInt) live across a cut travels as a 0-dim int64 tensor.
  return at::scalar_tensor(v.toInt(), at::kLong);
}

} // namespace

void segment_module::bind_inputs(const bundle& x, values& table) const {
  const auto& p = source_->program;
  const auto& in = plan_.inputs;
  const bool by_name = x.is_named();
  if (!by_name) {
    ACTORPIPE_CHECK(x.size() == in.size(), "segment '", plan_.name, "' of ", p.what, " takes ",
                    in.size(), in.size() == 1 ? " tensor" : " tensors", " but was given ", x.size(),
                    ": ", x.describe());
  }
  for (std::size_t i = 0; i < in.size(); ++i) {
    auto s = in[i];
    auto t = by_name ? x.at(p.name_of(s)) : x[i];
    if (p.sym_ints.count(s) != 0) {
      table[static_cast<std::size_t>(s)] = t.item<int64_t>();
      continue;
    }
    if (plan_.written_inputs.count(s) != 0) {
      // The graph writes it in place; the tensor is the previous stage's (or the caller's).
      t = t.clone();
    }
    table[static_cast<std::size_t>(s)] = std::move(t);
  }
  if (plan_.first) {
    check_batch(table);
  }
}

// The user inputs' batch dimensions against what the program was exported for.
void segment_module::check_batch(const values& table) const {
  const auto& p = source_->program;
  for (const auto& b : p.batch) {
    int64_t rows = 0;
    for (auto s : p.user_inputs) {
      const auto& v = table[static_cast<std::size_t>(s)];
      if (p.name_of(s) == b.input && v.isTensor() && v.toTensor().dim() > 0) {
        rows = v.toTensor().size(0);
      }
    }
    if (!b.symbol && b.fixed > 0 && rows != b.fixed) {
      throw c10::Error(concat("input '", b.input, "' has ", rows, " rows, but ", p.what,
                              " was exported for a batch of ", b.fixed,
                              " only (its dimension 0 is not dynamic): export with "
                              "dynamic_shapes={'",
                              b.input,
                              "': {0: torch.export.Dim('batch')}} so that micro-batches of "
                              "any size run"),
                       {});
    }
    // A lower bound of 2 is export's own (it specialises sizes 0 and 1 while tracing), not the
    // model's: a micro-batch of one row runs the same graph.
    auto least = b.min == 2 ? int64_t{1} : b.min;
    if (b.symbol && (rows < least || rows > b.max)) {
      throw c10::Error(concat("input '", b.input, "' has ", rows, " rows, outside ", least, "..",
                              b.max, ", the range ", p.what, " was exported for (its Dim ",
                              *b.symbol, ")"),
                       {});
    }
  }
}

bundle segment_module::outputs(values& table) const {
  const auto& p = source_->program;
  if (plan_.last) {
    std::vector<at::Tensor> out;
    for (auto s : p.user_outputs) {
      out.push_back(as_tensor(table[static_cast<std::size_t>(s)]));
    }
    return out.size() == 1 ? bundle(std::move(out.front())) : bundle(std::move(out));
  }
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto s : plan_.outputs) {
    named.emplace_back(p.name_of(s), as_tensor(table[static_cast<std::size_t>(s)]));
  }
  return bundle::named(std::move(named));
}

bundle segment_module::forward(const bundle& x) {
  const auto& p = source_->program;
  values table(p.values.size());
  for (const auto& b : bindings_) {
    for (auto s : p.state[b.state].slots) {
      table[static_cast<std::size_t>(s)] = b.tensor;
    }
  }
  bind_inputs(x, table);
  try {
    run_nodes(p, table, plan_.begin, plan_.end, run_context{device_, is_training()}, plan_.drop);
  } catch (const c10::Error& e) {
    throw c10::Error(
      concat(e.what_without_backtrace(), " (in segment '", plan_.name, "' of ", p.what, ")"), {});
  }
  if (!plan_.mutations.empty()) {
    torch::NoGradGuard no_grad;
    for (const auto& [s, index] : plan_.mutations) {
      for (auto& b : bindings_) {
        if (b.state == index) {
          b.tensor.copy_(table[static_cast<std::size_t>(s)].toTensor());
        }
      }
    }
  }
  return outputs(table);
}

namespace {

const segment_module* as_segment(const layer& l) {
  return dynamic_cast<const segment_module*>(l.module().get());
}

} // namespace

layer_list layers_of(std::shared_ptr<const source> from) {
  layer_list layers;
  for (auto& plan : plan_segments(from->program, from->options)) {
    auto name = plan.name;
    layers.push_back(layer::model_wide(
      name, torch::nn::AnyModule(std::make_shared<segment_module>(from, std::move(plan)))));
  }
  return layers;
}

const source* source_of(const layer_list& layers) {
  if (layers.empty()) {
    return nullptr;
  }
  const auto* first = as_segment(layers.front());
  if (first == nullptr || first->origin()->segments != layers.size()) {
    return nullptr;
  }
  for (const auto& l : layers) {
    const auto* s = as_segment(l);
    if (s == nullptr || s->origin() != first->origin()) {
      return nullptr;
    }
  }
  return first->origin().get();
}

} // namespace exported

bool exported_programs_supported() {
  return true;
}

namespace {

// The archive's bytes are kept once, by the source its segments share (save_exported starts from
// them); the program is read from that copy.
layer_list load_owned(std::string bytes, const std::string& what, const exported_options& options) {
  auto from = std::make_shared<exported::source>();
  from->bytes = std::move(bytes);
  from->what = what;
  from->options = options;
  from->program = exported::read_program(from->bytes, what, options.program);
  from->segments = exported::plan_segments(from->program, options).size();
  return exported::layers_of(std::move(from));
}

} // namespace

layer_list load_exported_bytes(const std::string& bytes, const std::string& what,
                               const exported_options& options) {
  return load_owned(bytes, what, options);
}

layer_list load_exported(const std::string& path, const exported_options& options) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  auto size = in.good() ? static_cast<std::streamoff>(in.tellg()) : -1;
  ACTORPIPE_CHECK(in.good() && size >= 0, "cannot read the PT2 archive '", path, "'");
  std::string bytes(static_cast<std::size_t>(size), '\0');
  in.seekg(0);
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ACTORPIPE_CHECK(in.good(), "cannot read the PT2 archive '", path, "'");
  return load_owned(std::move(bytes), "'" + path + "'", options);
}

bool is_exported(const layer_list& layers) {
  return exported::source_of(layers) != nullptr;
}

std::vector<std::pair<std::string, std::string>> exported_state_names(const layer_list& layers) {
  const auto* from = exported::source_of(layers);
  ACTORPIPE_CHECK(from != nullptr, "exported_state_names: the layers were not loaded by "
                                   "load_exported");
  std::vector<std::pair<std::string, std::string>> names;
  for (const auto* s : exported::saved_state(from->program)) {
    for (const auto& n : s->names) {
      names.emplace_back(n, s->name);
    }
  }
  return names;
}

} // namespace actorpipe
