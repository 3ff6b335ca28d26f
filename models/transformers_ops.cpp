// The ops Hugging Face transformers registers from Python that its models' exported programs
// call, as C++ kernels with autograd formulas of ours (library_op, models/exported_program.hpp).
//
// transformers/integrations/moe.py registers `transformers::grouped_mm_fallback` (and its
// backward) with torch.library.custom_op: a mixture of experts' grouped matrix product, each
// expert's weight times the rows routed to it, the rows sorted by expert and `offs` the running
// count of rows per expert. Its experts take this path under torch.export where the weights are
// not bfloat16 (torch._grouped_mm, which libtorch has, otherwise). The kernels here compute what
// the Python ones compute, with the same products in the same order (torch.mm into slices), so
// that a pipeline's losses equal eager PyTorch's.
//
// They are registered under a namespace of ours, not `transformers`: a Python process that
// imports transformers registers that name itself, and a second registration of one name fails.
// The program's node keeps its target; resolving it finds these.
#include <torch/autograd.h>
#include <torch/library.h>

#include <map>

#include <actorpipe/errors.hpp>
#include <actorpipe/exported.hpp>

#include "models/exported_program.hpp"

namespace actorpipe::exported {

namespace {

using detail::concat;

// The end row of each expert's rows (offs, cumulative), on the host: the one sync a call makes,
// as the Python kernel's offs.tolist().
std::vector<int64_t> ends_of(const at::Tensor& input, const at::Tensor& weight,
                             const at::Tensor& offs, const char* op) {
  ACTORPIPE_CHECK(input.dim() == 2 && weight.dim() == 3 && offs.dim() == 1, op,
                  ": expected input (S, in), weight (experts, in, out) and offs (experts), got ",
                  input.sizes(), ", ", weight.sizes(), " and ", offs.sizes());
  ACTORPIPE_CHECK(offs.size(0) == weight.size(0) && input.size(1) == weight.size(1), op,
                  ": offs has ", offs.size(0), " entries and weight ", weight.size(0),
                  " experts; input has ", input.size(1), " columns and weight ", weight.size(1),
                  " rows");
  auto host = offs.to(at::kCPU, at::kLong).contiguous();
  std::vector<int64_t> ends(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  int64_t start = 0;
  for (auto end : ends) {
    ACTORPIPE_CHECK(end == start || (end > start && end <= input.size(0)), op,
                    ": offs must not decrease nor exceed the ", input.size(0), " rows, got ", host);
    start = end;
  }
  return ends;
}

at::Tensor grouped_mm(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& offs) {
  auto ends = ends_of(input, weight, offs, "transformers::grouped_mm_fallback");
  auto output = at::zeros({input.size(0), weight.size(2)}, input.options());
  int64_t start = 0;
  for (std::size_t i = 0; i < ends.size(); ++i) {
    if (ends[i] == start) {
      continue;
    }
    auto rows = output.slice(0, start, ends[i]);
    at::mm_out(rows, input.slice(0, start, ends[i]), weight.select(0, static_cast<int64_t>(i)));
    start = ends[i];
  }
  return output;
}

std::tuple<at::Tensor, at::Tensor> grouped_mm_backward(const at::Tensor& input,
                                                       const at::Tensor& weight,
                                                       const at::Tensor& offs,
                                                       const at::Tensor& grad_output) {
  auto ends = ends_of(input, weight, offs, "transformers::grouped_mm_fallback_backward");
  auto grad_input = at::zeros_like(input);
  auto grad_weight = at::zeros_like(weight);
  int64_t start = 0;
  for (std::size_t i = 0; i < ends.size(); ++i) {
    if (ends[i] == start) {
      continue;
    }
    auto e = static_cast<int64_t>(i);
    auto g = grad_output.slice(0, start, ends[i]);
    auto gi = grad_input.slice(0, start, ends[i]);
    auto gw = grad_weight.select(0, e);
    at::mm_out(gi, g, weight.select(0, e).t());
    at::mm_out(gw, input.slice(0, start, ends[i]).t(), g);
    start = ends[i];
  }
  return {grad_input, grad_weight};
}

// The autograd formula the Python op registers: gradients for input and weight, none for offs.
struct grouped_mm_function : torch::autograd::Function<grouped_mm_function> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& offs) {
    ctx->save_for_backward({input, weight, offs});
    return grouped_mm(input, weight, offs);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto [grad_input, grad_weight] =
      grouped_mm_backward(saved[0], saved[1], saved[2], grads[0].contiguous());
    return {grad_input, grad_weight, at::Tensor()};
  }
};

at::Tensor grouped_mm_autograd(const at::Tensor& input, const at::Tensor& weight,
                               const at::Tensor& offs) {
  return grouped_mm_function::apply(input, weight, offs);
}

} // namespace

// Each library op's name among ours.
const std::map<std::string, std::string>& replacements() {
  static const std::map<std::string, std::string> table{
    {"transformers::grouped_mm_fallback", "actorpipe_transformers::grouped_mm_fallback"},
    {"transformers::grouped_mm_fallback_backward",
     "actorpipe_transformers::grouped_mm_fallback_backward"}};
  return table;
}

TORCH_LIBRARY(actorpipe_transformers, m) {
  m.def("grouped_mm_fallback(Tensor input, Tensor weight, Tensor offs) -> Tensor");
  m.def("grouped_mm_fallback_backward(Tensor input, Tensor weight, Tensor offs, "
        "Tensor grad_output) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(actorpipe_transformers, CompositeExplicitAutograd, m) {
  m.impl("grouped_mm_fallback", &grouped_mm);
  m.impl("grouped_mm_fallback_backward", &grouped_mm_backward);
}

TORCH_LIBRARY_IMPL(actorpipe_transformers, Autograd, m) {
  m.impl("grouped_mm_fallback", &grouped_mm_autograd);
}

std::optional<c10::OperatorHandle> library_op(const std::string& name,
                                              const std::string& overload) {
  auto it = replacements().find(name);
  if (it == replacements().end() || !overload.empty()) {
    return std::nullopt;
  }
  return c10::Dispatcher::singleton().findSchema({it->second, ""});
}

} // namespace actorpipe::exported

namespace actorpipe {

std::vector<std::string> library_ops() {
  std::vector<std::string> names;
  for (const auto& [name, ours] : exported::replacements()) {
    (void)ours;
    names.push_back(name);
  }
  return names;
}

} // namespace actorpipe
