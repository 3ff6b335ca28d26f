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
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <actorpipe/bundle.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/memory.hpp>
#include <actorpipe/options.hpp>
#include <actorpipe/partition.hpp>

#include "stages/graphs.hpp"

namespace actorpipe {
class DeferredBatchNorm2dImpl;
class batch_norm_sync;
} // namespace actorpipe

namespace actorpipe::stages {

class weight_pass;

/// Where a stage sits in its pipeline.
struct stage_config {
  std::size_t index = 0;
  std::size_t count = 1;
  /// Model index of the stage's first layer (for error messages).
  std::size_t first_layer = 0;
  c10::Device device = c10::Device(c10::kCPU);
  /// Tied parameters (<actorpipe/layers.hpp>) this stage holds: each holder's name here ->
  /// the tie's name (its first holder's). A tie held twice here is one parameter.
  std::map<std::string, std::string> tied;
  /// The ties also held by other stages -> whether this stage's tensor is a copy (it is not on
  /// the stage of the tie's first holder, which alone checkpoints it and counts it in the
  /// gradient norm).
  std::map<std::string, bool> shared_ties;
  /// The stages holding the ties of shared_ties, this one included: the members of its
  /// tied-gradient sum.
  std::set<std::size_t> tie_holders;
  /// bf16: the forward runs under CPU autocast on the calling (the stage's) thread and float
  /// activations leave the stage in bf16 (the last stage's in float32); see autocast_scope.
  precision_mode precision = precision_mode::fp32;
};

/// Runs a slice of layers. Every public member takes the stage's lock, so the owning actor's
/// thread and a user thread reading parameters never race. Forward and backward are keyed by
/// micro-batch; the autograd graph of a micro-batch lives in the stash between them and never
/// leaves the stage: outputs and input gradients are returned detached.
///
/// Activations are bundles (<actorpipe/bundle.hpp>). An output tensor that needs a gradient
/// (floating point, in the graph) is returned detached but still flagged `requires_grad`, which
/// is how the next stage knows to send its gradient back; the gradient bundle a backward takes
/// holds exactly one tensor per such output, in order, and a backward returns one per input
/// so flagged.
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

  /// ZeRO (shard_mode): this stage is replica `rank`'s of `ranks`; from now on its optimizer
  /// holds and steps only the parameters this rank owns (whole tensors, largest first, each to
  /// the rank owning the fewest elements so far: every rank computes the same split). Call it
  /// before the first step (the optimizer is made anew, without state). `ranks` 1 undoes it.
  void shard_optimizer(std::size_t rank, std::size_t ranks);

  /// This rank and the ranks; which rank owns each parameter, in with_tensors' order, and
  /// whether each is tied to another stage (its gradient is all-reduced even under ZeRO-2,
  /// since the tie's holders sum it): both empty when not sharded. Set by shard_optimizer.
  struct shard_layout {
    std::size_t rank = 0;
    std::size_t ranks = 1;
    std::vector<std::size_t> owner;
    std::vector<bool> tied;
  };
  shard_layout shards() const;

  /// Bytes of optimizer state this stage holds now (SGD's momenta, Adam's averages), and of
  /// parameter gradients (defined ones).
  int64_t optimizer_bytes() const;
  int64_t gradient_bytes() const;

  /// Starts a step: clears gradients and the stash, sets train/eval mode and, for training,
  /// snapshots buffers (batch-norm statistics) so that abort_step can restore them.
  void begin_step(bool train);

  /// Forward of one micro-batch; in training, stashes input and output. Returns the output,
  /// detached (flags kept, see above), on this stage's device. With `recompute`, only the input
  /// (and the generator's state, for a stage with dropout) is stashed and backward recomputes
  /// the forward first: same gradients, same dropout masks, batch-norm statistics counted once.
  bundle forward(int32_t microbatch, const bundle& input, bool recompute = false);

  /// Last stage, training: forward plus loss; stashes `scale * loss` for backward and returns
  /// the unscaled loss (a detached scalar on the stage's device: reading it waits for the
  /// device, so a stage on a GPU reads it once its program has run). The stage's output must be
  /// one tensor.
  torch::Tensor forward_loss(int32_t microbatch, const bundle& input, const torch::Tensor& target,
                             const loss_function& loss, double scale, bool recompute = false);

  /// Backward of one micro-batch from its output gradients (empty on the last stage, which
  /// starts from its stashed loss). Accumulates parameter gradients, drops the stash entry and
  /// returns the input gradients, detached (empty on the first stage). A gradient bundle whose
  /// layout does not match the outputs that need one throws pipeline_error (shape_mismatch)
  /// naming the tensor, with the stash entry kept.
  bundle backward(int32_t microbatch, const bundle& output_gradient);

  /// Zero-bubble B: only the input gradients (empty on the first stage), which the previous
  /// stage waits for. Keeps the stash, and what each weight node of the graph received, for
  /// backward_weight (stages/weight_pass.hpp); the latter counts in the stash's bytes until W.
  bundle backward_input(int32_t microbatch, const bundle& output_gradient);

  /// Zero-bubble W: accumulates the parameter gradients of a micro-batch whose backward_input
  /// ran, and releases its stash. Runs only the weight nodes on what B kept for them (the
  /// weight pass); walks the graph again where the weight pass does not apply (the first stage,
  /// whose B computes nothing; a parameter off the input path) or is switched off.
  void backward_weight(int32_t microbatch);

  /// Whether W uses the weight pass where it applies (default true; false: always a second walk
  /// of the graph, as before it existed; for comparisons).
  void use_weight_pass(bool on);
  /// W's so far: how many ran as a weight pass and how many walked the graph.
  std::pair<std::size_t, std::size_t> weight_passes() const;

  /// CUDA graphs (stages/graphs.hpp) on `device`, the stage actor's (which captures them),
  /// under `mode`; `who` names the stage in the notes. Off (the default): always eager. A
  /// stage with deferred batch norms, recomputation or a loss that takes the batch's inputs
  /// runs eagerly, and says why once.
  void use_graphs(std::shared_ptr<device_context> device, cuda_graph_mode mode,
                  const std::string& who);
  /// Starts a training step's graphs with the stage's part of the program, in order (before
  /// begin_step); and, during the warm-up, an eager action's host time (auto's rule).
  void begin_graph_step(const std::vector<graph_action>& program);
  void observe_action_ms(double ms);
  /// Runs without graphs from now on, saying why once (a loss that takes the batch's inputs).
  void turn_off_graphs(const std::string& why);
  /// Whether the last forward's or backward's result is a graph's static buffers (see
  /// device_context::record).
  bool replayed_last() const;
  /// What the graphs have to say, each line once (taken); replays and captures so far.
  std::vector<std::string> take_graph_notes();
  std::pair<std::size_t, std::size_t> graph_counts() const;

  /// After the last micro-batch of a training step: deferred batch norms update their running
  /// statistics from the whole step's (DeferredBatchNorm2dImpl::commit).
  void end_step();

  /// Synchronised batch norm: every DeferredBatchNorm2d of this stage normalises over all
  /// replicas through `sync` (null: local again). Returns how many it found.
  std::size_t synchronise_batch_norm(const c10::intrusive_ptr<batch_norm_sync>& sync);

  /// Drops the stash and gradients and restores the buffers snapshotted by begin_step.
  void abort_step();

  /// The buffers begin_step snapshotted (empty outside training), and putting such a snapshot
  /// back: a step undone after the next one began (overlapping steps) returns to its own start.
  std::vector<torch::Tensor> step_start_buffers() const;
  void restore_step_start_buffers(const std::vector<torch::Tensor>& snapshot);

  /// Steps the optimizer over the gradients accumulated since begin_step, after scaling every
  /// gradient by `gradient_scale` (global norm clipping) when that is not 1.
  void optimizer_step(double gradient_scale = 1.0);

  /// BMUF (bmuf_options): from now on this stage keeps a global value and a block momentum per
  /// parameter, saved by state() with the optimizer's state ("optimizer/<name>/block_momentum",
  /// and "block_previous" with `nesterov`).
  void enable_blocks(bool nesterov);
  /// BMUF: the global values become the parameters as they are now; the block momenta zero.
  void start_blocks();
  /// BMUF after load_state(all): start_blocks(), with the block momenta `all` holds.
  void load_blocks(const std::map<std::string, torch::Tensor>& all);
  /// BMUF, at a block's end: the parameters hold the replicas' average; updates the block
  /// momenta and global values (bmuf_options) and sets the parameters to the global values.
  void end_block(double block_lr, double block_momentum);
  /// Clears the optimizer's state (SGD's momentum buffers, Adam's averages and step count).
  void reset_optimizer_state();

  /// Sum of the squares of all gradients (for the global gradient norm); a tied parameter's
  /// copy does not count (its original does, once). `owned_only` (sharded): only the
  /// parameters this rank owns, whose sums over the ranks make the stage's.
  double gradient_square_sum(bool owned_only = false) const;

  /// The parameters this stage shares with other stages (config().shared_ties), by tie name,
  /// with their gradients defined: the holders sum these gradients before the optimizer steps.
  std::map<std::string, torch::Tensor> shared_parameters() const;

  /// Runs `fn(parameters, buffers)` under the stage's lock: the replica sync reads and writes
  /// gradients and buffers in place, in model order.
  void with_tensors(const std::function<void(const std::vector<torch::Tensor>& parameters,
                                             const std::vector<torch::Tensor>& buffers)>& fn);

  std::size_t stash_size() const;
  /// Most micro-batches stashed at once since begin_step.
  std::size_t peak_stash() const;
  /// Most bytes stashed at once since begin_step: the inputs of the micro-batches between
  /// forward and backward, and what their forwards allocated that the graph keeps alive (saved
  /// activations, outputs); for a recomputed micro-batch, its input only until its backward
  /// rebuilds the rest.
  int64_t peak_stash_bytes() const;
  /// How far the most its micro-batches held at once since begin_step rose above
  /// peak_stash_bytes, as the planner predicts it (working_bytes): at each action, the stash
  /// and what the action's allocations held at their peak (a forward's, and a backward's with
  /// what its forward kept, less what it freed of that and less the parameters' gradients it
  /// made). On the CPU: a GPU's backward runs on autograd's device thread, which the tally does
  /// not reach.
  int64_t peak_working_bytes() const;
  /// Counts this stage's stash together with `other`'s from now on (the chunks of one stage
  /// actor, which run one action at a time): stash_bytes, peak_stash_bytes and
  /// peak_working_bytes are then the stage actor's, whose chunks' own peaks need not coincide.
  void count_stash_with(const stage& other);

  int64_t parameter_count() const;

  /// Copies of parameters (or of their gradients) named "<layer>.<parameter>".
  std::vector<std::pair<std::string, torch::Tensor>> named_tensors(bool gradients) const;

  /// Sets every parameter group's learning rate (SGD and Adam; others throw invalid_argument).
  void set_learning_rate(double lr);

  using tensor_map = std::map<std::string, torch::Tensor>;

  /// Copies of everything a checkpoint holds, keyed model-wide so that another partition can
  /// load it: "<layer>.<name>" for parameters and buffers, "optimizer/<layer>.<name>/<field>"
  /// for optimizer state (SGD momentum; Adam step, averages). With `copy` false, the stage's own
  /// tensors instead (detached, not copied): for a caller that copies them itself (packing
  /// them into a frame, say) before the stage runs again. A tied parameter's copy (on a later
  /// holder) is the first holder's to store; `tie_copies` includes it too (and its optimizer
  /// state), for a state this stage alone restores (load_state takes either).
  tensor_map state(bool copy = true, bool tie_copies = false) const;

  /// Sharded (shard_optimizer): copies of the parameters this rank owns and of their optimizer
  /// state (keys as state()'s), and putting such a copy back: what an optimizer step changes
  /// here before the parameters are broadcast from their owners.
  tensor_map owned_state() const;
  void load_owned_state(const tensor_map& part);

  /// Sharded, on rank 0: every rank's optimizer state (keys as state()'s), gathered for a
  /// checkpoint; checkpoint_state() includes it until the next optimizer step or load.
  void keep_gathered_state(tensor_map optimizer_state);
  /// Whether keep_gathered_state() came after the last optimizer step or load (on every rank:
  /// the others keep an empty map).
  bool holds_gathered_state() const;

  /// What a checkpoint or snapshot holds: state(copy). Sharded, rank 0's with the state
  /// keep_gathered_state() kept; without it (or on another rank), this rank's part, marked
  /// with stages::partial_state_key so that it is never written or loaded (its parameters
  /// may be read).
  tensor_map checkpoint_state(bool copy = true) const;

  /// The parameter and buffer keys of state(), with their shapes.
  std::map<std::string, std::vector<int64_t>> required_keys() const;

  /// Loads this stage's entries of `all`: parameters and buffers must all be there with their
  /// shapes (checked before anything is copied; pipeline_error names the key otherwise);
  /// optimizer state is loaded where present and cleared where absent.
  void load_state(const tensor_map& all);

private:
  struct stash_entry {
    bundle input;
    /// The output, or the scaled loss on the last stage.
    bundle output;
    /// The outputs backward starts from, and their gradients (none on the last stage: the
    /// loss). Zero-bubble schedules keep them from B for W.
    std::vector<torch::Tensor> roots;
    std::vector<torch::Tensor> root_gradients;
    bool input_done = false;
    /// Zero-bubble: W's weight pass, prepared by B (null: W walks the graph).
    std::shared_ptr<weight_pass> weights;
    /// Activation recomputation: the output is rebuilt from the input at backward, replaying
    /// the generator from `generator_state` (defined when the stage draws random numbers);
    /// the last stage keeps its target, loss function and scale for it.
    bool recompute = false;
    torch::Tensor generator_state;
    torch::Tensor target;
    loss_function loss;
    double scale = 1.0;
    /// What it holds (peak_stash_bytes).
    int64_t bytes = 0;
    /// Its forward replayed a CUDA graph (graphs_->passes holds the rest).
    bool graphed = false;
    /// The count of what its forward (or its recomputation) allocated, which its backward
    /// counts on too (peak_working_bytes).
    std::shared_ptr<memory::tally_count> count;
  };

  // Keeps `entry` until backward; `retained`: what its forward allocated that is still alive.
  void stash(int32_t microbatch, stash_entry entry, int64_t retained);
  void unstash(std::map<int32_t, stash_entry>::iterator it);
  // gradient_bytes() with the lock held; the bytes of an entry's input (and generator state),
  // which the previous stage or the batch allocated; and the most held at once raised to `bytes`.
  int64_t held_gradient_bytes() const;
  static int64_t input_bytes(const stash_entry& entry);
  void note_held(int64_t bytes) {
    stash_tally_->peak_held = std::max(stash_tally_->peak_held, bytes);
  }
  // Adds `bytes` (negative: takes them away) to the stash, raising its peak.
  void add_stashed(int64_t bytes) {
    stash_tally_->bytes += bytes;
    stash_tally_->peak = std::max(stash_tally_->peak, stash_tally_->bytes);
  }

  // Rebuilds a recomputed entry's output (and graph); nothing for the others.
  void recompute(int32_t microbatch, stash_entry& entry);
  // The loss of the last stage's output, checked (one tensor in, a scalar out).
  torch::Tensor loss_of(int32_t microbatch, const bundle& outputs, const torch::Tensor& target,
                        const loss_function& loss) const;

  // Pairs the outputs that need a gradient with `output_gradient`'s tensors, checking the
  // layout, into entry.roots and entry.root_gradients.
  void pair_gradients(int32_t microbatch, stash_entry& entry, const bundle& output_gradient) const;
  // The inputs that take a gradient.
  static std::vector<torch::Tensor> gradient_inputs(const stash_entry& entry);
  // Their gradients, as a bundle (zeros where the graph did not reach an input).
  bundle input_gradients(const stash_entry& entry, std::vector<torch::Tensor> grads) const;
  // The input as this stage runs it: on its device and, in training, detached, with the
  // tensors flagged by the previous stage requiring grad.
  bundle receive(const bundle& input, bool train) const;

  bundle run(int32_t microbatch, const bundle& input) const;

  // CUDA graphs: the book, the device that captures, the stage's pool, each micro-batch's
  // pass and the parameters' gradients that every backward graph adds into.
  struct graphs {
    graph_book book;
    std::shared_ptr<device_context> device;
    std::optional<graph_pool> pool;
    std::map<int32_t, graph_pass> passes;
    std::vector<torch::Tensor> parameter_gradients;
    bool replayed_last = false;
  };
  std::unique_ptr<graphs> graphs_;
  // Whether a training forward (of the last stage, with its target) runs through a graph: the
  // one decision for forward and forward_loss. Eager without graphs, or once they are turned off
  // (recomputation turns them off: it keeps a micro-batch's input alone, a graph all of it).
  graph_book::use graph_use(int32_t microbatch, const bundle& input, const torch::Tensor* target,
                            bool recompute);
  // A training forward through its graph (captured first in the capture step), stashed;
  // nothing when a capture fails (then eager from now on). `x` as receive() made it.
  std::optional<bundle> graphed_forward(int32_t microbatch, const bundle& x, graph_book::use use,
                                        const torch::Tensor& target = {},
                                        const loss_function* loss = nullptr, double scale = 1);
  graph_pass& capture_forward(int32_t microbatch, const bundle& x, const torch::Tensor& target,
                              const loss_function* loss);
  bundle graphed_backward(int32_t microbatch, std::map<int32_t, stash_entry>::iterator it,
                          const bundle& output_gradient);
  void capture_backward(int32_t microbatch, graph_pass& pass);
  // Makes each parameter's gradient the tensor the backward graphs add into (its value kept).
  void seat_parameter_gradients(graph_pass& pass);
  std::string where(int32_t microbatch) const;
  // The fields of a pipeline_error about `microbatch` of this stage.
  error_details details(int32_t microbatch, error_kind kind) const;
  std::vector<torch::Tensor> buffers() const;
  // Copies of the buffers, and putting such copies back (begin/abort a step, recomputation).
  std::vector<torch::Tensor> copy_buffers() const;
  void restore_buffers(const std::vector<torch::Tensor>& copies);
  std::vector<torch::Tensor> parameters() const;
  // Whether this stage holds parameter `name` (a tie's name) as a copy of another stage's.
  bool is_copy(const std::string& name) const;

  mutable std::mutex mutex_;
  bool use_weight_pass_ = true;
  std::size_t weight_passes_ = 0;
  std::size_t weight_walks_ = 0;
  stage_config config_;
  layer_list layers_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  optimizer_factory make_optimizer_;
  // ZeRO: this rank's place, and the parameters it owns for owns() (ranks 1: not sharded).
  shard_layout shards_;
  std::set<const c10::TensorImpl*> owned_;
  // Rank 0 after a gather (keep_gathered_state), until the next step or load.
  std::optional<tensor_map> gathered_;
  bool owns(const torch::Tensor& p) const;
  // state(), under the lock; `owned_only`: owned parameters and their optimizer state only.
  tensor_map collect_state(bool copy, bool tie_copies, bool owned_only) const;
  // The optimizer's state of the owned parameters from `all` (cleared where absent).
  void load_optimizer_state(const tensor_map& all);
  std::map<int32_t, stash_entry> stash_;
  std::size_t peak_stash_ = 0;
  // Bytes stashed, their peak, and the most the micro-batches held at once (the stash and the
  // running action's bytes): this stage's, or, shared (count_stash_with), its stage actor's.
  struct stash_tally {
    int64_t bytes = 0;
    int64_t peak = 0;
    int64_t peak_held = 0;
  };
  std::shared_ptr<stash_tally> stash_tally_ = std::make_shared<stash_tally>();
  bool train_ = false;
  std::vector<torch::Tensor> buffer_snapshot_;
  std::vector<std::shared_ptr<DeferredBatchNorm2dImpl>> batch_norms_;
  // A module of the stage draws from the CPU generator in training (dropout).
  bool draws_random_ = false;
  // BMUF: per parameter name, its global value, block momentum and (Nesterov) previous momentum.
  struct block_state {
    torch::Tensor global;
    torch::Tensor momentum;
    torch::Tensor previous;
  };
  bool blocks_ = false;
  bool block_nesterov_ = false;
  std::map<std::string, block_state> block_states_;
  // Global values from the parameters, momenta from `all` where it has them (else zero).
  void reset_blocks(const tensor_map& all);
};

/// Stage k of `cut` over its slice of `layers`, on `device`, with an optimizer when `optimizer`
/// is set (the in-process pipeline and a node build their stages alike). A parameter tied
/// between layers of this stage and of another (tied_parameters) becomes a copy here unless
/// this stage holds its first holder: the layer's module is given the copy (tie_parameter), so
/// build stages of one layer list once, in order of k. `precision`: stage_config::precision.
std::shared_ptr<stage> make_stage(const layer_list& layers, const partition& cut, std::size_t k,
                                  c10::Device device, const optimizer_factory& optimizer,
                                  precision_mode precision = precision_mode::fp32);

} // namespace actorpipe::stages
