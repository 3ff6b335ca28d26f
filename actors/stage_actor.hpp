/// \file
/// The stage actor: runs one stage's program per step on a thread of its own.
///
/// Protocol
/// - in  (connect_atom, actor prev, actor next): neighbours; invalid handles at the ends.
/// - in  (plan_atom, step_plan): start a step. Gradients are cleared; the program runs action by
///       action, each as soon as its input is there: a forward needs the micro-batch's input
///       (first stage: from the plan) or activation (from prev); a backward needs the gradient
///       from next (last stage: its own loss). Outputs go straight to the neighbour.
/// - in  (forward_atom | backward_atom, step, microbatch, tensor): inputs, buffered by step, so
///       they may arrive before the plan; inputs of older steps are dropped.
/// - in  (abort_atom, step) -> true: drop the step and restore the stage (gradients, stash,
///       buffers); the reply confirms it.
/// - in  (update_atom, step, learning_rate) -> (double optimizer_ms, std::string error): set the
///       learning rate (when >= 0) and step the optimizer.
/// - in  (save_atom, path) -> std::string error: write the stage's state (parameters, buffers,
///       optimizer state keyed by layer name) to `path`.
/// - in  (load_atom, shared_ptr<const tensor_map>) -> std::string error: load this stage's keys.
/// - out (done_atom, stage_report) to the scheduler when the program has run.
/// - out (failed_atom, step, message) to the scheduler when an action throws or a wait runs past
///       wait_timeout; the message says who waits for what ("stage 1 waits for the activation
///       of microbatch 7 from stage 0").
#pragma once

#include <chrono>
#include <memory>

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

#include <actorpipe/pipeline.hpp>

namespace actorpipe::stages {
class stage;
}

namespace actorpipe::actors {

struct stage_actor_options {
  std::chrono::milliseconds wait_timeout{60000};
  /// Intra-op threads for this stage's thread.
  std::size_t threads = 1;
  /// Used by the last stage in training.
  loss_function loss;
};

/// Spawns a stage actor on a dedicated thread, reporting to `scheduler`.
caf::actor spawn_stage(caf::actor_system& sys, std::shared_ptr<stages::stage> stage,
                       caf::actor scheduler, stage_actor_options options);

} // namespace actorpipe::actors
