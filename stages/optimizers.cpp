#include <actorpipe/optimizers.hpp>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <actorpipe/errors.hpp>

namespace actorpipe {

optimizer_factory sgd(double lr, double momentum, double weight_decay, bool nesterov) {
  ACTORPIPE_CHECK(lr > 0, "sgd: learning rate (", lr, ") must be > 0");
  ACTORPIPE_CHECK(momentum >= 0, "sgd: momentum (", momentum, ") must be >= 0");
  ACTORPIPE_CHECK(weight_decay >= 0, "sgd: weight decay (", weight_decay, ") must be >= 0");
  ACTORPIPE_CHECK(!nesterov || momentum > 0, "sgd: Nesterov momentum needs a momentum > 0");
  return [=](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::SGD>(std::move(params), torch::optim::SGDOptions(lr)
                                                                    .momentum(momentum)
                                                                    .weight_decay(weight_decay)
                                                                    .nesterov(nesterov));
  };
}

optimizer_factory adam(double lr, double weight_decay) {
  ACTORPIPE_CHECK(lr > 0, "adam: learning rate (", lr, ") must be > 0");
  ACTORPIPE_CHECK(weight_decay >= 0, "adam: weight decay (", weight_decay, ") must be >= 0");
  return [=](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(
      std::move(params), torch::optim::AdamOptions(lr).weight_decay(weight_decay));
  };
}

optimizer_factory adamw(double lr, double weight_decay) {
  ACTORPIPE_CHECK(lr > 0, "adamw: learning rate (", lr, ") must be > 0");
  ACTORPIPE_CHECK(weight_decay >= 0, "adamw: weight decay (", weight_decay, ") must be >= 0");
  return [=](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::AdamW>(
      std::move(params), torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
  };
}

optimizer_factory make_optimizer(const optimizer_spec& spec) {
  if (spec.name == "sgd") {
    return sgd(spec.lr, spec.momentum, spec.weight_decay, spec.nesterov);
  }
  if (spec.name == "adam" || spec.name == "adamw") {
    ACTORPIPE_CHECK(!spec.nesterov && spec.momentum == 0, spec.name,
                    ": momentum and Nesterov are SGD's (Adam has its own moment estimates)");
    return spec.name == "adam" ? adam(spec.lr, spec.weight_decay)
                               : adamw(spec.lr, spec.weight_decay);
  }
  throw invalid_argument(
    detail::concat("unknown optimizer '", spec.name, "' (known: sgd, adam, adamw)"));
}

} // namespace actorpipe
