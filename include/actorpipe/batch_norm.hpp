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
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>

#include <actorpipe/layers.hpp>

namespace actorpipe {

/// What a synchronised batch norm (SyncBatchNorm) needs from the other replicas of its stage.
/// The stage actor of a data-parallel pipeline provides it (data_parallel_options::
/// sync_batch_norm); the calls come from the stage's thread, in the same order on every replica.
class batch_norm_sync : public torch::CustomClassHolder {
public:
  ~batch_norm_sync() override = default;
  /// Replaces `sums` (a contiguous float64 tensor, the same shape on every replica) with its
  /// sum over the replicas. Throws pipeline_error when a replica fails to join before the
  /// deadline.
  virtual void all_reduce_sum(torch::Tensor& sums) = 0;
  /// This replica's weight in the average of gradients this step (its samples for a mean loss,
  /// 1 for a summed one): a gradient flowing back into the shared statistics counts as much as
  /// the replica's gradients do.
  virtual double gradient_weight() const = 0;
};

/// Batch norm over [N, C, H, W] inputs, equal to torch::nn::BatchNorm2d (same options,
/// parameters, buffers, names, initialisation and eval behaviour) except that its running
/// statistics update can be deferred to the end of a step. The built-in ResNets use it
/// (model_options::deferred_batch_norm turns deferral on).
///
/// Synchronised (`sync` set, as data_parallel_options::sync_batch_norm does for every replica's
/// stages), a training forward normalises by the statistics of the same micro-batch of every
/// replica together: per-channel sums and sums of squares are all-reduced (one float64
/// all-reduce per forward) and their gradient is all-reduced in backward, so R replicas
/// normalise as one BatchNorm2d over the R micro-batches concatenated. Running statistics are
/// updated from those global statistics (per micro-batch, or once per step when deferred), the
/// same on every replica.
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
  /// Set by the stage of a data-parallel pipeline with sync_batch_norm (null: local batch norm).
  c10::intrusive_ptr<batch_norm_sync> sync;
  torch::Tensor weight;
  torch::Tensor bias;
  torch::Tensor running_mean;
  torch::Tensor running_var;
  torch::Tensor num_batches_tracked;

private:
  // The synchronised training forward.
  torch::Tensor synchronised(const torch::Tensor& input);
  // Counts one update of the running statistics; returns its factor (momentum).
  double count_update();

  torch::Tensor sum_;
  torch::Tensor square_sum_;
  double count_ = 0;
};

TORCH_MODULE(DeferredBatchNorm2d);

/// Sets `sync` on every DeferredBatchNorm2d inside `layers` (null: local again); returns how
/// many it found.
std::size_t set_batch_norm_sync(const layer_list& layers,
                                const c10::intrusive_ptr<batch_norm_sync>& sync);

/// How many DeferredBatchNorm2d `layers` hold.
std::size_t count_batch_norms(const layer_list& layers);

/// The batch norms inside `layers` that are not DeferredBatchNorm2d (torch::nn::BatchNorm2d, a
/// scripted BatchNorm): they normalise locally and cannot synchronise. Each entry names the
/// layer and the module's type ("'bn' (torch::nn::BatchNorm1d)").
std::vector<std::string> local_batch_norms(const layer_list& layers);

/// Sets `deferred` on every DeferredBatchNorm2d inside `layers`; returns how many it found.
std::size_t set_deferred_batch_norm(const layer_list& layers, bool deferred);

} // namespace actorpipe
