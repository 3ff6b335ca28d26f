#include "training/planning.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <thread>

#include <unistd.h>

#include <ATen/Parallel.h>
#include <actorpipe/memory.hpp>
#include <torch/torch.h>

namespace actorpipe::training {
namespace {

// Threads that keep the other cores busy while a profile runs on fewer threads than the machine
// has, as the other stages of a pipeline do: two one-thread stages on two cores each run
// slower than one of them alone (shared caches, memory bandwidth, SMT siblings), and costs
// measured on an idle machine predicted a 2-stage ResNet-50 step 27% too short.
class busy_neighbours {
public:
  explicit busy_neighbours(std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
      threads_.emplace_back([this] {
        at::set_num_threads(1);
        torch::NoGradGuard no_grad;
        // A convolution's mix: matrix products on data far larger than the caches.
        auto input = torch::randn({8, 64, 56, 56});
        auto weight = torch::randn({64, 64, 3, 3}) * 0.05;
        while (!stop_.load(std::memory_order_relaxed)) {
          input = torch::conv2d(input, weight, {}, 1, 1).tanh_();
        }
      });
    }
  }
  ~busy_neighbours() {
    stop_ = true;
    for (auto& t : threads_) {
      t.join();
    }
  }
  busy_neighbours(const busy_neighbours&) = delete;
  busy_neighbours& operator=(const busy_neighbours&) = delete;

private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

std::size_t cores() {
  return std::max(1u, std::thread::hardware_concurrency());
}

// The calling thread measures as a stage thread runs: with its intra-op threads, its memory (cold
// memory would charge page faults to the layers with the largest activations and skew a
// time-balanced cut) and busy neighbours on the cores it leaves (`machine_cores`; 0: none).
class as_a_stage {
public:
  as_a_stage(std::size_t threads, bool warm, std::size_t machine_cores)
    : memory_(warm), neighbours_(machine_cores > threads ? machine_cores - threads : 0),
      previous_threads_(at::get_num_threads()) {
    at::set_num_threads(static_cast<int>(threads));
  }
  ~as_a_stage() { at::set_num_threads(previous_threads_); }
  as_a_stage(const as_a_stage&) = delete;
  as_a_stage& operator=(const as_a_stage&) = delete;

private:
  memory::warm_memory_scope memory_;
  busy_neighbours neighbours_;
  int previous_threads_;
};

// On a GPU the stage's kernels, not its host threads, take the time: profiled there, on the
// calling thread as it is.
std::vector<layer_profile> profile_at(const layer_list& layers, const torch::Tensor& batch,
                                      int64_t samples, std::size_t threads, bool warm, int repeats,
                                      bool split_backward, std::size_t machine_cores = 0,
                                      c10::Device device = c10::Device(c10::kCPU)) {
  profile_options options;
  options.repeats = repeats;
  options.split_backward = split_backward;
  options.device = device;
  if (device.is_cuda()) {
    return profile_layers(layers, batch.slice(0, 0, samples), options);
  }
  as_a_stage stage(threads, warm, machine_cores);
  return profile_layers(layers, batch.slice(0, 0, samples), options);
}

// The optimizer step's memory traffic at `threads`, beside busy neighbours (its scratch tensors
// are allocated before the timing: memory is not warmed); on a GPU, its kernels there.
double update_at(const layer_list& layers, std::size_t threads, std::size_t machine_cores = 0,
                 c10::Device device = c10::Device(c10::kCPU)) {
  if (device.is_cuda()) {
    return profile_update(layers, 3, device);
  }
  as_a_stage stage(threads, /*warm=*/false, machine_cores);
  return profile_update(layers);
}

} // namespace

std::vector<c10::Device> parse_devices(const std::vector<std::string>& names,
                                       const planning_args& plan, const std::string& setting) {
  std::vector<c10::Device> devices;
  for (const auto& d : names) {
    try {
      devices.emplace_back(d);
    } catch (const std::exception&) {
      throw invalid_argument(
        detail::concat(setting, ": '", d, "' is no device (cpu, cuda or cuda:N)"));
    }
  }
  if (!devices.empty() && plan.layout_auto()) {
    ACTORPIPE_CHECK(!plan.threads_auto || !devices.front().is_cuda(),
                    "--threads auto tries thread counts on this machine's cores: with stages on "
                    "GPUs (",
                    setting, ") leave it out");
    for (std::size_t i = 0; i < devices.size(); ++i) {
      for (std::size_t j = 0; j < i; ++j) {
        ACTORPIPE_CHECK(!devices[i].is_cuda() || devices[i] != devices[j],
                        "--stages auto: ", devices[i].str(), " is listed twice in ", setting,
                        "; the planner puts one stage on each device (stages sharing a GPU do "
                        "not run side by side): list each GPU once, or give --stages");
      }
    }
  }
  return devices;
}

std::size_t threads_per_stage(std::size_t stages, std::size_t flag) {
  if (flag > 0) {
    return flag;
  }
  return std::max<std::size_t>(1, cores() / std::max<std::size_t>(1, stages));
}

namespace {

// The memory caps of `a` and what they weigh (the optimizer's state), and the recomputation
// modes the planner compares: the user's, or every mode under a byte cap when --recompute was
// left out.
void set_memory_caps(layout_space& space, const planning_args& a) {
  space.max_stash = a.max_stash;
  space.max_stash_bytes = a.max_stash_bytes;
  space.max_memory_bytes = a.max_memory_bytes;
  space.optimizer_state = std::max(0.0, a.optimizer_state);
  if (!a.recompute_given && (a.max_memory_bytes > 0 || a.max_stash_bytes > 0)) {
    space.recompute = {recompute_mode::never, recompute_mode::except_last, recompute_mode::always};
  } else {
    space.recompute = {parse_recompute_mode(a.recompute)};
  }
}

} // namespace

layout_space layout_space_for(const layer_list& layers, int64_t batch, const planning_args& a) {
  layout_space space;
  space.batch = batch;
  space.cores = cores();
  bool stages_auto = a.stages == 0;
  space.stage_counts.clear();
  if (stages_auto) {
    auto most = a.max_stages > 0 ? a.max_stages : space.cores;
    if (!a.devices.empty()) {
      most = std::min(a.max_stages > 0 ? a.max_stages : a.devices.size(), a.devices.size());
    }
    for (std::size_t s = 1; s <= std::min(most, layers.size()); ++s) {
      space.stage_counts.push_back(s);
    }
  } else {
    space.stage_counts.push_back(a.stages);
  }
  space.thread_counts.clear();
  if (a.threads_auto) {
    for (std::size_t t = 1; t <= space.cores; ++t) {
      space.thread_counts.push_back(t);
    }
  } else if (a.threads > 0) {
    space.thread_counts.push_back(a.threads);
    space.cores = 0; // the user's count, even past the cores
  }
  space.microbatch_counts.clear();
  if (a.microbatches > 0 && (!stages_auto || a.microbatches_given)) {
    space.microbatch_counts.push_back(a.microbatches);
  } else {
    for (std::size_t m = 1; m <= 64 && static_cast<int64_t>(m) <= batch; m *= 2) {
      space.microbatch_counts.push_back(m);
    }
  }
  space.schedules.clear();
  if (a.schedule == "auto" || (stages_auto && !a.schedule_given)) {
    space.schedules = layout_space{}.schedules; // every built-in one
  } else {
    space.schedules.push_back(parse_schedule_kind(a.schedule));
  }
  space.chunks = std::max<std::size_t>(2, a.chunks);
  if (stages_auto && !a.partition_given) {
    space.partitions = {"uniform", "params", "time"};
  } else {
    space.partitions = {a.partition};
  }
  set_memory_caps(space, a);
  if (a.profile_device().is_cuda() && !a.threads_auto) {
    space.cores = 0; // stages on GPUs do not share the host's cores for their compute
  }
  return space;
}

std::vector<measured_costs> measure_costs(const layer_list& layers, const torch::Tensor& batch,
                                          const layout_space& space, const planning_args& a,
                                          bool progress) {
  bool split = std::any_of(space.schedules.begin(), space.schedules.end(),
                           [](schedule_kind k) { return splits_backward(k); });
  auto needed = costs_needed(layers, space);
  std::vector<measured_costs> costs;
  std::map<std::size_t, double> update_ms; // per thread count, measured once each
  auto started = std::chrono::steady_clock::now();
  progress = progress && isatty(STDERR_FILENO) == 1; // a log gets the closing line only
  for (std::size_t k = 0; k < needed.size(); ++k) {
    auto [threads, samples] = needed[k];
    if (progress) {
      std::fprintf(stderr,
                   "\rprofiling layers: %zu thread(s), %lld samples per micro-batch (%zu of "
                   "%zu)   ",
                   threads, static_cast<long long>(samples), k + 1, needed.size());
      std::fflush(stderr);
    }
    auto update = update_ms.find(threads);
    if (update == update_ms.end()) {
      update =
        update_ms.emplace(threads, update_at(layers, threads, cores(), a.profile_device())).first;
    }
    costs.push_back(
      measured_costs{threads, samples,
                     profile_at(layers, batch, samples, threads, !a.cold_memory, a.profile_repeats,
                                split, cores(), a.profile_device()),
                     update->second});
  }
  if (!needed.empty()) {
    std::fprintf(stderr, "%sprofiled the layers at %zu thread/size pairs in %.1f s%s\n",
                 progress ? "\r" : "", needed.size(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
                 progress ? "                              " : "");
  }
  return costs;
}

void print_ranking(const std::vector<layout>& ranking, std::size_t rows) {
  std::printf("  %4s %6s %7s %4s %-12s %6s %-19s %11s %7s %6s %9s %8s  %s\n", "rank", "stages",
              "threads", "m", "schedule", "chunks", "partition", "step ms", "bubble", "stash",
              "stash MB", "mem MB", "cut");
  auto row = [&](std::size_t i) {
    const auto& l = ranking[i];
    std::printf("  %4zu %6zu %7zu %4zu %-12s %6zu %-19s %11.2f %6.1f%% %6.2f %9.1f %8.1f  %s%s%s\n",
                i + 1, l.stages, l.threads, l.microbatches, to_string(l.schedule).c_str(), l.chunks,
                l.partition_spec.c_str(), l.step_ms, 100 * l.bubble, l.stash,
                static_cast<double>(l.stash_bytes) / 1e6, static_cast<double>(l.memory_bytes) / 1e6,
                l.cut.to_string().c_str(), recompute_suffix(l.recompute).c_str(),
                l.fits ? "" : "  (over the memory cap)");
  };
  std::size_t shown = std::min(rows, ranking.size());
  for (std::size_t i = 0; i < shown; ++i) {
    row(i);
  }
  // Beyond the first rows: the fastest single stage (plain accumulation, the layout to beat)
  // and the fastest layout over the memory cap (what the cap costs), when not shown already.
  bool single_shown = false;
  bool over_shown = false;
  for (std::size_t i = 0; i < shown; ++i) {
    single_shown = single_shown || ranking[i].stages == 1;
    over_shown = over_shown || !ranking[i].fits;
  }
  std::size_t over = 0;
  for (std::size_t i = shown; i < ranking.size(); ++i) {
    bool single = !single_shown && ranking[i].stages == 1;
    bool first_over = !over_shown && !ranking[i].fits;
    if (single || first_over) {
      std::printf("  %4s\n", "...");
      row(i);
      single_shown = single_shown || single;
      over_shown = over_shown || first_over;
    } else {
      over += ranking[i].fits ? 0 : 1;
    }
  }
  if (ranking.size() > shown) {
    std::printf("  (%zu layouts in all%s)\n", ranking.size(),
                over > 0 ? detail::concat(", ", over, " more over the memory cap not shown").c_str()
                         : "");
  }
}

// No layout fits the memory caps: the error names the caps and the smallest need.
[[noreturn]] void refuse_over_caps(const std::vector<layout>& ranking, const planning_args& a) {
  auto smallest =
    std::min_element(ranking.begin(), ranking.end(), [&](const layout& x, const layout& y) {
      if (a.max_memory_bytes > 0) {
        return x.memory_bytes < y.memory_bytes;
      }
      return a.max_stash_bytes > 0 ? x.stash_bytes < y.stash_bytes : x.stash < y.stash;
    });
  std::string caps;
  if (a.max_stash > 0 || a.max_stash_bytes > 0) {
    caps = detail::concat("--max-stash ", a.max_stash_bytes > 0
                                            ? detail::concat(a.max_stash_bytes, " bytes")
                                            : detail::concat(a.max_stash, " micro-batches"));
  }
  if (a.max_memory_bytes > 0) {
    caps += detail::concat(caps.empty() ? "" : ", ", "--max-memory ", a.max_memory_bytes,
                           " bytes per stage");
  }
  throw invalid_argument(detail::concat(
    "the planner: no layout fits the memory cap (", caps, "); the smallest needs ", smallest->stash,
    " micro-batches, ", smallest->stash_bytes, " bytes of activations, ", smallest->memory_bytes,
    " bytes in all on its fullest stage (", smallest->to_string(), ")"));
}

namespace {

// A fixed layout under a memory cap: each stage's predicted peak against the caps, as the
// planner checks every layout it ranks; the first stage over one is refused with its need.
void check_fixed_layout_caps(const plan_choice& c, std::size_t stages, int64_t batch_size,
                             const planning_args& a) {
  auto plan = c.custom.empty() ? make_schedule(c.kind, stages, c.microbatches, c.chunks) : c.custom;
  auto scale = static_cast<double>(batch_size) / static_cast<double>(c.microbatches) /
               static_cast<double>(c.profiled_samples);
  auto costs = costs_of(c.profile, c.cut, scale);
  charge_recomputation(costs, c.recompute, c.microbatches);
  auto sim = simulate(plan, c.microbatches, costs);
  auto layout = detail::concat(plan.programs.size(), " stage(s), ", c.schedule_name, ", ",
                               c.microbatches, " micro-batch(es), partition ", c.cut.to_string(),
                               recompute_suffix(c.recompute));
  auto refuse = [&](const std::string& cap, std::size_t s, const std::string& need) {
    throw invalid_argument(detail::concat(
      cap, ": stage ", s, " of the layout given (", layout, ") needs ", need,
      ", predicted (docs/memory.md); fewer layers on it, more stages or micro-batches, "
      "--recompute always, or --stages auto (the planner picks the fastest layout that fits) "
      "need less"));
  };
  for (std::size_t s = 0; s < plan.programs.size(); ++s) {
    auto m = stage_memory(c.profile, c.cut, plan, s, scale, std::max(0.0, a.optimizer_state),
                          c.recompute, c.microbatches);
    if (a.max_memory_bytes > 0 && m.total() > a.max_memory_bytes) {
      refuse(detail::concat("--max-memory ", a.max_memory_bytes, " bytes per stage"), s,
             detail::concat(m.total(), " bytes at its peak (parameters ", m.parameters,
                            ", gradients ", m.gradients, ", optimizer ", m.optimizer,
                            ", activations ", m.activations, ", working ", m.working,
                            ", workspace ", m.workspace, ")"));
    }
    if (a.max_stash_bytes > 0 && m.activations > a.max_stash_bytes) {
      refuse(detail::concat("--max-stash ", a.max_stash_bytes, " bytes"), s,
             detail::concat(m.activations, " bytes of stashed activations"));
    }
    if (a.max_stash > 0 && sim.peak_stash[s] > a.max_stash + 1e-9) {
      refuse(detail::concat("--max-stash ", a.max_stash, " micro-batches"), s,
             detail::concat(sim.peak_stash[s], " micro-batches stashed at once"));
    }
  }
}

} // namespace

namespace {

// A built-in schedule given with --chunks: interleaving takes two chunks per stage or more, a V
// exactly two.
void check_chunks_apply(const plan_choice& c) {
  const char* instead = c.kind == schedule_kind::interleaved ? "1f1b" : "zb-h1";
  ACTORPIPE_CHECK(!interleaves(c.kind) || c.chunks > 1, "--schedule ", c.schedule_name,
                  " with --chunks ", c.chunks,
                  " interleaves nothing: give --chunks 2 or more, or --schedule ", instead);
  ACTORPIPE_CHECK(placement_of(c.kind) != chunk_placement::v_shape || c.chunks == 2, "--schedule ",
                  c.schedule_name, " runs two chunks per stage in a V: --chunks ", c.chunks,
                  " does not apply (leave it out, or give 2)");
}

// A given layout (no --stages or --threads auto): the schedule as named, the cut, and the
// profile where the cut or a memory cap needs one (or `always_profile`).
plan_choice given_layout(plan_choice choice, const layer_list& layers, const torch::Tensor& batch,
                         const planning_args& a, bool always_profile) {
  auto batch_size = batch.size(0);
  auto threads = threads_per_stage(a.stages, a.threads);
  choice.profiled_samples = largest_microbatch(batch_size, a.microbatches);
  choice.schedule_name = a.schedule;
  if (a.schedule.rfind("file:", 0) == 0) {
    choice.custom = load_schedule(a.schedule.substr(5));
    choice.chunks = chunks_of(choice.custom);
  } else {
    choice.kind = parse_schedule_kind(a.schedule);
    // The V schedules hold two chunks per stage by construction (--chunks 2 is implied).
    if (a.chunks == 1) {
      choice.chunks = chunks_for(choice.kind, a.chunks);
    }
    check_chunks_apply(choice);
  }
  bool capped = a.max_memory_bytes > 0 || a.max_stash > 0 || a.max_stash_bytes > 0;
  if (always_profile || a.partition == "time" || capped) {
    bool split =
      choice.custom.empty() ? splits_backward(choice.kind) : splits_backward(choice.custom);
    choice.profile =
      profile_at(layers, batch, choice.profiled_samples, threads, !a.cold_memory, a.profile_repeats,
                 split, std::min(cores(), a.stages * threads), a.profile_device());
  }
  choice.cut = partition_by_spec(a.partition, layers, a.stages * choice.chunks, choice.profile);
  if (capped) {
    check_fixed_layout_caps(choice, a.stages, batch_size, a);
  }
  return choice;
}

// --stages or --threads auto: every layout ranked by simulated step, printed, and the fastest
// taken with the profile it was ranked on.
plan_choice ranked_layout(plan_choice choice, const layer_list& layers, const torch::Tensor& batch,
                          const planning_args& a) {
  auto batch_size = batch.size(0);
  auto space = layout_space_for(layers, batch_size, a);
  auto costs = measure_costs(layers, batch, space, a, /*progress=*/true);
  choice.ranking = rank_layouts(layers, costs, space);
  double spread = 0;
  for (const auto& c : costs) {
    spread = std::max(spread, profile_spread(c.layers));
  }
  std::printf("layouts ranked by simulated step (per-layer costs profiled at each thread count and "
              "micro-batch size; profile spread %.1f%%):\n",
              100 * spread);
  print_ranking(choice.ranking);
  const auto& best = choice.ranking.front();
  if (!best.fits) {
    refuse_over_caps(choice.ranking, a);
  }
  choice.kind = best.schedule;
  choice.schedule_name = to_string(best.schedule);
  choice.microbatches = best.microbatches;
  choice.chunks = best.chunks;
  choice.recompute = best.recompute;
  choice.threads = best.threads;
  choice.cut = best.cut;
  auto samples = largest_microbatch(batch_size, best.microbatches);
  for (auto& c : costs) {
    if (c.threads == best.threads && c.samples == samples) {
      choice.profile = std::move(c.layers);
      choice.profiled_samples = samples;
    }
  }
  std::printf("  chosen: %s, %zu micro-batch(es), %zu chunk(s), %zu stage(s) x %zu thread(s), "
              "cut %s%s, predicted %.1f ms per step\n",
              choice.schedule_name.c_str(), choice.microbatches, choice.chunks, best.stages,
              best.threads, choice.cut.to_string().c_str(),
              recompute_suffix(best.recompute).c_str(), best.step_ms);
  std::fflush(stdout);
  return choice;
}

// The projection's space for `d` devices as `r` replicas of d / r stages, each replica's batch
// in micro-batches of the profiled size (no extrapolation to sizes not measured).
layout_space projected_space(const planning_args& a, const projection_args& p, int64_t batch_size,
                             std::size_t d, std::size_t r, std::size_t threads, int64_t samples) {
  auto replica_batch = batch_size / static_cast<int64_t>(r);
  layout_space space;
  space.batch = batch_size;
  space.devices = d;
  space.replica_counts = {r};
  space.stage_counts = {d / r};
  space.cores = 0; // a device each
  space.thread_counts = {threads};
  space.microbatch_counts = {static_cast<std::size_t>(std::max<int64_t>(
    1, std::min<int64_t>(replica_batch / samples, static_cast<int64_t>(p.max_microbatches))))};
  space.schedules = a.schedule == "auto" || !a.schedule_given
                      ? layout_space{}.schedules
                      : std::vector<schedule_kind>{parse_schedule_kind(a.schedule)};
  space.chunks = std::max<std::size_t>(2, a.chunks);
  space.partitions = {a.partition_given ? a.partition : "time"};
  set_memory_caps(space, a);
  space.link_gbps = p.link_gbps;
  space.link_latency_ms = p.link_latency_ms;
  return space;
}

} // namespace

plan_choice choose_plan(const layer_list& layers, const torch::Tensor& batch,
                        const planning_args& a, bool always_profile) {
  bool automatic = a.automatic();
  ACTORPIPE_CHECK(a.schedule == "auto" || a.stages == 0 || a.microbatches >= 1, "microbatches (",
                  a.microbatches, ") must be >= 1 (0 only with --schedule auto or --stages auto)");
  plan_choice choice;
  choice.microbatches = a.microbatches;
  choice.chunks = a.chunks;
  choice.recompute = parse_recompute_mode(a.recompute);
  if (a.schedule.rfind("file:", 0) == 0) {
    ACTORPIPE_CHECK(!automatic, "--schedule ", a.schedule,
                    " fixes stages, micro-batches and schedule: --stages auto and --threads auto "
                    "do not apply");
  }
  if (!automatic) {
    return given_layout(std::move(choice), layers, batch, a, always_profile);
  }
  return ranked_layout(std::move(choice), layers, batch, a);
}

projection project(const layer_list& layers, const torch::Tensor& batch, const planning_args& a,
                   const projection_args& p) {
  ACTORPIPE_CHECK(!p.devices.empty(), "a projection needs device counts (--devices)");
  ACTORPIPE_CHECK(a.microbatches >= 1, "--microbatches (", a.microbatches,
                  ") sets the profiled micro-batch size and must be >= 1");
  auto batch_size = batch.size(0);
  projection result;
  const auto threads = result.threads = a.threads > 0 ? a.threads : 1;
  const auto samples = result.samples = largest_microbatch(batch_size, a.microbatches);
  std::vector<measured_costs> costs{{threads, samples,
                                     profile_at(layers, batch, samples, threads, !a.cold_memory,
                                                a.profile_repeats, /*split_backward=*/true),
                                     update_at(layers, threads)}};
  std::vector<std::size_t> counts{1};
  for (auto d : p.devices) {
    ACTORPIPE_CHECK(d >= 1, "--devices: a device count must be >= 1");
    if (std::find(counts.begin(), counts.end(), d) == counts.end()) {
      counts.push_back(d);
    }
  }
  for (auto d : counts) {
    projection_row row;
    row.devices = d;
    auto started = std::chrono::steady_clock::now();
    // Every stages x replicas == d.
    for (std::size_t r = 1; r <= d; ++r) {
      if (d % r != 0 || batch_size / static_cast<int64_t>(r) < 1) {
        continue;
      }
      std::vector<layout> ranking;
      try {
        ranking =
          rank_layouts(layers, costs, projected_space(a, p, batch_size, d, r, threads, samples));
      } catch (const invalid_argument&) {
        continue; // more stages than layers
      }
      row.layouts += ranking.size();
      const auto& best = ranking.front();
      if (best.fits && (!row.found || best.step_ms < row.best.step_ms)) {
        row.found = true;
        row.best = best;
      }
      if (best.fits && r == 1) {
        row.pipeline_found = true;
        row.pipeline = best;
      }
    }
    row.ranking_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
    result.rows.push_back(std::move(row));
  }
  return result;
}

pipeline_options pipeline_options_for(const plan_choice& choice, const planning_args& args,
                                      pipeline_options base) {
  auto po = std::move(base);
  po.microbatches = choice.microbatches;
  po.schedule = choice.kind;
  po.chunks = choice.chunks;
  po.custom_schedule = choice.custom;
  po.threads_per_stage = choice.threads > 0 ? choice.threads : args.threads;
  po.recompute = choice.recompute;
  po.warm_memory = !args.cold_memory;
  po.devices = args.devices;
  if (args.layout_auto() && po.devices.size() > choice.stages()) {
    // The planner placed fewer stages than there are devices: the first ones, in order.
    po.devices.resize(choice.stages(), po.devices.front());
  }
  return po;
}

} // namespace actorpipe::training
