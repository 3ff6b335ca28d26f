/// \file
/// A stage: a contiguous slice of a model's layers, bound to one device, owning its parameters,
/// its optimizer and the stash of micro-batches between their forward and backward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>

#include <actorpipe/layers.hpp>
#include <actorpipe/options.hpp>
#include <actorpipe/partition.hpp>

namespace actorpipe {
class DeferredBatchNorm2dImpl;
}

namespace actorpipe::stages {

/// Where a stage sits in its pipeline.
struct stage_config {
  std::size_t index = 0;
  std::size_t count = 1;
  /// Model index of the stage's first layer (for error messages).
  std::size_t first_layer = 0;
  c10::Device device = c10::Device(c10::kCPU);
};

/// Runs a slice of layers. Every public member takes the stage's lock, so the owning actor's
/// thread and a user thread reading parameters never race. Forward and backward are keyed by
/// micro-batch; the autograd graph of a micro-batch lives in the stash between them and never
/// leaves the stage: outputs and input gradients are returned detached.
///
/// Errors: forward and backward throw pipeline_error naming the stage, micro-batch, layer and
/// shapes; the stage is then unchanged except for the failed micro-batch, and abort_step()
/// restores the state of begin_step().
class stage {
public:
  stage(stage_config config, layer_list layers);

  const stage_config& config() const noexcept { return config_; }
  bool is_first() const noexcept { return config_.index == 0; }
  bool is_last() const noexcept { return config_.index + 1 == config_.count; }

  /// Creates the optimizer over this stage's parameters.
  void attach_optimizer(const optimizer_factory& make);

  /// Starts a step: clears gradients and the stash, sets train/eval mode and, for training,
  /// snapshots buffers (batch-norm statistics) so that abort_step can restore them.
  void begin_step(bool train);

  /// Forward of one micro-batch; in training, stashes input and output. Returns the output,
  /// detached, on this stage's device.
  torch::Tensor forward(int32_t microbatch, const torch::Tensor& input);

  /// Last stage, training: forward plus loss; stashes `scale * loss` for backward and returns
  /// the unscaled loss value.
  double forward_loss(int32_t microbatch, const torch::Tensor& input, const torch::Tensor& target,
                      const loss_function& loss, double scale);

  /// Backward of one micro-batch from its output gradient (undefined on the last stage, which
  /// starts from its stashed loss). Accumulates parameter gradients, drops the stash entry and
  /// returns the input gradient, detached (undefined on the first stage).
  torch::Tensor backward(int32_t microbatch, const torch::Tensor& output_gradient);

  /// Zero-bubble B: only the input gradient (undefined on the first stage), which the previous
  /// stage waits for. Keeps the stash and the output gradient for backward_weight.
  torch::Tensor backward_input(int32_t microbatch, const torch::Tensor& output_gradient);

  /// Zero-bubble W: accumulates the parameter gradients of a micro-batch whose backward_input
  /// ran, and releases its stash.
  void backward_weight(int32_t microbatch);

  /// After the last micro-batch of a training step: deferred batch norms update their running
  /// statistics from the whole step's (DeferredBatchNorm2dImpl::commit).
  void end_step();

  /// Drops the stash and gradients and restores the buffers snapshotted by begin_step.
  void abort_step();

  /// Steps the optimizer over the gradients accumulated since begin_step, after scaling every
  /// gradient by `gradient_scale` (global norm clipping) when that is not 1.
  void optimizer_step(double gradient_scale = 1.0);

  /// Sum of the squares of all gradients (for the global gradient norm).
  double gradient_square_sum() const;

  /// Runs `fn(parameters, buffers)` under the stage's lock: the replica sync reads and writes
  /// gradients and buffers in place, in model order.
  void with_tensors(const std::function<void(const std::vector<torch::Tensor>& parameters,
                                             const std::vector<torch::Tensor>& buffers)>& fn);

  std::size_t stash_size() const;
  /// Most micro-batches stashed at once since begin_step.
  std::size_t peak_stash() const;

  int64_t parameter_count() const;

  /// Copies of parameters (or of their gradients) named "<layer>.<parameter>".
  std::vector<std::pair<std::string, torch::Tensor>> named_tensors(bool gradients) const;

  /// Sets every parameter group's learning rate (SGD and Adam; others throw invalid_argument).
  void set_learning_rate(double lr);

  using tensor_map = std::map<std::string, torch::Tensor>;

  /// Copies of everything a checkpoint holds, keyed model-wide so that another partition can
  /// load it: "<layer>.<name>" for parameters and buffers, "optimizer/<layer>.<name>/<field>"
  /// for optimizer state (SGD momentum; Adam step, averages).
  tensor_map state() const;

  /// The parameter and buffer keys of state(), with their shapes.
  std::map<std::string, std::vector<int64_t>> required_keys() const;

  /// Loads this stage's entries of `all`: parameters and buffers must all be there with their
  /// shapes (checked before anything is copied; pipeline_error names the key otherwise);
  /// optimizer state is loaded where present and cleared where absent.
  void load_state(const tensor_map& all);

private:
  struct stash_entry {
    torch::Tensor input;
    /// The output, or the scaled loss on the last stage.
    torch::Tensor output;
    /// Zero-bubble schedules: the output gradient, kept from B for W.
    torch::Tensor output_gradient;
    bool input_done = false;
  };

  // The gradient to start the entry's backward from (undefined on the last stage: the loss).
  torch::Tensor start_gradient(int32_t microbatch, const stash_entry& entry,
                               const torch::Tensor& output_gradient) const;
  torch::Tensor input_gradient(const stash_entry& entry) const;

  torch::Tensor run(int32_t microbatch, const torch::Tensor& input) const;
  std::string where(int32_t microbatch) const;
  // The fields of a pipeline_error about `microbatch` of this stage.
  error_details details(int32_t microbatch, error_kind kind) const;
  std::vector<torch::Tensor> buffers() const;
  std::vector<torch::Tensor> parameters() const;

  mutable std::mutex mutex_;
  stage_config config_;
  layer_list layers_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::map<int32_t, stash_entry> stash_;
  std::size_t peak_stash_ = 0;
  bool train_ = false;
  std::vector<torch::Tensor> buffer_snapshot_;
  std::vector<std::shared_ptr<DeferredBatchNorm2dImpl>> batch_norms_;
};

/// Stage k of `cut` over its slice of `layers`, on `device`, with an optimizer when `optimizer`
/// is set (the in-process pipeline and a node build their stages alike).
std::shared_ptr<stage> make_stage(const layer_list& layers, const partition& cut, std::size_t k,
                                  c10::Device device, const optimizer_factory& optimizer);

} // namespace actorpipe::stages
