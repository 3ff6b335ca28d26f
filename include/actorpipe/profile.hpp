/// \file
/// Per-layer costs measured on a sample micro-batch, and what they predict: time-balanced
/// partitions and per-stage action costs for the schedule simulator.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <actorpipe/actions.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/partition.hpp>

namespace actorpipe {

/// What one layer costs on the profiled micro-batch (medians over the repeats).
struct layer_profile {
  std::string name;
  double forward_ms = 0;
  double backward_ms = 0;
  /// Bytes of the layer's output (the activation a cut after it would send).
  int64_t output_bytes = 0;
  int64_t parameters = 0;
};

/// Runs each layer on `sample` (its input, e.g. one micro-batch) `repeats` times after one
/// warm-up, timing forward and backward (from a random output gradient) separately, in train
/// mode, on the calling thread with its intra-op threads. Parameters' gradients are cleared
/// afterwards; batch-norm statistics are restored.
std::vector<layer_profile> profile_layers(const layer_list& layers, const torch::Tensor& sample,
                                          int repeats = 3);

/// `stages` non-empty stages minimising the slowest stage's forward + backward time.
partition partition_by_time(const std::vector<layer_profile>& profile, std::size_t stages);

/// Action costs per part of `cut` (virtual stages, model order) in milliseconds, scaled by
/// `scale` (e.g. micro-batch size / profiled size). For split backward, B and W each take half
/// of a part's backward, except that the model's first part computes no input gradient.
std::vector<action_costs> costs_of(const std::vector<layer_profile>& profile, const partition& cut,
                                   double scale = 1.0);

} // namespace actorpipe
