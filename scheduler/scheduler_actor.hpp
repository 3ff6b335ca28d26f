/// \file
/// The scheduler actor: plans each step, hands every stage its program, collects the stages'
/// reports and runs the optimizer steps once every stage has finished.
///
/// Protocol
/// - in  (connect_atom, std::vector<caf::actor> stages): the stage actors, in order; monitored.
/// - in  (run_atom, std::shared_ptr<step_request>): queue a step; steps run one at a time, in
///       arrival order. The request's `finish` is called exactly once, from the scheduler's
///       thread, with the result or an error.
/// - in  (done_atom, stage_report), (failed_atom, step, message): from the stages.
/// - A step fails (and every stage is told to abort, leaving parameters and buffers as they
///   were) when a stage fails, a stage actor terminates, or the step passes step_timeout.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <vector>

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

#include <actorpipe/pipeline.hpp>
#include <actorpipe/schedule.hpp>

namespace actorpipe::scheduler {

/// The outcome of one step as the scheduler sees it.
struct step_outcome {
  step_result result;
  /// Forward-only: outputs by micro-batch.
  std::vector<torch::Tensor> outputs;
  /// Set when the step failed.
  std::exception_ptr error;
};

/// One step to run, already split into micro-batches.
struct step_request {
  bool train = true;
  std::vector<torch::Tensor> inputs;
  std::vector<torch::Tensor> targets;
  std::vector<double> loss_scales;
  std::function<void(step_outcome)> finish;
};

struct scheduler_options {
  schedule_kind schedule = schedule_kind::one_f_one_b;
  std::chrono::milliseconds step_timeout{600000};
  /// How long a failing step waits for every stage to confirm its abort before reporting.
  std::chrono::milliseconds abort_timeout{60000};
};

/// Spawns the scheduler; connect it to its stages with (connect_atom, stages) before running.
caf::actor spawn_scheduler(caf::actor_system& sys, scheduler_options options);

} // namespace actorpipe::scheduler

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<actorpipe::scheduler::step_request>)
