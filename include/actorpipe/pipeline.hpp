/// \file
/// The embedding API: an engine (the actor system), and pipelines that train and evaluate a
/// layer list cut into stage actors. CAF stays behind this header. The value types a pipeline
/// is configured with and reports are vocabulary (<actorpipe/options.hpp>,
/// <actorpipe/results.hpp>, <actorpipe/errors.hpp>); this header includes them, and the loss and
/// optimizer factories, so that it alone still gives all of a pipeline.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <actorpipe/errors.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/losses.hpp>
#include <actorpipe/models.hpp>
#include <actorpipe/optimizers.hpp>
#include <actorpipe/options.hpp>
#include <actorpipe/partition.hpp>
#include <actorpipe/results.hpp>
#include <actorpipe/schedule.hpp>

namespace actorpipe {

namespace recovery {
class access;
class placed_stages;
} // namespace recovery

/// Owns the actor system that runs stage and scheduler actors. Create one per process and keep
/// it alive longer than its pipelines.
class engine {
public:
  /// `worker_threads` CAF workers serve the scheduler; stage actors run on threads of their own.
  explicit engine(std::size_t worker_threads = 1);
  ~engine();
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  struct impl;
  impl& internals() { return *impl_; }

private:
  std::unique_ptr<impl> impl_;
};

/// A model cut into stage actors plus a scheduler actor that drives them.
///
/// Thread-safety: calls from several threads are queued and run one step at a time in call
/// order. Parameter accessors take each stage's lock and may run during a step.
class pipeline {
public:
  /// Spawns one stage actor per stage of `cut` and a scheduler. The layers' modules are moved to
  /// their stage's device and owned by the stages from now on (the caller's handles alias them).
  /// Throws invalid_argument for an empty model, a partition that does not cover `layers`, a
  /// device count that does not match the stage count, or microbatches == 0.
  pipeline(engine& sys, layer_list layers, partition cut, pipeline_options options);

  /// Places stage actor i on options.placement.nodes[i], an `actorpipe node` process, which
  /// builds its stage from `model` (so no model code ships); activations and gradients go from
  /// node to node, never through this process. The loss and optimizer come from `model`
  /// (options.loss and options.optimizer are ignored), and so do the hooks (model.hooks, run on
  /// the nodes; options.hooks, functions of this process, are refused). Every schedule and chunk
  /// count; replicas meet at rank 0's store (options.data_parallel); CPU only. Throws
  /// pipeline_error naming the node that cannot be reached, refuses the secret or cannot build
  /// its stage. named_gradients() is not available; named_parameters()
  /// fetches the parameters from the nodes.
  pipeline(engine& sys, remote_model model, partition cut, pipeline_options options);
  ~pipeline();
  pipeline(const pipeline&) = delete;
  pipeline& operator=(const pipeline&) = delete;

  /// Starts one training step on `inputs` (batch dimension first) and `targets`; the future
  /// holds the result or a pipeline_error. Invalid arguments throw before anything runs.
  std::future<step_result> train_step_async(torch::Tensor inputs, torch::Tensor targets);

  /// train_step_async(...).get(), bounded by the step timeout.
  step_result train_step(torch::Tensor inputs, torch::Tensor targets);

  /// A training step on inputs already split into micro-batches (one tensor each, batch
  /// dimension first; as many as pipeline_options::microbatches), e.g. produced scattered by
  /// another pipeline. Losses are scaled by each part's share of all samples.
  step_result train_step(std::vector<torch::Tensor> inputs, std::vector<torch::Tensor> targets);

  /// Forward-only pass (no stash, no gradients), one output per micro-batch on the last stage's
  /// device. A batch smaller than the micro-batch count runs as that many micro-batches.
  std::vector<torch::Tensor> forward_scattered(torch::Tensor inputs);

  /// Forward-only pass with the micro-batch outputs concatenated along dimension 0.
  torch::Tensor forward(torch::Tensor inputs);

  /// Learning rate of every stage's optimizer (all parameter groups) from the next step on.
  /// SGD and Adam; ordered with the steps submitted around it.
  void set_learning_rate(double lr);

  /// Writes every stage's parameters, buffers and optimizer state into `dir` (created when
  /// missing): one file per stage, `stage-<index>.pt`, in libtorch's pickle format, tensors
  /// keyed by layer name ("layer3.0.conv1.weight", "optimizer/fc.weight/momentum_buffer").
  /// Runs between steps, in call order. Throws pipeline_error naming the stage that failed.
  void save_state(const std::string& dir);

  /// Loads what save_state wrote, from a pipeline of the same model cut any way: every
  /// `stage-*.pt` file in `dir` is read and each stage takes its layers' tensors. Everything is
  /// checked (missing, unknown or misshapen tensors) before any stage changes; pipeline_error
  /// names the tensor otherwise.
  void load_state(const std::string& dir);

  /// Keeps a copy of every stage's parameters, buffers and optimizer state in this process's
  /// memory (stages on nodes send theirs), where the loss of a node cannot take it; recover()
  /// restores the newest. Runs between steps, in call order; the previous snapshot is kept until
  /// this one is complete. Returns the snapshot's number (1, 2, ...; 0 stands for the state the
  /// pipeline was built with or last loaded by load_state). Throws pipeline_error as a step.
  /// Stages on nodes: once it is complete here, each node also keeps its stages' copy (the newest
  /// only, node_options::keep_snapshots), with `note` (train() writes where in the data it was
  /// taken), so that a driver that died can start again from it (restore_from_nodes()).
  uint64_t snapshot(const std::string& note = {});

  /// As snapshot(), without waiting for the copies: every stage copies its state between the
  /// step before and the step after (on its thread, a copy of the tensors), and the copies come
  /// to this process while the next steps run (stages on nodes pack and send theirs beside their
  /// work). The snapshot becomes the newest once all of it has come; the next snapshot, recover(),
  /// load_state() and newest_snapshot() wait for it first (within the step deadline). One that
  /// fails (a node lost before its state came; the steps after it then fail too) leaves the
  /// previous one the newest, with a warning in the log. Returns the snapshot's number.
  uint64_t snapshot_in_background(const std::string& note = {});

  /// Stages on nodes, in a driver that started again after its predecessor died: the newest
  /// snapshot (snapshot()) that the nodes keep whole, one part of it for every stage actor: its
  /// number, note, cut (the placement's when it was taken, which a recovery or a rejoin may have
  /// changed since) and the node keeping each part: the node of that stage, else its neighbour
  /// (each node also holds a copy of the next node's stages, one pipeline without replicas), so a
  /// node lost with the driver loses nothing. Throws pipeline_error (io) naming what each node
  /// keeps when no snapshot is kept whole, invalid_argument for stages in process.
  kept_snapshot kept_on_nodes();
  /// Every stage loads its part of kept snapshot `kept` (kept_on_nodes()) from the node keeping
  /// it; it becomes this pipeline's newest snapshot too (what recover() restores). Where the
  /// snapshot's nodes or cut are not the pipeline's, the stages are first placed as they were
  /// when it was taken; where a copy put two stage actors on one node, they are then spread over
  /// the pipeline's nodes left without one, from the state loaded (nothing replayed). A node of
  /// the pipeline left without a stage counts as lost, and rejoin_nodes() cuts the model back
  /// onto it. Throws pipeline_error (io) naming the stage and node that do not keep it.
  void restore_from_nodes(const kept_snapshot& kept);

  /// The number of the newest complete snapshot (0: the state the pipeline was built with or
  /// last loaded), after waiting for one still arriving: what recover() restores.
  uint64_t newest_snapshot();

  /// After a step of stages on nodes failed (error_kind::node_lost, or a timeout: a node that
  /// stopped answering), puts the pipeline back together: asks every node of the placement
  /// whether it answers (each within placement.connect_timeout, all at once), moves the stages of
  /// those that do not to spares that answer (placement.spares, in order), or, short of spares,
  /// cuts the model anew over the nodes left with `repartition(parts)` (by parameter counts when
  /// empty; parts = nodes left x options.chunks, each stage keeping its chunk count), builds the
  /// stages there, restores every stage from the newest snapshot and says what it did. With every
  /// node answering it rebuilds the same layout. Later steps are numbered after the failed one; the
  /// caller replays its data from the snapshot's step. Throws pipeline_error (node_lost) when no
  /// node is left, invalid_argument for stages in process (nothing to move) or a repartition of the
  /// wrong stage count. Not queued like the steps: call it from the thread that runs them, with no
  /// step or request of another thread pending. `found_lost`: nodes the failed step already
  /// found lost (pipeline_error::node() of a node_lost failure: its connection closed, or its
  /// heartbeat went unanswered), counted lost without being asked again (a frozen node would
  /// cost the question another heartbeat timeout); rejoin_nodes() takes them back if they answer.
  recovery_report recover(std::function<partition(std::size_t)> repartition = {},
                          const std::vector<std::string>& found_lost = {});

  /// Stages on nodes, between steps, after recover() lost nodes: takes back those that answer
  /// again (a node restarted). Whether they do is asked beside the steps: a call starts the
  /// question (each node within placement.connect_timeout) and returns at once; a later call takes
  /// the answer. Where recover() cut the model anew onto fewer nodes, every stage is placed again
  /// over the nodes it runs on plus those back (with the cut as built when their count is as
  /// built, else `repartition(parts)`, by parameter counts when empty), restored from a snapshot
  /// taken now: nothing is replayed. Where spares took their stages, they stand by as spares
  /// (placement.spares) for the next loss. Returns what it did (recovery_report::rejoined), or
  /// nothing. Throws as recover().
  std::optional<recovery_report>
  rejoin_nodes(std::function<partition(std::size_t)> repartition = {});

  /// Stages on nodes, between steps: places the stages again on the same nodes, cut by `cut`
  /// (as many stages as now), restored from the state now (a snapshot taken here: nothing is
  /// replayed). Returns that snapshot's number. Throws invalid_argument for stages in process or
  /// another stage count, pipeline_error as recover().
  uint64_t repartition(const partition& cut);

  /// Writes the trained model as one TorchScript file that Python's `torch.jit.load` runs
  /// (its parameters and buffers as they are now, on nodes too), for a model loaded with
  /// load_torchscript (<actorpipe/torchscript.hpp>); invalid_argument for any other model.
  /// Runs between steps, like save_state.
  void save_torchscript(const std::string& path);

  /// Writes the trained model as a PT2 archive that Python's `torch.export.load(path).module()`
  /// runs (its weights as they are now, on nodes too), for a model loaded with load_exported
  /// (<actorpipe/exported.hpp>); invalid_argument for any other model. Runs between steps.
  void save_exported(const std::string& path);

  /// Writes the trained model back in the format it was loaded from (a PT2 archive or
  /// TorchScript: the table of models/model_formats.hpp); invalid_argument for a built-in model,
  /// whose weights save_state writes. Runs between steps.
  void save_model(const std::string& path);

  /// Copies of the trained parameters and persistent buffers by name, as save_state writes them
  /// (layer::qualified; from every stage, on nodes too). Runs between steps.
  std::map<std::string, torch::Tensor> state_dict();

  /// Data parallelism: a barrier with a deadline at which the replicas also agree on a value.
  /// Every replica's pipeline makes the same calls in the same order, each with the same `what`
  /// (which names it in messages, "the end of epoch 3") and its `value` (a step, an epoch); a
  /// call returns when all have arrived with the same value. Throws pipeline_error
  /// (replica_failure) naming the ranks that did not arrive within data_parallel_options::timeout,
  /// or the ranks and values that differ. Does nothing without replicas. Call it between steps.
  void replicas_agree(const std::string& what, int64_t value);

  /// Makes the replicas' state whole for a checkpoint. BMUF (data_parallel_options::bmuf): ends
  /// the warm-up or the running block now, so that every replica holds the same (filtered)
  /// parameters; nothing at a block's start. Sharded optimizer state
  /// (data_parallel_options::shard): replica 0's stages gather every replica's part, which
  /// replica 0's save_state then writes whole, until its next step. Nothing otherwise. Every
  /// replica must call it at the same point. train() calls it at each epoch's end and before
  /// each checkpoint. Throws pipeline_error (replica_failure) when the sync fails.
  void end_block();

  /// The training schedule for the configured micro-batch count (built in or custom).
  actorpipe::schedule training_schedule() const;

  /// Stage actors (the partition's parts divided by chunks).
  std::size_t stages() const;
  const partition& cut() const;
  /// Stages on nodes: the node ("host:port") of each stage actor now; empty in process.
  const std::vector<std::string>& nodes() const;
  /// Stages on nodes: the spares standing by now (given, or nodes that came back or joined).
  const std::vector<std::string>& spares() const;
  /// With placement.accept_joins: "host:port" where nodes join (the port taken, when 0 was
  /// asked); empty otherwise.
  std::string join_address() const;
  /// Parameter elements per stage actor.
  std::vector<int64_t> stage_parameter_counts() const;

  /// Copies of all parameters named "<layer>.<parameter>", in model order.
  std::vector<std::pair<std::string, torch::Tensor>> named_parameters() const;
  /// Copies of all gradients of the last step (undefined where a parameter got none).
  std::vector<std::pair<std::string, torch::Tensor>> named_gradients() const;

  struct impl;
  /// The engine's own: a set of replicas' recovery drives each replica's pipeline through it
  /// (only engine/ can make the key).
  recovery::placed_stages placed(const recovery::access& key);

private:
  std::unique_ptr<impl> impl_;
};

} // namespace actorpipe
