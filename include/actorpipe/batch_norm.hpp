/// \file
/// Deferred batch norm (as torchgpipe offers): with micro-batches, a batch-norm layer normally
/// updates its running statistics once per micro-batch, from micro-batch statistics. Deferred,
/// it still normalises each micro-batch by its own statistics (so gradients are unchanged), but
/// accumulates per-channel sums over all micro-batches of a step and updates the running
/// statistics once, at the end of the step, with the statistics of the whole batch: the same
/// running mean, variance and counter as one forward over the full batch.
#pragma once

#include <cstddef>
#include <ostream>

#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>

#include <actorpipe/layers.hpp>

namespace actorpipe {

/// Batch norm over [N, C, H, W] inputs, equal to torch::nn::BatchNorm2d (same options,
/// parameters, buffers, names, initialisation and eval behaviour) except that its running
/// statistics update can be deferred to the end of a step. The built-in ResNets use it
/// (model_options::deferred_batch_norm turns deferral on).
class DeferredBatchNorm2dImpl : public torch::nn::Cloneable<DeferredBatchNorm2dImpl> {
public:
  explicit DeferredBatchNorm2dImpl(int64_t num_features)
    : DeferredBatchNorm2dImpl(torch::nn::BatchNormOptions(num_features)) {}
  explicit DeferredBatchNorm2dImpl(const torch::nn::BatchNormOptions& options);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  torch::Tensor forward(const torch::Tensor& input);

  /// Applies what was accumulated since the last commit (as one update of the running
  /// statistics with the accumulated batch's mean and unbiased variance) and clears it. Stages
  /// call it after the last micro-batch of every training step; nothing happens when nothing
  /// was accumulated.
  void commit();

  /// Forgets what was accumulated (a stage does this when a step begins).
  void discard();

  torch::nn::BatchNormOptions options;
  /// Whether training forwards accumulate instead of updating running statistics.
  bool deferred = false;
  /// Set by a stage while it recomputes a forward (activation recomputation): training
  /// forwards then accumulate nothing, so a micro-batch counts once.
  bool recomputing = false;
  torch::Tensor weight;
  torch::Tensor bias;
  torch::Tensor running_mean;
  torch::Tensor running_var;
  torch::Tensor num_batches_tracked;

private:
  // Counts one update of the running statistics; returns its factor (momentum).
  double count_update();

  torch::Tensor sum_;
  torch::Tensor square_sum_;
  double count_ = 0;
};

TORCH_MODULE(DeferredBatchNorm2d);

/// Sets `deferred` on every DeferredBatchNorm2d inside `layers`; returns how many it found.
std::size_t set_deferred_batch_norm(const layer_list& layers, bool deferred);

} // namespace actorpipe
