/// \file
/// The built-in schedules: GPipe, 1F1B, interleaved, the zero-bubble family (ZB-H1, ZB-H2,
/// interleaved ZB, ZB-V, V-Half, V-Min) and DualPipeV, built as per-stage programs; their names.
#include <actorpipe/schedule.hpp>

#include <algorithm>
#include <array>
#include <deque>
#include <limits>
#include <tuple>

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

// Splits every backward of `s` into B and W, stage i deferring each W by i backwards: the W of
// a stage's k-th backward follows its (k + i)-th B, the rest drain at the end. Later stages pass
// their B's upstream sooner, earlier stages fill their cool-down with W's.
schedule defer_weights(const schedule& s) {
  schedule result(s.size(), s.placement);
  for (std::size_t st = 0; st < s.size(); ++st) {
    std::vector<action> weights;
    std::size_t next_w = 0;
    for (const auto& a : s[st]) {
      result[st].push_back(a);
      if (a.kind != action_kind::backward) {
        continue;
      }
      weights.push_back(
        W(static_cast<std::size_t>(a.microbatch), static_cast<std::size_t>(a.chunk)));
      if (weights.size() > st + next_w) {
        result[st].push_back(weights[next_w++]);
      }
    }
    while (next_w < weights.size()) {
      result[st].push_back(weights[next_w++]);
    }
  }
  return result;
}

// ZB-H1 (Qi et al.): 1F1B's order of F and B, B computing only the input gradient, and stage s
// deferring each weight gradient by s micro-batches: W(k - s) follows B(k). With equal F, B and
// W costs the bubble is (p - 1) units against 1F1B's 3(p - 1), and no stage holds more than p
// micro-batches, 1F1B's peak (on its first stage).
schedule make_zb_h1(std::size_t p, std::size_t m) {
  return defer_weights(make_1f1b(p, m));
}

// Interleaved zero bubble (PyTorch's ScheduleInterleavedZeroBubble, ZB1P over v chunks):
// interleaved 1F1B's warm-up and order, each W deferred as ZB-H1 defers it.
schedule make_interleaved_zb(std::size_t p, std::size_t m, std::size_t v) {
  return defer_weights(make_interleaved(p, m, v));
}

// DualPipeV (DeepSeek, the V-shaped half of DualPipe): two chunks per stage in a V, stage r of p
// in eight phases: 2(p - r - 1) forwards of chunk 0; r + 1 pairs F0 F1; p - r - 1 rounds B1 W1
// F1 (split backward); the main phase, F0 with B1 then F1 with B0 (each pair overlapped on a GPU:
// one pair's transfer hides behind the other's compute); p - r - 1 rounds B1, F1 with B0; r + 1
// rounds B1 B0 (the second half split); p - r - 1 rounds W B0 (split); r + 1 W's. A backward
// that is not split is a lone B (split_backwards: one walk of the graph). Follows
// deepseek-ai/DualPipe's dualpipev.py; needs m >= 2p.
schedule make_dualpipe_v(std::size_t p, std::size_t m) {
  ACTORPIPE_CHECK(m >= 2 * p, "the dualpipe-v schedule needs microbatches (", m,
                  ") >= 2 x stages (", 2 * p, ")");
  schedule result(p, chunk_placement::v_shape);
  for (std::size_t r = 0; r < p; ++r) {
    auto& program = result[r];
    std::array<std::size_t, 2> next_f{};
    std::array<std::size_t, 2> next_b{};
    std::deque<action> weights;
    auto forward = [&](std::size_t c) { program.push_back(F(next_f[c]++, c)); };
    auto backward = [&](std::size_t c, bool split) {
      auto mb = next_b[c]++;
      program.push_back(B(mb, c));
      if (split) {
        weights.push_back(W(mb, c));
      }
    };
    auto weight = [&] {
      program.push_back(weights.front());
      weights.pop_front();
    };
    auto later = p - r - 1;
    for (std::size_t i = 0; i < 2 * later; ++i) {
      forward(0);
    }
    for (std::size_t i = 0; i < r + 1; ++i) {
      forward(0);
      forward(1);
    }
    for (std::size_t i = 0; i < later; ++i) {
      backward(1, true);
      weight();
      forward(1);
    }
    for (std::size_t i = 0; i < m - 2 * p + r + 1; ++i) {
      forward(0);
      backward(1, false);
      forward(1);
      backward(0, false);
    }
    for (std::size_t i = 0; i < later; ++i) {
      backward(1, false);
      forward(1);
      backward(0, false);
    }
    bool split = false;
    for (std::size_t i = 0; i < r + 1; ++i) {
      split = split || (i == (r + 1) / 2 && r % 2 == 1);
      backward(1, split);
      split = split || (i == (r + 1) / 2 && r % 2 == 0);
      backward(0, split);
    }
    for (std::size_t i = 0; i < later; ++i) {
      weight();
      backward(0, true);
    }
    while (!weights.empty()) {
      weight();
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

// V-Min's stash in chunk activations: about a third of 1F1B's 2p, and one kept for the second
// chunk (make_v needs 2 at least).
std::size_t v_min_cap(std::size_t p) {
  return (2 * p + 2) / 3 + 1;
}

// ZB-V, V-Half and V-Min (Qi et al.): two chunks per stage in a V (stage 0 holds the first and the
// last virtual stage), backward split into B and W, built by list scheduling with unit costs.
// Whenever a stage is free it runs, of what is ready then, the oldest input-gradient B (the
// critical path), else a forward (of the chunk nearer the loss first) while its stash stays within
// `cap` chunk activations, one of them kept for the second chunk (whose forwards lead to the loss
// and so to the backwards that free the stash), else the oldest W. Stages decide in the order of
// the time they can start, so no later decision could have made an earlier one's input ready
// sooner. ZB-V's cap is 2p chunk activations (1F1B's p micro-batches), V-Half's p + 1, V-Min's
// ceil(2p / 3) + 1 (v_min_cap).
class v_builder {
public:
  v_builder(std::size_t p, std::size_t m, std::size_t cap)
    : p_(p), m_(m), cap_(cap), f_end_(p * v * m, -1.0), b_end_(p * v * m, -1.0), stages_(p),
      result_(p, chunk_placement::v_shape), choices_(p) {
    while (leaves_ < p) {
      leaves_ *= 2;
    }
    tree_.assign(2 * leaves_, p);
    for (std::size_t i = 0; i < p; ++i) {
      tree_[leaves_ + i] = i;
    }
  }

  schedule build() {
    for (std::size_t i = 0; i < p_; ++i) {
      update(i);
    }
    for (auto remaining = p_ * v * m_ * 3; remaining > 0; --remaining) {
      auto best = tree_[1];
      ACTORPIPE_CHECK(best < p_ && choices_[best].start < std::numeric_limits<double>::infinity(),
                      "the V schedule for ", p_, " stages and ", m_,
                      " micro-batches deadlocks with a stash of ", cap_, " chunk activations");
      place(best);
    }
    return std::move(result_);
  }

private:
  static constexpr std::size_t v = 2;
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
  // What a stage would run next and when (start infinite: nothing it can run yet).
  struct choice {
    double start = std::numeric_limits<double>::infinity();
    action what{};
  };

  // When (virtual stage, micro-batch)'s F or B ends, -1 until placed.
  double& slot(std::vector<double>& ends, std::size_t vs, std::size_t mb) {
    return ends[vs * m_ + mb];
  }

  // B before F before W; then the older micro-batch; then the chunk nearer the loss.
  static auto rank(const action& a) {
    auto kind = a.kind == action_kind::backward ? 0 : a.kind == action_kind::forward ? 1 : 2;
    return std::make_tuple(kind, a.microbatch, -a.chunk);
  }

  // Stage i's next action: of what is ready when it can start, the best ranked.
  choice evaluate(std::size_t i) {
    auto& st = stages_[i];
    candidates_.clear();
    for (std::size_t c = 0; c < v; ++c) {
      auto vs = virtual_stage_of(chunk_placement::v_shape, p_, i, c);
      auto mb = st.next_b[c];
      if (mb < m_ && slot(f_end_, vs, mb) >= 0) {
        auto ready = vs + 1 == p_ * v ? slot(f_end_, vs, mb) : slot(b_end_, vs + 1, mb);
        if (ready >= 0) {
          candidates_.push_back({B(mb, c), ready});
        }
      }
      mb = st.next_f[c];
      auto limit = c + 1 == v ? cap_ : cap_ - 1;
      if (mb < m_ && st.stash + 1 <= limit) {
        auto ready = vs == 0 ? 0.0 : slot(f_end_, vs - 1, mb);
        if (ready >= 0) {
          candidates_.push_back({F(mb, c), ready});
        }
      }
    }
    if (!st.weights.empty()) {
      candidates_.push_back({st.weights.front(), 0.0});
    }
    choice result;
    if (candidates_.empty()) {
      return result;
    }
    auto earliest = std::min_element(candidates_.begin(), candidates_.end(), [](auto& x, auto& y) {
                      return x.ready < y.ready;
                    })->ready;
    result.start = std::max(st.clock, earliest);
    const candidate* pick = nullptr;
    for (const auto& cand : candidates_) {
      if (cand.ready <= result.start && (pick == nullptr || rank(cand.what) < rank(pick->what))) {
        pick = &cand;
      }
    }
    result.what = pick->what;
    return result;
  }

  // The tournament's winner of two stages: the sooner start, the lower index of equals (a left
  // subtree's stages come first).
  std::size_t winner(std::size_t a, std::size_t b) const {
    if (a >= p_) {
      return b;
    }
    if (b >= p_) {
      return a;
    }
    return choices_[b].start < choices_[a].start ? b : a;
  }

  void update(std::size_t i) {
    choices_[i] = evaluate(i);
    for (auto node = (leaves_ + i) / 2; node >= 1; node /= 2) {
      tree_[node] = winner(tree_[2 * node], tree_[2 * node + 1]);
    }
  }

  // Runs stage `i`'s choice; it changes only that stage's next choice and that of the stage its
  // output goes to, so only those are evaluated again (building a 64 x 512 ZB-V: 177 -> 60 ms).
  void place(std::size_t i) {
    auto best = choices_[i].what;
    auto& st = stages_[i];
    auto c = static_cast<std::size_t>(best.chunk);
    auto mb = static_cast<std::size_t>(best.microbatch);
    auto vs = virtual_stage_of(chunk_placement::v_shape, p_, i, c);
    st.clock = choices_[i].start + 1;
    switch (best.kind) {
    case action_kind::forward:
      slot(f_end_, vs, mb) = st.clock;
      ++st.next_f[c];
      ++st.stash;
      break;
    case action_kind::backward:
      slot(b_end_, vs, mb) = st.clock;
      ++st.next_b[c];
      st.weights.push_back(W(mb, c));
      break;
    case action_kind::weight:
      st.weights.pop_front();
      --st.stash;
      break;
    }
    result_[i].push_back(best);
    update(i);
    if (best.kind == action_kind::forward && vs + 1 < p_ * v) {
      update(holder_of(chunk_placement::v_shape, p_, vs + 1).stage);
    } else if (best.kind == action_kind::backward && vs > 0) {
      update(holder_of(chunk_placement::v_shape, p_, vs - 1).stage);
    }
  }

  std::size_t p_;
  std::size_t m_;
  std::size_t cap_;
  std::vector<double> f_end_;
  std::vector<double> b_end_;
  std::vector<stage_state> stages_;
  schedule result_;
  std::vector<candidate> candidates_;
  std::vector<choice> choices_;
  // A tournament over the stages' choices: each node holds the stage that starts soonest below
  // it, so the root is the next stage to run and a changed choice costs log p comparisons (a
  // scan of every stage per action was most of building a 64 x 512 plan).
  std::size_t leaves_ = 1;
  std::vector<std::size_t> tree_;
};

schedule make_v(std::size_t p, std::size_t m, std::size_t cap) {
  return v_builder(p, m, cap).build();
}

} // namespace

std::size_t chunks_for(schedule_kind kind, std::size_t chunks) {
  return placement_of(kind) == chunk_placement::v_shape ? 2 : chunks;
}

namespace {
// Every built-in schedule and its name, in the order the help lists them.
const std::array<std::pair<schedule_kind, const char*>, 10> schedule_names{{
  {schedule_kind::gpipe, "gpipe"},
  {schedule_kind::one_f_one_b, "1f1b"},
  {schedule_kind::interleaved, "interleaved"},
  {schedule_kind::zb_h1, "zb-h1"},
  {schedule_kind::zb_h2, "zb-h2"},
  {schedule_kind::interleaved_zb, "interleaved-zb"},
  {schedule_kind::zb_v, "zb-v"},
  {schedule_kind::v_half, "v-half"},
  {schedule_kind::v_min, "v-min"},
  {schedule_kind::dualpipe_v, "dualpipe-v"},
}};
} // namespace

std::string known_schedules() {
  std::string out;
  for (const auto& [kind, name] : schedule_names) {
    out += (out.empty() ? "" : ", ") + std::string(name);
  }
  return out;
}

schedule_kind parse_schedule_kind(const std::string& name) {
  for (const auto& [kind, known] : schedule_names) {
    if (name == known) {
      return kind;
    }
  }
  throw invalid_argument(
    detail::concat("unknown schedule '", name, "' (known: ", known_schedules(), ")"));
}

chunk_placement parse_chunk_placement(const std::string& name) {
  ACTORPIPE_CHECK(name == "looped" || name == "v", "placement '", name,
                  "' is neither \"looped\" nor \"v\"");
  return name == "v" ? chunk_placement::v_shape : chunk_placement::looped;
}

std::string to_string(schedule_kind kind) {
  for (const auto& [known, name] : schedule_names) {
    if (kind == known) {
      return name;
    }
  }
  return "?";
}

bool takes_microbatches(schedule_kind kind, std::size_t stages, std::size_t microbatches) {
  if (interleaves(kind)) {
    return microbatches % stages == 0;
  }
  return kind != schedule_kind::dualpipe_v || microbatches >= 2 * stages;
}

schedule make_schedule(schedule_kind kind, std::size_t stages, std::size_t microbatches,
                       std::size_t chunks) {
  check_sizes(stages, microbatches, chunks);
  if (placement_of(kind) == chunk_placement::v_shape) {
    ACTORPIPE_CHECK(chunks == 2, "schedule ", to_string(kind),
                    " runs two chunks per stage in a V, not ", chunks);
  } else {
    ACTORPIPE_CHECK(!interleaves(kind) || microbatches % stages == 0, "the ", to_string(kind),
                    " schedule needs microbatches (", microbatches,
                    ") to be a multiple of stages (", stages, ")");
    ACTORPIPE_CHECK(chunks == 1 || interleaves(kind), "schedule ", to_string(kind),
                    " runs one chunk per stage, not ", chunks,
                    " (use interleaved or interleaved-zb for more)");
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
  case schedule_kind::interleaved_zb:
    return make_interleaved_zb(stages, microbatches, chunks);
  case schedule_kind::dualpipe_v:
    return make_dualpipe_v(stages, microbatches);
  case schedule_kind::v_min:
    return make_v(stages, microbatches, v_min_cap(stages));
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
  case schedule_kind::interleaved_zb:
  case schedule_kind::dualpipe_v:
  case schedule_kind::v_min:
    return true;
  }
  return false;
}

} // namespace actorpipe
