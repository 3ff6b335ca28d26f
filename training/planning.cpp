#include "training/planning.hpp"

#include <cstdio>
#include <iostream>
#include <limits>
#include <thread>

#include <ATen/Parallel.h>
#include <actorpipe/memory.hpp>
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

std::string model_name(const model_args& m) {
  return !m.model.empty()        ? m.model
         : m.data == "synthetic" ? "resnet50"
         : m.data == "text"      ? "gpt"
                                 : "cnn";
}

void check_model_fits_data(const model_args& m) {
  if (m.model.empty()) {
    return; // the data's own model
  }
  bool resnet = m.model.rfind("resnet", 0) == 0;
  bool gpt = m.model == "gpt";
  ACTORPIPE_CHECK(m.data != "fashion-mnist" || (!resnet && !gpt),
                  "--data fashion-mnist takes 1x28x28 images: use --model cnn or mlp (ResNets "
                  "train on --data synthetic, gpt on --data text or synthetic)");
  ACTORPIPE_CHECK(m.data != "text" || gpt,
                  "--data text trains a language model: use --model gpt (not ", m.model, ")");
}

model_setup build_model(const model_args& m) {
  model_setup setup;
  setup.name = model_name(m);
  check_model_fits_data(m);
  bool resnet = setup.name.rfind("resnet", 0) == 0;
  bool gpt = setup.name == "gpt";
  ACTORPIPE_CHECK(m.batch >= 0, "--batch (", m.batch, ") must be >= 1");
  ACTORPIPE_CHECK(m.image >= 1, "--image (", m.image, ") must be >= 1");
  setup.options.in_channels = resnet ? 3 : 1;
  setup.options.image_size = resnet ? m.image : 28;
  setup.options.num_classes =
    m.classes > 0 && m.data == "synthetic" ? m.classes : (resnet ? 1000 : 10);
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
  return setup;
}

torch::Tensor model_setup::sample() const {
  // A generator of its own: profiling must not shift the data drawn from the global one.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(12345);
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
