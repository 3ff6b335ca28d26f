// Planned against measured: a step's own action times fed back into the simulator.
#include <actorpipe/schedule.hpp>

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

namespace actorpipe {

namespace {

// A whole backward's kind among the action kinds (a B without its W is `backward`).
constexpr int whole_backward = 3;

// What a step measured: each (virtual stage, kind)'s durations, when its first action started
// and its last ended, and how long each stage was busy.
struct measured_actions {
  std::map<std::pair<std::size_t, int>, std::vector<double>> durations;
  double first = 1e300;
  double last = 0;
  std::vector<double> busy;
};

measured_actions measured_actions_of(const schedule& planned, const step_result& measured) {
  auto p = measured.stages.size();
  measured_actions m;
  m.busy.assign(p, 0);
  for (std::size_t s = 0; s < p; ++s) {
    stage_program ran;
    for (const auto& a : measured.stages[s].actions) {
      ran.push_back(a.what);
    }
    auto split = split_backwards(ran);
    for (std::size_t i = 0; i < ran.size(); ++i) {
      const auto& a = measured.stages[s].actions[i];
      auto vs = planned.virtual_stage(s, static_cast<std::size_t>(a.what.chunk));
      auto kind = a.what.kind == action_kind::backward && !split[i] ? whole_backward
                                                                    : static_cast<int>(a.what.kind);
      m.durations[{vs, kind}].push_back(a.end_ms - a.start_ms);
      m.first = std::min(m.first, a.start_ms);
      m.last = std::max(m.last, a.end_ms);
      m.busy[s] += a.end_ms - a.start_ms;
    }
  }
  return m;
}

// Mean duration per virtual stage and kind (a whole backward, a B without its W, apart from a
// split one): the schedule adds durations up, and with few micro-batches a median is just the
// slowest one.
std::vector<action_costs> mean_costs(const measured_actions& m, std::size_t virtual_stages) {
  // -1 where the step ran none of that kind.
  auto mean = [&](std::size_t vs, int kind) {
    auto it = m.durations.find({vs, kind});
    if (it == m.durations.end()) {
      return -1.0;
    }
    double sum = 0;
    for (auto d : it->second) {
      sum += d;
    }
    return sum / static_cast<double>(it->second.size());
  };
  std::vector<action_costs> costs;
  auto at_least_0 = [](double ms) { return std::max(ms, 0.0); };
  for (std::size_t vs = 0; vs < virtual_stages; ++vs) {
    action_costs c;
    c.forward = at_least_0(mean(vs, static_cast<int>(action_kind::forward)));
    c.backward = at_least_0(mean(vs, static_cast<int>(action_kind::backward)));
    c.weight = at_least_0(mean(vs, static_cast<int>(action_kind::weight)));
    // The simulator charges a whole backward `fused`, or backward + weight without one.
    auto whole = mean(vs, whole_backward);
    c.fused = whole >= 0 ? whole : -1;
    costs.push_back(c);
  }
  return costs;
}

} // namespace

bubble_report compare_bubbles(const schedule& planned, std::size_t microbatches,
                              const step_result& measured) {
  auto p = measured.stages.size();
  ACTORPIPE_CHECK(planned.size() == p, "compare_bubbles: ", planned.size(),
                  " planned programs for ", p, " measured stages");
  auto m = measured_actions_of(planned, measured);
  auto sim = simulate(planned, microbatches, mean_costs(m, p * chunks_of(planned)));
  bubble_report r;
  r.busy_ms = m.busy;
  r.planned_bubble = sim.bubble;
  r.planned_ms = sim.makespan;
  r.measured_ms = m.last > m.first ? m.last - m.first : 0;
  for (std::size_t s = 0; s < p; ++s) {
    r.measured_bubble.push_back(r.measured_ms > 0 ? 1 - m.busy[s] / r.measured_ms : 0);
  }
  return r;
}

std::string bubble_report::to_string() const {
  std::ostringstream out;
  char line[160];
  std::snprintf(line, sizeof line, "step time: planned %.1f ms, measured %.1f ms (%+.1f%%)\n",
                planned_ms, measured_ms,
                planned_ms > 0 ? 100 * (measured_ms - planned_ms) / planned_ms : 0.0);
  out << line;
  for (std::size_t s = 0; s < planned_bubble.size(); ++s) {
    std::snprintf(line, sizeof line, "  stage %zu bubble: planned %5.1f%%, measured %5.1f%%\n", s,
                  100 * planned_bubble[s], 100 * measured_bubble[s]);
    out << line;
  }
  return out.str();
}

} // namespace actorpipe
