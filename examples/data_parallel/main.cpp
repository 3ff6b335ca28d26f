// Trains a user-defined model as 2 replicas x 2 stages in one process and checks that the
// replicas end with the parameters of one plain libtorch model trained on the whole batches;
// then again with the optimizer state sharded across the replicas (ZeRO-2), each keeping half.
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
  // The same, each replica keeping and stepping half the momenta (docs/memory.md).
  auto zero = options;
  zero.data_parallel.shard = actorpipe::shard_mode::gradients;
  actorpipe::replicated_pipeline sharded(
    sys, [] { return actorpipe::to_layer_list(make_model()); }, actorpipe::partition_uniform(5, 2),
    zero, /*replicas=*/2);
  int64_t whole_bytes = 0;
  int64_t sharded_bytes = 0;

  // The same training, plainly.
  auto plain = make_model();
  torch::optim::SGD plain_sgd(plain->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  torch::manual_seed(1);
  double loss = 0;
  for (int step = 0; step < 20; ++step) {
    auto x = torch::randn({64, 8});
    auto y = torch::sin(x).sum(1, /*keepdim=*/true);
    auto r = replicas.train_step(x, y); // each replica trains on 32 of the 64 samples
    auto z = sharded.train_step(x, y);
    loss = r.loss;
    whole_bytes = 0;
    sharded_bytes = 0;
    for (std::size_t s = 0; s < r.stages.size(); ++s) {
      whole_bytes += r.stages[s].optimizer_bytes;
      sharded_bytes += z.stages[s].optimizer_bytes;
    }
    plain_sgd.zero_grad();
    mse(plain->forward(x), y).backward();
    torch::nn::utils::clip_grad_norm_(plain->parameters(), 5.0);
    plain_sgd.step();
  }

  double worst = 0;
  auto expected = plain->named_parameters();
  for (auto* pipe : {&replicas, &sharded}) {
    for (std::size_t r = 0; r < pipe->replicas(); ++r) {
      for (const auto& [name, value] : pipe->replica(r).named_parameters()) {
        worst = std::max(worst, (value - expected[name]).abs().max().item<double>());
      }
    }
  }
  std::printf("2 replicas x 2 stages: loss %.5f after 20 steps; largest difference from plain "
              "libtorch %.2e (sharded too); momenta on replica 0: %lld bytes, sharded %lld\n",
              loss, worst, static_cast<long long>(whole_bytes),
              static_cast<long long>(sharded_bytes));
  return worst < 1e-4 && sharded_bytes < whole_bytes ? 0 : 1;
}
