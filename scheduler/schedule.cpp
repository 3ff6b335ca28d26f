#include <actorpipe/schedule.hpp>

#include <algorithm>
#include <set>
#include <sstream>

#include <actorpipe/errors.hpp>

namespace actorpipe {
namespace {

void check_sizes(std::size_t stages, std::size_t microbatches) {
  ACTORPIPE_CHECK(stages >= 1, "stages (", stages, ") must be >= 1");
  ACTORPIPE_CHECK(microbatches >= 1, "microbatches (", microbatches, ") must be >= 1");
}

action F(std::size_t mb) {
  return {action_kind::forward, static_cast<int32_t>(mb)};
}

action B(std::size_t mb) {
  return {action_kind::backward, static_cast<int32_t>(mb)};
}

std::string to_string(const action& a) {
  return detail::concat(a.kind == action_kind::forward ? 'F' : 'B', a.microbatch);
}

} // namespace

schedule_kind parse_schedule_kind(const std::string& name) {
  if (name == "gpipe") {
    return schedule_kind::gpipe;
  }
  if (name == "1f1b") {
    return schedule_kind::one_f_one_b;
  }
  throw invalid_argument(detail::concat("unknown schedule '", name, "' (known: gpipe, 1f1b)"));
}

std::string to_string(schedule_kind kind) {
  return kind == schedule_kind::gpipe ? "gpipe" : "1f1b";
}

schedule make_schedule(schedule_kind kind, std::size_t stages, std::size_t microbatches) {
  check_sizes(stages, microbatches);
  schedule result(stages);
  for (std::size_t s = 0; s < stages; ++s) {
    auto& program = result[s];
    if (kind == schedule_kind::gpipe) {
      for (std::size_t mb = 0; mb < microbatches; ++mb) {
        program.push_back(F(mb));
      }
      for (std::size_t mb = microbatches; mb-- > 0;) {
        program.push_back(B(mb));
      }
      continue;
    }
    // 1F1B: stage s runs p - s - 1 warm-up forwards so that its first backward arrives just as
    // its next forward would, then alternates, then drains.
    auto warmup = std::min(stages - s - 1, microbatches);
    for (std::size_t mb = 0; mb < warmup; ++mb) {
      program.push_back(F(mb));
    }
    for (std::size_t k = 0; k + warmup < microbatches; ++k) {
      program.push_back(F(warmup + k));
      program.push_back(B(k));
    }
    for (std::size_t mb = microbatches - warmup; mb < microbatches; ++mb) {
      program.push_back(B(mb));
    }
  }
  return result;
}

schedule make_forward_schedule(std::size_t stages, std::size_t microbatches) {
  check_sizes(stages, microbatches);
  schedule result(stages);
  for (auto& program : result) {
    for (std::size_t mb = 0; mb < microbatches; ++mb) {
      program.push_back(F(mb));
    }
  }
  return result;
}

void validate(const schedule& s, std::size_t microbatches, bool training) {
  auto p = s.size();
  ACTORPIPE_CHECK(p >= 1, "a schedule needs at least one stage");
  // Per stage: every micro-batch forwarded once, and in training backed up once, after it.
  for (std::size_t st = 0; st < p; ++st) {
    std::set<int32_t> forwarded;
    std::set<int32_t> backed;
    for (std::size_t i = 0; i < s[st].size(); ++i) {
      const auto& a = s[st][i];
      ACTORPIPE_CHECK(a.microbatch >= 0 && static_cast<std::size_t>(a.microbatch) < microbatches,
                      "stage ", st, ", action ", i, " (", to_string(a),
                      "): micro-batch out of range 0..", microbatches - 1);
      if (a.kind == action_kind::forward) {
        ACTORPIPE_CHECK(forwarded.insert(a.microbatch).second, "stage ", st, ", action ", i,
                        ": micro-batch ", a.microbatch, " is forwarded twice");
      } else {
        ACTORPIPE_CHECK(training, "stage ", st, ", action ", i,
                        ": a forward-only schedule has a backward (", to_string(a), ")");
        ACTORPIPE_CHECK(forwarded.count(a.microbatch) == 1, "stage ", st, ", action ", i,
                        ": backward of micro-batch ", a.microbatch, " before its forward");
        ACTORPIPE_CHECK(backed.insert(a.microbatch).second, "stage ", st, ", action ", i,
                        ": micro-batch ", a.microbatch, " is backed up twice");
      }
    }
    ACTORPIPE_CHECK(forwarded.size() == microbatches, "stage ", st, " forwards ", forwarded.size(),
                    " of ", microbatches, " micro-batches");
    ACTORPIPE_CHECK(!training || backed.size() == microbatches, "stage ", st, " backs up ",
                    backed.size(), " of ", microbatches, " micro-batches");
  }
  // Across stages: run the programs with their data dependencies; if no stage can move before
  // all are done, the schedule deadlocks.
  std::vector<std::size_t> pc(p, 0);
  std::vector<std::set<int32_t>> forward_done(p);
  std::vector<std::set<int32_t>> backward_done(p);
  auto ready = [&](std::size_t st, const action& a) {
    if (a.kind == action_kind::forward) {
      return st == 0 || forward_done[st - 1].count(a.microbatch) == 1;
    }
    return st + 1 == p || backward_done[st + 1].count(a.microbatch) == 1;
  };
  for (bool moved = true; moved;) {
    moved = false;
    for (std::size_t st = 0; st < p; ++st) {
      while (pc[st] < s[st].size() && ready(st, s[st][pc[st]])) {
        const auto& a = s[st][pc[st]];
        (a.kind == action_kind::forward ? forward_done : backward_done)[st].insert(a.microbatch);
        ++pc[st];
        moved = true;
      }
    }
  }
  for (std::size_t st = 0; st < p; ++st) {
    if (pc[st] < s[st].size()) {
      const auto& a = s[st][pc[st]];
      bool fwd = a.kind == action_kind::forward;
      throw invalid_argument(detail::concat(
        "schedule deadlocks: stage ", st, " waits at action ", pc[st], " (", to_string(a),
        ") for the ", fwd ? "activation" : "gradient", " of micro-batch ", a.microbatch,
        " from stage ", fwd ? st - 1 : st + 1, ", which never sends it"));
    }
  }
}

std::size_t peak_stash(const stage_program& program) {
  std::size_t live = 0;
  std::size_t peak = 0;
  for (const auto& a : program) {
    if (a.kind == action_kind::forward) {
      peak = std::max(peak, ++live);
    } else if (live > 0) {
      --live;
    }
  }
  return peak;
}

std::string to_string(const stage_program& program) {
  std::string out;
  for (const auto& a : program) {
    out += (out.empty() ? "" : " ") + to_string(a);
  }
  return out;
}

} // namespace actorpipe
