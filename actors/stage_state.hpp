// A stage actor's state, and the work after its program that does not need the actor itself:
// the replica sync, tied gradients, BMUF blocks and the optimizer step (early or confirmed).
// Shared by actors/stage_actor.cpp (the behaviour: plans, actions, messages),
// actors/stage_update.cpp and actors/stage_requests.cpp (block, save, fetch, load). Private to
// actors/.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <caf/expected.hpp>

#include <actorpipe/batch_norm.hpp>

#include "actors/deadline.hpp"
#include "actors/messages.hpp"
#include "actors/stage_actor.hpp"
#include "comm/replica_group.hpp"
#include "stages/device.hpp"
#include "stages/stage.hpp"

namespace actorpipe::actors::stage_parts {

using clock_type = std::chrono::steady_clock;
/// (step, micro-batch, local chunk)
using key = std::tuple<uint64_t, int32_t, int32_t>;

inline double ms_since(clock_type::time_point start) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - start).count();
}

// Synchronised batch norm's side of the replica sync: the statistics' all-reduces run on the
// stage's thread through its stage_sync, weighted like the replica's gradients this step.
class replica_batch_norm_sync final : public batch_norm_sync {
public:
  explicit replica_batch_norm_sync(std::shared_ptr<comm::stage_sync> sync)
    : sync_(std::move(sync)) {}
  void all_reduce_sum(torch::Tensor& sums) override {
    sync_->all_reduce_sum(sums, "batch-norm statistics all-reduce");
  }
  double gradient_weight() const override { return weight; }
  double weight = 1;

private:
  std::shared_ptr<comm::stage_sync> sync_;
};

struct stage_state {
  std::vector<std::shared_ptr<stages::stage>> chunks;
  // The device the chunks compute on, and its stream (the CPU's: no-ops).
  std::shared_ptr<stages::device_context> device;
  c10::intrusive_ptr<replica_batch_norm_sync> batch_norm_sync;
  stage_actor_options options;
  stage_listener_actor scheduler;
  std::vector<stage_peer_actor> stages;
  bool threads_set = false;

  // Inputs that arrived, by (step, micro-batch, chunk).
  std::map<key, bundle> activations;
  std::map<key, bundle> gradients;

  // The running step.
  bool active = false;
  step_plan plan;
  // Index of the program's next action.
  std::size_t next_action = 0;
  stage_report report;
  // By action: a B split into input gradient (B) and weight gradient (its W, later): zero-bubble
  // programs split all, DualPipeV some (split_backwards).
  std::vector<bool> split_actions;
  // Micro-batches in the running step.
  int32_t microbatches = 0;
  // The last stage's losses of this step's micro-batches, in the order computed, and which.
  std::vector<torch::Tensor> losses;
  std::vector<std::size_t> loss_positions;
  // With options.device_timing: the device's marks around each action of the report
  // (stages/device.hpp's timeline), in the report's order.
  std::vector<std::pair<int, int>> action_marks;
  std::size_t live = 0;
  std::size_t peak_live = 0;
  bool waiting = false;
  clock_type::time_point wait_start;
  // The running wait's deadline (one timer at most pending: actors/deadline.hpp).
  deadline_timer deadline;

  // Optimizer post-validation: the step whose optimizer step ran before its update (0: none),
  // the chunks' state from before it, the learning rate it set and how long it took.
  uint64_t stepped_early = 0;
  std::vector<stages::stage::tensor_map> before_update;
  // The chunks' buffers as that step began, which an abort puts back.
  std::vector<std::vector<torch::Tensor>> early_buffers;
  double early_learning_rate = -1;
  double early_ms = 0;

  // Overlapping steps: plans that came before this stage was done with the running one, and
  // whether the running step's optimizer step is still to come (from the update).
  std::deque<step_plan> queued;
  bool awaiting_update = false;

  // BMUF: optimizer steps since the running block (or the warm-up) began, and whether the
  // warm-up is over.
  int64_t block_position = 0;
  bool warmed_up = false;
  bool bmuf() const { return options.sync && options.bmuf.block_steps > 0; }

  std::size_t actor_count() const { return options.count; }
  std::size_t virtual_index(int32_t chunk) const {
    return virtual_stage_of(options.placement, options.count, options.index,
                            static_cast<std::size_t>(chunk));
  }
  std::size_t virtual_count() const { return options.count * chunks.size(); }

  static inline const char* name = "actorpipe.stage";
};

// actors/stage_update.cpp:

/// The report's loss: each micro-batch's loss times its scale, summed in the order computed.
void add_losses(stage_state& s);
/// After a training program: averages gradients (and buffers) with the other replicas' same
/// stage; `origin` is the step's start (the sync's times in the report).
void sync_replicas(stage_state& s, clock_type::time_point origin);
/// After a training program: losses, batch-norm commits, the replica sync, tied gradients, and
/// the report's memory and gradient norm figures; throws what fails.
void end_training_program(stage_state& s, clock_type::time_point origin);
/// BMUF: ends the warm-up or the running block.
void end_block(stage_state& s);
/// BMUF after an optimizer step: whether this step ends the warm-up or a block.
bool ends_block(const stage_state& s);
/// Whether the replicas shard this stage's optimizer state (ZeRO-1 or -2).
inline bool sharded(const stage_state& s) {
  return s.options.sync && s.options.shard != shard_mode::none && s.options.sync->size() > 1;
}
/// ZeRO: every replica's optimizer state gathered on rank 0's chunks, for a checkpoint
/// (stages::stage::keep_gathered_state).
void gather_optimizer_state(stage_state& s);
/// After the replica sync: tied parameters' gradients become the sum over their holders.
void sum_tied_gradients(stage_state& s);
/// Puts back the chunks' state from before an early optimizer step; throws what failed (a
/// pipeline_error of kind stage_failure naming the stage and step).
void restore_before_update(stage_state& s);
/// restore_before_update where no one waits for an answer: a failure is logged.
void undo_early_step(stage_state& s) noexcept;
/// Post-validation: the optimizer step right after the program.
void step_early(stage_state& s);
/// The optimizer step of a training step: the milliseconds it took, or this stage's refusal.
caf::expected<double> update(stage_state& s, uint64_t step, double learning_rate,
                             double gradient_scale);

// actors/stage_requests.cpp (each on the stage's thread, its settings set):

/// BMUF: ends the running block now; ZeRO: gathers the sharded optimizer state (for a
/// checkpoint). This stage's refusal, or none.
caf::error end_block_now(stage_state& s);
/// Saves every chunk's state (parameters, buffers, optimizer state; on the CPU) to `path`.
caf::error save_state(stage_state& s, const std::string& path);
/// Every chunk's state on the CPU, for a snapshot.
caf::expected<std::shared_ptr<const stages::stage::tensor_map>> fetch_state(stage_state& s);
/// Loads every chunk's state from `all` (and BMUF's block state); the refusal is of the kind
/// the stage found (a tensor of another shape: shape_mismatch).
caf::error load_state(stage_state& s, const stages::stage::tensor_map& all);
/// Checkpoints and snapshots hold CPU tensors whatever the stage's device, so that they can be
/// read onto any devices (on the CPU the same tensors: no copy).
stages::stage::tensor_map on_cpu(stages::stage::tensor_map all);

} // namespace actorpipe::actors::stage_parts
