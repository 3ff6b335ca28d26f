#include "training/planning.hpp"

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <thread>

#include <ATen/Parallel.h>
#include <actorpipe/data.hpp>
#include <actorpipe/memory.hpp>
#include <actorpipe/torchscript.hpp>
#include <torch/torch.h>

namespace actorpipe::training {
namespace {

partition cut_for(const layer_list& layers, const std::string& spec, std::size_t parts,
                  const std::vector<layer_profile>& profile) {
  if (spec == "time") {
    return partition_by_time(profile, parts);
  }
  return parse_partition(spec, layers, parts);
}

// Profiles as a stage thread runs: with its intra-op threads and its memory (cold memory would
// charge page faults to the layers with the largest activations and skew a time-balanced cut).
std::vector<layer_profile> profile_at(const layer_list& layers, const torch::Tensor& batch,
                                      int64_t samples, std::size_t threads, bool warm) {
  memory::warm_memory_scope memory(warm);
  auto previous = at::get_num_threads();
  at::set_num_threads(static_cast<int>(threads));
  auto profile = profile_layers(layers, batch.slice(0, 0, samples));
  at::set_num_threads(previous);
  return profile;
}

} // namespace

bool is_torchscript_model(const std::string& model) {
  auto ends_with = [&](const std::string& suffix) {
    return model.size() > suffix.size() &&
           model.compare(model.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends_with(".pt") || ends_with(".pth") || model.find('/') != std::string::npos;
}

std::string tensor_file_of(const std::string& data) {
  const std::string prefix = "tensors:";
  return data.rfind(prefix, 0) == 0 ? data.substr(prefix.size()) : std::string{};
}

std::string image_folder_of(const std::string& data) {
  const std::string prefix = "images:";
  return data.rfind(prefix, 0) == 0 ? data.substr(prefix.size()) : std::string{};
}

std::string model_name(const model_args& m) {
  return !m.model.empty()                   ? m.model
         : m.data == "synthetic"            ? "resnet50"
         : m.data == "text"                 ? "gpt"
         : !image_folder_of(m.data).empty() ? "resnet18"
                                            : "cnn";
}

void check_model_fits_data(const model_args& m) {
  const bool tensors = !tensor_file_of(m.data).empty();
  ACTORPIPE_CHECK(m.data != "tensors:", "--data tensors:PATH needs the file's path");
  ACTORPIPE_CHECK(m.data != "images:", "--data images:DIR needs the folder's path");
  const bool images = !image_folder_of(m.data).empty();
  if (m.model.empty()) {
    ACTORPIPE_CHECK(!tensors, "--data ", m.data,
                    " has no model of its own: give --model (a TorchScript file, e.g. "
                    "model.pt, or a built-in model)");
    return; // the data's own model
  }
  if (is_torchscript_model(m.model)) {
    ACTORPIPE_CHECK(tensors || images || m.data == "fashion-mnist", "--model ", m.model,
                    " (a TorchScript file) trains on --data tensors:PATH (its inputs and targets, "
                    "docs/from-pytorch.md), images:DIR or fashion-mnist, not ",
                    m.data);
    return;
  }
  bool gpt = m.model == "gpt";
  ACTORPIPE_CHECK((m.data != "fashion-mnist" && !images) || !gpt, "--data ", m.data,
                  " holds images: train gpt on --data text or synthetic");
  ACTORPIPE_CHECK(m.data != "text" || gpt,
                  "--data text trains a language model: use --model gpt (not ", m.model, ")");
}

namespace {

// An image folder's files and classes (the model's outputs), with its skipped files reported.
void scan_images(model_setup& setup, const model_args& m) {
  auto dir = image_folder_of(m.data);
  if (dir.empty()) {
    return;
  }
  ACTORPIPE_CHECK(m.bad_images == "fail" || m.bad_images == "skip", "--bad-images '", m.bad_images,
                  "' is not fail or skip");
  ACTORPIPE_CHECK(m.channels == 1 || m.channels == 3, "--channels (", m.channels,
                  ") must be 1 (grey) or 3 (RGB)");
  setup.images = scan_image_folder(dir, m.bad_images == "skip" ? bad_image_policy::skip
                                                               : bad_image_policy::fail);
  for (const auto& why : setup.images.skipped) {
    std::cerr << "warning: " << why << " (left out: --bad-images skip)\n";
  }
}

// A tensor file's first batch is what the model sees: profiles take it (any shape, any dtype).
void take_example(model_setup& setup, const model_args& m) {
  auto path = tensor_file_of(m.data);
  if (path.empty()) {
    return;
  }
  setup.file = load_tensor_file(path);
  auto rows = torch::arange(setup.batch, torch::kLong).remainder(setup.file.size());
  setup.example = setup.file.images.index({rows});
}

} // namespace

model_setup build_model(const model_args& m) {
  model_setup setup;
  setup.name = model_name(m);
  check_model_fits_data(m);
  if (is_torchscript_model(setup.name)) {
    ACTORPIPE_CHECK(m.batch >= 0, "--batch (", m.batch, ") must be >= 1");
    std::ifstream in(setup.name, std::ios::binary);
    ACTORPIPE_CHECK(in.good(), "--model ", setup.name,
                    ": cannot read the file (a TorchScript model is a path ending in .pt)");
    setup.torchscript.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    setup.layers = load_torchscript_bytes(setup.torchscript, "--model " + setup.name);
    setup.batch = m.batch > 0 ? m.batch : (m.data == "fashion-mnist" ? 64 : 32);
    take_example(setup, m);
    scan_images(setup, m);
    if (!setup.images.classes.empty()) {
      setup.options.in_channels = m.channels;
      setup.options.image_size = m.image;
    }
    return setup;
  }
  bool resnet = setup.name.rfind("resnet", 0) == 0;
  bool gpt = setup.name == "gpt";
  ACTORPIPE_CHECK(m.batch >= 0, "--batch (", m.batch, ") must be >= 1");
  ACTORPIPE_CHECK(m.image >= 1, "--image (", m.image, ") must be >= 1");
  // Synthetic data: the ResNets take RGB images of --image pixels and 1000 classes, as on
  // ImageNet. Fashion-MNIST: 1x28x28 images of 10 classes, the ResNets with a small-image stem.
  // An image folder: --channels x --image x --image images of its classes, the ResNets with the
  // small-image stem up to 64 pixels.
  const bool fashion = m.data == "fashion-mnist";
  setup.options.in_channels = resnet && !fashion ? 3 : 1;
  setup.options.image_size = resnet && !fashion ? m.image : 28;
  setup.options.num_classes =
    m.classes > 0 && m.data == "synthetic" ? m.classes : (resnet && !fashion ? 1000 : 10);
  setup.options.small_stem = resnet && fashion;
  scan_images(setup, m);
  if (!setup.images.classes.empty()) {
    setup.options.in_channels = m.channels;
    setup.options.image_size = m.image;
    setup.options.num_classes = static_cast<int64_t>(setup.images.classes.size());
    setup.options.small_stem = resnet && m.image <= 64;
  }
  setup.batch = m.batch > 0 ? m.batch : gpt ? 32 : (m.data == "synthetic" ? 120 : 64);
  setup.options.deferred_batch_norm = m.deferred_batch_norm;
  if (gpt) {
    auto pick = [](int64_t flag, int64_t fallback) { return flag > 0 ? flag : fallback; };
    setup.options.vocabulary = pick(m.vocabulary, pick(m.classes, 64));
    setup.options.layers = pick(m.layers, default_gpt_layers);
    setup.options.heads = pick(m.heads, default_gpt_heads);
    setup.options.width = pick(m.width, default_gpt_width);
    setup.options.context = pick(m.context, default_gpt_context);
    setup.options.dropout = m.dropout;
  }
  torch::manual_seed(m.seed);
  setup.layers = make_model(setup.name, setup.options);
  take_example(setup, m);
  return setup;
}

layer_list model_setup::fresh(uint64_t seed) const {
  if (!torchscript.empty()) {
    return load_torchscript_bytes(torchscript, "--model " + name);
  }
  torch::manual_seed(seed);
  return make_model(name, options);
}

torch::Tensor model_setup::sample() const {
  // A generator of its own: profiling must not shift the data drawn from the global one.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(12345);
  if (example.defined()) {
    return example;
  }
  if (language_model()) {
    return torch::randint(options.vocabulary, {batch, options.context}, generator, torch::kLong);
  }
  return torch::randn({batch, options.in_channels, options.image_size, options.image_size},
                      generator);
}

std::size_t threads_per_stage(std::size_t stages, std::size_t flag) {
  if (flag > 0) {
    return flag;
  }
  auto cores = std::max(1u, std::thread::hardware_concurrency());
  return std::max<std::size_t>(1, cores / std::max<std::size_t>(1, stages));
}

plan_choice choose_plan(const layer_list& layers, const torch::Tensor& batch,
                        const planning_args& a, bool always_profile) {
  auto batch_size = batch.size(0);
  bool automatic = a.schedule == "auto";
  ACTORPIPE_CHECK(automatic || a.microbatches >= 1, "microbatches (", a.microbatches,
                  ") must be >= 1 (0 only with --schedule auto)");
  ACTORPIPE_CHECK(a.stages >= 1, "stages (", a.stages, ") must be >= 1");
  plan_choice choice;
  choice.microbatches = a.microbatches;
  choice.chunks = a.chunks;
  auto threads = threads_per_stage(a.stages, a.threads);
  bool need_profile = always_profile || automatic || a.partition == "time";
  auto reference_m = static_cast<int64_t>(a.microbatches > 0 ? a.microbatches : 4);
  choice.profiled_samples = std::max<int64_t>(1, batch_size / reference_m);
  if (need_profile) {
    choice.profile = profile_at(layers, batch, choice.profiled_samples, threads, !a.cold_memory);
  }
  if (a.schedule.rfind("file:", 0) == 0) {
    choice.custom = load_schedule(a.schedule.substr(5));
    choice.schedule_name = a.schedule;
    choice.chunks = chunks_of(choice.custom);
    choice.cut = cut_for(layers, a.partition, a.stages * choice.chunks, choice.profile);
    return choice;
  }
  if (!automatic) {
    choice.kind = parse_schedule_kind(a.schedule);
    choice.schedule_name = a.schedule;
    choice.cut = cut_for(layers, a.partition, a.stages * a.chunks, choice.profile);
    return choice;
  }
  // auto: simulate every built-in schedule (and micro-batch count when not fixed) with the
  // profiled costs, scaled to each micro-batch size, and keep the fastest within --max-stash.
  std::vector<std::size_t> counts;
  if (a.microbatches > 0) {
    counts.push_back(a.microbatches);
  } else {
    for (std::size_t m = 1; m <= 64 && static_cast<int64_t>(m) <= batch_size; m *= 2) {
      counts.push_back(m);
    }
  }
  std::printf("schedule auto: simulated with per-layer costs profiled at %lld samples\n",
              static_cast<long long>(choice.profiled_samples));
  std::printf("  %-12s %6s %6s %12s %8s %10s\n", "schedule", "chunks", "m", "makespan ms", "bubble",
              "max stash");
  double best = std::numeric_limits<double>::infinity();
  for (auto m : counts) {
    auto scale = static_cast<double>(batch_size) / static_cast<double>(m) /
                 static_cast<double>(choice.profiled_samples);
    for (auto kind : {schedule_kind::gpipe, schedule_kind::one_f_one_b, schedule_kind::zb_h1,
                      schedule_kind::interleaved}) {
      std::size_t v = kind == schedule_kind::interleaved ? std::max<std::size_t>(2, a.chunks) : 1;
      if (a.stages * v > layers.size() ||
          (kind == schedule_kind::interleaved && (a.stages < 2 || m % a.stages != 0))) {
        continue;
      }
      auto cut = cut_for(layers, a.partition, a.stages * v, choice.profile);
      auto plan = make_schedule(kind, a.stages, m, v);
      auto sim = simulate(plan, m, costs_of(choice.profile, cut, scale));
      auto stash = *std::max_element(sim.peak_stash.begin(), sim.peak_stash.end());
      bool fits = a.max_stash <= 0 || stash <= a.max_stash;
      std::printf("  %-12s %6zu %6zu %12.1f %7.1f%% %10.2f%s\n", to_string(kind).c_str(), v, m,
                  sim.makespan, 100 * sim.mean_bubble(), stash, fits ? "" : "  (over --max-stash)");
      if (fits && sim.makespan < best) {
        best = sim.makespan;
        choice.kind = kind;
        choice.schedule_name = to_string(kind);
        choice.microbatches = m;
        choice.chunks = v;
        choice.cut = cut;
      }
    }
  }
  ACTORPIPE_CHECK(best < std::numeric_limits<double>::infinity(),
                  "--schedule auto: no schedule fits --max-stash ", a.max_stash);
  std::printf("  chosen: %s, %zu micro-batches, %zu chunk(s), cut %s\n",
              choice.schedule_name.c_str(), choice.microbatches, choice.chunks,
              choice.cut.to_string().c_str());
  std::fflush(stdout);
  return choice;
}

pipeline_options pipeline_options_for(const plan_choice& choice, const planning_args& args) {
  pipeline_options po;
  po.microbatches = choice.microbatches;
  po.schedule = choice.kind;
  po.chunks = choice.chunks;
  po.custom_schedule = choice.custom;
  po.threads_per_stage = args.threads;
  po.warm_memory = !args.cold_memory;
  return po;
}

} // namespace actorpipe::training
