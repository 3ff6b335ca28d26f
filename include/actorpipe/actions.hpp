/// \file
/// Vocabulary: schedules as data. A schedule is one program per stage actor, a program the
/// ordered actions that actor runs in one step. Plain value types, no functions: building,
/// validating and simulating schedules is <actorpipe/schedule.hpp>.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

/// "F3", "B0", "W2", or with a chunk "F1@1": how programs, traces and errors name an action
/// (parse_action in <actorpipe/schedule.hpp> reads it back).
inline std::string to_string(const action& a) {
  char kind = a.kind == action_kind::forward ? 'F' : a.kind == action_kind::backward ? 'B' : 'W';
  auto text = kind + std::to_string(a.microbatch);
  return a.chunk == 0 ? text : text + '@' + std::to_string(a.chunk);
}

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
  /// Zero-bubble ZB-H2 (Qi et al.): ZB-H1 with p - 1 - i more warm-up forwards on stage i, which
  /// fill the wait for the first input gradient; stage i stashes up to 2p - 1 - i micro-batches.
  zb_h2,
};

/// Cost of each action on one virtual stage (chunk c of stage i is virtual stage c * p + i), in
/// any unit. `backward` is the input-gradient part; a schedule without weight actions charges
/// `fused` for its B, or backward + weight when `fused` is negative (a split backward walks the
/// graph twice and may cost more than one fused pass); `send` is added to every dependency that
/// crosses from this virtual stage to the next or back.
struct action_costs {
  double forward = 1;
  double backward = 1;
  double weight = 1;
  double fused = -1;
  /// Time for this virtual stage's output to reach the next one, and for its gradient (the same
  /// size) to come back: a link's latency plus bytes / bandwidth (0 in one process).
  double send = 0;
};

/// One action placed in time (planned by the simulator, or measured).
struct timed_action {
  action what;
  double start = 0;
  double end = 0;
};

} // namespace actorpipe
