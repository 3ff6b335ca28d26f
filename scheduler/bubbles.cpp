// Planned against measured: a step's own action times fed back into the simulator.
#include <actorpipe/schedule.hpp>

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

namespace actorpipe {

bubble_report compare_bubbles(const schedule& planned, std::size_t microbatches,
                              const step_result& measured) {
  auto p = measured.stages.size();
  auto chunks = chunks_of(planned);
  ACTORPIPE_CHECK(planned.size() == p, "compare_bubbles: ", planned.size(),
                  " planned programs for ", p, " measured stages");
  // Mean duration per virtual stage and kind: the schedule adds durations up, and with few
  // micro-batches a median is just the slowest one.
  std::map<std::pair<std::size_t, action_kind>, std::vector<double>> durations;
  double first = 1e300;
  double last = 0;
  bubble_report r;
  auto& busy = r.busy_ms;
  busy.assign(p, 0);
  for (std::size_t s = 0; s < p; ++s) {
    for (const auto& a : measured.stages[s].actions) {
      auto vs = planned.virtual_stage(s, static_cast<std::size_t>(a.what.chunk));
      durations[{vs, a.what.kind}].push_back(a.end_ms - a.start_ms);
      first = std::min(first, a.start_ms);
      last = std::max(last, a.end_ms);
      busy[s] += a.end_ms - a.start_ms;
    }
  }
  auto mean = [&](std::size_t vs, action_kind kind) {
    auto it = durations.find({vs, kind});
    if (it == durations.end()) {
      return 0.0;
    }
    double sum = 0;
    for (auto d : it->second) {
      sum += d;
    }
    return sum / static_cast<double>(it->second.size());
  };
  bool split = splits_backward(planned);
  std::vector<action_costs> costs;
  for (std::size_t vs = 0; vs < p * chunks; ++vs) {
    // Without weight actions the simulator charges backward + weight for B: put it all in B.
    costs.push_back({mean(vs, action_kind::forward), mean(vs, action_kind::backward),
                     split ? mean(vs, action_kind::weight) : 0.0});
  }
  auto sim = simulate(planned, microbatches, costs);
  r.planned_bubble = sim.bubble;
  r.planned_ms = sim.makespan;
  r.measured_ms = last > first ? last - first : 0;
  for (std::size_t s = 0; s < p; ++s) {
    r.measured_bubble.push_back(r.measured_ms > 0 ? 1 - busy[s] / r.measured_ms : 0);
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
