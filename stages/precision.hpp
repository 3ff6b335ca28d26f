/// \file
/// bf16 mixed precision on a stage's thread: the autocast scope a stage runs its forward in,
/// the casts at stage boundaries, and whether this CPU computes bf16 natively.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>

#include <actorpipe/options.hpp>

namespace actorpipe::stages {

/// Sets libtorch's autocast for `device` (CPU, or CUDA for a stage on a GPU) on the calling
/// thread for its lifetime (autocast state is thread-local): on, to bfloat16, for
/// precision_mode::bf16; off for fp32, whatever the thread had. Restores the thread's state and,
/// leaving the outermost scope, drops autocast's cache of bf16 weight copies (the optimizer changes
/// the weights between scopes).
///
/// The first scope also makes libtorch 1.13's CPU autocast run layer_norm and group_norm in
/// float32 (as Megatron keeps its LayerNorms): 1.13 leaves them out of autocast's lists, and
/// their CPU kernels refuse a bf16 input with float32 weights.
class autocast_scope {
public:
  explicit autocast_scope(precision_mode mode, c10::DeviceType device = c10::DeviceType::CPU);
  ~autocast_scope();
  autocast_scope(const autocast_scope&) = delete;
  autocast_scope& operator=(const autocast_scope&) = delete;

private:
  c10::DeviceType device_;
  bool was_enabled_;
  c10::ScalarType was_dtype_;
  bool enabled_;
};

/// A stage's floating output as it leaves the stage under `mode`: for bf16, float32 tensors
/// become bf16 (in the graph, so their gradients come back in bf16 too) unless `last`, where
/// bf16 tensors become float32 (the loss and the caller's outputs are float32). Others as is.
at::Tensor boundary_cast(const at::Tensor& t, precision_mode mode, bool last);

/// Whether this CPU has bf16 arithmetic instructions (avx512_bf16 or amx_bf16 in
/// /proc/cpuinfo's flags). Without them libtorch 1.13 emulates bf16 matrix products, which
/// are then several times slower than float32 (BENCHMARKS.md, "bf16 on a CPU without it").
bool cpu_has_native_bf16();

/// "" when bf16 is native here (or `mode` is fp32); otherwise a warning for the user that
/// names the CPU and what bf16 costs on it.
std::string precision_warning(precision_mode mode);

} // namespace actorpipe::stages
