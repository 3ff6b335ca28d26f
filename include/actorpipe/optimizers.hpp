/// \file
/// Optimizer factories for pipeline_options::optimizer: each stage builds its own optimizer over
/// its own parameters with the factory, on its own thread.
#pragma once

#include <actorpipe/options.hpp>

namespace actorpipe {

/// SGD with the given learning rate, momentum, weight decay and Nesterov momentum
/// (torch.optim.SGD's update). Throws invalid_argument for lr <= 0, momentum or weight_decay < 0,
/// or nesterov without momentum.
optimizer_factory sgd(double lr, double momentum = 0.0, double weight_decay = 0.0,
                      bool nesterov = false);

/// Adam with the given learning rate and weight decay (added to the gradient, as torch.optim.Adam
/// does). Throws invalid_argument for lr <= 0 or weight_decay < 0.
optimizer_factory adam(double lr, double weight_decay = 0.0);

/// AdamW: Adam with decoupled weight decay (the parameters shrink by lr * weight_decay before the
/// update, as torch.optim.AdamW, whose default decay is 0.01). Throws invalid_argument for
/// lr <= 0 or weight_decay < 0.
optimizer_factory adamw(double lr, double weight_decay = 1e-2);

/// The factory an optimizer_spec describes; throws invalid_argument for an unknown name.
optimizer_factory make_optimizer(const optimizer_spec& spec);

} // namespace actorpipe
