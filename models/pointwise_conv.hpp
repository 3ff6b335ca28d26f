/// \file
/// A 1x1 convolution that stays on oneDNN for small batches.
///
/// libtorch 1.13 sends an unstrided 1x1 convolution of fewer than 16 samples on one intra-op
/// thread to its native kernel (im2col-free, but one BLAS call per sample, forward and backward)
/// instead of oneDNN. On the deep, small-spatial layers of a ResNet (layer3, layer4 at 8x8 and
/// 4x4) those per-sample GEMMs are thin, and a micro-batch of 8 costs ~1.45x per sample what a
/// micro-batch of 16 costs (BENCHMARKS.md, "Small micro-batches"). Pipeline
/// stages run on one thread each with exactly such micro-batches, so this module runs them on
/// oneDNN forward and backward input, and computes the weight gradient as one GEMM over the
/// whole micro-batch. Every other case is libtorch's Conv2d unchanged.
#pragma once

#include <cstdint>

#include <torch/nn/modules/conv.h>

namespace actorpipe::models {

/// libtorch's Conv2d with kernel 1, no bias, no padding; same parameters and state-dict names.
class PointwiseConv2dImpl : public torch::nn::Conv2dImpl {
public:
  PointwiseConv2dImpl(int64_t in, int64_t out, int64_t stride);
  torch::Tensor forward(const torch::Tensor& x);
};
TORCH_MODULE(PointwiseConv2d);

/// Whether PointwiseConv2d computes `x` on its own path (else libtorch's Conv2d does).
bool pointwise_fast_path(const torch::nn::Conv2dImpl& conv, const torch::Tensor& x);

} // namespace actorpipe::models
