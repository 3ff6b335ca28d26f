/// \file
/// Planning a pipeline's layout for a model from a program's settings: its cut, its schedule,
/// micro-batches, chunks, recomputation and threads, with per-layer profiles where asked for
/// (`--partition time`, `--schedule auto`) and the planner's ranking where anything is automatic;
/// projections onto other machines. What `actorpipe train`, `plan` and `bench` share; the flags
/// that fill these settings are cli/flags.hpp's, the model they plan for is model_setup.hpp's, and
/// a training run's plan (settings in, pipeline out) is run_plan.hpp's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <actorpipe/layers.hpp>
#include <actorpipe/partition.hpp>
#include <actorpipe/pipeline.hpp>
#include <actorpipe/planner.hpp>
#include <actorpipe/profile.hpp>
#include <actorpipe/schedule.hpp>

namespace actorpipe::training {

struct planning_args {
  /// 0: chosen by the planner (--stages auto), from 1 up to max_stages.
  std::size_t stages = 2;
  /// --stages auto: the most stages to try (0: the cores, at most the layers).
  std::size_t max_stages = 0;
  /// 0: chosen by the planner (--schedule auto, --stages auto).
  std::size_t microbatches = 4;
  std::size_t chunks = 1;
  /// A built-in schedule's name (known_schedules()), auto, or file:PATH.
  std::string schedule = "1f1b";
  /// uniform, params, time, or cut:I,J.
  std::string partition = "uniform";
  /// Which of --schedule, --partition and --microbatches the user gave: with --stages auto the
  /// others are chosen too.
  bool stages_given = false;
  bool schedule_given = false;
  bool partition_given = false;
  bool microbatches_given = false;
  /// Memory caps for the planner: most micro-batches a stage may stash, most activation bytes
  /// a stage may keep (0: no limit).
  double max_stash = 0;
  int64_t max_stash_bytes = 0;
  /// The most bytes a stage may hold at its peak, predicted (--max-memory; 0: no limit), and
  /// the fp32 tensors the optimizer keeps per parameter (layout_space::optimizer_state; below 0:
  /// not known, counted as 0; `actorpipe plan` takes the train command's default for the model).
  int64_t max_memory_bytes = 0;
  double optimizer_state = -1;
  /// --recompute: never, except_last or always. Not given (recompute_given false) under a byte
  /// cap (--max-memory, --max-stash in bytes), the planner tries every mode and keeps the
  /// fastest layout that fits.
  std::string recompute = "never";
  bool recompute_given = false;
  /// Intra-op threads per stage (0: cores / stages); threads_auto: the planner tries each
  /// count that fits the cores.
  std::size_t threads = 0;
  bool threads_auto = false;
  /// Stage threads use libtorch's allocator instead of the warm-memory cache.
  bool cold_memory = false;
  /// Timed profile rounds per layer (medians are kept).
  int profile_repeats = 5;
  /// --devices: stage i's device. With --stages auto the planner places at most this many
  /// stages, stage i on the i-th device, and profiles the layers on the first (the devices
  /// alike); --partition time profiles there too.
  std::vector<c10::Device> devices;
  c10::Device profile_device() const {
    return devices.empty() ? c10::Device(c10::kCPU) : devices.front();
  }

  /// True when the planner chooses the stages or threads (--stages auto, --threads auto).
  bool layout_auto() const { return stages == 0 || threads_auto; }
  /// True when the planner chooses anything (--stages, --schedule or --threads auto).
  bool automatic() const { return layout_auto() || schedule == "auto"; }
};

/// What to run.
struct plan_choice {
  partition cut;
  schedule_kind kind = schedule_kind::one_f_one_b;
  std::string schedule_name;
  /// Set for file: schedules.
  schedule custom;
  std::size_t microbatches = 1;
  std::size_t chunks = 1;
  recompute_mode recompute = recompute_mode::never;
  /// Intra-op threads per stage (0: as the flags say).
  std::size_t threads = 0;
  /// Per-layer costs at the chosen micro-batch size (empty unless something needed them).
  std::vector<layer_profile> profile;
  /// Micro-batch size the profile was taken at.
  int64_t profiled_samples = 0;
  /// The planner's ranking, fastest first (empty when nothing was automatic).
  std::vector<layout> ranking;

  std::size_t stages() const { return cut.stages() / std::max<std::size_t>(1, chunks); }
  /// Which part of the cut each stage's chunks hold.
  chunk_placement placement() const {
    return custom.empty() ? placement_of(kind) : custom.placement;
  }
};

/// The planner's space for `layers`, a batch of `batch` samples and the flags.
layout_space layout_space_for(const layer_list& layers, int64_t batch, const planning_args& args);

/// Profiles `layers` at every (threads, samples) pair `space` needs, as stage threads run them
/// (intra-op threads, warm memory unless `cold`), printing progress to stderr when `progress`.
std::vector<measured_costs> measure_costs(const layer_list& layers, const torch::Tensor& batch,
                                          const layout_space& space, const planning_args& args,
                                          bool progress);

/// Prints a ranking: its first `rows` layouts, then the fastest single stage if it is not among
/// them, and how many layouts exceed the memory caps.
void print_ranking(const std::vector<layout>& ranking, std::size_t rows = 10);

/// A projection onto other machines (`actorpipe plan --devices`): devices that each compute as
/// one stage of this machine does at args.threads threads, joined by a link.
struct projection_args {
  std::vector<std::size_t> devices;
  double link_gbps = 0;
  double link_latency_ms = 0;
  /// The most micro-batches per replica and step.
  std::size_t max_microbatches = 1024;
};

/// The fastest layout found for one device count, and how long ranking took.
struct projection_row {
  std::size_t devices = 0;
  bool found = false;
  layout best;
  /// The fastest with every device a stage (no replicas), when the model has that many layers.
  bool pipeline_found = false;
  layout pipeline;
  std::size_t layouts = 0;
  double ranking_ms = 0;
};

/// A projection: the per-device threads and profiled micro-batch size, and a row per device
/// count (1 first).
struct projection {
  std::size_t threads = 1;
  int64_t samples = 1;
  std::vector<projection_row> rows;
};

/// Profiles `layers` once (at args.threads, default 1, on micro-batches of batch / the
/// --microbatches flag) and, for 1 device and each count of `p.devices`, ranks every stages x
/// replicas == devices layout (each replica's batch cut into micro-batches of the profiled
/// size) with the link's transfer and all-reduce times (rank_layouts), returning the fastest
/// of each, and the fastest with every device a stage.
projection project(const layer_list& layers, const torch::Tensor& batch, const planning_args& args,
                   const projection_args& p);

/// Resolves the flags for `layers` and a batch shaped like `batch` (whose first dimension is the
/// batch size). Profiles the layers (on the calling thread, with the stages' thread count) when
/// --partition time needs it; when anything is automatic (args.automatic()), ranks the layouts
/// the flags leave open (rank_layouts) with costs profiled at each thread count and micro-batch
/// size, prints the ranking and takes the fastest that fits the memory caps.
plan_choice choose_plan(const layer_list& layers, const torch::Tensor& batch,
                        const planning_args& args, bool always_profile = false);

/// `base` (the caller's settings: timeouts, clipping, placement) with the choice's fields set
/// (micro-batches, schedule, chunks, recomputation), the flags' threads per stage and memory,
/// and the devices of the chosen stages (args.devices, in order); loss and optimizer are the
/// caller's.
pipeline_options pipeline_options_for(const plan_choice& choice, const planning_args& args,
                                      pipeline_options base = {});

/// The threads each stage gets for `stages` stage actors and the --threads flag.
std::size_t threads_per_stage(std::size_t stages, std::size_t flag);

/// A device list (`setting` names it in messages: --devices, or the Python module's devices) as
/// devices. With --stages auto they are the devices the planner may place stages on (one stage
/// each, in order; profiled on the first), so a GPU listed twice is refused: two stages sharing
/// it would not run side by side as the planner assumes; so is --threads auto with GPUs.
std::vector<c10::Device> parse_devices(const std::vector<std::string>& names,
                                       const planning_args& plan,
                                       const std::string& setting = "--devices");

} // namespace actorpipe::training
