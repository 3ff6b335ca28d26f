/// \file
/// Built-in loss functions for pipeline_options::loss, known by name so that nodes in other
/// processes can build them (remote_model::loss).
#pragma once

#include <string>

#include <actorpipe/options.hpp>

namespace actorpipe {

/// A built-in loss, mean over the micro-batch: "mse" (targets shaped like the outputs) or
/// "cross_entropy" (class-index targets; logits [N, T, classes] against tokens [N, T] take the
/// mean over all tokens, as a language model's loss). Throws invalid_argument for an unknown name.
loss_function builtin_loss(const std::string& name);

} // namespace actorpipe
