#include <actorpipe/schedule.hpp>

#include <algorithm>
#include <array>
#include <deque>
#include <fstream>
#include <limits>
#include <map>
#include <tuple>

#include <nlohmann/json.hpp>

#include <actorpipe/errors.hpp>

namespace actorpipe {
namespace {

void check_sizes(std::size_t stages, std::size_t microbatches, std::size_t chunks) {
  ACTORPIPE_CHECK(stages >= 1, "stages (", stages, ") must be >= 1");
  ACTORPIPE_CHECK(microbatches >= 1, "microbatches (", microbatches, ") must be >= 1");
  ACTORPIPE_CHECK(chunks >= 1, "chunks (", chunks, ") must be >= 1");
}

action F(std::size_t mb, std::size_t chunk = 0) {
  return {action_kind::forward, static_cast<int32_t>(mb), static_cast<int32_t>(chunk)};
}

action B(std::size_t mb, std::size_t chunk = 0) {
  return {action_kind::backward, static_cast<int32_t>(mb), static_cast<int32_t>(chunk)};
}

action W(std::size_t mb, std::size_t chunk = 0) {
  return {action_kind::weight, static_cast<int32_t>(mb), static_cast<int32_t>(chunk)};
}

schedule make_gpipe(std::size_t p, std::size_t m) {
  schedule result(p);
  for (auto& program : result) {
    for (std::size_t mb = 0; mb < m; ++mb) {
      program.push_back(F(mb));
    }
    for (std::size_t mb = m; mb-- > 0;) {
      program.push_back(B(mb));
    }
  }
  return result;
}

// Stage s runs p - s - 1 warm-up forwards so that its first backward arrives just as its next
// forward would, then alternates, then drains.
schedule make_1f1b(std::size_t p, std::size_t m) {
  schedule result(p);
  for (std::size_t s = 0; s < p; ++s) {
    auto& program = result[s];
    auto warmup = std::min(p - s - 1, m);
    for (std::size_t mb = 0; mb < warmup; ++mb) {
      program.push_back(F(mb));
    }
    for (std::size_t k = 0; k + warmup < m; ++k) {
      program.push_back(F(warmup + k));
      program.push_back(B(k));
    }
    for (std::size_t mb = m - warmup; mb < m; ++mb) {
      program.push_back(B(mb));
    }
  }
  return result;
}

// Megatron-LM's interleaved 1F1B: micro-batches advance through the chunks in groups of p.
schedule make_interleaved(std::size_t p, std::size_t m, std::size_t v) {
  ACTORPIPE_CHECK(m % p == 0, "the interleaved schedule needs microbatches (", m,
                  ") to be a multiple of stages (", p, ")");
  auto total = m * v;
  auto chunk_of = [&](std::size_t k, bool forward) {
    auto c = (k / p) % v;
    return forward ? c : v - 1 - c;
  };
  auto mb_of = [&](std::size_t k) { return (k / (p * v)) * p + k % p; };
  schedule result(p);
  for (std::size_t s = 0; s < p; ++s) {
    auto& program = result[s];
    auto warmup = std::min((p - s - 1) * 2 + (v - 1) * p, total);
    for (std::size_t k = 0; k < warmup; ++k) {
      program.push_back(F(mb_of(k), chunk_of(k, true)));
    }
    for (std::size_t k = 0; k + warmup < total; ++k) {
      program.push_back(F(mb_of(warmup + k), chunk_of(warmup + k, true)));
      program.push_back(B(mb_of(k), chunk_of(k, false)));
    }
    for (std::size_t k = total - warmup; k < total; ++k) {
      program.push_back(B(mb_of(k), chunk_of(k, false)));
    }
  }
  return result;
}

// ZB-H1 (Qi et al.): 1F1B's order of F and B, B computing only the input gradient, and stage s
// deferring each weight gradient by s micro-batches: W(k - s) follows B(k). Later stages thus
// pass their B's upstream sooner, earlier stages fill their cool-down with W's. With equal F, B
// and W costs the bubble is (p - 1) units against 1F1B's 3(p - 1), and no stage holds more than
// p micro-batches, 1F1B's peak (on its first stage).
schedule make_zb_h1(std::size_t p, std::size_t m) {
  auto one_f_one_b = make_1f1b(p, m);
  schedule result(p);
  for (std::size_t s = 0; s < p; ++s) {
    std::size_t next_w = 0;
    for (const auto& a : one_f_one_b[s]) {
      result[s].push_back(a);
      if (a.kind == action_kind::backward && static_cast<std::size_t>(a.microbatch) >= s + next_w) {
        result[s].push_back(W(next_w++));
      }
    }
    while (next_w < m) {
      result[s].push_back(W(next_w++));
    }
  }
  return result;
}

// ZB-H2 (Qi et al.): ZB-H1's B and W, with stage s running 2(p - 1 - s) + 1 warm-up forwards
// instead of p - 1 - s. The extra forwards fill what ZB-H1 leaves idle on the early stages while
// they wait for their first input gradient ((p - 1)(F + B - W) there); in exchange stage s
// stashes up to 2p - 1 - s micro-batches. With equal costs on every stage it is no faster than
// ZB-H1 (the pipeline's fill is the same); it pays where the early stages are the slower ones,
// which is where the wait costs the whole pipeline.
schedule make_zb_h2(std::size_t p, std::size_t m) {
  schedule result(p);
  for (std::size_t s = 0; s < p; ++s) {
    auto& program = result[s];
    auto warmup = std::min(2 * (p - 1 - s) + 1, m);
    for (std::size_t mb = 0; mb < warmup; ++mb) {
      program.push_back(F(mb));
    }
    std::size_t next_f = warmup;
    std::size_t next_w = 0;
    for (std::size_t k = 0; k < m; ++k) {
      program.push_back(B(k));
      while (next_w + s <= k) {
        program.push_back(W(next_w++));
      }
      if (next_f < m) {
        program.push_back(F(next_f++));
      }
    }
    while (next_w < m) {
      program.push_back(W(next_w++));
    }
  }
  return result;
}

// ZB-V and V-Half (Qi et al.): two chunks per stage in a V (stage 0 holds the first and the last
// virtual stage), backward split into B and W, built by list scheduling with unit costs. Whenever
// a stage is free it runs, of what is ready then, the oldest input-gradient B (the critical
// path), else a forward (of the chunk nearer the loss first) while its stash stays within `cap`
// chunk activations, one of them kept for the second chunk (whose forwards lead to the loss and
// so to the backwards that free the stash), else the oldest W. Stages decide in the order of
// the time they can start, so no later decision could have made an earlier one's input ready
// sooner. ZB-V's cap is 2p chunk activations (1F1B's p micro-batches), V-Half's p + 1.
schedule make_v(std::size_t p, std::size_t m, std::size_t cap) {
  constexpr std::size_t v = 2;
  auto virtual_stages = p * v;
  // When each (virtual stage, micro-batch)'s F and B end, -1 until they are placed.
  std::vector<double> f_end(virtual_stages * m, -1.0);
  std::vector<double> b_end(virtual_stages * m, -1.0);
  auto slot = [&](std::vector<double>& ends, std::size_t vs, std::size_t mb) -> double& {
    return ends[vs * m + mb];
  };
  struct stage_state {
    double clock = 0;
    std::size_t stash = 0;
    std::array<std::size_t, v> next_f{};
    std::array<std::size_t, v> next_b{};
    std::deque<action> weights;
  };
  struct candidate {
    action what;
    double ready = 0;
  };
  // B before F before W; then the older micro-batch; then the chunk nearer the loss.
  auto rank = [](const action& a) {
    auto kind = a.kind == action_kind::backward ? 0 : a.kind == action_kind::forward ? 1 : 2;
    return std::make_tuple(kind, a.microbatch, -a.chunk);
  };
  std::vector<stage_state> stages(p);
  schedule result(p, chunk_placement::v_shape);
  auto remaining = virtual_stages * m * 3;
  std::vector<candidate> candidates;
  // What each stage would run next and when (start infinite: nothing it can run yet). Placing
  // an action changes only its own stage's choice and that of the stage its output goes to, so
  // only those are evaluated again (building a 64 x 512 ZB-V: 177 -> 60 ms).
  struct choice {
    double start = std::numeric_limits<double>::infinity();
    action what{};
  };
  auto evaluate = [&](std::size_t i) {
    auto& st = stages[i];
    candidates.clear();
    for (std::size_t c = 0; c < v; ++c) {
      auto vs = virtual_stage_of(chunk_placement::v_shape, p, i, c);
      auto mb = st.next_b[c];
      if (mb < m && slot(f_end, vs, mb) >= 0) {
        auto ready = vs + 1 == virtual_stages ? slot(f_end, vs, mb) : slot(b_end, vs + 1, mb);
        if (ready >= 0) {
          candidates.push_back({B(mb, c), ready});
        }
      }
      mb = st.next_f[c];
      auto limit = c + 1 == v ? cap : cap - 1;
      if (mb < m && st.stash + 1 <= limit) {
        auto ready = vs == 0 ? 0.0 : slot(f_end, vs - 1, mb);
        if (ready >= 0) {
          candidates.push_back({F(mb, c), ready});
        }
      }
    }
    if (!st.weights.empty()) {
      candidates.push_back({st.weights.front(), 0.0});
    }
    choice result;
    if (candidates.empty()) {
      return result;
    }
    auto earliest = std::min_element(candidates.begin(), candidates.end(), [](auto& x, auto& y) {
                      return x.ready < y.ready;
                    })->ready;
    result.start = std::max(st.clock, earliest);
    const candidate* pick = nullptr;
    for (const auto& cand : candidates) {
      if (cand.ready <= result.start && (pick == nullptr || rank(cand.what) < rank(pick->what))) {
        pick = &cand;
      }
    }
    result.what = pick->what;
    return result;
  };
  std::vector<choice> choices(p);
  // A tournament over the stages' choices: each node holds the stage that starts soonest below
  // it, the lower index of equals (a left subtree's stages come first), so the root is the next
  // stage to run and a changed choice costs log p comparisons (a scan of every stage per action
  // was most of building a 64 x 512 plan).
  std::size_t leaves = 1;
  while (leaves < p) {
    leaves *= 2;
  }
  std::vector<std::size_t> tree(2 * leaves, p);
  auto winner = [&](std::size_t a, std::size_t b) {
    if (a >= p) {
      return b;
    }
    if (b >= p) {
      return a;
    }
    return choices[b].start < choices[a].start ? b : a;
  };
  auto update = [&](std::size_t i) {
    choices[i] = evaluate(i);
    for (auto node = (leaves + i) / 2; node >= 1; node /= 2) {
      tree[node] = winner(tree[2 * node], tree[2 * node + 1]);
    }
  };
  for (std::size_t i = 0; i < p; ++i) {
    tree[leaves + i] = i;
  }
  for (std::size_t i = 0; i < p; ++i) {
    update(i);
  }
  while (remaining > 0) {
    auto best_stage = tree[1];
    ACTORPIPE_CHECK(best_stage < p &&
                      choices[best_stage].start < std::numeric_limits<double>::infinity(),
                    "the V schedule for ", p, " stages and ", m,
                    " micro-batches deadlocks with a stash of ", cap, " chunk activations");
    auto best = choices[best_stage].what;
    auto best_start = choices[best_stage].start;
    auto& st = stages[best_stage];
    auto c = static_cast<std::size_t>(best.chunk);
    auto mb = static_cast<std::size_t>(best.microbatch);
    auto vs = virtual_stage_of(chunk_placement::v_shape, p, best_stage, c);
    st.clock = best_start + 1;
    switch (best.kind) {
    case action_kind::forward:
      slot(f_end, vs, mb) = st.clock;
      ++st.next_f[c];
      ++st.stash;
      break;
    case action_kind::backward:
      slot(b_end, vs, mb) = st.clock;
      ++st.next_b[c];
      st.weights.push_back(W(mb, c));
      break;
    case action_kind::weight:
      st.weights.pop_front();
      --st.stash;
      break;
    }
    result[best_stage].push_back(best);
    --remaining;
    update(best_stage);
    if (best.kind == action_kind::forward && vs + 1 < virtual_stages) {
      update(holder_of(chunk_placement::v_shape, p, vs + 1).stage);
    } else if (best.kind == action_kind::backward && vs > 0) {
      update(holder_of(chunk_placement::v_shape, p, vs - 1).stage);
    }
  }
  return result;
}

} // namespace

std::size_t chunks_for(schedule_kind kind, std::size_t chunks) {
  return placement_of(kind) == chunk_placement::v_shape ? 2 : chunks;
}

schedule_kind parse_schedule_kind(const std::string& name) {
  if (name == "gpipe") {
    return schedule_kind::gpipe;
  }
  if (name == "1f1b") {
    return schedule_kind::one_f_one_b;
  }
  if (name == "interleaved") {
    return schedule_kind::interleaved;
  }
  if (name == "zb-h1") {
    return schedule_kind::zb_h1;
  }
  if (name == "zb-h2") {
    return schedule_kind::zb_h2;
  }
  if (name == "zb-v") {
    return schedule_kind::zb_v;
  }
  if (name == "v-half") {
    return schedule_kind::v_half;
  }
  throw invalid_argument(detail::concat(
    "unknown schedule '", name, "' (known: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, v-half)"));
}

chunk_placement parse_chunk_placement(const std::string& name) {
  ACTORPIPE_CHECK(name == "looped" || name == "v", "placement '", name,
                  "' is neither \"looped\" nor \"v\"");
  return name == "v" ? chunk_placement::v_shape : chunk_placement::looped;
}

std::string to_string(schedule_kind kind) {
  switch (kind) {
  case schedule_kind::gpipe:
    return "gpipe";
  case schedule_kind::one_f_one_b:
    return "1f1b";
  case schedule_kind::interleaved:
    return "interleaved";
  case schedule_kind::zb_h1:
    return "zb-h1";
  case schedule_kind::zb_h2:
    return "zb-h2";
  case schedule_kind::zb_v:
    return "zb-v";
  case schedule_kind::v_half:
    return "v-half";
  }
  return "?";
}

schedule make_schedule(schedule_kind kind, std::size_t stages, std::size_t microbatches,
                       std::size_t chunks) {
  check_sizes(stages, microbatches, chunks);
  if (placement_of(kind) == chunk_placement::v_shape) {
    ACTORPIPE_CHECK(chunks == 2, "schedule ", to_string(kind),
                    " runs two chunks per stage in a V, not ", chunks);
  } else {
    ACTORPIPE_CHECK(chunks == 1 || kind == schedule_kind::interleaved, "schedule ", to_string(kind),
                    " runs one chunk per stage, not ", chunks, " (use interleaved for more)");
  }
  switch (kind) {
  case schedule_kind::gpipe:
    return make_gpipe(stages, microbatches);
  case schedule_kind::one_f_one_b:
    return make_1f1b(stages, microbatches);
  case schedule_kind::interleaved:
    return make_interleaved(stages, microbatches, chunks);
  case schedule_kind::zb_h1:
    return make_zb_h1(stages, microbatches);
  case schedule_kind::zb_h2:
    return make_zb_h2(stages, microbatches);
  case schedule_kind::zb_v:
    return make_v(stages, microbatches, 2 * stages);
  case schedule_kind::v_half:
    return make_v(stages, microbatches, stages + 1);
  }
  return {};
}

schedule make_forward_schedule(std::size_t stages, std::size_t microbatches, std::size_t chunks,
                               chunk_placement placement) {
  check_sizes(stages, microbatches, chunks);
  schedule result(stages, placement);
  for (auto& program : result) {
    for (std::size_t c = 0; c < chunks; ++c) {
      for (std::size_t mb = 0; mb < microbatches; ++mb) {
        program.push_back(F(mb, c));
      }
    }
  }
  return result;
}

std::size_t chunks_of(const schedule& s) {
  int32_t most = 0;
  for (const auto& program : s) {
    for (const auto& a : program) {
      most = std::max(most, a.chunk);
    }
  }
  return static_cast<std::size_t>(most) + 1;
}

bool splits_backward(const schedule& s) {
  for (const auto& program : s) {
    for (const auto& a : program) {
      if (a.kind == action_kind::weight) {
        return true;
      }
    }
  }
  return false;
}

bool splits_backward(schedule_kind kind) {
  switch (kind) {
  case schedule_kind::gpipe:
  case schedule_kind::one_f_one_b:
  case schedule_kind::interleaved:
    return false;
  case schedule_kind::zb_h1:
  case schedule_kind::zb_h2:
  case schedule_kind::zb_v:
  case schedule_kind::v_half:
    return true;
  }
  return false;
}

std::string to_string(const stage_program& program) {
  std::string out;
  for (const auto& a : program) {
    out += (out.empty() ? "" : " ") + to_string(a);
  }
  return out;
}

action parse_action(const std::string& text) {
  auto bad = [&] {
    return invalid_argument(
      detail::concat("'", text, "' is not an action (F3, B0, W2 or with a chunk, F1@1)"));
  };
  if (text.size() < 2 || (text[0] != 'F' && text[0] != 'B' && text[0] != 'W')) {
    throw bad();
  }
  auto at = text.find('@');
  auto number = [&](const std::string& digits) {
    if (digits.empty() || digits.size() > 9 ||
        digits.find_first_not_of("0123456789") != std::string::npos) {
      throw bad();
    }
    return static_cast<int32_t>(std::stol(digits));
  };
  action a{text[0] == 'F'   ? action_kind::forward
           : text[0] == 'B' ? action_kind::backward
                            : action_kind::weight,
           number(text.substr(1, at == std::string::npos ? std::string::npos : at - 1)),
           at == std::string::npos ? 0 : number(text.substr(at + 1))};
  return a;
}

schedule load_schedule(const std::string& path) {
  std::ifstream in(path);
  ACTORPIPE_CHECK(in.good(), "schedule file '", path, "' cannot be read");
  schedule result;
  try {
    auto j = nlohmann::json::parse(in);
    if (j.contains("placement")) {
      result.placement = parse_chunk_placement(j.at("placement").get<std::string>());
    }
    for (const auto& program : j.at("programs")) {
      result.programs.emplace_back();
      for (const auto& item : program) {
        result.programs.back().push_back(parse_action(item.get<std::string>()));
      }
    }
  } catch (const nlohmann::json::exception& e) {
    throw invalid_argument(detail::concat("schedule file '", path, "': ", e.what(),
                                          " (expected {\"programs\": [[\"F0\", ...], ...]})"));
  } catch (const invalid_argument& e) {
    throw invalid_argument(detail::concat("schedule file '", path, "': ", e.what()));
  }
  ACTORPIPE_CHECK(!result.empty(), "schedule file '", path, "' has no programs");
  return result;
}

namespace {
simulation run_simulation(const schedule& s, std::size_t microbatches,
                          const std::vector<action_costs>& costs, double send_latency,
                          bool timeline);
} // namespace

void validate(const schedule& s, std::size_t microbatches, bool training) {
  auto p = s.size();
  ACTORPIPE_CHECK(p >= 1, "a schedule needs at least one stage");
  auto v = chunks_of(s);
  bool split = splits_backward(s);
  // Which (micro-batch, chunk) a stage has forwarded, backed up and weighted so far, and how
  // many: flat flags (sets of pairs made validating a 64 x 512 ZB-V plan cost 45 ms).
  struct seen {
    std::vector<char> flags;
    std::size_t size = 0;
    bool count(std::size_t k) const { return flags[k] != 0; }
    bool insert(std::size_t k) {
      if (flags[k] != 0) {
        return false;
      }
      flags[k] = 1;
      ++size;
      return true;
    }
  };
  for (std::size_t st = 0; st < p; ++st) {
    seen forwarded{std::vector<char>(microbatches * v, 0)};
    seen backed{forwarded};
    seen weighted{forwarded};
    for (std::size_t i = 0; i < s[st].size(); ++i) {
      const auto& a = s[st][i];
      auto where = [&] {
        return detail::concat("stage ", st, ", action ", i, " (", to_string(a), ")");
      };
      ACTORPIPE_CHECK(a.microbatch >= 0 && static_cast<std::size_t>(a.microbatch) < microbatches,
                      where(), ": micro-batch out of range 0..", microbatches - 1);
      ACTORPIPE_CHECK(a.chunk >= 0, where(), ": negative chunk");
      auto key = static_cast<std::size_t>(a.microbatch) * v + static_cast<std::size_t>(a.chunk);
      switch (a.kind) {
      case action_kind::forward:
        ACTORPIPE_CHECK(forwarded.insert(key), where(), ": micro-batch ", a.microbatch,
                        " is forwarded twice");
        break;
      case action_kind::backward:
        ACTORPIPE_CHECK(training, where(), ": a forward-only schedule has a backward");
        ACTORPIPE_CHECK(forwarded.count(key) == 1, where(), ": backward of micro-batch ",
                        a.microbatch, " before its forward");
        ACTORPIPE_CHECK(backed.insert(key), where(), ": micro-batch ", a.microbatch,
                        " is backed up twice");
        break;
      case action_kind::weight:
        ACTORPIPE_CHECK(training, where(), ": a forward-only schedule has a weight action");
        ACTORPIPE_CHECK(backed.count(key) == 1, where(), ": weight gradient of micro-batch ",
                        a.microbatch, " before its backward");
        ACTORPIPE_CHECK(weighted.insert(key), where(), ": micro-batch ", a.microbatch,
                        " has two weight actions");
        break;
      }
    }
    auto expected = microbatches * v;
    ACTORPIPE_CHECK(forwarded.size == expected, "stage ", st, " forwards ", forwarded.size, " of ",
                    expected, " micro-batch chunks");
    ACTORPIPE_CHECK(!training || backed.size == expected, "stage ", st, " backs up ", backed.size,
                    " of ", expected, " micro-batch chunks");
    ACTORPIPE_CHECK(!split || weighted.size == expected, "stage ", st, " has ", weighted.size,
                    " weight actions for ", expected, " micro-batch chunks");
  }
  run_simulation(s, microbatches, {action_costs{}}, 0, /*timeline=*/false);
}

double peak_stash(const stage_program& program, std::size_t chunks) {
  bool split = false;
  for (const auto& a : program) {
    split = split || a.kind == action_kind::weight;
  }
  auto release = split ? action_kind::weight : action_kind::backward;
  double live = 0;
  double peak = 0;
  for (const auto& a : program) {
    if (a.kind == action_kind::forward) {
      live += 1.0 / static_cast<double>(chunks);
      peak = std::max(peak, live);
    } else if (a.kind == release) {
      live -= 1.0 / static_cast<double>(chunks);
    }
  }
  return peak;
}

double simulation::mean_bubble() const {
  double sum = 0;
  for (auto b : bubble) {
    sum += b;
  }
  return bubble.empty() ? 0 : sum / static_cast<double>(bubble.size());
}

namespace {

// simulate(), with or without the timeline (validate needs only whether every action runs:
// writing 196,608 timeline entries into fresh pages was most of validating a 64 x 512 ZB-V plan).
simulation run_simulation(const schedule& s, std::size_t microbatches,
                          const std::vector<action_costs>& costs, double send_latency,
                          bool timeline) {
  auto p = s.size();
  auto v = chunks_of(s);
  auto virtual_stages = p * v;
  bool split = splits_backward(s);
  ACTORPIPE_CHECK(costs.size() == 1 || costs.size() == virtual_stages, "simulate: ", costs.size(),
                  " costs given for ", virtual_stages, " virtual stages");
  auto cost_at = [&](std::size_t vs) -> const action_costs& {
    return costs.size() == 1 ? costs[0] : costs[vs];
  };
  auto cost_of = [&](const action& a, std::size_t vs) {
    const auto& c = cost_at(vs);
    switch (a.kind) {
    case action_kind::forward:
      return c.forward;
    case action_kind::backward:
      return split ? c.backward : c.fused >= 0 ? c.fused : c.backward + c.weight;
    case action_kind::weight:
      return c.weight;
    }
    return 0.0;
  };
  // When each (kind, micro-batch, virtual stage) finished, -1 while it has not: a flat table
  // (a map of 131,072 actions made a 64 x 512 interleaved plan cost 96 ms).
  std::size_t max_microbatch = microbatches;
  for (const auto& program : s) {
    for (const auto& a : program) {
      ACTORPIPE_CHECK(a.microbatch >= 0 && a.chunk >= 0, "simulate: action ", to_string(a),
                      " has a negative micro-batch or chunk");
      max_microbatch = std::max(max_microbatch, static_cast<std::size_t>(a.microbatch) + 1);
    }
  }
  // By virtual stage, then kind, then micro-batch: a stage's consecutive actions read and write
  // neighbouring entries.
  std::vector<double> finished(3 * max_microbatch * virtual_stages, -1.0);
  auto slot = [&](action_kind kind, int32_t microbatch, std::size_t vs) -> double& {
    return finished[(vs * 3 + static_cast<std::size_t>(kind)) * max_microbatch +
                    static_cast<std::size_t>(microbatch)];
  };
  simulation result;
  result.busy.assign(p, 0);
  result.timeline.assign(p, {});
  for (std::size_t st = 0; timeline && st < p; ++st) {
    result.timeline[st].reserve(s[st].size());
  }
  std::vector<std::size_t> pc(p, 0);
  std::vector<double> clock(p, 0);
  // The time an action's cross-stage input is there, or -1 while it is not known yet.
  auto input_ready = [&](std::size_t st, const action& a) -> double {
    auto vs = s.virtual_stage(st, static_cast<std::size_t>(a.chunk));
    if (a.kind == action_kind::forward) {
      if (vs == 0) {
        return 0;
      }
      auto done = slot(action_kind::forward, a.microbatch, vs - 1);
      return done < 0 ? -1 : done + send_latency + cost_at(vs - 1).send;
    }
    if (a.kind == action_kind::backward && vs + 1 < virtual_stages) {
      auto done = slot(action_kind::backward, a.microbatch, vs + 1);
      return done < 0 ? -1 : done + send_latency + cost_at(vs).send;
    }
    return 0; // the last virtual stage's backward and every W depend on the stage's own order
  };
  for (bool moved = true; moved;) {
    moved = false;
    for (std::size_t st = 0; st < p; ++st) {
      while (pc[st] < s[st].size()) {
        const auto& a = s[st][pc[st]];
        auto ready = input_ready(st, a);
        if (ready < 0) {
          break;
        }
        auto vs = s.virtual_stage(st, static_cast<std::size_t>(a.chunk));
        auto start = std::max(clock[st], ready);
        auto end = start + cost_of(a, vs);
        slot(a.kind, a.microbatch, vs) = end;
        if (timeline) {
          result.timeline[st].push_back({a, start, end});
        }
        result.busy[st] += end - start;
        clock[st] = end;
        ++pc[st];
        moved = true;
      }
    }
  }
  for (std::size_t st = 0; st < p; ++st) {
    if (pc[st] < s[st].size()) {
      const auto& a = s[st][pc[st]];
      bool fwd = a.kind == action_kind::forward;
      auto vs = s.virtual_stage(st, static_cast<std::size_t>(a.chunk));
      auto from = holder_of(s.placement, p, fwd ? vs - 1 : vs + 1);
      throw invalid_argument(detail::concat(
        "schedule deadlocks: stage ", st, " waits at action ", pc[st], " (", to_string(a),
        ") for the ", fwd ? "activation" : "gradient", " of micro-batch ", a.microbatch,
        " from stage ", from.stage, from.chunk > 0 ? detail::concat(" chunk ", from.chunk) : "",
        ", which never sends it"));
    }
    result.makespan = std::max(result.makespan, clock[st]);
  }
  for (std::size_t st = 0; st < p; ++st) {
    result.bubble.push_back(result.makespan > 0 ? 1 - result.busy[st] / result.makespan : 0);
    result.peak_stash.push_back(peak_stash(s[st], v));
  }
  return result;
}

} // namespace

simulation simulate(const schedule& s, std::size_t microbatches,
                    const std::vector<action_costs>& costs, double send_latency) {
  return run_simulation(s, microbatches, costs, send_latency, /*timeline=*/true);
}

} // namespace actorpipe
