// Stages on nodes: a pipeline whose two stages live in `actorpipe node` processes (or, when no
// addresses are given, in two nodes this program starts itself), trained on the same batches as
// the same pipeline in this process. Activations go from node to node.
//
//   actorpipe node --listen 127.0.0.1:7001 --secret-file secret &
//   actorpipe node --listen 127.0.0.1:7002 --secret-file secret &
//   ./distributed 127.0.0.1:7001 127.0.0.1:7002 "$(cat secret)"
//   ./distributed            # two nodes inside this program, on loopback, building a model
//                            # this program registered (register_model) by its name
#include <cmath>
#include <iomanip>
#include <iostream>
#include <memory>

#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

int main(int argc, char** argv) {
  using namespace actorpipe;
  const bool own = argc < 3;
  // A model of this program's own: make_model, and the nodes this program runs, build it by name.
  register_model("wide_mlp", [](const model_options& o) {
    return to_layer_list(torch::nn::Sequential(
      torch::nn::Flatten(), torch::nn::Linear(o.in_channels * o.image_size * o.image_size, 512),
      torch::nn::GELU(), torch::nn::Linear(512, 256), torch::nn::GELU(),
      torch::nn::Linear(256, o.num_classes)));
  });
  // The nodes build their stages from this description: no model code ships (`actorpipe node`
  // processes know the built-in models; this program's own nodes know wide_mlp too).
  remote_model model;
  model.name = own ? "wide_mlp" : "mlp";
  model.options.in_channels = 1;
  model.options.image_size = 28;
  model.options.num_classes = 10;
  model.seed = 7;
  model.loss = "cross_entropy";
  model.optimizer = {"sgd", 0.05, 0.9, 0.0};

  std::vector<std::unique_ptr<node>> own_nodes;
  pipeline_options options;
  options.microbatches = 4;
  if (!own) {
    options.placement.nodes = {argv[1], argv[2]};
    options.placement.secret = argc >= 4 ? argv[3] : "";
  } else {
    for (int i = 0; i < 2; ++i) {
      own_nodes.push_back(std::make_unique<node>(node_options{}));
      options.placement.nodes.push_back(own_nodes.back()->address());
    }
  }
  engine sys;
  auto cut = partition_uniform(make_model(model.name, model.options).size(), 2);
  pipeline remote(sys, model, cut, options);

  // The same model in this process, for comparison.
  torch::manual_seed(model.seed);
  pipeline_options local_options;
  local_options.microbatches = 4;
  local_options.loss = builtin_loss(model.loss);
  local_options.optimizer = make_optimizer(model.optimizer);
  pipeline local(sys, make_model(model.name, model.options), cut, local_options);

  torch::manual_seed(1);
  double worst = 0;
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({32, 1, 28, 28});
    auto y = torch::randint(10, {32}, torch::kLong);
    auto r = remote.train_step(x, y);
    auto l = local.train_step(x, y);
    worst = std::max(worst, std::abs(r.loss - l.loss) / std::abs(l.loss));
    std::cout << "step " << r.step << "  loss on nodes " << std::setprecision(7) << r.loss
              << "  in process " << l.loss << "  (" << std::setprecision(3) << r.wall_ms
              << " ms on " << options.placement.nodes[0] << " + " << options.placement.nodes[1]
              << ")\n";
  }
  std::cout << model.name << ": largest relative loss difference: " << worst << '\n';
  return worst < 1e-4 ? 0 : 1;
}
