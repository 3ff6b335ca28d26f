/// \file
/// Schedules as data: per stage, the ordered actions it runs in one step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <actorpipe/errors.hpp>

namespace actorpipe {

/// What a stage does with one micro-batch.
enum class action_kind : uint8_t {
  /// Run the chunk's layers on the micro-batch's input; stash what backward needs.
  forward,
  /// Back-propagate the micro-batch's output gradient. In a schedule without weight actions this
  /// is the whole backward and releases the stash; with them (zero-bubble schedules) it computes
  /// only the input gradient, the part the previous stage waits for.
  backward,
  /// Zero-bubble schedules: the weight-gradient part of a backward, deferred into bubbles;
  /// releases the stash.
  weight,
};

/// One step of a stage's program.
struct action {
  action_kind kind;
  int32_t microbatch;
  /// The stage's model chunk (0 unless the schedule is interleaved). Chunk c of stage i is
  /// virtual stage c * stages + i of the model.
  int32_t chunk = 0;

  friend bool operator==(const action& a, const action& b) {
    return a.kind == b.kind && a.microbatch == b.microbatch && a.chunk == b.chunk;
  }
};

/// The ordered actions of one stage.
using stage_program = std::vector<action>;

/// One program per stage, index = stage index.
using schedule = std::vector<stage_program>;

/// The built-in schedules.
enum class schedule_kind {
  /// All forwards, then all backwards in reverse order; stashes m micro-batches per stage.
  gpipe,
  /// Warm-up forwards, then one forward one backward, then cool-down backwards; stage i stashes
  /// at most min(p - i, m) micro-batches.
  one_f_one_b,
  /// Megatron's interleaved 1F1B: each stage holds v model chunks; bubble (1/v)(p-1)/m.
  /// Needs microbatches to be a multiple of stages.
  interleaved,
  /// Zero-bubble ZB-H1 (Qi et al.): backward split into input-gradient (B) and weight-gradient
  /// (W) actions, W deferred into bubbles, the same stash bound as 1F1B.
  zb_h1,
};

/// "gpipe", "1f1b", "interleaved" or "zb-h1"; throws invalid_argument naming the known ones.
schedule_kind parse_schedule_kind(const std::string& name);

std::string to_string(schedule_kind kind);

/// The training schedule of `kind` for `stages` stages, `microbatches` micro-batches and
/// `chunks` model chunks per stage (only interleaved takes chunks > 1). Throws
/// invalid_argument for zero sizes or sizes the schedule cannot take.
schedule make_schedule(schedule_kind kind, std::size_t stages, std::size_t microbatches,
                       std::size_t chunks = 1);

/// Forward-only (evaluation): every stage forwards micro-batches 0..m-1 through its chunks.
schedule make_forward_schedule(std::size_t stages, std::size_t microbatches,
                               std::size_t chunks = 1);

/// Model chunks per stage of `s` (1 + the largest chunk index).
std::size_t chunks_of(const schedule& s);

/// True when `s` splits backward into B and W actions.
bool splits_backward(const schedule& s);

/// Checks that `s` can run: on every stage and chunk, each micro-batch is forwarded exactly
/// once, and in training backed up exactly once after its forward (and, when the schedule
/// splits backward, its weight gradient once after that); and running the programs with their
/// cross-stage dependencies cannot deadlock. Throws invalid_argument naming the stage, action
/// and micro-batch at fault.
void validate(const schedule& s, std::size_t microbatches, bool training);

/// The most micro-batches stage `program` holds stashed at once (a chunk's entry counts 1/v).
double peak_stash(const stage_program& program, std::size_t chunks = 1);

/// "F0 F1 B0 W0 F2@1" style description of an action and a program.
std::string to_string(const action& a);
std::string to_string(const stage_program& program);

/// Parses one action as to_string writes it ("F3", "B0", "W2", "F1@1").
action parse_action(const std::string& text);

/// Reads a schedule from JSON: {"programs": [["F0", "F1", "B0", ...], ...]}, one list per stage.
/// Throws invalid_argument naming the file and the bad entry. Validate before running it.
schedule load_schedule(const std::string& path);

/// Cost of each action on one virtual stage (chunk c of stage i is virtual stage c * p + i), in
/// any unit. `backward` is the input-gradient part; a schedule without weight actions charges
/// backward + weight for its B.
struct action_costs {
  double forward = 1;
  double backward = 1;
  double weight = 1;
};

/// One action placed in time.
struct timed_action {
  action what;
  double start = 0;
  double end = 0;
};

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
/// `send_latency` is added to every cross-stage dependency. Throws invalid_argument when the
/// schedule deadlocks (naming who waits for what) or costs do not fit.
simulation simulate(const schedule& s, std::size_t microbatches,
                    const std::vector<action_costs>& costs, double send_latency = 0);

} // namespace actorpipe
