/// \file
/// Cutting a layer list into contiguous stages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <actorpipe/errors.hpp>
#include <actorpipe/layers.hpp>

namespace actorpipe {

/// Where a layer list is cut: stage i holds layers [bounds[i], bounds[i + 1]).
/// Invariant: bounds.front() == 0, bounds.back() == layer count, strictly increasing.
struct partition {
  std::vector<std::size_t> bounds;

  std::size_t stages() const noexcept { return bounds.empty() ? 0 : bounds.size() - 1; }
  std::size_t begin(std::size_t stage) const { return bounds.at(stage); }
  std::size_t end(std::size_t stage) const { return bounds.at(stage + 1); }

  /// "[0, 4) [4, 11)" style description.
  std::string to_string() const;
};

/// Cuts before each listed layer index: cuts {3, 7} over 10 layers gives [0,3) [3,7) [7,10).
/// Throws invalid_argument when a cut is out of range (must be in 1..layers-1) or not increasing.
partition partition_at(std::size_t layers, const std::vector<std::size_t>& cuts);

/// `stages` stages of (nearly) equal layer count; earlier stages take the remainder.
/// Throws invalid_argument when stages is 0 or exceeds the layer count.
partition partition_uniform(std::size_t layers, std::size_t stages);

/// `stages` non-empty contiguous stages minimising the largest per-stage sum of `costs` (one
/// per layer; exact, by dynamic programming), each stage k's sum times `slowdown[k]` where given
/// (a slower device: one per stage). Throws as partition_uniform, and invalid_argument for a
/// slowdown of another length.
partition partition_by_cost(const std::vector<double>& costs, std::size_t stages,
                            const std::vector<double>& slowdown = {});

/// `stages` non-empty stages minimising the largest per-stage parameter count.
partition partition_by_params(const layer_list& layers, std::size_t stages);

/// Parses "uniform", "params" or "cut:3,7" (with `stages` used by the first two; for cut
/// the stage count is cuts + 1 and must agree with `stages` unless stages is 0).
partition parse_partition(const std::string& spec, const layer_list& layers, std::size_t stages);

/// Parameter elements per stage.
std::vector<int64_t> stage_parameter_counts(const layer_list& layers, const partition& p);

} // namespace actorpipe
