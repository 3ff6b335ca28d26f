/// \file
/// The stage actor: runs one stage's program per step on a thread of its own.
///
/// A stage actor holds one or more model chunks (virtual stages): which virtual stage chunk c of
/// actor i is the options' chunk_placement says (looped: c * p + i; a V: stage 0 holds the first
/// and the last). Activations of virtual stage k go to the actor holding k + 1, gradients to the
/// one holding k - 1 (in a V the last stage sends its first chunk's output to itself); with one
/// chunk these are simply the next and previous actors.
///
/// Protocol
/// The protocol is the typed interface `local_stage_actor` (actors/messages.hpp): a message it
/// does not list, or a reply of the wrong type, does not compile.
/// - in  (connect_atom, std::vector<stage_peer_actor> stages): all stage actors, in order.
/// - in  (plan_atom, step_plan): start a step. Gradients are cleared; the program runs action by
///       action, each as soon as its input is there: a forward needs the micro-batch's input
///       (first virtual stage: from the plan) or activation; a backward needs the gradient from
///       the next virtual stage (last: its own loss); a weight action needs its backward.
///       Outputs go straight to the neighbour.
/// - in  (forward_atom | backward_atom, step, microbatch, chunk, tensor): inputs, buffered by
///       step, so they may arrive before the plan; inputs of older steps are dropped.
/// - in  (abort_atom, step) -> true: drop the step and restore every chunk (gradients, stash,
///       buffers); the reply confirms it.
/// - After the program of a training step, with replicas: gradients are all-reduced with the
///       same stage of the other replicas (stage_sync), then buffers are synced; the report
///       carries the loss over all replicas.
/// - Then, with parameters tied to other stages: their gradients are summed with the other
///       holders' (comm::tie_group).
/// - Replies that fail carry a CAF error of category `actorpipe` (actors/pipeline_errc.hpp:
///       the error_kind and the sentence naming the stage), never an error string in the value.
/// - in  (update_atom, step, learning_rate, gradient_scale) -> double optimizer_ms: set the
///       learning rate (when >= 0), scale gradients, step the optimizers.
///       With BMUF (options.bmuf.block_steps > 0) gradients are not averaged (nor the loss):
///       after the optimizer step that ends a warm-up or a block, the parameters are broadcast
///       from rank 0 or averaged and filtered (bmuf_options); a failed block sync restores the
///       chunks' state from before the optimizer step. With a sharded optimizer state
///       (options.shard): each chunk's optimizer steps this replica's parameters only, then every
///       parameter is broadcast from its owner (a failed broadcast restores what the step
///       changed here).
/// - in  (block_atom) -> true (replica_failure): BMUF: end the warm-up or the running block now (no
///       effect at a block's start). Sharded: gather every replica's optimizer state on replica
///       0's chunks for a checkpoint (no effect when nothing stepped since the last gather). An
///       error otherwise.
/// - in  (save_atom, path) -> true (io): write the chunks' state (parameters, buffers,
///       optimizer state keyed by layer name) to `path`.
/// - in  (load_atom, shared_ptr<const tensor_map>) -> true (io): load the chunks' keys.
/// - in  (fetch_atom, uint64 keep_as) -> shared_ptr<const tensor_map> (io): the chunks' state (as
///       save_atom writes it) in memory (keep_as: for stages on nodes, a snapshot's number).
/// - out (done_atom, stage_report) to its listener (`stage_listener_actor`: the scheduler, or the
///       node hosting it) when the program has run.
/// - out (failed_atom, step, failure) to its listener when an action throws or a wait runs past
///       wait_timeout; the message says who waits for what ("stage 1 waits for the activation
///       of microbatch 7 from stage 0").
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include <caf/actor_system.hpp>

#include <actorpipe/options.hpp>
#include <actorpipe/stage_settings.hpp>

#include "actors/messages.hpp"

namespace actorpipe::stages {
class stage;
}

namespace actorpipe::comm {
class stage_sync;
class tie_group;
} // namespace actorpipe::comm

namespace actorpipe::actors {

/// A stage actor's settings (one value, the same in process and on a node) and what cannot
/// leave the process: functions and the shared objects of its replica sync and tied parameters.
struct stage_actor_options : stage_settings {
  stage_actor_options() = default;
  explicit stage_actor_options(stage_settings settings) : stage_settings(std::move(settings)) {}

  /// Used by the last virtual stage in training.
  loss_function loss;
  /// Used instead of `loss` when set: the plan then carries the micro-batches' inputs.
  loss_with_inputs_function loss_with_inputs;
  /// Data parallelism: the collectives of this stage index across replicas (null: none); with
  /// it, the settings' buffers, sync_batch_norm and bmuf apply.
  std::shared_ptr<comm::stage_sync> sync;
  stage_hooks hooks;
  /// Parameters tied between stages (a GPT's embedding and head): the group of stage actors
  /// that sum their gradients after the replica sync (null: no ties across actors, or none).
  /// Every actor of the pipeline holds it, so that any failure wakes the holders.
  std::shared_ptr<comm::tie_group> ties;
};

local_stage_actor spawn_stage(caf::actor_system& sys,
                              std::vector<std::shared_ptr<stages::stage>> chunks,
                              stage_listener_actor scheduler, stage_actor_options options);

} // namespace actorpipe::actors
