/// \file
/// Data-parallel replicas over c10d: the rendezvous (a TCPStore served by rank 0, or an
/// in-process store for replicas of one process), a barrier with a deadline that names missing
/// ranks, one process group per stage index (Gloo on the CPU, NCCL on GPUs), and the per-stage
/// gradient sync.
///
/// Nothing here knows of actors: a stage actor calls its stage_sync after its last backward.
/// c10d's headers stay inside replica_group.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include <actorpipe/options.hpp>

namespace actorpipe::comm {

/// The collectives of one stage index across replicas (its "data" group).
class stage_sync {
public:
  struct impl;
  explicit stage_sync(std::unique_ptr<impl> self);
  ~stage_sync();
  stage_sync(const stage_sync&) = delete;
  stage_sync& operator=(const stage_sync&) = delete;

  /// Overwrites `tensors` (same order on every replica) with rank 0's.
  void broadcast(std::vector<torch::Tensor> tensors);

  struct totals {
    double weight = 0;
    double weighted_loss = 0;
  };

  /// The sums over replicas of each replica's `weight` (its samples) and `weighted_loss`.
  totals sum(double weight, double weighted_loss);

  /// Replaces `sums` (contiguous, the same shape on every replica) with its sum over replicas
  /// (synchronised batch norm's statistics). `what` names it in errors.
  void all_reduce_sum(torch::Tensor& sums, const char* what);

  /// Gradient sync of one step: every gradient g (parameters in model order; undefined ones
  /// count as zero and become defined) becomes sum_r(scale_r * g_r). All-reduced in buckets of
  /// about bucket_bytes, last parameters first, all launched before the first is awaited.
  /// Returns the bytes all-reduced. Throws pipeline_error naming the stage when a collective
  /// fails or passes the deadline.
  int64_t all_reduce_gradients(const std::vector<torch::Tensor>& parameters, double scale);

  /// Replaces floating-point `tensors` (the same shapes on every replica) by their mean over the
  /// replicas (BMUF's parameter average). `what` names it in errors. Returns the bytes reduced.
  int64_t average(std::vector<torch::Tensor> tensors, const char* what);

  /// Buffers after a step: rank 0's, or the average of floating-point buffers.
  void sync_buffers(std::vector<torch::Tensor> buffers, buffer_sync mode);

  /// This replica's rank in the group, and the group's size.
  std::size_t rank() const;
  std::size_t size() const;

  /// ZeRO-2: as all_reduce_gradients, but the gradient of parameter i is summed on its owner
  /// `owner[i]` only (reduce, in buckets per owner) and released (undefined) on the other ranks;
  /// the parameters flagged in `all_reduce` (tied to another stage) are all-reduced as before.
  /// Returns the bytes sent into the collectives.
  int64_t reduce_gradients(const std::vector<torch::Tensor>& parameters,
                           const std::vector<std::size_t>& owner,
                           const std::vector<bool>& all_reduce, double scale);

  /// ZeRO after the optimizer step: every parameter i takes its owner's value (broadcast from
  /// `owner[i]`, in buckets per owner). Returns the bytes broadcast.
  int64_t broadcast_from_owners(const std::vector<torch::Tensor>& parameters,
                                const std::vector<std::size_t>& owner);

  /// Every rank's `mine` (CPU tensors by name) merged on rank 0, in rank order (a later rank's
  /// entry wins a name); the other ranks get an empty map. `what` names it in errors.
  std::map<std::string, torch::Tensor>
  gather_on_first(const std::map<std::string, torch::Tensor>& mine, const char* what);

private:
  std::unique_ptr<impl> self_;
};

/// One replica's membership: rendezvous, barrier and a process group per stage index.
class replica_group {
public:
  /// Meets the other replicas: rank 0 serves the store at master_addr:master_port (or the
  /// in-process store is used), every rank checks in, and all wait until all arrived. Throws
  /// pipeline_error naming the ranks that did not arrive within options.timeout, or the master
  /// that could not be reached.
  /// `devices`: where each stage index computes (CPU when not given); a stage's group uses
  /// options.backend, or (automatic) NCCL for a stage on a GPU and Gloo on the CPU.
  replica_group(const data_parallel_options& options, std::size_t stages,
                const std::vector<c10::Device>& devices = {});
  ~replica_group();
  replica_group(const replica_group&) = delete;
  replica_group& operator=(const replica_group&) = delete;

  /// Every rank puts `value` under `what`, then waits until all have (deadline: the options'
  /// timeout). Throws pipeline_error naming the ranks missing at the deadline, or every rank's
  /// value when they differ. Every rank makes the same calls in the same order.
  void agree(const std::string& what, int64_t value);

  /// The sync of stage index `stage` (shared with its stage actor).
  std::shared_ptr<stage_sync> stage(std::size_t stage) const { return stages_.at(stage); }

  /// What this replica's scheduler calls when a training step fails: the failure is counted in
  /// the rendezvous store (once: a step that failed because another replica's did is not
  /// counted again), where every rank's stage syncs look while they wait in a collective (Gloo:
  /// the wait ends there, not at the deadline) and before each step's first collective; their
  /// groups are then abandoned for good (comm/replica_failures.hpp). Never throws: a store that
  /// cannot be reached is logged.
  std::function<void(uint64_t step, const std::string& why)> failure_announcer() const;

  /// A store prefix no earlier call on this rank gave (`what` and a call number; every rank
  /// calls in the same order, so the ranks' prefixes match): where stages on nodes form their
  /// groups, anew for each placement.
  std::string fresh_prefix(const std::string& what);

private:
  struct rendezvous;
  std::unique_ptr<rendezvous> rendezvous_;
  std::vector<std::shared_ptr<stage_sync>> stages_;
};

/// The sync of stage index `stage` for a process that is not a replica itself (a node hosting
/// that replica's stage): a client of rank 0's store at options.master_addr:master_port, which
/// forms the stage's Gloo group under `prefix` at its first collective, on the calling thread,
/// within options.timeout (every rank's stage gets there at about the same time). Errors as
/// replica_group's, from that first collective.
std::shared_ptr<stage_sync> join_stage_group(const data_parallel_options& options,
                                             std::size_t stage, const std::string& prefix,
                                             c10::Device device = c10::Device(c10::kCPU));

/// A store for replicas that live in one process (no sockets for the rendezvous).
std::shared_ptr<detail::local_store> make_local_store();

} // namespace actorpipe::comm
