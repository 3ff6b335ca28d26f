// What the tests of replicas share: a pipeline's options for replicas of the tiny MLP, and a
// small model with batch norm.
#pragma once

#include "oracle.hpp"

namespace actorpipe::test {

inline pipeline_options mlp_options(std::size_t microbatches) {
  pipeline_options o;
  o.microbatches = microbatches;
  o.loss = mse;
  o.optimizer = sgd(0.1, 0.9);
  o.data_parallel.timeout = std::chrono::milliseconds(20000);
  return o;
}

// A small model with batch norm, for the buffer modes.
inline layer_list bn_model(uint64_t seed) {
  torch::manual_seed(seed);
  layer_list layers;
  layers.emplace_back("flatten", [](const torch::Tensor& x) { return x.flatten(1); });
  layers.emplace_back("fc1", torch::nn::AnyModule(torch::nn::Linear(16, 6)));
  layers.emplace_back("bn", torch::nn::AnyModule(torch::nn::BatchNorm1d(6)));
  layers.emplace_back("fc2", torch::nn::AnyModule(torch::nn::Linear(6, 3)));
  return layers;
}

inline torch::Tensor running_mean(const layer_list& layers) {
  for (const auto& l : layers) {
    if (l.name() == "bn") {
      return l.module()->named_buffers()["running_mean"].clone();
    }
  }
  return {};
}

} // namespace actorpipe::test
