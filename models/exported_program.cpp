// Reading a PT2 archive's program with PyTorch's own schema types, and running its nodes
// through the c10 dispatcher (models/exported_program.hpp).
#include "models/exported_program.hpp"

#include <ATen/ScalarOps.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/utils/generated_serialization_types.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <unordered_map>

#include <actorpipe/errors.hpp>
#include <actorpipe/exported.hpp>

namespace actorpipe::exported {

namespace ex = torch::_export;
using detail::concat;

slot program::slot_of(const std::string& name) {
  auto [it, added] = slots_.emplace(name, static_cast<slot>(values.size()));
  if (added) {
    values.push_back(name);
  }
  return it->second;
}

int schema_major() {
  return ACTORPIPE_PT2_SCHEMA_MAJOR;
}

namespace {

c10::ScalarType scalar_type_of(ex::ScalarType s, const std::string& where) {
  using S = ex::ScalarType;
  switch (s) {
  case S::BYTE:
    return at::kByte;
  case S::CHAR:
    return at::kChar;
  case S::SHORT:
    return at::kShort;
  case S::INT:
    return at::kInt;
  case S::LONG:
    return at::kLong;
  case S::HALF:
    return at::kHalf;
  case S::FLOAT:
    return at::kFloat;
  case S::DOUBLE:
    return at::kDouble;
  case S::COMPLEXHALF:
    return at::kComplexHalf;
  case S::COMPLEXFLOAT:
    return at::kComplexFloat;
  case S::COMPLEXDOUBLE:
    return at::kComplexDouble;
  case S::BOOL:
    return at::kBool;
  case S::BFLOAT16:
    return at::kBFloat16;
  case S::UINT16:
    return at::kUInt16;
  case S::FLOAT8E4M3FN:
    return at::kFloat8_e4m3fn;
  case S::FLOAT8E5M2:
    return at::kFloat8_e5m2;
  case S::FLOAT8E4M3FNUZ:
    return at::kFloat8_e4m3fnuz;
  case S::FLOAT8E5M2FNUZ:
    return at::kFloat8_e5m2fnuz;
  default:
    break;
  }
  throw invalid_argument(concat(where, ": dtype number ", static_cast<int>(s),
                                " of the export schema has no libtorch dtype"));
}

c10::MemoryFormat memory_format_of(ex::MemoryFormat m, const std::string& where) {
  switch (m) {
  case ex::MemoryFormat::ContiguousFormat:
    return c10::MemoryFormat::Contiguous;
  case ex::MemoryFormat::ChannelsLast:
    return c10::MemoryFormat::ChannelsLast;
  case ex::MemoryFormat::ChannelsLast3d:
    return c10::MemoryFormat::ChannelsLast3d;
  case ex::MemoryFormat::PreserveFormat:
    return c10::MemoryFormat::Preserve;
  default:
    break;
  }
  throw invalid_argument(concat(where, ": memory format ", static_cast<int>(m), " is unknown"));
}

int64_t fixed_int(const ex::SymInt& s, const std::string& where) {
  ACTORPIPE_CHECK(s.tag() == ex::SymInt::Tag::AS_INT, where,
                  ": a stored tensor has a symbolic size or stride (",
                  s.get_as_expr().get_expr_str(), ")");
  return s.get_as_int();
}

std::string record(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  auto [data, size] = reader.getRecord(name);
  return std::string(static_cast<const char*>(data.get()), size);
}

// --- the archive's weights and constants --------------------------------------------------

// A stored tensor's layout as its metadata gives it, checked: a plain strided tensor.
struct stored_layout {
  c10::ScalarType dtype;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
};

template <class PayloadMeta>
stored_layout layout_of(const PayloadMeta& meta, const std::string& where) {
  ACTORPIPE_CHECK(!meta.get_use_pickle(), where,
                  " is a tensor subclass (pickled in the archive); actorpipe trains plain tensors "
                  "(export a model whose parameters are torch.nn.Parameter of plain tensors)");
  ACTORPIPE_CHECK(meta.get_tensor_meta().has_value(), where, " has no tensor metadata");
  const auto& tm = *meta.get_tensor_meta();
  ACTORPIPE_CHECK(tm.get_layout() == ex::Layout::Strided, where,
                  " is not a strided (dense) tensor");
  stored_layout layout{scalar_type_of(tm.get_dtype(), where), {}, {}, 0};
  for (const auto& s : tm.get_sizes()) {
    layout.sizes.push_back(fixed_int(s, where));
  }
  for (const auto& s : tm.get_strides()) {
    layout.strides.push_back(fixed_int(s, where));
  }
  layout.offset = fixed_int(tm.get_storage_offset(), where);
  return layout;
}

// Whether the storage holds every element the layout reaches.
bool fits(const stored_layout& l, const at::Storage& storage) {
  if (std::find(l.sizes.begin(), l.sizes.end(), 0) != l.sizes.end()) {
    return true; // no element: no byte needed
  }
  int64_t extent = l.offset;
  for (std::size_t d = 0; d < l.sizes.size(); ++d) {
    extent += l.sizes[d] == 0 ? 0 : (l.sizes[d] - 1) * l.strides.at(d);
  }
  return l.sizes.empty() || (extent + 1) * static_cast<int64_t>(c10::elementSize(l.dtype)) <=
                              static_cast<int64_t>(storage.nbytes());
}

// One payload folder (data/weights/ or data/constants/): fqn -> tensor, a tensor stored once
// under several fqns (a tied parameter) shared.
std::map<std::string, at::Tensor> read_payload(caffe2::serialize::PyTorchStreamReader& reader,
                                               const std::string& folder, const std::string& config,
                                               const std::string& what) {
  std::map<std::string, at::Tensor> tensors;
  if (!reader.hasRecord(folder + config)) {
    return tensors;
  }
  ex::PayloadConfig payload;
  try {
    payload = nlohmann::json::parse(record(reader, folder + config)).get<ex::PayloadConfig>();
  } catch (const std::exception& e) {
    throw invalid_argument(concat(what, ": ", folder, config,
                                  " is not the export schema's payload "
                                  "configuration: ",
                                  detail::first_line(e.what())));
  }
  std::map<std::string, at::Storage> storages;
  std::map<std::string, std::pair<std::string, at::Tensor>> seen; // path + layout -> tensor
  for (const auto& [fqn, meta] : payload.get_config()) {
    auto where = concat(what, ": '", fqn, "'");
    auto layout = layout_of(meta, where);
    const auto& path = meta.get_path_name();
    auto key =
      concat(path, layout.sizes, layout.strides, layout.offset, static_cast<int>(layout.dtype));
    if (auto it = seen.find(key); it != seen.end()) {
      tensors[fqn] = it->second.second;
      continue;
    }
    auto stored = storages.find(path);
    if (stored == storages.end()) {
      ACTORPIPE_CHECK(reader.hasRecord(folder + path), where, ": the archive has no ", folder, path,
                      " (truncated?)");
      auto [data, n] = reader.getRecord(folder + path);
      stored = storages
                 .emplace(path, at::Storage(at::Storage::use_byte_size_t(), n, std::move(data),
                                            nullptr, false))
                 .first;
    }
    ACTORPIPE_CHECK(fits(layout, stored->second), where, ": ", folder, path, " holds ",
                    stored->second.nbytes(), " bytes, too few for its shape ",
                    c10::IntArrayRef(layout.sizes), " (truncated?)");
    auto t = at::empty({0}, at::TensorOptions().dtype(layout.dtype));
    t.set_(stored->second, layout.offset, layout.sizes, layout.strides);
    seen.emplace(key, std::make_pair(fqn, t));
    tensors[fqn] = t;
  }
  return tensors;
}

// --- the signature ------------------------------------------------------------------------

struct state_input {
  std::string fqn;
  state_tensor::kind role;
  bool persistent = true;
};

void bind_state(program& p, slot s, const state_input& in, const at::Tensor& tensor) {
  for (auto& entry : p.state) {
    if (entry.tensor.unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl()) {
      entry.slots.push_back(s);
      if (std::find(entry.names.begin(), entry.names.end(), in.fqn) == entry.names.end()) {
        entry.names.push_back(in.fqn);
      }
      return;
    }
  }
  state_tensor entry;
  entry.name = in.fqn;
  entry.names = {in.fqn};
  entry.slots = {s};
  entry.tensor = tensor;
  entry.role = in.role;
  entry.persistent = in.persistent;
  if (in.role == state_tensor::kind::parameter) {
    entry.tensor.requires_grad_(true);
  }
  p.state.push_back(std::move(entry));
}

c10::IValue constant_of(const ex::ConstantValue& v) {
  using T = ex::ConstantValue::Tag;
  switch (v.tag()) {
  case T::AS_INT:
    return v.get_as_int();
  case T::AS_FLOAT:
    return v.get_as_float().get();
  case T::AS_STRING:
    return v.get_as_string();
  case T::AS_BOOL:
    return v.get_as_bool();
  default:
    return {};
  }
}

void read_inputs(program& p, const ex::GraphSignature& signature,
                 const std::map<std::string, at::Tensor>& weights,
                 const std::map<std::string, at::Tensor>& constants,
                 std::vector<std::pair<slot, c10::IValue>>& fixed) {
  auto tensor_named = [&](const std::string& fqn) {
    auto it = weights.find(fqn);
    if (it == weights.end()) {
      it = constants.find(fqn);
      ACTORPIPE_CHECK(it != constants.end(), p.what, ": the archive stores no tensor '", fqn,
                      "' (truncated, or written by another tool)");
    }
    return it->second;
  };
  using T = ex::InputSpec::Tag;
  for (const auto& spec : signature.get_input_specs()) {
    switch (spec.tag()) {
    case T::USER_INPUT: {
      const auto& arg = spec.get_user_input().get_arg();
      ACTORPIPE_CHECK(arg.tag() == ex::Argument::Tag::AS_TENSOR, p.what,
                      ": forward takes an input that is not a tensor; a pipeline's inputs are "
                      "tensors (export with tensors only, or bind the others as constants)");
      p.user_inputs.push_back(p.slot_of(arg.get_as_tensor().get_name()));
      break;
    }
    case T::PARAMETER: {
      const auto& s = spec.get_parameter();
      bind_state(p, p.slot_of(s.get_arg().get_name()),
                 {s.get_parameter_name(), state_tensor::kind::parameter},
                 tensor_named(s.get_parameter_name()));
      break;
    }
    case T::BUFFER: {
      const auto& s = spec.get_buffer();
      bind_state(p, p.slot_of(s.get_arg().get_name()),
                 {s.get_buffer_name(), state_tensor::kind::buffer, s.get_persistent()},
                 tensor_named(s.get_buffer_name()));
      break;
    }
    case T::TENSOR_CONSTANT: {
      const auto& s = spec.get_tensor_constant();
      bind_state(p, p.slot_of(s.get_arg().get_name()),
                 {s.get_tensor_constant_name(), state_tensor::kind::constant, false},
                 tensor_named(s.get_tensor_constant_name()));
      break;
    }
    case T::CONSTANT_INPUT: {
      const auto& s = spec.get_constant_input();
      fixed.emplace_back(p.slot_of(s.get_name()), constant_of(s.get_value()));
      break;
    }
    case T::CUSTOM_OBJ:
      throw invalid_argument(concat(p.what, ": the program takes a TorchScript object ('",
                                    spec.get_custom_obj().get_custom_obj_name(),
                                    "'), which actorpipe cannot give it"));
    default:
      throw invalid_argument(concat(p.what,
                                    ": the program takes an effect token (an op with "
                                    "side effects, such as a print in forward), which actorpipe "
                                    "does not run"));
    }
  }
}

void read_outputs(program& p, const ex::GraphSignature& signature) {
  auto state_index = [&](const std::string& fqn) {
    for (std::size_t i = 0; i < p.state.size(); ++i) {
      const auto& names = p.state[i].names;
      if (std::find(names.begin(), names.end(), fqn) != names.end()) {
        return i;
      }
    }
    throw invalid_argument(concat(p.what, ": the program writes '", fqn,
                                  "', which it does not "
                                  "take"));
  };
  using T = ex::OutputSpec::Tag;
  for (const auto& spec : signature.get_output_specs()) {
    switch (spec.tag()) {
    case T::USER_OUTPUT: {
      const auto& arg = spec.get_user_output().get_arg();
      ACTORPIPE_CHECK(arg.tag() == ex::Argument::Tag::AS_TENSOR, p.what,
                      ": forward returns something that is not a tensor; the last stage's output "
                      "goes to the loss, so forward returns tensors");
      p.user_outputs.push_back(p.slot_of(arg.get_as_tensor().get_name()));
      break;
    }
    case T::BUFFER_MUTATION: {
      const auto& s = spec.get_buffer_mutation();
      p.mutations.emplace_back(p.slot_of(s.get_arg().get_name()), state_index(s.get_buffer_name()));
      break;
    }
    case T::PARAMETER_MUTATION: {
      const auto& s = spec.get_parameter_mutation();
      p.mutations.emplace_back(p.slot_of(s.get_arg().get_name()),
                               state_index(s.get_parameter_name()));
      break;
    }
    case T::USER_INPUT_MUTATION:
      throw invalid_argument(concat(p.what, ": forward writes its input '",
                                    spec.get_user_input_mutation().get_user_input_name(),
                                    "' in place; a stage's input is not the caller's tensor"));
    case T::LOSS_OUTPUT:
    case T::GRADIENT_TO_PARAMETER:
    case T::GRADIENT_TO_USER_INPUT:
      throw invalid_argument(concat(p.what,
                                    ": the program is a joint forward-backward graph "
                                    "(_export_forward_backward); actorpipe trains the forward "
                                    "program torch.export.export returns, with autograd"));
    default:
      throw invalid_argument(concat(p.what, ": the program returns an effect token, which "
                                            "actorpipe does not run"));
    }
  }
  ACTORPIPE_CHECK(!p.user_outputs.empty(), p.what, ": forward returns no tensor");
}

// --- the output the loss reads ---------------------------------------------------------------

std::size_t leaves_of(const nlohmann::json& spec) {
  if (!spec.is_object() || spec.value("type", nlohmann::json()).is_null()) {
    return 1;
  }
  std::size_t n = 0;
  for (const auto& child : spec.value("children_spec", nlohmann::json::array())) {
    n += leaves_of(child);
  }
  return n;
}

// The position among the flattened outputs of the top-level entry `logits` of what forward
// returns (a dict or a ModelOutput, whose pytree context lists its keys), if it is one tensor.
std::optional<std::size_t> logits_of(const std::string& out_spec) {
  try {
    auto spec = nlohmann::json::parse(out_spec).at(1);
    auto context = spec.value("context", nlohmann::json());
    if (!context.is_string()) {
      return std::nullopt;
    }
    auto keys = nlohmann::json::parse(context.get<std::string>());
    const auto& children = spec.at("children_spec");
    std::size_t at = 0;
    for (std::size_t k = 0; k < keys.size() && k < children.size(); ++k) {
      if (keys[k].is_string() && keys[k] == "logits") {
        return leaves_of(children[k]) == 1 ? std::optional<std::size_t>(at) : std::nullopt;
      }
      at += leaves_of(children[k]);
    }
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// Forward returning several tensors (a ModelOutput with hidden states, a dict, a tuple): the loss
// reads `logits` where forward returns it by that name, else the first; the rest are not kept.
void choose_loss_output(program& p, const ex::ExportedProgram& ep) {
  if (p.user_outputs.size() == 1) {
    return;
  }
  std::size_t chosen = 0;
  for (const auto& entry : ep.get_graph_module().get_module_call_graph()) {
    if (entry.get_fqn().empty() && entry.get_signature().has_value()) {
      if (auto at = logits_of(entry.get_signature()->get_out_spec());
          at && *at < p.user_outputs.size()) {
        chosen = *at;
      }
    }
  }
  p.user_outputs = {p.user_outputs[chosen]};
}

// "s52", or the first symbol of "Symbol('s52', positive=True)".
std::string symbol_of(const std::string& expression) {
  auto quote = expression.find('\'');
  if (quote == std::string::npos) {
    return expression;
  }
  return expression.substr(quote + 1, expression.find('\'', quote + 1) - quote - 1);
}

void read_batch_dimensions(program& p, const ex::ExportedProgram& ep) {
  const auto& values = ep.get_graph_module().get_graph().get_tensor_values();
  for (auto s : p.user_inputs) {
    batch_dimension b;
    b.input = p.name_of(s);
    auto it = values.find(b.input);
    if (it == values.end() || it->second.get_sizes().empty()) {
      continue;
    }
    const auto& size = it->second.get_sizes().front();
    if (size.tag() == ex::SymInt::Tag::AS_INT) {
      b.fixed = size.get_as_int();
    } else {
      b.symbol = symbol_of(size.get_as_expr().get_expr_str());
      const auto& ranges = ep.get_range_constraints();
      if (auto r = ranges.find(*b.symbol); r != ranges.end()) {
        b.min = r->second.get_min_val().value_or(1);
        b.max = r->second.get_max_val().value_or(INT64_MAX);
      }
    }
    p.batch.push_back(std::move(b));
  }
}

// --- nodes ----------------------------------------------------------------------------------

int64_t floor_div(int64_t a, int64_t b) {
  auto q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

const std::map<std::string, builtin>& builtins() {
  static const std::map<std::string, builtin> table{
    {"_operator.add", [](int64_t a, int64_t b) { return a + b; }},
    {"_operator.sub", [](int64_t a, int64_t b) { return a - b; }},
    {"_operator.mul", [](int64_t a, int64_t b) { return a * b; }},
    {"_operator.floordiv", [](int64_t a, int64_t b) { return floor_div(a, b); }},
    {"_operator.mod", [](int64_t a, int64_t b) { return a - floor_div(a, b) * b; }},
    {"torch.sym_max", [](int64_t a, int64_t b) { return std::max(a, b); }},
    {"torch.sym_min", [](int64_t a, int64_t b) { return std::min(a, b); }},
  };
  return table;
}

// The nn_module_stack's modules, outermost first: "L__self__,,Model;L__self__layers_0,layers.0,
// pkg.Block;..." -> ({"layers.0", ...}, {"pkg.Block", ...}). The root (an empty path) is left
// out, and so are entries PyTorch makes for nodes without a module
// ("_empty_nn_module_stack_from_metadata_hook" as key, path and class): a module's class is a
// qualified name, theirs is not.
void read_modules(const ex::Node& n, node& out) {
  auto it = n.get_metadata().find("nn_module_stack");
  if (it == n.get_metadata().end()) {
    return;
  }
  const auto& text = it->second;
  std::size_t start = 0;
  while (start < text.size()) {
    auto end = text.find(';', start);
    auto entry = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
    auto first = entry.find(',');
    auto second = first == std::string::npos ? first : entry.find(',', first + 1);
    if (second != std::string::npos && second > first + 1) {
      auto type = entry.substr(second + 1);
      if (type.find('.') != std::string::npos) {
        out.modules.push_back(entry.substr(first + 1, second - first - 1));
        out.module_types.push_back(std::move(type));
      }
    }
    start = end == std::string::npos ? text.size() : end + 1;
  }
}

struct planner {
  program& p;
  const std::string& where; // "node 'linear_3' (torch.ops.aten.linear.default)"

  argument_plan plan(const ex::Argument& a, const c10::Argument& formal) {
    using T = ex::Argument::Tag;
    argument_plan plan;
    const auto kind = formal.type()->kind();
    switch (a.tag()) {
    case T::AS_NONE:
      break;
    case T::AS_TENSOR:
      plan.how = argument_plan::kind::value;
      plan.value = p.slot_of(a.get_as_tensor().get_name());
      break;
    case T::AS_OPTIONAL_TENSOR:
      if (a.get_as_optional_tensor().tag() == ex::OptionalTensorArgument::Tag::AS_TENSOR) {
        plan.how = argument_plan::kind::value;
        plan.value = p.slot_of(a.get_as_optional_tensor().get_as_tensor().get_name());
      }
      break;
    case T::AS_TENSORS:
      plan.how = argument_plan::kind::tensors;
      for (const auto& t : a.get_as_tensors()) {
        plan.values.push_back(p.slot_of(t.get_name()));
      }
      break;
    case T::AS_OPTIONAL_TENSORS:
      plan.how = argument_plan::kind::optional_tensors;
      for (const auto& o : a.get_as_optional_tensors()) {
        plan.values.push_back(o.tag() == ex::OptionalTensorArgument::Tag::AS_TENSOR
                                ? p.slot_of(o.get_as_tensor().get_name())
                                : -1);
      }
      break;
    case T::AS_INT:
      // A float argument may be written as an int (eps=0).
      plan.constant = kind == c10::TypeKind::FloatType
                        ? c10::IValue(static_cast<double>(a.get_as_int()))
                        : c10::IValue(a.get_as_int());
      break;
    case T::AS_INTS:
      plan.constant = c10::IValue(c10::List<int64_t>(a.get_as_ints()));
      break;
    case T::AS_FLOAT:
      plan.constant = a.get_as_float().get();
      break;
    case T::AS_FLOATS: {
      c10::List<double> list;
      for (const auto& f : a.get_as_floats()) {
        list.push_back(f.get());
      }
      plan.constant = list;
      break;
    }
    case T::AS_BOOL:
      plan.constant = a.get_as_bool();
      if (a.get_as_bool() && kind == c10::TypeKind::BoolType &&
          (formal.name() == "train" || formal.name() == "training")) {
        plan.how = argument_plan::kind::mode;
      }
      break;
    case T::AS_BOOLS: {
      c10::List<bool> list;
      for (bool b : a.get_as_bools()) {
        list.push_back(b);
      }
      plan.constant = list;
      break;
    }
    case T::AS_STRING:
      plan.constant = a.get_as_string();
      break;
    case T::AS_STRINGS: {
      c10::List<std::string> list;
      for (const auto& s : a.get_as_strings()) {
        list.push_back(s);
      }
      plan.constant = list;
      break;
    }
    case T::AS_SYM_INT: {
      const auto& s = a.get_as_sym_int();
      if (s.tag() == ex::SymIntArgument::Tag::AS_INT) {
        plan.constant = s.get_as_int();
      } else {
        plan.how = kind == c10::TypeKind::TensorType ? argument_plan::kind::scalar_tensor
                                                     : argument_plan::kind::value;
        plan.value = p.slot_of(s.get_as_name());
        return plan;
      }
      break;
    }
    case T::AS_SYM_INTS: {
      bool fixed = true;
      for (const auto& s : a.get_as_sym_ints()) {
        bool named = s.tag() == ex::SymIntArgument::Tag::AS_NAME;
        plan.ints.push_back(named ? 0 : s.get_as_int());
        plan.values.push_back(named ? p.slot_of(s.get_as_name()) : -1);
        fixed = fixed && !named;
      }
      if (fixed) {
        plan.constant = c10::IValue(c10::List<int64_t>(plan.ints));
        plan.values.clear();
      } else {
        plan.how = argument_plan::kind::ints;
      }
      break;
    }
    case T::AS_SYM_BOOL: {
      const auto& s = a.get_as_sym_bool();
      ACTORPIPE_CHECK(s.tag() == ex::SymBoolArgument::Tag::AS_BOOL, p.what, ": ", where,
                      " takes a symbolic bool, which actorpipe does not evaluate");
      plan.constant = s.get_as_bool();
      break;
    }
    case T::AS_SYM_FLOAT: {
      const auto& s = a.get_as_sym_float();
      ACTORPIPE_CHECK(s.tag() == ex::SymFloatArgument::Tag::AS_FLOAT, p.what, ": ", where,
                      " takes a symbolic float, which actorpipe does not evaluate");
      plan.constant = s.get_as_float().get();
      break;
    }
    case T::AS_SCALAR_TYPE:
      plan.constant = scalar_type_of(a.get_as_scalar_type(), where);
      break;
    case T::AS_MEMORY_FORMAT:
      plan.constant = memory_format_of(a.get_as_memory_format(), where);
      break;
    case T::AS_LAYOUT:
      ACTORPIPE_CHECK(a.get_as_layout() == ex::Layout::Strided, p.what, ": ", where,
                      " asks for a layout other than strided");
      plan.constant = c10::kStrided;
      break;
    case T::AS_DEVICE:
      plan.how = argument_plan::kind::device;
      break;
    default:
      throw invalid_argument(concat(p.what, ": ", where, " takes '", formal.name(),
                                    "' as an argument kind actorpipe does not run (number ",
                                    static_cast<int>(a.tag()), " of the export schema)"));
    }
    // A Python number where the schema wants a Tensor (add.Tensor(t, 1)) is a wrapped number,
    // which type promotion treats as eager does.
    if (plan.how == argument_plan::kind::constant && kind == c10::TypeKind::TensorType &&
        (plan.constant.isInt() || plan.constant.isDouble() || plan.constant.isBool())) {
      auto wrapped = c10::scalar_to_tensor(plan.constant.toScalar());
      wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
      plan.constant = wrapped;
    }
    return plan;
  }

  output_plan plan(const ex::Argument& o) {
    using T = ex::Argument::Tag;
    output_plan out;
    if (o.tag() == T::AS_TENSOR) {
      out.how = output_plan::kind::one;
      out.value = p.slot_of(o.get_as_tensor().get_name());
    } else if (o.tag() == T::AS_TENSORS) {
      out.how = output_plan::kind::list;
      for (const auto& t : o.get_as_tensors()) {
        out.values.push_back(p.slot_of(t.get_name()));
      }
    } else if (o.tag() == T::AS_SYM_INT &&
               o.get_as_sym_int().tag() == ex::SymIntArgument::Tag::AS_NAME) {
      out.how = output_plan::kind::one;
      out.value = p.slot_of(o.get_as_sym_int().get_as_name());
      p.sym_ints.insert(out.value);
    } else if (o.tag() == T::AS_OPTIONAL_TENSOR &&
               o.get_as_optional_tensor().tag() == ex::OptionalTensorArgument::Tag::AS_TENSOR) {
      out.how = output_plan::kind::one;
      out.value = p.slot_of(o.get_as_optional_tensor().get_as_tensor().get_name());
    } else if (o.tag() != T::AS_NONE && o.tag() != T::AS_OPTIONAL_TENSOR) {
      throw invalid_argument(concat(p.what, ": ", where,
                                    " returns a value of a kind actorpipe "
                                    "does not keep (number ",
                                    static_cast<int>(o.tag()), " of the export schema)"));
    }
    return out;
  }
};

// "torch.ops.aten.add.Tensor" -> ("aten::add", "Tensor"); ".default" -> "".
std::pair<std::string, std::string> op_name_of(const std::string& target) {
  const std::string prefix = "torch.ops.";
  auto rest = target.substr(prefix.size());
  auto first = rest.find('.');
  auto last = rest.rfind('.');
  if (first == std::string::npos || last == first) {
    return {};
  }
  auto overload = rest.substr(last + 1);
  return {rest.substr(0, first) + "::" + rest.substr(first + 1, last - first - 1),
          overload == "default" ? "" : overload};
}

bool draws_random(const c10::FunctionSchema& schema) {
  static const std::set<std::string> dropouts{"aten::dropout",
                                              "aten::dropout_",
                                              "aten::feature_dropout",
                                              "aten::alpha_dropout",
                                              "aten::feature_alpha_dropout",
                                              "aten::native_dropout",
                                              "aten::rrelu",
                                              "aten::rrelu_"};
  if (dropouts.count(schema.name()) != 0) {
    return true;
  }
  for (const auto& a : schema.arguments()) {
    if (a.type()->kind() == c10::TypeKind::OptionalType &&
        a.type()->containedType(0)->kind() == c10::TypeKind::GeneratorType) {
      return true;
    }
  }
  return false;
}

// The op of a node, refused by name where actorpipe cannot run it.
c10::OperatorHandle resolve(const program& p, const ex::Node& n, const std::string& where) {
  const auto& target = n.get_target();
  ACTORPIPE_CHECK(
    target.rfind("torch.ops.higher_order.", 0) != 0, p.what, ": ", where,
    " is a higher-order op, which actorpipe does not run: it runs ATen and registered "
    "ops node by node and no higher-order op (control flow such as torch.cond, "
    "torch.no_grad or autocast regions inside forward, wrapped submodules). Move it "
    "out of forward or compute it before export");
  ACTORPIPE_CHECK(target.rfind("torch.ops.", 0) == 0, p.what, ": ", where,
                  " calls a Python function, which actorpipe does not run (the SymInt arithmetic "
                  "it runs: _operator.add, sub, mul, floordiv, mod, torch.sym_max, sym_min)");
  auto [name, overload] = op_name_of(target);
  auto op = library_op(name, overload);
  if (!op) {
    op = c10::Dispatcher::singleton().findSchema({name, overload});
  }
  if (!op) {
    std::string ours;
    for (const auto& o : library_ops()) {
      ours += (ours.empty() ? "" : ", ") + o;
    }
    throw invalid_argument(concat(
      p.what, ": ", where,
      " calls an op that is not registered in this process (a custom op, such as one a Python "
      "library registers with torch.library: load a C++ library that defines it, e.g. with "
      "torch::dynamic_library or by linking it, before loading the program; of such ops "
      "actorpipe runs ",
      ours.empty() ? std::string("none on this line") : ours, ")"));
  }
  if (p.dialect != "TRAINING") {
    static const std::set<std::string> no_formula{"aten::copy"};
    ACTORPIPE_CHECK(no_formula.count(name) == 0, p.what, ": the program was decomposed (dialect ",
                    p.dialect, ", from run_decompositions()) and ", where,
                    " has no autograd formula: train the program torch.export.export returns, "
                    "without run_decompositions()");
  }
  return *op;
}

void plan_nodes(program& p, const ex::Graph& graph) {
  for (const auto& n : graph.get_nodes()) {
    if (n.get_target() == "torch.ops.pippy._pipe_split.default") {
      p.markers.push_back(p.nodes.size());
      continue;
    }
    node out;
    out.target = n.get_target();
    out.name = n.get_name().value_or(concat("#", p.nodes.size()));
    read_modules(n, out);
    auto where = concat("node '", out.name, "' (", out.target, ")");
    std::unordered_map<std::string, const ex::Argument*> given;
    for (const auto& a : n.get_inputs()) {
      given[a.get_name()] = &a.get_arg();
    }
    planner plan{p, where};
    if (auto b = builtins().find(out.target); b != builtins().end()) {
      out.arithmetic = b->second;
      static const c10::Argument int_argument("a", c10::IntType::get());
      for (const char* name : {"a", "b"}) {
        ACTORPIPE_CHECK(given.count(name) != 0, p.what, ": ", where, " has no argument '", name,
                        "'");
        out.arguments.push_back(plan.plan(*given[name], int_argument));
      }
    } else {
      out.op = resolve(p, n, where);
      const auto& schema = out.op->schema();
      out.draws_random = draws_random(schema);
      for (const auto& formal : schema.arguments()) {
        auto it = given.find(formal.name());
        if (it != given.end()) {
          out.arguments.push_back(plan.plan(*it->second, formal));
        } else {
          ACTORPIPE_CHECK(formal.default_value().has_value(), p.what, ": ", where, " leaves out '",
                          formal.name(), "', which has no default in ", schema);
          argument_plan fallback;
          fallback.constant = *formal.default_value();
          out.arguments.push_back(std::move(fallback));
        }
        const auto& written = out.arguments.back();
        if (formal.alias_info() != nullptr && formal.alias_info()->isWrite()) {
          if (written.how == argument_plan::kind::value) {
            out.writes.push_back(written.value);
          }
          for (auto s : written.values) {
            if (s >= 0) {
              out.writes.push_back(s);
            }
          }
        }
      }
    }
    for (const auto& o : n.get_outputs()) {
      out.outputs.push_back(plan.plan(o));
    }
    p.nodes.push_back(std::move(out));
  }
}

// Nodes eager runs in train mode only: batch norm's `num_batches_tracked += 1` (the graph was
// traced in train mode; its batch_norm ops take the mode as an argument, this add_ does not), as
// torch.ao.quantization.move_exported_model_to_eval rewrites it.
void mark_training_only(program& p) {
  std::set<slot> counters;
  for (const auto& s : p.state) {
    const std::string suffix = "num_batches_tracked";
    if (s.role == state_tensor::kind::buffer && s.name.size() >= suffix.size() &&
        s.name.compare(s.name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      counters.insert(s.slots.begin(), s.slots.end());
    }
  }
  for (auto& n : p.nodes) {
    n.training_only = n.target == "torch.ops.aten.add_.Tensor" && n.writes.size() == 1 &&
                      counters.count(n.writes.front()) != 0;
  }
}

ex::ExportedProgram parse(const std::string& text, const std::string& what,
                          const std::string& entry) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw invalid_argument(
      concat(what, ": ", entry, " is not JSON (truncated?): ", detail::first_line(e.what())));
  }
  int major = -1, minor = -1;
  try {
    major = json.at("schema_version").at("major").get<int>();
    minor = json.at("schema_version").at("minor").get<int>();
  } catch (const std::exception&) {
  }
  ACTORPIPE_CHECK(major == schema_major(), what, ": the program is in the export schema ", major,
                  ".", minor, ", and this actorpipe reads schema ", schema_major(),
                  ".x (built against PyTorch ", TORCH_VERSION,
                  "); export it with a PyTorch whose torch.export writes schema ", schema_major(),
                  ".x, or build actorpipe against the PyTorch that wrote it");
  try {
    return json.get<ex::ExportedProgram>();
  } catch (const std::exception& e) {
    throw invalid_argument(concat(what, ": ", entry, " does not follow the export schema ", major,
                                  ".", minor, ": ", detail::first_line(e.what())));
  }
}

std::unique_ptr<caffe2::serialize::PyTorchStreamReader> open_archive(const std::string& bytes,
                                                                     const std::string& what) {
  try {
    return std::make_unique<caffe2::serialize::PyTorchStreamReader>(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(),
                                                             static_cast<off_t>(bytes.size())));
  } catch (const std::exception& e) {
    throw invalid_argument(concat(what,
                                  " is not a PT2 archive (what torch.export.save writes), or "
                                  "it is truncated: ",
                                  detail::first_line(e.what())));
  }
}

std::string model_entry(caffe2::serialize::PyTorchStreamReader& reader, const std::string& what,
                        const std::string& model) {
  ACTORPIPE_CHECK(reader.hasRecord("archive_format") && record(reader, "archive_format") == "pt2",
                  what,
                  " is a zip file but not a PT2 archive (no archive_format 'pt2'): write it "
                  "with torch.export.save(torch.export.export(model, example), path)");
  auto entry = "models/" + model + ".json";
  if (!reader.hasRecord(entry)) {
    std::string found;
    for (const auto& r : reader.getAllRecords()) {
      if (r.rfind("models/", 0) == 0 && r.size() > 12 && r.compare(r.size() - 5, 5, ".json") == 0) {
        found += (found.empty() ? "" : ", ") + r.substr(7, r.size() - 12);
      }
    }
    throw invalid_argument(concat(what, " holds no program '", model, "' (it holds: ",
                                  found.empty() ? std::string("none") : found, ")"));
  }
  return entry;
}

} // namespace

program read_program(const std::string& bytes, const std::string& what, const std::string& model) {
  program p;
  p.what = what;
  auto reader = open_archive(bytes, what);
  try {
    auto entry = model_entry(*reader, what, model);
    auto ep = parse(record(*reader, entry), what, entry);
    const auto& verifiers = ep.get_verifiers();
    p.dialect = verifiers.empty() ? std::string("ATEN") : verifiers.front();
    auto weights = read_payload(*reader, "data/weights/", model + "_weights_config.json", what);
    auto constants =
      read_payload(*reader, "data/constants/", model + "_constants_config.json", what);
    const auto& graph_module = ep.get_graph_module();
    std::vector<std::pair<slot, c10::IValue>> fixed;
    read_inputs(p, graph_module.get_signature(), weights, constants, fixed);
    ACTORPIPE_CHECK(fixed.empty(), what, ": forward takes a constant input ('",
                    fixed.empty() ? std::string() : p.name_of(fixed.front().first),
                    "'); export with tensors as the only inputs");
    read_outputs(p, graph_module.get_signature());
    choose_loss_output(p, ep);
    read_batch_dimensions(p, ep);
    plan_nodes(p, graph_module.get_graph());
    mark_training_only(p);
  } catch (const c10::Error& e) {
    throw invalid_argument(concat(what, " is a damaged PT2 archive (truncated?): ",
                                  detail::first_line(e.what_without_backtrace())));
  }
  return p;
}

// --- running --------------------------------------------------------------------------------

namespace {

const c10::IValue& value_at(const program& p, const values& table, slot s) {
  const auto& v = table[static_cast<std::size_t>(s)];
  if (v.isNone()) {
    throw c10::Error(concat("the value '", p.name_of(s), "' is not defined here"), {});
  }
  return v;
}

void push_argument(const program& p, const values& table, const argument_plan& a,
                   const run_context& context, torch::jit::Stack& stack) {
  using K = argument_plan::kind;
  switch (a.how) {
  case K::constant:
    stack.push_back(a.constant);
    break;
  case K::value:
    stack.push_back(value_at(p, table, a.value));
    break;
  case K::scalar_tensor: {
    auto wrapped = c10::scalar_to_tensor(value_at(p, table, a.value).toScalar());
    wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
    stack.emplace_back(std::move(wrapped));
    break;
  }
  case K::tensors: {
    c10::List<at::Tensor> list;
    list.reserve(a.values.size());
    for (auto s : a.values) {
      list.push_back(value_at(p, table, s).toTensor());
    }
    stack.emplace_back(std::move(list));
    break;
  }
  case K::optional_tensors: {
    c10::List<std::optional<at::Tensor>> list;
    for (auto s : a.values) {
      list.push_back(s < 0 ? std::optional<at::Tensor>()
                           : std::optional<at::Tensor>(value_at(p, table, s).toTensor()));
    }
    stack.emplace_back(std::move(list));
    break;
  }
  case K::ints: {
    c10::List<int64_t> list;
    for (std::size_t i = 0; i < a.ints.size(); ++i) {
      list.push_back(a.values[i] < 0 ? a.ints[i] : value_at(p, table, a.values[i]).toInt());
    }
    stack.emplace_back(std::move(list));
    break;
  }
  case K::device:
    stack.emplace_back(context.device);
    break;
  case K::mode:
    stack.emplace_back(context.training);
    break;
  }
}

void store_outputs(const node& n, torch::jit::Stack& stack, values& table) {
  for (std::size_t k = 0; k < n.outputs.size() && k < stack.size(); ++k) {
    const auto& o = n.outputs[k];
    if (o.how == output_plan::kind::one) {
      table[static_cast<std::size_t>(o.value)] = std::move(stack[k]);
    } else if (o.how == output_plan::kind::list) {
      auto list = stack[k].toTensorList();
      for (std::size_t j = 0; j < o.values.size() && j < list.size(); ++j) {
        table[static_cast<std::size_t>(o.values[j])] = list.get(j);
      }
    }
  }
}

void run_node(const program& p, const node& n, values& table, const run_context& context,
              torch::jit::Stack& stack) {
  try {
    stack.clear();
    for (const auto& a : n.arguments) {
      push_argument(p, table, a, context, stack);
    }
    if (n.arithmetic != nullptr) {
      auto result = n.arithmetic(stack[0].toInt(), stack[1].toInt());
      stack.clear();
      stack.emplace_back(result);
    } else {
      n.op->callBoxed(stack);
    }
    store_outputs(n, stack, table);
  } catch (const c10::Error& e) {
    throw c10::Error(concat("node '", n.name, "' (", n.target, "): ", e.what_without_backtrace()),
                     {});
  }
}

} // namespace

void run_nodes(const program& p, values& table, std::size_t begin, std::size_t end,
               const run_context& context, const std::vector<std::vector<slot>>& drop) {
  torch::jit::Stack stack;
  for (std::size_t i = begin; i < end; ++i) {
    const auto& n = p.nodes[i];
    if (n.training_only && !context.training) {
      // Its output is the tensor it would have written.
      table[static_cast<std::size_t>(n.outputs.front().value)] =
        table[static_cast<std::size_t>(n.writes.front())];
    } else {
      run_node(p, n, table, context, stack);
    }
    if (i < drop.size()) {
      for (auto s : drop[i]) {
        table[static_cast<std::size_t>(s)] = c10::IValue();
      }
    }
  }
}

} // namespace actorpipe::exported
