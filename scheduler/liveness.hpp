// What a stage's program holds stashed over time: the one liveness rule that the simulator's
// count (peak_stash, schedule.cpp) and the memory model's bytes (stashed_bytes, planner.cpp)
// walk. Private to scheduler/.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include <actorpipe/actions.hpp>

namespace actorpipe::liveness {

/// The most `program` holds at once. `entry(microbatch, chunk, split)` gives what a micro-batch
/// chunk's forward stashes (`.first`) and what its backward adds to it (`.second`: under
/// recomputation the rebuilt rest, and for a split B what W will read); the entry is freed,
/// both parts, at its W, or at its backward when that is whole (`split`, as split_backwards).
/// `during(action, split)` is how far the action rises for a moment above what is held once its
/// entry part is added (its working set; 0 counts the stash alone).
template <class Entry, class During>
double peak_held(const stage_program& program, const std::vector<bool>& split, Entry entry,
                 During during) {
  double live = 0;
  double peak = 0;
  for (std::size_t i = 0; i < program.size(); ++i) {
    const auto& a = program[i];
    if (a.kind == action_kind::forward) {
      live += entry(a.microbatch, a.chunk, false).first;
    } else if (a.kind == action_kind::backward) {
      live += entry(a.microbatch, a.chunk, split[i]).second;
    }
    peak = std::max(peak, live + std::max(0.0, during(a, split[i])));
    if (a.kind == action_kind::weight || (a.kind == action_kind::backward && !split[i])) {
      auto held = entry(a.microbatch, a.chunk, a.kind == action_kind::weight);
      live -= held.first + held.second;
    }
  }
  return peak;
}

template <class Entry>
double peak_held(const stage_program& program, const std::vector<bool>& split, Entry entry) {
  return peak_held(program, split, entry, [](const action&, bool) { return 0.0; });
}

} // namespace actorpipe::liveness
