/// \file
/// Choosing a model, a pipeline's cut and its schedule from a program's settings, with per-layer
/// profiles where asked for (`--partition time`, `--schedule auto`): what `actorpipe train`,
/// `plan` and `bench` share. The flags that fill these settings are cli/flags.hpp's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <actorpipe/data.hpp>
#include <actorpipe/images.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/models.hpp>
#include <actorpipe/partition.hpp>
#include <actorpipe/pipeline.hpp>
#include <actorpipe/planner.hpp>
#include <actorpipe/profile.hpp>
#include <actorpipe/schedule.hpp>

namespace actorpipe::training {

/// What model and data a command uses.
struct model_args {
  std::string data = "fashion-mnist";
  std::string model;
  int64_t batch = 0;
  /// Synthetic data and image folders: the images' side.
  int64_t image = 128;
  int64_t classes = 0;
  /// Image folders: 3 (RGB) or 1 (grey) channels, and what to do with a file that is not an
  /// image ("fail" or "skip").
  int64_t channels = 3;
  std::string bad_images = "fail";
  uint64_t seed = 0;
  bool deferred_batch_norm = false;
  /// ResNets: one layer per residual block (model_options::block_layers).
  bool block_layers = false;
  /// gpt: sizes (0: the defaults below) and dropout; the vocabulary comes from the text (or
  /// --classes, else 64, for synthetic tokens).
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t width = 0;
  int64_t context = 0;
  double dropout = 0;
  int64_t vocabulary = 0;
  /// A PT2 archive's cut into layers (--segments).
  std::string segments = "auto";
};

/// The gpt sizes `actorpipe train --model gpt` takes when no flag says otherwise: 4 blocks of 4
/// heads, width 128, context 64 (a character model of about 0.8 M parameters).
inline constexpr int64_t default_gpt_layers = 4;
inline constexpr int64_t default_gpt_heads = 4;
inline constexpr int64_t default_gpt_width = 128;
inline constexpr int64_t default_gpt_context = 64;

/// True when --model names a model file written in Python rather than a built-in model: a name
/// ending in ".pt", ".pth" (TorchScript) or ".pt2" (a PT2 archive of torch.export), or
/// containing '/'. Which of the two it is, the file's contents say (load_model_file).
bool is_model_file(const std::string& model);

/// The path of `--data tensors:PATH`, or an empty string for other data.
std::string tensor_file_of(const std::string& data);

/// The folder of `--data images:DIR`, or an empty string for other data.
std::string image_folder_of(const std::string& data);

/// A built model with its input shape.
struct model_setup {
  std::string name;
  model_options options;
  layer_list layers;
  int64_t batch = 0;
  /// A model file's bytes (TorchScript or a PT2 archive: what nodes receive); empty for a
  /// built-in model.
  std::string model_file;
  /// A PT2 archive's cut into layers (--segments: exported_options::segments).
  std::string segments = "auto";
  /// Real inputs [batch, ...] to profile with, when the data gives them (tensor files).
  torch::Tensor example;
  /// --data tensors:PATH: the file's inputs and targets (empty otherwise).
  dataset file;
  /// --data images:DIR: the folder's files and classes (empty otherwise).
  image_folder images;

  /// A random batch shaped like the real one (token ids for a language model), or the tensor
  /// file's first batch.
  torch::Tensor sample() const;
  /// The model again, with modules of its own: a built-in one drawn after
  /// torch::manual_seed(seed), a model file's from its bytes (`seed` unused).
  layer_list fresh(uint64_t seed) const;
  /// A language model (inputs are token ids [N, context], outputs logits per token).
  bool language_model() const { return name == "gpt"; }
};

/// The model a run trains: --model, else the data's own (cnn for Fashion-MNIST, gpt for text,
/// resnet50 for synthetic data).
std::string model_name(const model_args& args);

/// The optimizer `actorpipe train` takes where no flag names one: Adam for the gpt; else SGD with
/// momentum 0.9, or plain SGD on streams (synthetic data, tensor files). `actorpipe plan` counts
/// its state by the same rule.
struct default_optimizer {
  bool adam = false;
  /// SGD's momentum, when SGD is the default or given without --momentum.
  double momentum = 0;
  /// The fp32 tensors it keeps per parameter (planning_args::optimizer_state).
  double state_tensors() const { return adam ? 2.0 : momentum > 0 ? 1.0 : 0.0; }
};
default_optimizer default_optimizer_for(const model_args& args);

/// Throws invalid_argument when --model cannot train on --data (before any data is read).
void check_model_fits_data(const model_args& args);

/// Builds the model (parameters drawn after torch::manual_seed(seed)), or loads a model file
/// (load_model_file: TorchScript or a PT2 archive).
model_setup build_model(const model_args& args);

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

/// A run's plan, built once: what the planner chose, and the pipeline options that carry it.
struct run_plan {
  plan_choice choice;
  pipeline_options options;
};

/// Plans a run (choose_plan) and sets the plan into the caller's settings `base`
/// (pipeline_options_for): the one place where `actorpipe train` and the Python module plan.
run_plan plan_run(const layer_list& layers, const torch::Tensor& batch, const planning_args& args,
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
