#include "models/pointwise_conv.hpp"

#include <actorpipe/torch_compat.hpp>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ops/mkldnn_convolution.h>
#include <torch/csrc/autograd/custom_function.h>

namespace actorpipe::models {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

torch::Tensor onednn_pointwise(const torch::Tensor& x, const torch::Tensor& w) {
  return at::mkldnn_convolution(x, w, c10::nullopt, {0, 0}, {1, 1}, {1, 1}, 1);
}

// y = conv1x1(x, w); dx = conv1x1(dy, w^T) on oneDNN; dw = dy [O, N*H*W] x^T [N*H*W, C], one GEMM.
struct pointwise_function : torch::autograd::Function<pointwise_function> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w) {
    auto xc = x.contiguous();
    ctx->save_for_backward({xc, w});
    return onednn_pointwise(xc, w.contiguous());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& w = saved[1];
    auto g = grads[0].contiguous();
    torch::Tensor dx;
    torch::Tensor dw;
    if (ctx->needs_input_grad(0)) {
      dx = onednn_pointwise(g, w.transpose(0, 1).contiguous());
    }
    if (ctx->needs_input_grad(1)) {
      auto out = w.size(0);
      auto in = w.size(1);
      dw = at::mm(g.transpose(0, 1).reshape({out, -1}), x.transpose(0, 1).reshape({in, -1}).t())
             .view(w.sizes());
    }
    return {dx, dw};
  }
};

} // namespace

PointwiseConv2dImpl::PointwiseConv2dImpl(int64_t in, int64_t out, int64_t stride)
  : torch::nn::Conv2dImpl(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)) {}

torch::Tensor PointwiseConv2dImpl::forward(const torch::Tensor& x) {
  if (pointwise_fast_path(*this, x)) {
    return pointwise_function::apply(x, weight);
  }
  return torch::nn::Conv2dImpl::forward(x);
}

bool pointwise_fast_path(const torch::nn::Conv2dImpl& conv, const torch::Tensor& x) {
  // The cases libtorch 1.13's ConvParams::use_mkldnn leaves to its native kernel.
  const auto& o = conv.options;
  const auto* padding = compat::get_if<torch::ExpandingArray<2>>(&o.padding());
  return at::hasMKLDNN() && at::globalContext().userEnabledMkldnn() && x.device().is_cpu() &&
         x.scalar_type() == at::kFloat && x.layout() == at::kStrided && x.dim() == 4 &&
         x.size(0) < 16 && at::get_num_threads() == 1 && !conv.bias.defined() &&
         (*o.kernel_size())[0] == 1 && (*o.kernel_size())[1] == 1 && (*o.stride())[0] == 1 &&
         (*o.stride())[1] == 1 && (*o.dilation())[0] == 1 && (*o.dilation())[1] == 1 &&
         o.groups() == 1 && padding != nullptr && (**padding)[0] == 0 && (**padding)[1] == 0 &&
         !o.transposed() && conv.weight.scalar_type() == at::kFloat;
}

} // namespace actorpipe::models
