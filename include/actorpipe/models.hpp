/// \file
/// Built-in models, each exposed as a layer list.
#pragma once

#include <string>
#include <vector>

#include <actorpipe/errors.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/options.hpp>

namespace actorpipe {

/// Names accepted by make_model, in a stable order.
const std::vector<std::string>& model_names();

/// Builds a model with fresh parameters drawn from libtorch's global generator (call
/// torch::manual_seed first for a repeatable model). Throws invalid_argument for an unknown name.
///
/// - resnet18/34/50/101: torchvision's structure and initialisation, as the layers
///   conv1, bn1, relu, maxpool, layer1, layer2, layer3, layer4, avgpool, flatten, fc.
/// - mlp: flatten, fc1, relu1, fc2, relu2, fc3 (hidden sizes 256 and 128).
/// - cnn: conv1, relu1, pool1, conv2, relu2, pool2, flatten, fc1, relu3, fc2; for 1x28x28 inputs.
/// - gpt: GPT-2's structure and initialisation as the layers embed (token and position
///   embeddings), block0 .. block<layers-1> (pre-LayerNorm causal self-attention and GELU MLP),
///   ln_f and head, the LM head tied to the token embedding (tied_parameters names it). Takes
///   token ids [N, T] (T <= context), gives logits [N, T, vocabulary]; sizes from model_options.
layer_list make_model(const std::string& name, const model_options& options = {});

} // namespace actorpipe
