// Binding nodes at load: each node's op resolved once (ours, the dispatcher's, or refused by
// name), each argument bound against the op's schema (a slot, a constant, a schema default),
// each output given its slots.
#include "models/exported_reading.hpp"

#include <ATen/ScalarOps.h>

#include <set>
#include <type_traits>
#include <unordered_map>

#include <actorpipe/errors.hpp>
#include <actorpipe/exported.hpp>

namespace actorpipe::exported {

namespace ex = torch::_export;
using detail::concat;

namespace {

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

// Binds one node's arguments and outputs: slots for the graph's values, constants for the rest.
struct argument_binder {
  program& p;
  const std::string& where; // "node 'linear_3' (torch.ops.aten.linear.default)"

  argument_plan bind(const ex::Argument& a, const c10::Argument& formal) {
    argument_plan plan;
    if (!bind_tensors(a, plan) && !bind_symbolic(a, formal, plan) &&
        !bind_constant(a, formal, plan)) {
      throw invalid_argument(concat(p.what, ": ", where, " takes '", formal.name(),
                                    "' as an argument kind actorpipe does not run (number ",
                                    static_cast<int>(a.tag()), " of the export schema)"));
    }
    // A Python number where the schema wants a Tensor (add.Tensor(t, 1)) is a wrapped number,
    // which type promotion treats as eager does.
    if (plan.how == argument_plan::kind::constant &&
        formal.type()->kind() == c10::TypeKind::TensorType &&
        (plan.constant.isInt() || plan.constant.isDouble() || plan.constant.isBool())) {
      auto wrapped = c10::scalar_to_tensor(plan.constant.toScalar());
      wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
      plan.constant = wrapped;
    }
    return plan;
  }

  // None, a tensor, an optional tensor, a list of either: the graph's values by slot.
  bool bind_tensors(const ex::Argument& a, argument_plan& plan) {
    using T = ex::Argument::Tag;
    using O = ex::OptionalTensorArgument::Tag;
    switch (a.tag()) {
    case T::AS_NONE:
      return true;
    case T::AS_TENSOR:
      plan.how = argument_plan::kind::value;
      plan.value = p.slot_of(a.get_as_tensor().get_name());
      return true;
    case T::AS_OPTIONAL_TENSOR:
      if (a.get_as_optional_tensor().tag() == O::AS_TENSOR) {
        plan.how = argument_plan::kind::value;
        plan.value = p.slot_of(a.get_as_optional_tensor().get_as_tensor().get_name());
      }
      return true;
    case T::AS_TENSORS:
      plan.how = argument_plan::kind::tensors;
      for (const auto& t : a.get_as_tensors()) {
        plan.values.push_back(p.slot_of(t.get_name()));
      }
      return true;
    case T::AS_OPTIONAL_TENSORS:
      plan.how = argument_plan::kind::optional_tensors;
      for (const auto& o : a.get_as_optional_tensors()) {
        plan.values.push_back(o.tag() == O::AS_TENSOR ? p.slot_of(o.get_as_tensor().get_name())
                                                      : -1);
      }
      return true;
    default:
      return false;
    }
  }

  // SymInts, bools and floats: constants where fixed, the graph's values where named.
  bool bind_symbolic(const ex::Argument& a, const c10::Argument& formal, argument_plan& plan) {
    using T = ex::Argument::Tag;
    switch (a.tag()) {
    case T::AS_SYM_INT: {
      const auto& s = a.get_as_sym_int();
      if (s.tag() == ex::SymIntArgument::Tag::AS_INT) {
        plan.constant = s.get_as_int();
      } else {
        plan.how = formal.type()->kind() == c10::TypeKind::TensorType
                     ? argument_plan::kind::scalar_tensor
                     : argument_plan::kind::value;
        plan.value = p.slot_of(s.get_as_name());
      }
      return true;
    }
    case T::AS_SYM_INTS:
      bind_sym_ints(a, plan);
      return true;
    case T::AS_SYM_BOOL: {
      const auto& s = a.get_as_sym_bool();
      ACTORPIPE_CHECK(s.tag() == ex::SymBoolArgument::Tag::AS_BOOL, p.what, ": ", where,
                      " takes a symbolic bool, which actorpipe does not evaluate");
      plan.constant = s.get_as_bool();
      return true;
    }
    case T::AS_SYM_FLOAT: {
      const auto& s = a.get_as_sym_float();
      ACTORPIPE_CHECK(s.tag() == ex::SymFloatArgument::Tag::AS_FLOAT, p.what, ": ", where,
                      " takes a symbolic float, which actorpipe does not evaluate");
      plan.constant = s.get_as_float().get();
      return true;
    }
    default:
      return false;
    }
  }

  // A list of SymInts: one constant list when all are fixed, else assembled per run.
  void bind_sym_ints(const ex::Argument& a, argument_plan& plan) {
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
  }

  template <class T, class List>
  static c10::IValue list_of(const List& items) {
    c10::List<T> list;
    for (const auto& item : items) {
      if constexpr (std::is_same_v<T, double>) {
        list.push_back(item.get());
      } else {
        list.push_back(item);
      }
    }
    return list;
  }

  // Numbers, strings, lists of them, dtypes, memory formats, the layout and the device.
  bool bind_constant(const ex::Argument& a, const c10::Argument& formal, argument_plan& plan) {
    using T = ex::Argument::Tag;
    const auto kind = formal.type()->kind();
    switch (a.tag()) {
    case T::AS_INT:
      // A float argument may be written as an int (eps=0).
      plan.constant = kind == c10::TypeKind::FloatType
                        ? c10::IValue(static_cast<double>(a.get_as_int()))
                        : c10::IValue(a.get_as_int());
      return true;
    case T::AS_INTS:
      plan.constant = c10::IValue(c10::List<int64_t>(a.get_as_ints()));
      return true;
    case T::AS_FLOAT:
      plan.constant = a.get_as_float().get();
      return true;
    case T::AS_FLOATS:
      plan.constant = list_of<double>(a.get_as_floats());
      return true;
    case T::AS_BOOL:
      plan.constant = a.get_as_bool();
      if (a.get_as_bool() && kind == c10::TypeKind::BoolType &&
          (formal.name() == "train" || formal.name() == "training")) {
        plan.how = argument_plan::kind::mode;
      }
      return true;
    case T::AS_BOOLS:
      plan.constant = list_of<bool>(a.get_as_bools());
      return true;
    case T::AS_STRING:
      plan.constant = a.get_as_string();
      return true;
    case T::AS_STRINGS:
      plan.constant = list_of<std::string>(a.get_as_strings());
      return true;
    default:
      return bind_enum(a, plan);
    }
  }

  bool bind_enum(const ex::Argument& a, argument_plan& plan) {
    using T = ex::Argument::Tag;
    switch (a.tag()) {
    case T::AS_SCALAR_TYPE:
      plan.constant = scalar_type_of(a.get_as_scalar_type(), where);
      return true;
    case T::AS_MEMORY_FORMAT:
      plan.constant = memory_format_of(a.get_as_memory_format(), where);
      return true;
    case T::AS_LAYOUT:
      ACTORPIPE_CHECK(a.get_as_layout() == ex::Layout::Strided, p.what, ": ", where,
                      " asks for a layout other than strided");
      plan.constant = c10::kStrided;
      return true;
    case T::AS_DEVICE:
      plan.how = argument_plan::kind::device;
      return true;
    default:
      return false;
    }
  }

  output_plan bind(const ex::Argument& o) {
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

using given_arguments = std::unordered_map<std::string, const ex::Argument*>;

// An op's arguments in its schema's order: those the node gives, bound; the rest its defaults,
// resolved here once rather than per call. The slots it writes in place are noted.
void bind_op_arguments(const program& p, const given_arguments& given, argument_binder& binder,
                       node& out, const std::string& where) {
  const auto& schema = out.op->schema();
  for (const auto& formal : schema.arguments()) {
    auto it = given.find(formal.name());
    if (it != given.end()) {
      out.arguments.push_back(binder.bind(*it->second, formal));
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

// One node of the graph: a builtin's two ints, or an op resolved with its arguments bound.
node bind_node(program& p, const ex::Node& n) {
  node out;
  out.target = n.get_target();
  out.name = n.get_name().value_or(concat("#", p.nodes.size()));
  read_modules(n, out);
  auto where = concat("node '", out.name, "' (", out.target, ")");
  given_arguments given;
  for (const auto& a : n.get_inputs()) {
    given[a.get_name()] = &a.get_arg();
  }
  argument_binder binder{p, where};
  if (auto b = builtins().find(out.target); b != builtins().end()) {
    out.arithmetic = b->second;
    static const c10::Argument int_argument("a", c10::IntType::get());
    for (const char* name : {"a", "b"}) {
      ACTORPIPE_CHECK(given.count(name) != 0, p.what, ": ", where, " has no argument '", name, "'");
      out.arguments.push_back(binder.bind(*given[name], int_argument));
    }
  } else {
    out.op = resolve(p, n, where);
    out.draws_random = draws_random(out.op->schema());
    bind_op_arguments(p, given, binder, out, where);
  }
  for (const auto& o : n.get_outputs()) {
    out.outputs.push_back(binder.bind(o));
  }
  return out;
}

} // namespace

void bind_nodes(program& p, const ex::Graph& graph) {
  for (const auto& n : graph.get_nodes()) {
    if (n.get_target() == "torch.ops.pippy._pipe_split.default") {
      p.markers.push_back(p.nodes.size());
      continue;
    }
    p.nodes.push_back(bind_node(p, n));
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

} // namespace actorpipe::exported
