// Running nodes: a range of a program's nodes through the c10 dispatcher on a value table, with
// autograd recording as in eager (models/exported_program.hpp).
#include "models/exported_program.hpp"

#include <actorpipe/errors.hpp>

namespace actorpipe::exported {

using detail::concat;

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
