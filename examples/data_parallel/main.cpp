// Trains a user-defined model as 2 replicas x 2 stages in one process and checks that the
// replicas end with the parameters of one plain libtorch model trained on the whole batches.
#include <cstdio>

#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

namespace {

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 1));
}

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

} // namespace

int main() {
  actorpipe::engine sys;
  actorpipe::pipeline_options options;
  options.microbatches = 2;
  options.loss = mse;
  options.optimizer = actorpipe::sgd(0.05, 0.9);
  options.max_grad_norm = 5.0; // global clipping across stages and replicas
  actorpipe::replicated_pipeline replicas(
    sys, [] { return actorpipe::to_layer_list(make_model()); }, actorpipe::partition_uniform(5, 2),
    options, /*replicas=*/2);

  // The same training, plainly.
  auto plain = make_model();
  torch::optim::SGD plain_sgd(plain->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  torch::manual_seed(1);
  double loss = 0;
  for (int step = 0; step < 20; ++step) {
    auto x = torch::randn({64, 8});
    auto y = torch::sin(x).sum(1, /*keepdim=*/true);
    loss = replicas.train_step(x, y).loss; // each replica trains on 32 of the 64 samples
    plain_sgd.zero_grad();
    mse(plain->forward(x), y).backward();
    torch::nn::utils::clip_grad_norm_(plain->parameters(), 5.0);
    plain_sgd.step();
  }

  double worst = 0;
  auto expected = plain->named_parameters();
  for (std::size_t r = 0; r < replicas.replicas(); ++r) {
    for (const auto& [name, value] : replicas.replica(r).named_parameters()) {
      worst = std::max(worst, (value - expected[name]).abs().max().item<double>());
    }
  }
  std::printf("2 replicas x 2 stages: loss %.5f after 20 steps; largest difference from plain "
              "libtorch %.2e\n",
              loss, worst);
  return worst < 1e-4 ? 0 : 1;
}
