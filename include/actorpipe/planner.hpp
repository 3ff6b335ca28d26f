/// \file
/// Choosing how to run a model: every stage count, threads per stage, micro-batch count,
/// schedule and partition of a space, simulated with per-layer costs measured at that thread
/// count and micro-batch size, ranked fastest first. One stage with all the cores (plain
/// gradient accumulation through the engine) is a layout like any other, so the first of the
/// ranking is never predicted slower than it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <actorpipe/actions.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/options.hpp>
#include <actorpipe/partition.hpp>
#include <actorpipe/profile.hpp>

namespace actorpipe {

/// Per-layer costs measured with `threads` intra-op threads on micro-batches of `samples`.
struct measured_costs {
  std::size_t threads = 1;
  int64_t samples = 1;
  std::vector<layer_profile> layers;
  /// The optimizer step over all the layers' parameters at `threads` (profile_update); a stage
  /// pays its parameters' share after its last backward.
  double update_ms = 0;
};

/// The layouts to compare.
struct layout_space {
  /// Samples per step (split into micro-batches as the engine does: tensor_split).
  int64_t batch = 1;
  std::vector<std::size_t> stage_counts{1, 2};
  /// Intra-op threads per stage to try; empty: cores / stages for each stage count.
  std::vector<std::size_t> thread_counts;
  /// The machine's cores: layouts of stages x threads above it are left out while a stage count
  /// has any that fit (0: no limit). A stage count that cannot fit runs 1 thread per stage and is
  /// charged the oversubscription (its costs times stages / cores).
  std::size_t cores = 0;
  std::vector<std::size_t> microbatch_counts{1, 2, 4, 8};
  std::vector<schedule_kind> schedules{schedule_kind::gpipe,       schedule_kind::one_f_one_b,
                                       schedule_kind::zb_h1,       schedule_kind::zb_h2,
                                       schedule_kind::interleaved, schedule_kind::interleaved_zb,
                                       schedule_kind::zb_v,        schedule_kind::v_half,
                                       schedule_kind::v_min,       schedule_kind::dualpipe_v};
  /// Model chunks per stage of the interleaved schedules.
  std::size_t chunks = 2;
  /// How to cut: "uniform", "params", "time" or "cut:I,J" (the last only where it has as many
  /// stages as the layout).
  std::vector<std::string> partitions{"time"};
  /// Memory caps (0: none): the most micro-batches any stage stashes, and the most bytes of
  /// activations any stage keeps (estimated: kept_bytes per micro-batch times its peak stash).
  double max_stash = 0;
  int64_t max_stash_bytes = 0;
  /// The most bytes any stage may hold at its peak, predicted (memory_estimate; 0: no limit),
  /// and the fp32 tensors the optimizer keeps per parameter (0: plain SGD, 1: SGD with
  /// momentum, 2: Adam).
  int64_t max_memory_bytes = 0;
  double optimizer_state = 0;
  /// Activation recomputation to try: a recomputing stage stashes its input alone and pays
  /// each recomputed backward its forward again (the planner tries every mode under a byte cap
  /// when the user left --recompute out; the fastest that fits wins).
  std::vector<recompute_mode> recompute{recompute_mode::never};
  /// The engine's own costs in ms, measured by actorpipe_micro_bench: per message between
  /// stages, and per step (planning, hand-out, optimizer round trips).
  double hop_ms = 0.01;
  double step_ms = 0.2;

  /// Projections onto other machines (actorpipe plan --devices, docs/scaling.md):
  /// a link between stages and between replicas, in GB/s and ms of latency per message (0 GB/s:
  /// in one process, no transfer time);
  double link_gbps = 0;
  double link_latency_ms = 0;
  /// data-parallel replicas of each layout (each on batch / replicas samples, its gradients
  /// all-reduced in a ring over the link after the step: 2 (r - 1) / r of each stage's
  /// gradient bytes per replica plus 2 (r - 1) latencies, not overlapped with compute);
  std::vector<std::size_t> replica_counts{1};
  /// and, when > 0, only the layouts of stages x replicas == devices.
  std::size_t devices = 0;
};

/// One simulated way to run.
struct layout {
  std::size_t stages = 1;
  std::size_t threads = 1;
  std::size_t microbatches = 1;
  /// Model chunks per stage (interleaved: the space's; zb-v, v-half: 2), else 1.
  std::size_t chunks = 1;
  schedule_kind schedule = schedule_kind::one_f_one_b;
  recompute_mode recompute = recompute_mode::never;
  /// The partition specs the cut came from ("time", "uniform,params", ...), and the cut
  /// (stages x chunks parts).
  std::string partition_spec;
  partition cut;
  /// Predicted step time in ms, mean bubble, peak stash (micro-batches, the largest over
  /// stages) and the estimated activation bytes of the fullest stage.
  double step_ms = 0;
  double bubble = 0;
  double stash = 0;
  int64_t stash_bytes = 0;
  /// The predicted peak of the fullest stage (memory_estimate::total), in bytes.
  int64_t memory_bytes = 0;
  /// Within the space's memory caps.
  bool fits = true;
  /// Projections: data-parallel replicas, the longest transfer of one micro-batch's activation
  /// between two stages, and the gradient all-reduce, in ms (included in step_ms).
  std::size_t replicas = 1;
  double send_ms = 0;
  double allreduce_ms = 0;
  /// The optimizer step of the stage with the most parameters, in ms (included in step_ms).
  double update_ms = 0;

  /// "2 x 1 thread, 8 micro-batches, 1f1b, time [0, 5) [5, 9)" (", recompute always" when it
  /// recomputes).
  std::string to_string() const;
};

/// ", recompute always" (or except_last), "" for never: how layouts and plans name it.
std::string recompute_suffix(recompute_mode recompute);

/// What a stage holds at its peak, predicted: its parameters, their gradients and the
/// optimizer's state (fp32: 4 bytes an element; optimizer_state tensors per parameter, divided
/// among `shard_ways` replicas under data_parallel_options::shard), the activations its
/// schedule stashes at once, the working set of the action running then, and on a GPU the
/// libraries' workspaces (stage_memory). The allocator's slack is not counted.
struct memory_estimate {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;
  int64_t activations = 0;
  int64_t working = 0;
  int64_t workspace = 0;
  int64_t total() const {
    return parameters + gradients + optimizer + activations + working + workspace;
  }
};

memory_estimate estimate_memory(int64_t parameter_elements, double optimizer_state,
                                int64_t activation_bytes, std::size_t shard_ways = 1);

/// Bytes a stage holding layers [begin, end) of `layers` keeps per stashed micro-batch, at the
/// profile's samples: each layer's retained_bytes (its output_bytes where that was not
/// measured) less what its layers after the first free of their inputs (freed_input_bytes)
/// and its input (the previous layer's output, or the first layer's input_bytes).
double kept_bytes(const std::vector<layer_profile>& layers, std::size_t begin, std::size_t end);

/// Activation bytes stage `stage` of `plan` holds at its peak, following its program: a
/// forward stashes what its chunk's part of `cut` keeps (kept_bytes, times `samples_scale`),
/// a whole backward frees it, a split B adds what W will read (the part's weight_kept_bytes;
/// none for the model's first part, whose B computes nothing) and its W frees both. Under
/// recomputation an entry keeps its part's input alone until its backward rebuilds it whole
/// (except_last: all but each step's last micro-batch).
double stashed_bytes(const std::vector<layer_profile>& layers, const partition& cut,
                     const schedule& plan, std::size_t stage, double samples_scale,
                     recompute_mode recompute = recompute_mode::never,
                     std::size_t microbatches = 1);

/// How far the peak of a stage holding layers [begin, end) rises above its full stash (at the
/// profile's samples): while one micro-batch's layer runs, the micro-batch holds what its layers
/// up to that one keep (kept_bytes of them; in the backward without its output where the next
/// layer freed it) and the layer needs its forward_working_bytes or backward_working_bytes
/// (with its output's gradient, alive while its backward runs, and the stage's, which lives
/// until the stage's backward ends); the
/// largest of these less the micro-batch's kept_bytes, at least 0. What the profile did not
/// measure (-1: hand-made costs) counts 0. The model's last stage, recomputing, runs its first
/// forward without autograd while its stash holds inputs alone: a layer's
/// no_grad_forward_bytes then, with its input where that is a layer's of the stage; other
/// stages build the graph and drop it, which the stash's rebuilt micro-batch covers.
double working_bytes(const std::vector<layer_profile>& layers, std::size_t begin, std::size_t end,
                     recompute_mode recompute = recompute_mode::never);

/// What stage `stage` of `plan` holds at its peak: its parameters (from `layers`' counts), their
/// gradients, the optimizer's state, stashed_bytes, its working set (the program walked as
/// stashed_bytes walks it, each action's working set, a part's working_bytes or for a split B
/// that less what it has yet to keep for W, beside what the stage holds during that action;
/// times `samples_scale`; the most of that less the stash's peak) and the workspaces of a device
/// like the profiled one: the largest workspace_bytes of each chunk's layers, summed over the
/// stage's chunks (each chunk on a stream of its own, pipeline_options::chunk_streams).
memory_estimate stage_memory(const std::vector<layer_profile>& layers, const partition& cut,
                             const schedule& plan, std::size_t stage, double samples_scale,
                             double optimizer_state,
                             recompute_mode recompute = recompute_mode::never,
                             std::size_t microbatches = 1);

/// Charges each recomputed backward in `costs` (one per virtual stage) its forward again: every
/// micro-batch's (always), all but the last of `microbatches` (except_last, as a mean), none
/// (never).
void charge_recomputation(std::vector<action_costs>& costs, recompute_mode recompute,
                          std::size_t microbatches);

/// The largest micro-batch of `batch` samples cut into `microbatches` (tensor_split: the first
/// parts take the remainder), the size a profile for that count is taken at.
int64_t largest_microbatch(int64_t batch, std::size_t microbatches);

/// The (threads, micro-batch samples) pairs rank_layouts needs costs for, in the order a
/// profiler should take them.
std::vector<std::pair<std::size_t, int64_t>> costs_needed(const layer_list& layers,
                                                          const layout_space& space);

/// Simulates every layout of `space`, each with the costs measured at its thread count and
/// micro-batch size (the nearest measured size, scaled linearly, when that one was not
/// measured), and returns them fastest first, layouts over a memory cap after all that fit;
/// ties go to fewer stages, then fewer micro-batches. Throws invalid_argument when `costs` has
/// nothing at a thread count the space needs or no layout applies.
std::vector<layout> rank_layouts(const layer_list& layers, const std::vector<measured_costs>& costs,
                                 const layout_space& space);

} // namespace actorpipe
