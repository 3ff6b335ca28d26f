#include <actorpipe/planner.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <stdexcept>

#include <actorpipe/errors.hpp>
#include <actorpipe/schedule.hpp>

#include "scheduler/liveness.hpp"

namespace actorpipe {
namespace {

std::vector<std::size_t> threads_for(const layout_space& space, std::size_t stages) {
  std::vector<std::size_t> candidates = space.thread_counts;
  if (candidates.empty()) {
    candidates.push_back(space.cores > 0 ? std::max<std::size_t>(1, space.cores / stages) : 1);
  }
  std::vector<std::size_t> fit;
  for (auto t : candidates) {
    if (t >= 1 && (space.cores == 0 || stages * t <= space.cores)) {
      fit.push_back(t);
    }
  }
  if (fit.empty()) {
    fit.push_back(1); // more stages than cores: one thread each, charged the oversubscription
  }
  std::sort(fit.begin(), fit.end());
  fit.erase(std::unique(fit.begin(), fit.end()), fit.end());
  return fit;
}

// Model chunks per stage of `kind`: the space's for the interleaved ones, 2 for the V schedules,
// else 1.
std::size_t chunks_in(schedule_kind kind, std::size_t interleaved_chunks) {
  return interleaves(kind) ? interleaved_chunks : chunks_for(kind, 1);
}

bool applies(schedule_kind kind, std::size_t stages, std::size_t m, std::size_t chunks,
             std::size_t layers) {
  if (stages == 1) { // every schedule is plain accumulation on one stage: keep one of them
    return kind == schedule_kind::one_f_one_b;
  }
  auto v = chunks_in(kind, chunks);
  if (stages * v > layers) {
    return false;
  }
  return takes_microbatches(kind, stages, m) && (!interleaves(kind) || v >= 2);
}

// Time to move `bytes` over the space's link in `messages` messages (0 without a link).
double transfer_ms(const layout_space& space, double bytes, double messages = 1) {
  return space.link_gbps > 0 ? messages * space.link_latency_ms + bytes / (space.link_gbps * 1e6)
                             : 0.0;
}

// Charges each part the transfer of its output to the next part over the space's link (the
// bytes scaled to the micro-batch), nothing where the next part is on the same stage (the V's
// turn); returns the longest.
double charge_transfers(std::vector<action_costs>& parts, const schedule& plan,
                        const measured_costs& measured, const partition& cut, double samples_scale,
                        const layout_space& space) {
  double longest = 0;
  auto stages = plan.size();
  for (std::size_t part = 0; part + 1 < parts.size(); ++part) {
    if (holder_of(plan.placement, stages, part).stage ==
        holder_of(plan.placement, stages, part + 1).stage) {
      continue;
    }
    auto bytes =
      static_cast<double>(measured.layers[cut.end(part) - 1].output_bytes) * samples_scale;
    parts[part].send = transfer_ms(space, bytes);
    longest = std::max(longest, parts[part].send);
  }
  return longest;
}

// The costs measured at `threads` on the size nearest `samples`.
const measured_costs& nearest(const std::vector<measured_costs>& costs, std::size_t threads,
                              int64_t samples) {
  const measured_costs* best = nullptr;
  for (const auto& c : costs) {
    if (c.threads != threads) {
      continue;
    }
    if (best == nullptr || std::llabs(c.samples - samples) < std::llabs(best->samples - samples)) {
      best = &c;
    }
  }
  ACTORPIPE_CHECK(best != nullptr, "rank_layouts: no costs measured at ", threads,
                  " thread(s) per stage");
  return *best;
}

// Calls fn(replicas, replica batch, stages, threads, micro-batches) for every shape of `space`
// that applies to `layers`.
template <class F>
void for_each_shape(const layer_list& layers, const layout_space& space, F fn) {
  for (auto r : space.replica_counts) {
    if (r == 0 || static_cast<int64_t>(r) > space.batch) {
      continue;
    }
    auto batch = space.batch / static_cast<int64_t>(r);
    for (auto s : space.stage_counts) {
      if (s == 0 || s > layers.size() || (space.devices > 0 && s * r != space.devices)) {
        continue;
      }
      for (auto t : threads_for(space, s)) {
        for (auto m : space.microbatch_counts) {
          if (m >= 1 && static_cast<int64_t>(m) <= batch) {
            fn(r, batch, s, t, m);
          }
        }
      }
    }
  }
}

} // namespace

int64_t largest_microbatch(int64_t batch, std::size_t microbatches) {
  auto count = static_cast<int64_t>(std::max<std::size_t>(1, microbatches));
  return std::max<int64_t>(1, (batch + count - 1) / count);
}

memory_estimate estimate_memory(int64_t parameter_elements, double optimizer_state,
                                int64_t activation_bytes, std::size_t shard_ways) {
  ACTORPIPE_CHECK(parameter_elements >= 0 && optimizer_state >= 0 && activation_bytes >= 0 &&
                    shard_ways >= 1,
                  "estimate_memory: counts must be >= 0 and shard_ways >= 1");
  memory_estimate m;
  m.parameters = 4 * parameter_elements;
  m.gradients = m.parameters;
  m.optimizer = static_cast<int64_t>(std::llround(
    static_cast<double>(m.parameters) * optimizer_state / static_cast<double>(shard_ways)));
  m.activations = activation_bytes;
  return m;
}

namespace {

// The input of a stage starting at layer `begin`: the previous layer's output, or a
// micro-batch of the model's input.
double input_of(const std::vector<layer_profile>& layers, std::size_t begin) {
  return static_cast<double>(begin > 0         ? layers[begin - 1].output_bytes
                             : !layers.empty() ? layers[0].input_bytes
                                               : 0);
}

} // namespace

double kept_bytes(const std::vector<layer_profile>& layers, std::size_t begin, std::size_t end) {
  ACTORPIPE_CHECK(begin <= end && end <= layers.size(), "kept_bytes: layers [", begin, ", ", end,
                  ") of ", layers.size());
  double bytes = input_of(layers, begin);
  for (auto i = begin; i < end; ++i) {
    const auto& l = layers[i];
    bytes += static_cast<double>(l.retained_bytes >= 0 ? l.retained_bytes : l.output_bytes);
    if (i > begin) { // what the stage's own layers free of each other's outputs
      bytes -= static_cast<double>(l.freed_input_bytes);
    }
  }
  return std::max(0.0, bytes);
}

namespace {

// How far one micro-batch's action on layers [begin, end) rises above what the micro-batch
// holds whole (kept_bytes of the layers), at the profile's samples, at least 0 where it stays
// under. While a layer runs, the micro-batch holds what its layers up to that one keep: in
// the forward as the layer runs; in the backward once the layers after it were backed up and
// freed theirs (and without this layer's output where the next layer freed it in the forward).
struct working_set {
  double forward = 0;            // a forward that builds the graph
  std::optional<double> no_grad; // a recomputing last stage's forward without autograd
  double backward = 0;           // a whole backward
  // A split B, above what it holds once it has kept all that its W reads (the layers' weight
  // gradients' inputs): while a layer's B runs, only the layers after it have kept theirs.
  double split_backward = 0;
  // What a split B keeps for W: the layers' weight_kept_bytes, none in the model's first part
  // (no input gradient: its B computes nothing, its W all).
  double for_w = 0;
};

working_set working_sets(const std::vector<layer_profile>& layers, std::size_t begin,
                         std::size_t end) {
  ACTORPIPE_CHECK(begin <= end && end <= layers.size(), "working_bytes: layers [", begin, ", ", end,
                  ") of ", layers.size());
  const auto whole = kept_bytes(layers, begin, end);
  working_set w;
  for (auto i = begin; i < end; ++i) {
    const auto& l = layers[i];
    auto upto = kept_bytes(layers, begin, i + 1);
    auto forward = static_cast<double>(std::max<int64_t>(0, l.forward_working_bytes));
    w.forward = std::max(w.forward, upto - whole + forward);
    if (begin > 0) { // so far: the B of layers [begin, i]
      w.for_w += static_cast<double>(std::max<int64_t>(0, l.weight_kept_bytes));
    }
    if (l.backward_working_bytes >= 0) {
      auto freed = i + 1 < end ? static_cast<double>(layers[i + 1].freed_input_bytes) : 0.0;
      // While a layer's backward runs, the gradient of its output is alive too, and the
      // stage's output gradient (its roots' gradients live until the backward ends).
      auto received = i + 1 < end ? static_cast<double>(layers[end - 1].output_bytes) : 0.0;
      auto backward = static_cast<double>(l.backward_working_bytes + l.output_bytes) + received;
      w.backward = std::max(w.backward, upto - freed - whole + backward);
      w.split_backward = std::max(w.split_backward, upto - freed - whole + backward - w.for_w);
    }
    if (end == layers.size() && l.no_grad_forward_bytes >= 0) {
      // Without autograd the stash holds the stage's input alone, and the layer its input.
      auto input = i > begin ? input_of(layers, i) : 0.0;
      auto above =
        input + static_cast<double>(l.no_grad_forward_bytes) - (whole - input_of(layers, begin));
      w.no_grad = std::max(w.no_grad.value_or(above), above);
    }
  }
  return w;
}

} // namespace

double working_bytes(const std::vector<layer_profile>& layers, std::size_t begin, std::size_t end,
                     recompute_mode recompute) {
  auto w = working_sets(layers, begin, end);
  auto most = std::max(w.forward, w.backward);
  return recompute != recompute_mode::never ? std::max(most, w.no_grad.value_or(0.0)) : most;
}

namespace {

// What stage `stage` of `plan` holds at its peak: stashed alone (`.first`, stashed_bytes), and
// with the working set of the action running then (`.second`). Each action's working set is
// added to what the stage holds during that action, not the largest to the largest stash: a
// split B's stash peaks as it ends, when what W reads is kept and its working set is gone.
std::pair<double, double> held_peaks(const std::vector<layer_profile>& layers, const partition& cut,
                                     const schedule& plan, std::size_t stage, double samples_scale,
                                     recompute_mode recompute, std::size_t microbatches) {
  auto v = chunks_of(plan);
  // Per chunk, at the profile's samples: what an entry keeps whole, its input alone, and what
  // its actions need for a moment (with what a split B keeps for W).
  std::vector<double> whole(v), input(v);
  std::vector<working_set> work(v);
  for (std::size_t c = 0; c < v; ++c) {
    auto part = plan.virtual_stage(stage, c);
    whole[c] = kept_bytes(layers, cut.begin(part), cut.end(part));
    input[c] = input_of(layers, cut.begin(part));
    work[c] = working_sets(layers, cut.begin(part), cut.end(part));
  }
  if (recompute == recompute_mode::except_last && microbatches < 2) {
    recompute = recompute_mode::never; // the only micro-batch is the last
  }
  auto recomputed = [&](int32_t microbatch) {
    return recompute == recompute_mode::always ||
           (recompute == recompute_mode::except_last &&
            static_cast<std::size_t>(microbatch) + 1 < microbatches);
  };
  // A forward stashes its entry (its input alone where recomputed); its backward rebuilds the
  // rest and, split, adds what W reads.
  auto entry = [&](int32_t microbatch, int32_t chunk, bool split) {
    auto c = static_cast<std::size_t>(chunk);
    auto rebuilt = recomputed(microbatch);
    return std::pair((rebuilt ? input[c] : whole[c]) * samples_scale,
                     ((rebuilt ? whole[c] - input[c] : 0.0) + (split ? work[c].for_w : 0.0)) *
                       samples_scale);
  };
  // Each working set is measured against the micro-batch held whole. A recomputed forward
  // holds its input alone once done: a graph built and dropped (its forward's working set),
  // or, on the last stage, a forward without autograd. A recomputed backward first rebuilds.
  auto during = [&](const action& a, bool split) {
    auto c = static_cast<std::size_t>(a.chunk);
    const auto& w = work[c];
    auto rebuilt = recomputed(a.microbatch);
    double above = 0;
    if (a.kind == action_kind::forward) {
      auto graph = rebuilt && w.no_grad ? *w.no_grad : w.forward;
      above = (rebuilt ? whole[c] - input[c] : 0.0) + graph;
    } else if (a.kind == action_kind::backward) {
      above = split ? w.split_backward : w.backward;
      if (rebuilt) {
        above = std::max(above, w.forward - (split ? w.for_w : 0.0));
      }
    }
    return above * samples_scale;
  };
  const auto& program = plan.programs.at(stage);
  auto split = split_backwards(program);
  return {liveness::peak_held(program, split, entry),
          liveness::peak_held(program, split, entry, during)};
}

} // namespace

double stashed_bytes(const std::vector<layer_profile>& layers, const partition& cut,
                     const schedule& plan, std::size_t stage, double samples_scale,
                     recompute_mode recompute, std::size_t microbatches) {
  return held_peaks(layers, cut, plan, stage, samples_scale, recompute, microbatches).first;
}

memory_estimate stage_memory(const std::vector<layer_profile>& layers, const partition& cut,
                             const schedule& plan, std::size_t stage, double samples_scale,
                             double optimizer_state, recompute_mode recompute,
                             std::size_t microbatches) {
  int64_t parameters = 0;
  for (std::size_t c = 0, v = chunks_of(plan); c < v; ++c) {
    auto part = plan.virtual_stage(stage, c);
    for (auto i = cut.begin(part); i < cut.end(part); ++i) {
      parameters += layers[i].parameters;
    }
  }
  auto [stashed, peak] =
    held_peaks(layers, cut, plan, stage, samples_scale, recompute, microbatches);
  auto activations = static_cast<int64_t>(std::llround(stashed));
  auto m = estimate_memory(parameters, optimizer_state, activations);
  m.working = std::max<int64_t>(0, static_cast<int64_t>(std::llround(peak)) - activations);
  // Each chunk runs on a CUDA stream of its own (pipeline_options::chunk_streams), and cuBLAS
  // keeps a workspace for each stream that multiplied matrices: a stage holds its chunks'.
  for (std::size_t c = 0, v = chunks_of(plan); c < v; ++c) {
    auto part = plan.virtual_stage(stage, c);
    int64_t chunk = 0;
    for (auto i = cut.begin(part); i < cut.end(part); ++i) {
      chunk = std::max(chunk, layers[i].workspace_bytes);
    }
    m.workspace += chunk;
  }
  return m;
}

void charge_recomputation(std::vector<action_costs>& costs, recompute_mode recompute,
                          std::size_t microbatches) {
  double share = 0; // of the micro-batches recomputed
  if (recompute == recompute_mode::always) {
    share = 1;
  } else if (recompute == recompute_mode::except_last && microbatches >= 1) {
    share = static_cast<double>(microbatches - 1) / static_cast<double>(microbatches);
  }
  for (auto& c : costs) {
    // The recomputation runs where the backward starts: B (or a whole backward).
    c.backward += share * c.forward;
    c.fused += c.fused >= 0 ? share * c.forward : 0;
  }
}

std::string layout::to_string() const {
  return detail::concat(stages, " x ", threads, threads == 1 ? " thread, " : " threads, ",
                        microbatches, microbatches == 1 ? " micro-batch, " : " micro-batches, ",
                        actorpipe::to_string(schedule),
                        chunks > 1 ? detail::concat(" (", chunks, " chunks)") : std::string{}, ", ",
                        partition_spec, " ", cut.to_string(), recompute_suffix(recompute));
}

std::string recompute_suffix(recompute_mode recompute) {
  return recompute == recompute_mode::never
           ? std::string{}
           : detail::concat(", recompute ", actorpipe::to_string(recompute));
}

std::vector<std::pair<std::size_t, int64_t>> costs_needed(const layer_list& layers,
                                                          const layout_space& space) {
  std::vector<std::pair<std::size_t, int64_t>> needed;
  for_each_shape(layers, space,
                 [&](std::size_t, int64_t batch, std::size_t, std::size_t t, std::size_t m) {
                   needed.emplace_back(t, largest_microbatch(batch, m));
                 });
  // Thread count first (one set_num_threads each), largest micro-batches first.
  std::sort(needed.begin(), needed.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : a.second > b.second;
  });
  needed.erase(std::unique(needed.begin(), needed.end()), needed.end());
  return needed;
}

namespace {

void check_ranking_inputs(const layer_list& layers, const std::vector<measured_costs>& costs,
                          const layout_space& space) {
  ACTORPIPE_CHECK(space.batch >= 1, "rank_layouts: batch (", space.batch, ") must be >= 1");
  ACTORPIPE_CHECK(!layers.empty(), "rank_layouts: no layers");
  ACTORPIPE_CHECK(space.link_gbps >= 0 && space.link_latency_ms >= 0,
                  "rank_layouts: a link needs bandwidth and latency >= 0");
  for (const auto& c : costs) {
    ACTORPIPE_CHECK(c.layers.size() == layers.size(), "rank_layouts: costs at ", c.threads,
                    " thread(s), ", c.samples, " samples cover ", c.layers.size(), " of the ",
                    layers.size(), " layers");
  }
}

// Layouts that fit first, then the faster, then fewer stages, then fewer micro-batches.
bool ranks_before(const layout& a, const layout& b) {
  if (a.fits != b.fits) {
    return a.fits;
  }
  if (a.step_ms != b.step_ms) {
    return a.step_ms < b.step_ms;
  }
  return a.stages != b.stages ? a.stages < b.stages : a.microbatches < b.microbatches;
}

double parameter_count(const measured_costs& measured) {
  double total = 0;
  for (const auto& lp : measured.layers) {
    total += static_cast<double>(lp.parameters);
  }
  return total;
}

// Simulates `l` (its shape, schedule, cut and recomputation set) on `measured` costs (whose
// layers hold `total_parameters`) and fills in its times, stash, memory and whether it fits the
// space's caps.
void simulate_layout(layout& l, const measured_costs& measured, double total_parameters,
                     double samples_scale, double contention, const layout_space& space) {
  auto plan = make_schedule(l.schedule, l.stages, l.microbatches, l.chunks);
  auto part_costs = costs_of(measured.layers, l.cut, samples_scale * contention);
  charge_recomputation(part_costs, l.recompute, l.microbatches);
  l.send_ms = charge_transfers(part_costs, plan, measured, l.cut, samples_scale, space);
  auto sim = simulate(plan, l.microbatches, part_costs, l.stages > 1 ? space.hop_ms : 0.0);
  l.bubble = sim.mean_bubble();
  // After the last backward: every stage steps its optimizer, replicas first all-reduce each
  // stage's gradients (stages in parallel).
  for (std::size_t a = 0; a < l.stages; ++a) {
    auto m = stage_memory(measured.layers, l.cut, plan, a, samples_scale, space.optimizer_state,
                          l.recompute, l.microbatches);
    l.stash = std::max(l.stash, sim.peak_stash[a]);
    l.stash_bytes = std::max(l.stash_bytes, m.activations);
    l.memory_bytes = std::max(l.memory_bytes, m.total());
    auto parameters = static_cast<double>(m.parameters) / 4;
    if (total_parameters > 0) {
      l.update_ms =
        std::max(l.update_ms, measured.update_ms * contention * parameters / total_parameters);
    }
    if (l.replicas > 1) { // a ring all-reduce of the stage's fp32 gradients
      auto rd = static_cast<double>(l.replicas);
      l.allreduce_ms = std::max(
        l.allreduce_ms, transfer_ms(space, 4 * parameters * 2 * (rd - 1) / rd, 2 * (rd - 1)));
    }
  }
  l.step_ms = sim.makespan + space.step_ms + l.update_ms + l.allreduce_ms;
  l.fits = (space.max_stash <= 0 || l.stash <= space.max_stash + 1e-9) &&
           (space.max_stash_bytes <= 0 || l.stash_bytes <= space.max_stash_bytes) &&
           (space.max_memory_bytes <= 0 || l.memory_bytes <= space.max_memory_bytes);
}

bool same_layout(const layout& a, const layout& b) {
  return a.stages == b.stages && a.threads == b.threads && a.microbatches == b.microbatches &&
         a.schedule == b.schedule && a.chunks == b.chunks && a.replicas == b.replicas &&
         a.recompute == b.recompute && a.cut.bounds == b.cut.bounds;
}

} // namespace

std::vector<layout> rank_layouts(const layer_list& layers, const std::vector<measured_costs>& costs,
                                 const layout_space& space) {
  check_ranking_inputs(layers, costs, space);
  ACTORPIPE_CHECK(!space.recompute.empty(), "rank_layouts: no recomputation mode to try");
  std::vector<layout> ranked;
  for_each_shape(
    layers, space, [&](std::size_t r, int64_t batch, std::size_t s, std::size_t t, std::size_t m) {
      // Stage threads beyond the cores share them: everything takes that much longer.
      double contention =
        space.cores > 0
          ? std::max(1.0, static_cast<double>(s * t) / static_cast<double>(space.cores))
          : 1.0;
      const auto& measured = nearest(costs, t, largest_microbatch(batch, m));
      // Sizes scale with the samples per micro-batch, times also with the contention.
      auto samples_scale =
        static_cast<double>(batch) / static_cast<double>(m) / static_cast<double>(measured.samples);
      auto total_parameters = parameter_count(measured);
      for (auto kind : space.schedules) {
        if (!applies(kind, s, m, space.chunks, layers.size())) {
          continue;
        }
        for (const auto& spec : space.partitions) {
          layout l;
          l.stages = s;
          l.threads = t;
          l.microbatches = m;
          l.chunks = chunks_in(kind, space.chunks);
          l.schedule = kind;
          l.partition_spec = spec;
          l.replicas = r;
          try {
            l.cut = partition_by_spec(spec, layers, s * l.chunks, measured.layers);
          } catch (const std::invalid_argument&) {
            continue; // e.g. a cut:I,J of another stage count
          }
          for (auto mode : space.recompute) {
            l.recompute = mode;
            auto same = std::find_if(ranked.begin(), ranked.end(),
                                     [&](const layout& o) { return same_layout(o, l); });
            if (same != ranked.end()) { // another spec, the same cut: one layout, both names
              same->partition_spec += "," + spec;
              continue;
            }
            auto simulated = l;
            simulate_layout(simulated, measured, total_parameters, samples_scale, contention,
                            space);
            ranked.push_back(std::move(simulated));
          }
        }
      }
    });
  ACTORPIPE_CHECK(!ranked.empty(), "rank_layouts: no layout of the space applies to ",
                  layers.size(), " layers and a batch of ", space.batch);
  std::stable_sort(ranked.begin(), ranked.end(), ranks_before);
  return ranked;
}

} // namespace actorpipe
