/// \file
/// Atoms, message types and typed actor interfaces of the scheduler and stage actors.
///
/// In-process, tensors travel by reference count (detached, never with an autograd graph).
/// The plain structs below are marked as unsafe (not serialisable) for CAF; when stages live in
/// other processes, tensor payloads cross through comm/'s wire format instead of CAF.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>
#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>

#include <actorpipe/actions.hpp>
#include <actorpipe/bundle.hpp>
#include <actorpipe/errors.hpp>
#include <actorpipe/results.hpp>

namespace actorpipe::actors {

/// whoever builds the stages -> stage: (connect_atom, std::vector<stage_peer_actor> stages): every
/// stage actor, in order; a stage sends to the actors holding its virtual neighbours.
/// Whoever builds the pipeline -> scheduler: (connect_atom, std::vector<stage_actor> stages).
using connect_atom = caf::atom_constant<caf::atom("connect")>;
/// scheduler -> stage: (plan_atom, step_plan): run this step's program.
using plan_atom = caf::atom_constant<caf::atom("plan")>;
/// stage -> stage holding the next virtual stage: (forward_atom, step, microbatch, chunk,
/// bundle activation), chunk being the receiver's local chunk.
using forward_atom = caf::atom_constant<caf::atom("forward")>;
/// stage -> stage holding the previous virtual stage: (backward_atom, step, microbatch, chunk,
/// bundle gradients): one tensor per activation tensor that needs a gradient (possibly none).
using backward_atom = caf::atom_constant<caf::atom("backward")>;
/// stage -> scheduler: (done_atom, stage_report) once its program has run.
using done_atom = caf::atom_constant<caf::atom("done")>;
/// stage -> scheduler: (failed_atom, step, failure) when an action failed or a wait expired.
using failed_atom = caf::atom_constant<caf::atom("failed")>;
/// scheduler -> stage: (abort_atom, step): drop the step, restore the stage as it was.
using abort_atom = caf::atom_constant<caf::atom("abort")>;
/// scheduler -> stage request: (update_atom, step, learning_rate, gradient_scale) ->
/// optimizer_ms; a negative learning rate keeps the current one. Requests that fail answer with
/// a refusal through CAF's error channel (actors/pipeline_errc.hpp: the kind and the sentence).
using update_atom = caf::atom_constant<caf::atom("update")>;
/// self-timer: (timeout_atom): the running wait's deadline may have passed.
using timeout_atom = caf::atom_constant<caf::atom("timeout")>;
/// user -> scheduler: (run_atom, shared_ptr<step_request>).
using run_atom = caf::atom_constant<caf::atom("run")>;
/// scheduler -> stage request: (save_atom, path) -> true: write the stage's state.
using save_atom = caf::atom_constant<caf::atom("save")>;
/// scheduler -> stage request: (load_atom, shared_ptr<const tensor_map>) -> true once loaded.
using load_atom = caf::atom_constant<caf::atom("load")>;
/// scheduler -> stage request: (fetch_atom, uint64 keep_as) -> shared_ptr<const tensor_map>:
/// copies of the stage's state as save_atom would write it, in memory; for snapshot `keep_as`
/// (> 0), which a stage on a node keeps a copy of once the driver has it whole (0: no snapshot).
using fetch_atom = caf::atom_constant<caf::atom("fetch")>;
/// scheduler -> stage request: (block_atom) -> true: BMUF, end the warm-up or the running block
/// now; a sharded optimizer state, gather it on replica 0 (for a checkpoint).
using block_atom = caf::atom_constant<caf::atom("block")>;

/// Tensors keyed model-wide ("<layer>.<name>"), as checkpoints hold them.
using tensor_map = std::map<std::string, torch::Tensor>;

/// Why a step failed: what the caller's pipeline_error will carry as fields, and its message.
struct failure {
  error_details details;
  std::string message;
};

/// The failure an exception thrown by a stage's work stands for: a pipeline_error keeps its
/// fields, anything else (and a pipeline_error of kind `other`) is a stage failure; `stage` and
/// `step` are this stage's, `microbatch` is filled in where the exception left it empty.
inline failure failure_of(const std::exception& e, std::size_t stage, uint64_t step,
                          std::optional<int32_t> microbatch = std::nullopt) {
  failure f;
  f.message = e.what();
  if (const auto* pe = dynamic_cast<const pipeline_error*>(&e)) {
    f.details = pe->details();
  }
  if (f.details.kind == error_kind::other) {
    f.details.kind = error_kind::stage_failure;
  }
  f.details.stage = stage;
  f.details.step = step;
  if (!f.details.microbatch) {
    f.details.microbatch = microbatch;
  }
  return f;
}

/// What a stage runs in one step.
struct step_plan {
  uint64_t step = 0;
  bool train = true;
  /// The step's micro-batches, as the scheduler planned them: the programs' actions run
  /// micro-batches 0 to microbatches - 1 (a forward pass of a small batch takes fewer).
  int32_t microbatches = 0;
  /// The step's start on the steady clock (nanoseconds since its epoch): action times are
  /// reported relative to it.
  int64_t origin_ns = 0;
  stage_program program;
  /// First stage only: the micro-batches of the batch.
  std::vector<torch::Tensor> inputs;
  /// Last stage, training only: the micro-batches' targets and the factors applied to their
  /// losses before backward (so that accumulated gradients equal the full batch's).
  std::vector<torch::Tensor> targets;
  std::vector<double> loss_scales;
  /// Last stage, training with a loss that sees the inputs: the micro-batches' inputs.
  std::vector<torch::Tensor> loss_inputs;
  /// Samples in this replica's batch (weights the replica's gradients in the replica sync).
  int64_t samples = 0;
  /// Training: the learning rate the step sets (< 0: unchanged), and whether the stage steps its
  /// optimizers as soon as its program has run, before the scheduler has seen every stage's
  /// gradients (optimizer post-validation): it keeps its state from before, drops it when the
  /// update confirms the step (gradient scale 1, the same rate), and restores it (then steps
  /// again) when clipping changed the step, or when the step fails.
  double learning_rate = -1;
  bool optimistic = false;
  /// Overlapping steps (pipeline_options::overlap_steps, in process): the scheduler may send the
  /// next step's plan before this step's update. The stage keeps it until its optimizer step for
  /// this step is done: right after its early step when nothing validates it (no clipping), or
  /// when the update comes; a next plan that arrives while this one runs waits its turn.
  bool overlapped = false;
};

/// What a stage reports when its program has run.
struct stage_report {
  uint64_t step = 0;
  stage_stats stats;
  /// Last stage, training: sum of scale * loss over micro-batches (over all replicas' samples
  /// when there are replicas).
  double loss = 0;
  /// Sum of squared gradients after the replica sync (when the scheduler clips).
  double gradient_square_sum = 0;
  /// Last stage, forward-only: the outputs, by micro-batch.
  std::vector<torch::Tensor> outputs;
};

/// What a stage's neighbours send it: activations forward, gradients back. A stage actor is one;
/// so is a node's link that carries them to a stage on another node.
using stage_peer_actor =
  caf::typed_actor<caf::reacts_to<forward_atom, uint64_t, int32_t, int32_t, bundle>,
                   caf::reacts_to<backward_atom, uint64_t, int32_t, int32_t, bundle>>;

/// Who a stage reports to: the scheduler (or, on a node, the node relaying to its scheduler).
using stage_listener_actor = caf::typed_actor<caf::reacts_to<done_atom, stage_report>,
                                              caf::reacts_to<failed_atom, uint64_t, failure>>;

/// The stage protocol as the scheduler uses it (actors/stage_actor.hpp has each message's
/// meaning). A stage actor and the scheduler's proxy of a stage on a node both implement it, so
/// a message it does not list, or a reply of the wrong type, is a compile error.
using stage_actor =
  caf::typed_actor<caf::reacts_to<plan_atom, step_plan>,
                   caf::replies_to<abort_atom, uint64_t>::with<bool>,
                   caf::replies_to<update_atom, uint64_t, double, double>::with<double>,
                   caf::replies_to<save_atom, std::string>::with<bool>,
                   caf::replies_to<load_atom, std::shared_ptr<const tensor_map>>::with<bool>,
                   caf::replies_to<fetch_atom, uint64_t>::with<std::shared_ptr<const tensor_map>>,
                   caf::replies_to<block_atom>::with<bool>>;

/// A stage actor running in this process: the scheduler's protocol, its neighbours', and
/// (connect_atom, peers) once, which tells it the actor holding each stage.
using local_stage_actor = stage_actor::extend_with<stage_peer_actor>::extend<
  caf::reacts_to<connect_atom, std::vector<stage_peer_actor>>>;

} // namespace actorpipe::actors

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(torch::Tensor)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(actorpipe::bundle)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(actorpipe::actors::step_plan)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(actorpipe::actors::stage_report)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(actorpipe::actors::failure)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<const actorpipe::actors::tensor_map>)
