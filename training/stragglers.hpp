// Stragglers: a stage whose forward and backward take far longer than they used to (another
// process on its node's cores, a node stopped half of the time) is named, and a cut that moves
// layers off it is worked out from the measured times (docs/distributed.md#stragglers).
// Private to training/; train() uses it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include <actorpipe/partition.hpp>
#include <actorpipe/results.hpp>
#include <actorpipe/training.hpp>

namespace actorpipe::training {

// Watches each stage's forward and backward time per step: its usual time is the median over
// `usual` steps after the first (warm-up), its recent time the median of the last `recent`; a
// stage whose recent time is at least `factor` times its usual one is named once (until it is
// back under half way between the two).
class straggler_watch {
public:
  straggler_watch(double factor, std::size_t usual = 5, std::size_t recent = 5)
    : factor_(factor), usual_(usual), recent_(recent) {}

  // After step `step`: its stages' figures. Returns the stages newly found slow (node empty).
  std::vector<slow_stage> observe(uint64_t step, const std::vector<stage_stats>& stages);

  // Every stage's usual and recent milliseconds (0 where not known yet).
  const std::vector<double>& usual_ms() const { return usual_ms_; }
  std::vector<double> recent_ms() const;

  // Starts again (a new layout: new usual times).
  void reset();

private:
  double factor_;
  std::size_t usual_;
  std::size_t recent_;
  std::size_t seen_ = 0;
  std::vector<std::vector<double>> first_;
  std::vector<std::deque<double>> last_;
  std::vector<double> usual_ms_;
  std::vector<bool> named_;
};

// A cut of the same layers into as many stages as `cut`, each stage k on a node `slowdown[k]`
// times as slow as it was, that makes the slowest stage as fast as it can be: each layer's cost
// is its stage's usual time shared among its layers by `layer_weights` (parameter counts, say),
// and a stage's time its layers' costs times its node's slowdown. Contiguous; every stage keeps
// at least one layer.
partition cut_for_speeds(const partition& cut, const std::vector<double>& usual_ms,
                         const std::vector<double>& slowdown,
                         const std::vector<double>& layer_weights);

} // namespace actorpipe::training
