// Pipelines a user-defined model across two stage actors and trains it on a toy regression.
#include <cstdio>

#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

int main() {
  torch::manual_seed(0);
  // Any sequential model: its children become the layers actorpipe cuts.
  torch::nn::Sequential model(torch::nn::Linear(8, 64), torch::nn::Tanh(),
                              torch::nn::Linear(64, 64), torch::nn::Tanh(),
                              torch::nn::Linear(64, 1));
  auto layers = actorpipe::to_layer_list(model);

  actorpipe::engine sys;
  actorpipe::pipeline_options options;
  options.microbatches = 4;
  options.schedule = actorpipe::schedule_kind::one_f_one_b;
  options.loss = [](const torch::Tensor& y, const torch::Tensor& t) {
    return torch::mse_loss(y, t);
  };
  options.optimizer = actorpipe::adam(0.01);
  actorpipe::pipeline pipe(sys, layers, actorpipe::partition_by_params(layers, 2), options);

  // Learn y = sum(sin(x)).
  auto x = torch::randn({256, 8});
  auto y = torch::sin(x).sum(1, /*keepdim=*/true);
  double first = 0;
  double last = 0;
  for (int step = 0; step < 200; ++step) {
    auto result = pipe.train_step(x, y);
    if (step == 0) {
      first = result.loss;
    }
    last = result.loss;
  }
  std::printf("stages %zu, loss %.4f -> %.4f\n", pipe.stages(), first, last);
  return last < first / 4 ? 0 : 1;
}
