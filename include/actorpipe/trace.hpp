/// \file
/// Timelines people can open: Chrome trace event files (Perfetto, chrome://tracing), SVG Gantt
/// charts of planned or measured schedules. (Planned against measured bubbles, which needs the
/// simulator: compare_bubbles in <actorpipe/schedule.hpp>.)
#pragma once

#include <string>
#include <vector>

#include <actorpipe/actions.hpp>
#include <actorpipe/results.hpp>

namespace actorpipe {

/// Writes `steps` (one after another on the time axis) as Chrome trace events: one track per
/// stage, an event per action (name "F3", "B0@1"; args: step, micro-batch, chunk, bytes sent),
/// flow arrows from each send to the action that received it, and with replicas an "all-reduce"
/// event per stage for its gradient sync. Throws pipeline_error when the
/// file cannot be written.
void write_chrome_trace(const std::string& path, const std::vector<step_result>& steps);

/// The measured timeline of a step, per stage, in milliseconds from its start.
std::vector<std::vector<timed_action>> timeline_of(const step_result& step);

/// Writes a Gantt chart (one row per stage; forward, backward and weight actions in three
/// colours, labelled with their micro-batch) as SVG. `unit` labels the time axis ("ms").
void write_gantt_svg(const std::string& path, const std::vector<std::vector<timed_action>>& rows,
                     const std::string& title, const std::string& unit);

} // namespace actorpipe
