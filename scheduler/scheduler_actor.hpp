/// \file
/// The scheduler actor: plans each step, hands every stage its program, collects the stages'
/// reports and runs the optimizer steps once every stage has finished.
///
/// Protocol (the typed interface `scheduler_actor` below)
/// - in  (connect_atom, std::vector<stage_actor> stages): the stage actors, in order; monitored.
///       Whoever built them has wired them to each other (in process: the pipeline sends each
///       local stage actor its peers; on nodes: each node wires its own).
/// - in  (run_atom, std::shared_ptr<step_request>): queue a request (train, forward, save, load);
///       requests run one at a time, in arrival order. The request's `finish` is called exactly
///       once, from the scheduler's thread, with the result or an error.
/// - in  (done_atom, stage_report), (failed_atom, step, failure): from the stages.
/// - A step fails (and every stage is told to abort, leaving parameters and buffers as they
///   were) when a stage fails, a stage actor terminates, or the step passes step_timeout.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <caf/actor_system.hpp>

#include <actorpipe/actions.hpp>
#include <actorpipe/results.hpp>
#include <actorpipe/schedule.hpp>

#include "actors/messages.hpp"

namespace actorpipe::scheduler {

/// The outcome of one step as the scheduler sees it.
struct step_outcome {
  step_result result;
  /// Forward-only: outputs by micro-batch.
  std::vector<torch::Tensor> outputs;
  /// fetch: every stage's state, merged (keys are model-wide).
  std::shared_ptr<std::map<std::string, torch::Tensor>> state;
  /// Set when the step failed.
  std::exception_ptr error;
};

/// What a request asks the stages to do.
enum class request_kind {
  /// A training step.
  train,
  /// A forward-only pass.
  forward,
  /// Every stage writes its state to `<path>/stage-<index>.pt`.
  save,
  /// Every stage loads its keys from `state`.
  load,
  /// Every stage sends a copy of its state (outcome.state).
  fetch,
  /// BMUF: every stage ends its warm-up or running block (stage_actor.hpp, block_atom).
  end_block,
};

/// One request, queued and run in order with the steps; inputs already split into micro-batches.
struct step_request {
  request_kind kind = request_kind::train;
  std::vector<torch::Tensor> inputs;
  std::vector<torch::Tensor> targets;
  std::vector<double> loss_scales;
  /// Training: the learning rate every stage sets before its optimizer step; < 0 keeps it.
  double learning_rate = -1;
  /// save: the directory.
  std::string path;
  /// load: tensors keyed model-wide.
  std::shared_ptr<const std::map<std::string, torch::Tensor>> state;
  /// fetch: the next request starts once every stage was asked (each copies its state before it
  /// runs anything after), not once every copy arrived; `finish` is then called later, from the
  /// scheduler's thread, with the state or the error.
  bool background = false;
  /// fetch: the snapshot's number (0: not a snapshot), which stages on nodes keep a copy of.
  uint64_t keep_as = 0;
  std::function<void(step_outcome)> finish;

  bool train() const { return kind == request_kind::train; }
};

struct scheduler_options {
  schedule_kind schedule = schedule_kind::one_f_one_b;
  std::size_t chunks = 1;
  /// Which virtual stage each stage's chunks are (the V schedules: v_shape); a custom schedule
  /// must place its chunks the same way.
  chunk_placement placement = chunk_placement::looped;
  /// Used for training instead of `schedule` when not empty.
  actorpipe::schedule custom;
  std::chrono::milliseconds step_timeout{600000};
  /// How long a failing step waits for every stage to confirm its abort before reporting.
  std::chrono::milliseconds abort_timeout{60000};
  /// Global gradient-norm clipping when > 0 (stages then report their squared gradient sums).
  double max_grad_norm = 0;
  /// Optimizer post-validation (pipeline_options::optimistic_update).
  bool optimistic_update = false;
  /// Overlapping steps (pipeline_options::overlap_steps): the next queued training step's plans
  /// go out while a training step runs.
  bool overlap_steps = false;
  /// The last stage also gets each micro-batch's inputs (a loss that sees them).
  bool inputs_to_loss = false;
  /// Per stage actor, the node ("host:port") that hosts it; empty when stages are in process. A
  /// stage actor that terminates is then a lost node (error_kind::node_lost), not a lost stage.
  std::vector<std::string> nodes;
  /// After each step message, how long the scheduler's thread polls for the next one before it
  /// sleeps (actors/linger.hpp); 0: sleep at once.
  std::chrono::microseconds linger{0};
  /// The step counter's start: the first step is first_step + 1. A pipeline rebuilt by
  /// recover() continues its predecessor's numbers, so that frames of the failed step still on
  /// their way are older than any step the new stages run (and dropped).
  uint64_t first_step = 0;
  /// Called (on the scheduler's thread) when a training step fails, before its stages are told
  /// to abort: replicas tell each other (comm::replica_group::failure_announcer), so that the
  /// others' collectives stop waiting for this one.
  std::function<void(uint64_t step, const std::string& why)> on_step_failure;
};

/// Spawns the scheduler; connect it to its stages with (connect_atom, stages) before running.
} // namespace actorpipe::scheduler

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<actorpipe::scheduler::step_request>)

namespace actorpipe::scheduler {

/// The scheduler protocol: it hears from its stages as their listener, takes its stages once
/// and requests to run.
using scheduler_actor = actors::stage_listener_actor::extend<
  caf::reacts_to<actors::connect_atom, std::vector<actors::stage_actor>>,
  caf::reacts_to<actors::run_atom, std::shared_ptr<step_request>>>;

scheduler_actor spawn_scheduler(caf::actor_system& sys, scheduler_options options);

} // namespace actorpipe::scheduler
