/// \file
/// Data parallelism: replicas of a pipeline that average their gradients per stage over c10d.
///
/// Across processes (or hosts), each process builds its own pipeline with
/// pipeline_options::data_parallel set (rank, replicas, rendezvous address; see
/// data_parallel_from_env) and feeds it its own shard of every batch (distributed_order).
/// Within one process, replicated_pipeline holds R pipelines and splits each batch among them.
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <actorpipe/pipeline.hpp>

namespace actorpipe {

namespace recovery {
struct membership;
}

/// `defaults` with what torchrun-style variables say: RANK, WORLD_SIZE, MASTER_ADDR,
/// MASTER_PORT (unset ones keep the default); under torchrun's agent store
/// (TORCHELASTIC_USE_AGENT_STORE=True) every rank is its client, keys under the restart's
/// attempt (data_parallel_options::launcher_store). Throws invalid_argument naming a variable whose
/// value is not a valid number or a rank not below the world size.
data_parallel_options data_parallel_from_env(data_parallel_options defaults = {});

/// A rendezvous for replicas that run in threads of this process: put the same one into every
/// replica's data_parallel_options::local (replicated_pipeline does this itself).
std::shared_ptr<detail::local_store> make_local_rendezvous();

/// R replicas of one pipeline in this process, each with its own stage actors (the cores are
/// shared: threads_per_stage defaults to cores / (stages x R)). A batch is split into R parts
/// (sizes differ by at most one); each replica runs its part and the stages average gradients
/// with their counterparts, so a step equals one pipeline's step on the whole batch.
class replicated_pipeline {
public:
  /// Builds a fresh model for each replica, called on the constructing thread in rank order
  /// (their initial parameters are replaced by replica 0's, so seeds need not agree).
  using model_factory = std::function<layer_list()>;

  /// `options.data_parallel` supplies timeout, bucket size, buffer mode and group; rank,
  /// replica count and the (in-process) rendezvous are set here. Throws what a pipeline
  /// constructor throws, or invalid_argument for replicas == 0.
  replicated_pipeline(engine& sys, const model_factory& make_model, partition cut,
                      pipeline_options options, std::size_t replicas);

  /// Replicas of a pipeline on nodes: options.placement.nodes lists every replica's nodes one
  /// replica after the other (replica r's stage i on entry r x stages + i), each node builds its
  /// stage of `model`, and the stages average their gradients with the other replicas' same
  /// stage node to node (c10d Gloo). The replicas meet at a store this process serves at
  /// options.data_parallel.master_addr:master_port, which every node must reach. Throws what
  /// the pipeline constructor for a remote_model throws, or invalid_argument for a node count
  /// that is not replicas x stages.
  replicated_pipeline(engine& sys, const remote_model& model, partition cut,
                      pipeline_options options, std::size_t replicas);
  ~replicated_pipeline();
  replicated_pipeline(const replicated_pipeline&) = delete;
  replicated_pipeline& operator=(const replicated_pipeline&) = delete;

  /// One step of every replica on its part of the batch. The result is replica 0's, whose loss
  /// is over the whole batch; wall_ms is the slowest replica's. The batch must hold at least
  /// replicas x microbatches samples. Throws pipeline_error when any replica's step failed.
  step_result train_step(torch::Tensor inputs, torch::Tensor targets);

  /// A step on a batch already scattered over the replicas (as DataParallel's
  /// `inputs_are_scattered=True`): replica r trains on inputs[r] and targets[r], one part per
  /// replica. Parts may differ in size: gradients are weighted by samples, so the step equals
  /// one pipeline's on the parts concatenated in rank order. Throws invalid_argument when the
  /// part counts are not the replica count, or a part is empty or its inputs and targets differ
  /// in samples.
  step_result train_step_scattered(std::vector<torch::Tensor> inputs,
                                   std::vector<torch::Tensor> targets);

  /// Every replica's pipeline::end_block(), together (BMUF; sharded optimizer state).
  void end_block();

  /// Writes the replicas' state as pipeline::save_state does (replica 0's parameters and
  /// buffers; the optimizer state gathered from every replica when it is sharded): end_block()
  /// then replica 0's save_state. A pipeline of any replica count, or none, loads it.
  void save_state(const std::string& dir);

  /// Sets every replica's learning rate from the next step on.
  void set_learning_rate(double lr);

  /// Forward-only on every replica at once (as DataParallel's forward): the batch split into
  /// parts as train_step splits it, part r through replica r, the outputs concatenated in batch
  /// order. A batch of fewer samples than replicas uses the first that many replicas.
  torch::Tensor forward(torch::Tensor inputs);

  /// The same, the outputs left scattered (DataParallel's `gather_to_one_device=False`):
  /// element r is replica r's outputs for its part.
  std::vector<torch::Tensor> forward_scattered(torch::Tensor inputs);

  /// Inputs already scattered (`inputs_are_scattered=True`): parts[r] runs on replica r (at
  /// most one part per replica, none empty); outputs gathered in order, or left scattered.
  torch::Tensor forward(const std::vector<torch::Tensor>& parts);
  std::vector<torch::Tensor> forward_scattered(const std::vector<torch::Tensor>& parts);

  /// Replicas on nodes, as pipeline::snapshot(): replica 0's stages send their state to this
  /// process, where the loss of a node cannot take it (every replica holds the same parameters
  /// and optimizer state after a step; with buffer_sync::none, replica 0's buffers stand for
  /// all). Returns the snapshot's number (0: the state the replicas were built with).
  uint64_t snapshot(const std::string& note = {});
  /// As pipeline::snapshot_in_background(): the copies come while the next steps run.
  uint64_t snapshot_in_background(const std::string& note = {});
  /// The number of the newest complete snapshot, after waiting for one still arriving.
  uint64_t newest_snapshot();

  /// After a step failed on nodes (error_kind::node_lost, or replica_failure or timeout: a
  /// replica whose partner stage went), puts the replicas back together: every node of every
  /// replica is asked whether it answers (each within placement.connect_timeout, all at once);
  /// a spare that answers (placement.spares, in order) takes each lost node's stages, so the
  /// world stays as it was; a replica that lost a node no spare replaces leaves, and the world
  /// shrinks to the replicas left, renumbered in their order (a batch is then split among
  /// fewer). The replicas meet again at the store of the (new) rank 0, their stages form new
  /// groups on their nodes, and every stage is restored from one state:
  /// - **a surviving replica's**, when a replica kept every node and either completed the failed
  ///   step (its all-reduce had every replica's gradients; another failed after it: the state is
  ///   that step's, recovery_report::failed_step its result) or failed only because another
  ///   replica did (replica_failure: the state is the step before's, unchanged). Its stages'
  ///   state is fetched before they stop and becomes the newest snapshot
  ///   (recovery_report::from_replica names the replica). Nothing is replayed: the caller goes on
  ///   after the failed step, or takes it again. Not with BMUF or sharded optimizer state, where
  ///   no replica holds the whole state;
  /// - otherwise the newest snapshot; the caller replays its data from the snapshot's step.
  /// Later steps equal those of the new world resumed from that state. Throws pipeline_error
  /// (node_lost) when no replica is left whole, invalid_argument for replicas in process. Call
  /// it from the thread that runs the steps.
  recovery_report recover();

  /// Between steps, replicas on nodes: the nodes lost in earlier recoveries, and new nodes that
  /// joined (placement.accept_joins), are asked beside the steps (at most once a second) whether
  /// they answer. A replica that left (a node of it lost, no spare) comes back when each node it
  /// had answers again and holds no other replica's stages, or a spare standing by (one given, a
  /// node back or one that joined) takes that node's place: the replicas meet again with it,
  /// every stage from the state now (replica 0's, after a completed step every replica's:
  /// nothing is replayed), and each step's batch is split over one more again. A node that
  /// answers and is not needed so stands by as a spare for the next loss. Returns what it did
  /// (recovery_report::rejoined, joined, replicas, nodes, spares_used: those standing by), or
  /// nothing where no node came (yet). Call it from the thread that runs the steps.
  std::optional<recovery_report> rejoin_nodes();

  /// With placement.accept_joins: "host:port" where nodes join (the port taken, when 0 was
  /// asked); empty otherwise.
  std::string join_address() const;

  std::size_t replicas() const;
  pipeline& replica(std::size_t rank);

private:
  std::vector<std::unique_ptr<pipeline>> replicas_;
  std::chrono::milliseconds deadline_{0};
  // How each replica's last training step ended (null: it completed; then its result), for
  // recover().
  std::vector<std::exception_ptr> last_outcomes_;
  std::vector<std::optional<step_result>> last_results_;
  // Replicas that left in a recovery, stopped, each with the nodes it had: they may come back
  // (rejoin_nodes).
  std::vector<std::pair<std::unique_ptr<pipeline>, std::vector<std::string>>> left_;
  // The nodes lost and those that joined (placement.accept_joins), asked whether they answer.
  std::unique_ptr<recovery::membership> members_;

  // recover()'s second half: the replicas `whole` (old ranks) go on, on `layouts`, meet again
  // and restore `state` (snapshot `number`; `taken` snapshots numbered so far).
  // What the world is now, into `report`: every replica's nodes, the cut, snapshot `number`,
  // the replica count and the seconds since `started`.
  void describe_world(recovery_report& report, uint64_t number,
                      std::chrono::steady_clock::time_point started) const;
  // rejoin_nodes()' second half: the nodes of `report.rejoined` answer again.
  recovery_report take_back(recovery_report report, std::chrono::steady_clock::time_point started);
  void rejoin(const std::vector<std::size_t>& whole,
              const std::vector<std::vector<std::string>>& layouts,
              const std::shared_ptr<const std::map<std::string, torch::Tensor>>& state,
              uint64_t number, uint64_t taken);
};

} // namespace actorpipe
