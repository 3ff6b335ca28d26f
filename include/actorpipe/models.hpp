/// \file
/// Built-in models, each exposed as a layer list.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <actorpipe/errors.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/options.hpp>

namespace actorpipe {

/// Names accepted by make_model: the built-in models, then those registered, in a stable order.
std::vector<std::string> model_names();

/// Builds a model of one's own from model_options (sizes, classes), drawing its parameters from
/// libtorch's global generator.
using model_factory = std::function<layer_list(const model_options&)>;

/// Makes `name` a model make_model builds, in this process: an application that runs its own
/// actorpipe::node registers its models before the node starts, and a pipeline whose
/// remote_model names one has its nodes build their stages with it (the scheduler's process
/// registers it too, to check the cut). Registering a name again replaces its factory;
/// invalid_argument for a built-in model's name. Thread-safe.
void register_model(const std::string& name, model_factory factory);

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

/// torch::manual_seed(seed), then make_model, under a lock of this process: threads that build
/// seeded models at the same time (nodes and replicas that share a process) each get the
/// model of their seed rather than draws from each other's sequence.
layer_list make_seeded_model(const std::string& name, const model_options& options, uint64_t seed);

} // namespace actorpipe
