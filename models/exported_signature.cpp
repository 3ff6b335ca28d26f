// The graph's signature: which inputs are parameters, buffers, constants and user inputs,
// what it returns, the output the loss reads, the inputs' batch dimensions.
#include "models/exported_reading.hpp"

#include <nlohmann/json.hpp>

#include <actorpipe/errors.hpp>

namespace actorpipe::exported {

namespace ex = torch::_export;
using detail::concat;

namespace {

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

} // namespace

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

namespace {

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

} // namespace

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

namespace {

// "s52", or the first symbol of "Symbol('s52', positive=True)".
std::string symbol_of(const std::string& expression) {
  auto quote = expression.find('\'');
  if (quote == std::string::npos) {
    return expression;
  }
  return expression.substr(quote + 1, expression.find('\'', quote + 1) - quote - 1);
}

} // namespace

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

} // namespace actorpipe::exported
