/// \file
/// The split-size sweep behind `actorpipe bench`: the same training steps through pipelines of
/// 1, 2, 4, 8, ... micro-batches and through plain libtorch (1 thread and all cores), interleaved
/// step by step in one process so that ratios hold on a noisy machine.
#pragma once

#include <algorithm>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "training/model_setup.hpp"
#include "training/planning.hpp"

namespace actorpipe::bench {

struct sweep_options {
  training::model_args model;
  training::planning_args plan;
  std::vector<std::size_t> splits{1, 2, 4, 8};
  /// Partitions to measure (each with every split); empty: plan.partition only.
  std::vector<std::string> partitions;
  /// Stage threads' memory per configuration: "warm", "cold" (empty: as plan.cold_memory says).
  std::vector<std::string> memory;
  /// Precisions to measure side by side, "fp32", "bf16" (empty: fp32); plain libtorch runs
  /// in each too (bf16: under the same autocast).
  std::vector<std::string> precisions;
  /// Recomputation modes of the pipelines side by side (empty: "never").
  std::vector<std::string> recompute;
  /// Schedules of the pipelines side by side (empty: plan.schedule only).
  std::vector<std::string> schedules;
  /// The pipelines' optimizer updates side by side: "early" (post-validation: a stage steps as
  /// soon as its program has run, pipeline_options::optimistic_update) or "wait" (every stage
  /// waits until all have their gradients) or "overlap" (pipeline_options::overlap_steps; every
  /// configuration then trains twice per measured step on the batch, the two steps submitted
  /// together); empty: wait (the default of pipeline_options).
  std::vector<std::string> updates;
  std::size_t steps = 3;
  double lr = 0.05;
  bool baselines = true;
  /// With baselines: plain libtorch on all cores also accumulates gradients over the micro-batches
  /// of every swept split above 1 (what the pipeline computes, without the pipeline).
  bool accumulated = true;
  bool progress = true;
  std::string json;
  std::string csv;
  std::string plot;
  /// Data parallelism grid: when not empty, the bench measures every replicas x stages pair
  /// (each replica on batch / replicas samples) instead of the split sweep.
  std::vector<std::size_t> replicas;
  /// With replicas: the optimizer state's sharding side by side ("none", "optimizer",
  /// "gradients": data_parallel_options::shard; empty: none), and the optimizer ("sgd", plain;
  /// "adam", whose state is twice the parameters).
  std::vector<std::string> shards;
  std::string optimizer = "sgd";
  /// Stage counts: of the replica grid, or (without replicas) of the pipelines swept side by
  /// side (empty: plan.stages).
  std::vector<std::size_t> stage_counts;
  /// Replica grid: Chrome trace of the last step of the largest configuration.
  std::string trace;
};

/// One replicas x stages configuration of the data-parallel grid.
struct replica_row {
  std::size_t replicas = 1;
  std::size_t stages = 1;
  /// data_parallel_options::shard, by name.
  std::string shard = "none";
  /// Replica 0's optimizer state and gradients after the sync, summed over its stages, at the
  /// last step (stage_stats::optimizer_bytes, gradient_bytes).
  int64_t optimizer_bytes = 0;
  int64_t gradient_bytes = 0;
  /// The longest stage's update (optimizer step; sharded, with the parameters' broadcast from
  /// their owners), median over steps.
  double update_ms = 0;
  std::size_t splits = 1;
  double median_ms = 0;
  double min_ms = 0;
  double max_ms = 0;
  double samples_per_second = 0;
  /// Against the first configuration of the grid.
  double speedup = 0;
  /// Longest gradient sync of a stage (median over steps) and its share of the step.
  double sync_ms = 0;
  double sync_share = 0;
  /// How long the step ran on after every stage's last backward (sync not hidden by compute).
  double exposed_sync_ms = 0;
  /// Gradient bytes all-reduced per step by one replica.
  int64_t sync_bytes = 0;
  double loss = 0;
};

/// Runs the replicas x stages grid, configurations interleaved step by step so that ratios hold
/// on a noisy machine; prints the table (and writes --json, --trace).
std::vector<replica_row> run_replica_sweep(const sweep_options& options);

/// One measured configuration.
struct sweep_row {
  std::string name;
  std::string partition;
  std::size_t splits = 0;
  /// Per step, milliseconds.
  double min_ms = 0;
  double median_ms = 0;
  double max_ms = 0;
  /// Ideal step times from the stages' own measured compute (median over steps):
  /// fill-drain (m + p - 1) * slowest stage per micro-batch, and the lower bound
  /// max(sum / p, slowest stage total).
  double fill_drain_ms = 0;
  double lower_bound_ms = 0;
  double efficiency = 0;
  /// Simulator's prediction from the same per-action costs.
  double predicted_ms = 0;
  /// The planner's layout (--stages auto, --threads auto): its prediction from the profiled
  /// per-layer costs, made before the run (0 for the other rows).
  double planned_ms = 0;
  std::size_t threads = 0;
  /// Compute per sample summed over stages (no waiting): shows a small-micro-batch cliff.
  double compute_ms_per_sample = 0;
  double gflops = 0;
  double peak_share = 0;
  double speedup_1t = 0;
  double speedup_all = 0;
  /// Pipelines: speedup over plain libtorch (all cores) accumulating gradients over the same
  /// micro-batches, the same math as the pipeline's.
  double speedup_accumulated = 0;
  /// Plain libtorch: the micro-batches it accumulates gradients over (0: the whole batch).
  std::size_t accumulated = 0;
  int64_t rss_mb = 0;
  std::string precision = "fp32";
  /// Pipelines: the recomputation mode, and the most bytes a stage stashed at once (the
  /// largest stage's peak_stash_bytes, median over steps), in MB.
  std::string recompute = "never";
  double stash_mb = 0;
  /// Samples (a language model: tokens) trained per second, at the median step time.
  double per_second = 0;
  /// Pipelines: stage actors x chunks (the partition's parts).
  std::size_t stages = 0;
  /// The loss of every step (warm-up first), and the largest relative difference from the
  /// first configuration's (plain libtorch 1 thread when baselines run): same math, same data.
  std::vector<double> losses;
  double loss_difference = 0;
  /// Pipelines: the same against plain libtorch accumulating over the same micro-batches.
  double loss_difference_accumulated = -1;
};

/// The bench's batches: `count` random image batches shaped like `setup`'s with one-hot
/// targets, drawn after torch::manual_seed(seed); the same for every configuration measured.
std::vector<std::pair<torch::Tensor, torch::Tensor>>
make_batches(const training::model_setup& setup, uint64_t seed, std::size_t count);

/// The median (the upper one for an even count); 0 for none.
inline double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  return xs.empty() ? 0 : xs[xs.size() / 2];
}

/// Runs the sweep, prints the table (and writes --json, --csv, --plot); returns its rows.
std::vector<sweep_row> run_sweep(const sweep_options& options);

/// Training FLOPs of one step of `layers` on `batch` (3 x the forward's convolution and matrix
/// multiply FLOPs, counted from libtorch's operator calls).
double training_flops(const layer_list& layers, const torch::Tensor& batch);

/// GFLOP/s of an n x n GEMM of `dtype` with `threads` intra-op threads (best of 3).
double gemm_gflops(int threads, c10::ScalarType dtype = c10::ScalarType::Float, int64_t n = 2048);

} // namespace actorpipe::bench
