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
  /// Run the stage's layers on the micro-batch's input; stash what backward needs.
  forward,
  /// Back-propagate the micro-batch's output gradient; release its stash.
  backward,
};

/// One step of a stage's program.
struct action {
  action_kind kind;
  int32_t microbatch;

  friend bool operator==(const action& a, const action& b) {
    return a.kind == b.kind && a.microbatch == b.microbatch;
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
};

/// "gpipe" or "1f1b"; throws invalid_argument naming the known schedules otherwise.
schedule_kind parse_schedule_kind(const std::string& name);

/// "gpipe" or "1f1b".
std::string to_string(schedule_kind kind);

/// The training schedule of `kind` for `stages` stages and `microbatches` micro-batches.
/// Throws invalid_argument when either is 0.
schedule make_schedule(schedule_kind kind, std::size_t stages, std::size_t microbatches);

/// Forward-only (evaluation): every stage forwards micro-batches 0..m-1 in order.
schedule make_forward_schedule(std::size_t stages, std::size_t microbatches);

/// Checks that `s` can run: every stage forwards each micro-batch exactly once (and, when
/// `training`, backs each up exactly once after its forward), and executing the programs with
/// their cross-stage dependencies cannot deadlock. Throws invalid_argument naming the stage,
/// action and micro-batch at fault.
void validate(const schedule& s, std::size_t microbatches, bool training);

/// The most micro-batches stage `stage` ever holds stashed when running its program.
std::size_t peak_stash(const stage_program& program);

/// "F0 F1 B0 F2 B1 B2" style description of a program.
std::string to_string(const stage_program& program);

} // namespace actorpipe
