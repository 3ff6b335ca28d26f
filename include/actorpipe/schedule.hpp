/// \file
/// Schedules: the built-in ones, validation, JSON files, and the simulator that runs a schedule
/// on per-action costs (the types themselves are in <actorpipe/actions.hpp>).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <actorpipe/actions.hpp>
#include <actorpipe/errors.hpp>
#include <actorpipe/results.hpp>

namespace actorpipe {

/// "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "interleaved-zb", "zb-v", "v-half",
/// "v-min" or "dualpipe-v"; throws invalid_argument naming the known ones.
schedule_kind parse_schedule_kind(const std::string& name);

std::string to_string(schedule_kind kind);

/// The built-in schedules' names, comma-separated ("gpipe, 1f1b, ...").
std::string known_schedules();

/// "looped" or "v" (as to_string(chunk_placement) writes them); throws invalid_argument otherwise.
chunk_placement parse_chunk_placement(const std::string& name);

/// The chunks per stage a pipeline of `kind` runs when asked for `chunks`: 2 for the V
/// schedules (they hold two by construction), `chunks` otherwise.
std::size_t chunks_for(schedule_kind kind, std::size_t chunks);

/// The training schedule of `kind` for `stages` stages, `microbatches` micro-batches and
/// `chunks` model chunks per stage (interleaved and interleaved-zb take any, the V schedules
/// exactly 2, the others 1). Throws invalid_argument for zero sizes or sizes the schedule cannot
/// take (interleaved: microbatches a multiple of stages; dualpipe-v: microbatches >= 2 stages).
schedule make_schedule(schedule_kind kind, std::size_t stages, std::size_t microbatches,
                       std::size_t chunks = 1);

/// Whether the built-in schedule of `kind` takes `microbatches` on `stages` stages: the
/// interleaved ones a multiple of stages, dualpipe-v at least 2 x stages, the others any
/// (make_schedule refuses the rest, naming the rule).
bool takes_microbatches(schedule_kind kind, std::size_t stages, std::size_t microbatches);

/// Forward-only (evaluation): every stage forwards micro-batches 0..m-1 through its chunks, in
/// chunk order, placed as `placement`.
schedule make_forward_schedule(std::size_t stages, std::size_t microbatches, std::size_t chunks = 1,
                               chunk_placement placement = chunk_placement::looped);

/// Model chunks per stage of `s` (1 + the largest chunk index).
std::size_t chunks_of(const schedule& s);

/// True when `s` splits backward into B and W actions.
bool splits_backward(const schedule& s);

/// True when the schedules of `kind` split backward (the zero-bubble ones and DualPipeV).
bool splits_backward(schedule_kind kind);

/// Checks that `s` can run: on every stage and chunk, each micro-batch is forwarded exactly
/// once, and in training backed up exactly once after its forward (and, where that backward is
/// split, its weight gradient once after that: a B without a W is a whole backward,
/// split_backwards); and running the programs with their
/// cross-stage dependencies cannot deadlock. Throws invalid_argument naming the stage, action
/// and micro-batch at fault.
void validate(const schedule& s, std::size_t microbatches, bool training);

/// The most micro-batches stage `program` holds stashed at once (a chunk's entry counts 1/v).
double peak_stash(const stage_program& program, std::size_t chunks = 1);

/// "F0 F1 B0 W0 F2@1": a program as its actions' names (to_string(action) in actions.hpp).
std::string to_string(const stage_program& program);

/// Parses one action as to_string writes it ("F3", "B0", "W2", "F1@1").
action parse_action(const std::string& text);

/// Reads a schedule from JSON: {"programs": [["F0", "F1", "B0", ...], ...]}, one list per stage,
/// and optionally "placement": "looped" (the default) or "v". Throws invalid_argument naming the
/// file and the bad entry. Validate before running it.
schedule load_schedule(const std::string& path);

/// What a schedule does with given costs.
struct simulation {
  double makespan = 0;
  /// Per stage: time computing, idle fraction of the makespan, most micro-batches stashed.
  std::vector<double> busy;
  std::vector<double> bubble;
  std::vector<double> peak_stash;
  std::vector<std::vector<timed_action>> timeline;

  /// Mean idle fraction over stages.
  double mean_bubble() const;
};

/// Runs `s` on a model of `costs.size()` virtual stages (or one cost for all when size 1);
/// `send_latency` is added to every cross-stage dependency, and a transfer between two stages
/// (`action_costs::send`) occupies their link: one at a time in each direction, queued in the
/// sender's order. A B without a W is charged a whole
/// backward (split_backwards). Throws invalid_argument when the
/// schedule deadlocks (naming who waits for what) or costs do not fit.
simulation simulate(const schedule& s, std::size_t microbatches,
                    const std::vector<action_costs>& costs, double send_latency = 0);

/// Planned against measured: the simulator's bubble per stage and makespan with costs taken
/// from the step's own actions (mean per stage, chunk and kind), beside what happened.
struct bubble_report {
  std::vector<double> planned_bubble;
  std::vector<double> measured_bubble;
  double planned_ms = 0;
  /// From the first action's start to the last action's end (optimizer steps excluded).
  double measured_ms = 0;
  /// Per stage: milliseconds spent in its actions.
  std::vector<double> busy_ms;

  /// A short table, one line per stage.
  std::string to_string() const;
};

bubble_report compare_bubbles(const schedule& planned, std::size_t microbatches,
                              const step_result& measured);

} // namespace actorpipe
