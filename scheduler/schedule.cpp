/// \file
/// What every schedule shares: validation, JSON files, the stash bound and the simulator (the
/// built-in schedules are in builtin.cpp).
#include <actorpipe/schedule.hpp>

#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include <actorpipe/errors.hpp>

#include "scheduler/liveness.hpp"

namespace actorpipe {

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

namespace {

// Which (micro-batch, chunk) a stage has forwarded, backed up or weighted so far, and how many:
// flat flags (sets of pairs made validating a 64 x 512 ZB-V plan cost 45 ms).
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

// Stage `st`'s program runs every micro-batch's chunks once, each backward after its forward
// and each weight pass after its backward; backwards and weight passes only when training.
void validate_program(const stage_program& program, std::size_t st, std::size_t microbatches,
                      std::size_t v, bool training) {
  seen forwarded{std::vector<char>(microbatches * v, 0)};
  seen backed{forwarded};
  seen weighted{forwarded};
  for (std::size_t i = 0; i < program.size(); ++i) {
    const auto& a = program[i];
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
}

} // namespace

void validate(const schedule& s, std::size_t microbatches, bool training) {
  auto p = s.size();
  ACTORPIPE_CHECK(p >= 1, "a schedule needs at least one stage");
  auto v = chunks_of(s);
  for (std::size_t st = 0; st < p; ++st) {
    validate_program(s[st], st, microbatches, v, training);
  }
  // Every action's input comes: the simulation refuses a schedule that deadlocks.
  run_simulation(s, microbatches, {action_costs{}}, 0, /*timeline=*/false);
}

namespace {

// peak_stash with `split` = split_backwards(program), which the simulator has already.
// A micro-batch chunk counts 1/chunks from its forward to its W, or to its B when that is whole.
double peak_stash_of(const stage_program& program, const std::vector<bool>& split,
                     std::size_t chunks) {
  auto share = 1.0 / static_cast<double>(chunks);
  return liveness::peak_held(program, split,
                             [share](int32_t, int32_t, bool) { return std::pair(share, 0.0); });
}

} // namespace

double peak_stash(const stage_program& program, std::size_t chunks) {
  return peak_stash_of(program, split_backwards(program), chunks);
}

double simulation::mean_bubble() const {
  double sum = 0;
  for (auto b : bubble) {
    sum += b;
  }
  return bubble.empty() ? 0 : sum / static_cast<double>(bubble.size());
}

namespace {

// The links between stages: each direction carries one transfer at a time, in the order its
// sender sent them (the sender's program order, so the queue is exact): a transfer of `cost`
// sent at `end` arrives when the link has carried what was sent before it, and then this one.
// Within a stage (the V's turn) nothing queues; `send_latency` is added to every transfer.
class link_queue {
public:
  link_queue(const schedule& s, double send_latency)
    : s_(s), latency_(send_latency), free_(s.size() * s.size(), 0.0) {}

  // When a transfer of `cost` from stage `from`, sent at `end`, is at virtual stage `to_vs`.
  double arrival(std::size_t from, std::size_t to_vs, double end, double cost) {
    auto to = holder_of(s_.placement, s_.size(), to_vs).stage;
    if (from == to || cost <= 0) {
      return end + cost + latency_;
    }
    auto& free = free_[from * s_.size() + to];
    free = std::max(free, end) + cost;
    return free + latency_;
  }

private:
  const schedule& s_;
  double latency_;
  std::vector<double> free_;
};

// One more than the largest micro-batch any action names (at least `microbatches`).
std::size_t microbatch_bound(const schedule& s, std::size_t microbatches) {
  for (const auto& program : s) {
    for (const auto& a : program) {
      ACTORPIPE_CHECK(a.microbatch >= 0 && a.chunk >= 0, "simulate: action ", to_string(a),
                      " has a negative micro-batch or chunk");
      microbatches = std::max(microbatches, static_cast<std::size_t>(a.microbatch) + 1);
    }
  }
  return microbatches;
}

// What an action of `kind` costs at `c`; `split`: a B whose W comes later (a B without one is
// whole: fused, or B + W without a fused cost).
double action_cost(action_kind kind, bool split, const action_costs& c) {
  switch (kind) {
  case action_kind::forward:
    return c.forward;
  case action_kind::backward:
    return split ? c.backward : c.fused >= 0 ? c.fused : c.backward + c.weight;
  case action_kind::weight:
    return c.weight;
  }
  return 0.0;
}

// Stage `st` is stuck at action `at`: names what it waits for and from whom.
[[noreturn]] void deadlock(const schedule& s, std::size_t st, std::size_t at) {
  const auto& a = s[st][at];
  bool fwd = a.kind == action_kind::forward;
  auto vs = s.virtual_stage(st, static_cast<std::size_t>(a.chunk));
  auto from = holder_of(s.placement, s.size(), fwd ? vs - 1 : vs + 1);
  throw invalid_argument(detail::concat(
    "schedule deadlocks: stage ", st, " waits at action ", at, " (", to_string(a), ") for the ",
    fwd ? "activation" : "gradient", " of micro-batch ", a.microbatch, " from stage ", from.stage,
    from.chunk > 0 ? detail::concat(" chunk ", from.chunk) : "", ", which never sends it"));
}

// One simulated step of a schedule: each stage runs its program in order, an action once its
// input has arrived (simulate()).
class step_simulator {
public:
  step_simulator(const schedule& s, std::size_t microbatches,
                 const std::vector<action_costs>& costs, double send_latency)
    : s_(s), costs_(costs), virtual_stages_(s.size() * chunks_of(s)),
      max_microbatch_(microbatch_bound(s, microbatches)),
      // By virtual stage, then kind, then micro-batch: a stage's consecutive actions read and
      // write neighbouring entries.
      finished_(3 * max_microbatch_ * virtual_stages_, -1.0), links_(s, send_latency) {
    ACTORPIPE_CHECK(costs.size() == 1 || costs.size() == virtual_stages_,
                    "simulate: ", costs.size(), " costs given for ", virtual_stages_,
                    " virtual stages");
    for (const auto& program : s) {
      split_.push_back(split_backwards(program));
    }
  }

  // Runs every stage as far as its inputs allow until none moves; with `timeline`, records each
  // action's start and end. Throws when a stage is left waiting (deadlock()).
  simulation run(bool timeline) {
    auto p = s_.size();
    simulation result;
    result.busy.assign(p, 0);
    result.timeline.assign(p, {});
    for (std::size_t st = 0; timeline && st < p; ++st) {
      result.timeline[st].reserve(s_[st].size());
    }
    std::vector<std::size_t> pc(p, 0);
    std::vector<double> clock(p, 0);
    for (bool moved = true; moved;) {
      moved = false;
      for (std::size_t st = 0; st < p; ++st) {
        moved = run_stage(st, pc[st], clock[st], timeline, result) || moved;
      }
    }
    for (std::size_t st = 0; st < p; ++st) {
      if (pc[st] < s_[st].size()) {
        deadlock(s_, st, pc[st]);
      }
      result.makespan = std::max(result.makespan, clock[st]);
    }
    for (std::size_t st = 0; st < p; ++st) {
      result.bubble.push_back(result.makespan > 0 ? 1 - result.busy[st] / result.makespan : 0);
      result.peak_stash.push_back(peak_stash_of(s_[st], split_[st], chunks_of(s_)));
    }
    return result;
  }

private:
  // Runs stage `st` from action `pc` while inputs are there; whether it ran any.
  bool run_stage(std::size_t st, std::size_t& pc, double& clock, bool timeline,
                 simulation& result) {
    bool moved = false;
    while (pc < s_[st].size()) {
      const auto& a = s_[st][pc];
      auto ready = input_ready(st, a);
      if (ready < 0) {
        break;
      }
      auto vs = s_.virtual_stage(st, static_cast<std::size_t>(a.chunk));
      auto start = std::max(clock, ready);
      auto end = start + action_cost(a.kind, split_[st][pc], cost_at(vs));
      slot(a.kind, a.microbatch, vs) = delivered(st, a, vs, end);
      if (timeline) {
        result.timeline[st].push_back({a, start, end});
      }
      result.busy[st] += end - start;
      clock = end;
      ++pc;
      moved = true;
    }
    return moved;
  }

  const action_costs& cost_at(std::size_t vs) const {
    return costs_.size() == 1 ? costs_[0] : costs_[vs];
  }

  // When the output of each (kind, micro-batch, virtual stage) is at the virtual stage that takes
  // it, -1 until known: a flat table (a map of 131,072 actions made a 64 x 512 interleaved plan
  // cost 96 ms).
  double& slot(action_kind kind, int32_t microbatch, std::size_t vs) {
    return finished_[(vs * 3 + static_cast<std::size_t>(kind)) * max_microbatch_ +
                     static_cast<std::size_t>(microbatch)];
  }

  // The time an action's cross-stage input is there, or -1 while it is not known yet.
  double input_ready(std::size_t st, const action& a) {
    auto vs = s_.virtual_stage(st, static_cast<std::size_t>(a.chunk));
    if (a.kind == action_kind::forward) {
      return vs == 0 ? 0 : slot(action_kind::forward, a.microbatch, vs - 1);
    }
    if (a.kind == action_kind::backward && vs + 1 < virtual_stages_) {
      return slot(action_kind::backward, a.microbatch, vs + 1);
    }
    return 0; // the last virtual stage's backward and every W depend on the stage's own order
  }

  // When action `a` of stage `st`, ending at `end`, has its output at the virtual stage that
  // takes it (a W's and the last stage's outputs go nowhere).
  double delivered(std::size_t st, const action& a, std::size_t vs, double end) {
    if (a.kind == action_kind::forward && vs + 1 < virtual_stages_) {
      return links_.arrival(st, vs + 1, end, cost_at(vs).send);
    }
    if (a.kind == action_kind::backward && vs > 0) {
      return links_.arrival(st, vs - 1, end, cost_at(vs - 1).send);
    }
    return end;
  }

  const schedule& s_;
  const std::vector<action_costs>& costs_;
  std::size_t virtual_stages_;
  std::size_t max_microbatch_;
  std::vector<double> finished_;
  link_queue links_;
  std::vector<std::vector<bool>> split_;
};

// simulate(), with or without the timeline (validate needs only whether every action runs:
// writing 196,608 timeline entries into fresh pages was most of validating a 64 x 512 ZB-V plan).
simulation run_simulation(const schedule& s, std::size_t microbatches,
                          const std::vector<action_costs>& costs, double send_latency,
                          bool timeline) {
  return step_simulator(s, microbatches, costs, send_latency).run(timeline);
}

} // namespace

simulation simulate(const schedule& s, std::size_t microbatches,
                    const std::vector<action_costs>& costs, double send_latency) {
  return run_simulation(s, microbatches, costs, send_latency, /*timeline=*/true);
}

} // namespace actorpipe
