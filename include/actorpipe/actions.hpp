/// \file
/// Vocabulary: schedules as data. A schedule is one program per stage actor, a program the
/// ordered actions that actor runs in one step. Plain value types, no functions: building,
/// validating and simulating schedules is <actorpipe/schedule.hpp>.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
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
  /// The stage's model chunk (0 unless the stage holds several). Which part of the model (virtual
  /// stage) chunk c of stage i is depends on the schedule's chunk_placement.
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

/// How the model's consecutive parts (virtual stages) are dealt to the chunks of p stage actors.
enum class chunk_placement : uint8_t {
  /// Chunk c of stage i is virtual stage c * p + i: the model loops over the stages once per
  /// chunk (Megatron's interleaved schedule).
  looped,
  /// Even chunks go down the stages and odd ones come back up: chunk c of stage i is virtual stage
  /// c * p + i for even c, c * p + p - 1 - i for odd c. With two chunks the model runs down and
  /// back in a V, stage 0 holding the first and the last part (ZB-V, V-Half): the loss is computed
  /// where the inputs enter, a tied embedding and head sit on one actor, and the last stage hands
  /// its activation to itself.
  v_shape,
};

/// The virtual stage (model part) that chunk `chunk` of stage `stage` of `stages` holds.
inline std::size_t virtual_stage_of(chunk_placement placement, std::size_t stages,
                                    std::size_t stage, std::size_t chunk) {
  bool up = placement == chunk_placement::v_shape && chunk % 2 == 1;
  return chunk * stages + (up ? stages - 1 - stage : stage);
}

/// Which stage actor holds a virtual stage, as which of its chunks.
struct chunk_holder {
  std::size_t stage = 0;
  std::size_t chunk = 0;
};

/// The inverse of virtual_stage_of.
inline chunk_holder holder_of(chunk_placement placement, std::size_t stages,
                              std::size_t virtual_stage) {
  auto chunk = virtual_stage / stages;
  auto offset = virtual_stage % stages;
  bool up = placement == chunk_placement::v_shape && chunk % 2 == 1;
  return {up ? stages - 1 - offset : offset, chunk};
}

/// "looped" or "v".
inline std::string to_string(chunk_placement placement) {
  return placement == chunk_placement::v_shape ? "v" : "looped";
}

/// One program per stage (index = stage index) and how the stages' chunks map onto the model.
/// Reads like the vector of programs it holds.
struct schedule {
  std::vector<stage_program> programs;
  chunk_placement placement = chunk_placement::looped;

  schedule() = default;
  explicit schedule(std::size_t stages, chunk_placement placement = chunk_placement::looped)
    : programs(stages), placement(placement) {}
  schedule(std::initializer_list<stage_program> programs,
           chunk_placement placement = chunk_placement::looped)
    : programs(programs), placement(placement) {}

  std::size_t size() const noexcept { return programs.size(); }
  bool empty() const noexcept { return programs.empty(); }
  stage_program& operator[](std::size_t stage) { return programs[stage]; }
  const stage_program& operator[](std::size_t stage) const { return programs[stage]; }
  auto begin() noexcept { return programs.begin(); }
  auto end() noexcept { return programs.end(); }
  auto begin() const noexcept { return programs.begin(); }
  auto end() const noexcept { return programs.end(); }

  /// The virtual stage of chunk `chunk` of stage `stage`.
  std::size_t virtual_stage(std::size_t stage, std::size_t chunk) const {
    return virtual_stage_of(placement, programs.size(), stage, chunk);
  }

  friend bool operator==(const schedule& a, const schedule& b) {
    return a.placement == b.placement && a.programs == b.programs;
  }
  friend bool operator!=(const schedule& a, const schedule& b) { return !(a == b); }
};

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
  /// Zero-bubble ZB-V (Qi et al.): two chunks per stage in a V (chunk_placement::v_shape), B and
  /// W split, built greedily under 1F1B's activation memory (p micro-batches per stage).
  zb_v,
  /// V-Half (Qi et al., "Pipeline Parallelism with Controllable Memory"): ZB-V's V and split
  /// backward under half of 1F1B's activation memory.
  v_half,
  /// Interleaved zero bubble (PyTorch's ScheduleInterleavedZeroBubble): interleaved 1F1B's order
  /// with backward split, stage i deferring each W by i backwards (ZB-H1 over several chunks).
  /// Needs microbatches to be a multiple of stages.
  interleaved_zb,
  /// DualPipeV (DeepSeek): two chunks per stage in a V; in its steady phase each stage runs the
  /// forward of one chunk beside the backward of the other, so a transfer in one direction hides
  /// behind compute in the other. Needs microbatches >= 2 x stages.
  dualpipe_v,
  /// V-Min (Qi et al.): ZB-V's V and split backward under about a third of 1F1B's activation
  /// memory, at the cost of bubbles.
  v_min,
};

/// True for the schedules whose chunks sit in a V (zb_v, v_half, v_min, dualpipe_v).
inline bool in_a_v(schedule_kind kind) {
  return kind == schedule_kind::zb_v || kind == schedule_kind::v_half ||
         kind == schedule_kind::v_min || kind == schedule_kind::dualpipe_v;
}

/// True for the schedules that take any number of chunks per stage (interleaved, interleaved_zb).
inline bool interleaves(schedule_kind kind) {
  return kind == schedule_kind::interleaved || kind == schedule_kind::interleaved_zb;
}

/// How the schedules of `kind` place chunks: v_shape for the V schedules, looped otherwise.
inline chunk_placement placement_of(schedule_kind kind) {
  return in_a_v(kind) ? chunk_placement::v_shape : chunk_placement::looped;
}

/// Which of `program`'s actions are split backwards: a B whose W (same micro-batch and chunk)
/// comes later in the program computes only the input gradient; a B without one is a whole
/// backward (input and weight gradients in one walk of the graph, as in a schedule that splits
/// nothing). Schedules that split only some backwards (DualPipeV) write the others as a lone B.
inline std::vector<bool> split_backwards(const stage_program& program) {
  std::vector<std::pair<int32_t, int32_t>> weights;
  for (const auto& a : program) {
    if (a.kind == action_kind::weight) {
      weights.emplace_back(a.microbatch, a.chunk);
    }
  }
  std::sort(weights.begin(), weights.end());
  std::vector<bool> split(program.size(), false);
  for (std::size_t i = 0; i < program.size(); ++i) {
    const auto& a = program[i];
    split[i] =
      a.kind == action_kind::backward &&
      std::binary_search(weights.begin(), weights.end(), std::make_pair(a.microbatch, a.chunk));
  }
  return split;
}

/// Cost of each action on one virtual stage (schedule::virtual_stage), in
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
