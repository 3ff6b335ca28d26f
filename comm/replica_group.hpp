/// \file
/// Data-parallel replicas over c10d: the rendezvous (a TCPStore served by rank 0, or an
/// in-process store for replicas of one process), a barrier with a deadline that names missing
/// ranks, one Gloo process group per stage index, and the per-stage gradient sync.
///
/// Nothing here knows of actors: a stage actor calls its stage_sync after its last backward.
/// c10d's headers stay inside replica_group.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include <actorpipe/pipeline.hpp>

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

  struct outcome {
    /// The sum over replicas of `weight` and of `weighted_loss`.
    double weight = 0;
    double weighted_loss = 0;
    int64_t bytes = 0;
  };

  /// Gradient sync of one step: every gradient g (parameters in model order; undefined ones
  /// count as zero and become defined) becomes sum_r(weight_r * g_r) / sum_r(weight_r), with
  /// `divide` false: sum_r(weight_r * g_r). All-reduced in buckets of about bucket_bytes, last
  /// parameters first, so the first bucket leaves before the rest is packed. Throws
  /// pipeline_error naming the stage when a collective fails or passes the deadline.
  outcome all_reduce_gradients(const std::vector<torch::Tensor>& parameters, double weight,
                               double weighted_loss, bool divide);

  /// Buffers after a step: rank 0's, or the average of floating-point buffers.
  void sync_buffers(std::vector<torch::Tensor> buffers, buffer_sync mode);

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
  replica_group(const data_parallel_options& options, std::size_t stages);
  ~replica_group();
  replica_group(const replica_group&) = delete;
  replica_group& operator=(const replica_group&) = delete;

  std::size_t rank() const noexcept { return rank_; }
  std::size_t size() const noexcept { return size_; }
  /// The sync of stage index `stage` (shared with its stage actor).
  std::shared_ptr<stage_sync> stage(std::size_t stage) const { return stages_.at(stage); }

private:
  std::size_t rank_ = 0;
  std::size_t size_ = 1;
  std::vector<std::shared_ptr<stage_sync>> stages_;
};

/// A store for replicas that live in one process (no sockets for the rendezvous).
std::shared_ptr<detail::local_store> make_local_store();

} // namespace actorpipe::comm
