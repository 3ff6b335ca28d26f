/// \file
/// What a training run does about faults, which the loop (train_loop.cpp) asks: whether a failed
/// step is recovered from (the kinds' table, include/actorpipe/errors.hpp), the recovery and what
/// the run forgets and replays after it, and lost nodes taking stages back. Private to training/.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <actorpipe/training.hpp>

namespace actorpipe::training {

/// Where a run is in its data: where it starts (the beginning, or where a checkpoint of the same
/// run stopped), where a recovery goes back to.
struct start_point {
  uint64_t step = 0;
  int64_t epoch = 0;
  int64_t batch = 0;
};

/// "a, b, c" or "none": what a recovery lists.
template <class T>
std::string join(const std::vector<T>& xs) {
  std::string text;
  for (const auto& x : xs) {
    text += (text.empty() ? "" : ", ") + detail::concat(x);
  }
  return text.empty() ? std::string("none") : text;
}

/// A run of few, slow steps (train_options::log_steps): a line per step on stdout.
void print_step_line(uint64_t step, int64_t total, const step_result& r);

/// Where the data is when a recovery goes on: `done` steps were complete when the next failed, at
/// position `now` (`after`: the position after it).
struct failed_at {
  uint64_t done = 0;
  start_point now;
  start_point after;
  /// The run's steps in all, for the step line of a failed step that completed on a replica.
  int64_t total = 0;
};

/// Whether the run recovers from `failure` (of a pipeline's run, or of replicas in this process):
/// train_options::recover_lost_nodes, and the reaction the kinds' table gives its kind.
inline bool recovers_from(const train_options& o, const pipeline_error& failure, bool replicated) {
  return o.recover_lost_nodes && reaction_to(failure.kind(), replicated) == fault_reaction::recover;
}

/// After a failed step the run recovers from: the pipeline recovers (at most o.max_recoveries
/// times in a run), and the run forgets what it did after the snapshot it goes back to
/// (`snapshots`: each one's position in the data) and says so; where it goes on.
start_point recover_from(pipeline& pipe, const pipeline_error& failure, const train_options& o,
                         const failed_at& where, std::map<uint64_t, start_point>& snapshots,
                         train_report& report);
start_point recover_from(replicated_pipeline& pipe, const pipeline_error& failure,
                         const train_options& o, const failed_at& where,
                         std::map<uint64_t, start_point>& snapshots, train_report& report);

/// Nodes lost earlier that answer again take stages back (or stand by as spares), from the state
/// after step `step`: nothing is replayed. The lead rank says so. Nothing when none came back.
std::optional<recovery_report> take_back_nodes(pipeline& pipe, const train_options& o,
                                               uint64_t step, bool lead);
std::optional<recovery_report> take_back_nodes(replicated_pipeline& pipe, const train_options& o,
                                               uint64_t step, bool lead);

} // namespace actorpipe::training
