#include "cli/train_command.hpp"

#include <fstream>
#include <iomanip>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

namespace actorpipe::cli {

CLI::App* add_train_command(CLI::App& app, train_args& a) {
  auto* cmd = app.add_subcommand(
    "train", "Train a built-in model, pipelined across stage actors, on synthetic data as in "
             "the PyTorch RPC pipeline tutorial (random images, one-hot targets, MSE loss, SGD)");
  cmd->add_option("--model", a.model, "Model: resnet18, resnet34, resnet50, resnet101, mlp, cnn")
    ->capture_default_str();
  cmd->add_option("--stages", a.stages, "Pipeline stages (stage actors), >= 1")
    ->capture_default_str();
  cmd->add_option("--microbatches", a.microbatches, "Micro-batches per batch, >= 1")
    ->capture_default_str();
  cmd->add_option("--schedule", a.schedule, "Schedule: gpipe or 1f1b")->capture_default_str();
  cmd
    ->add_option("--partition", a.partition,
                 "How to cut the layer list: uniform (by layer count), params (balance "
                 "parameters) or cut:I,J (stages start at layers I, J)")
    ->capture_default_str();
  cmd->add_option("--batch", a.batch, "Samples per batch")->capture_default_str();
  cmd
    ->add_option("--image", a.image,
                 "Image side length for the ResNets (mlp and cnn take 28x28 grey images)")
    ->capture_default_str();
  cmd
    ->add_option("--classes", a.classes,
                 "Output classes (0: 1000 for the ResNets, 10 for mlp and cnn)")
    ->capture_default_str();
  cmd->add_option("--steps", a.steps, "Training steps (batches)")->capture_default_str();
  cmd->add_option("--lr", a.lr, "SGD learning rate")->capture_default_str();
  cmd->add_option("--seed", a.seed, "Seed for parameters and data")->capture_default_str();
  cmd
    ->add_option("--threads", a.threads,
                 "Intra-op threads per stage (0: cores divided among the stages)")
    ->capture_default_str();
  cmd
    ->add_option("--wait-timeout", a.wait_timeout_ms,
                 "Milliseconds a stage waits for an input before failing the step")
    ->capture_default_str();
  cmd->add_option("--json", a.json, "Write every step's loss and timings to this JSON file");
  return cmd;
}

int run_train(const train_args& a) {
  bool resnet = a.model.rfind("resnet", 0) == 0;
  model_options mo;
  mo.in_channels = resnet ? 3 : 1;
  mo.image_size = resnet ? a.image : 28;
  mo.num_classes = a.classes > 0 ? a.classes : (resnet ? 1000 : 10);
  ACTORPIPE_CHECK(a.batch >= 1, "--batch (", a.batch, ") must be >= 1");
  ACTORPIPE_CHECK(a.image >= 1, "--image (", a.image, ") must be >= 1");
  ACTORPIPE_CHECK(a.wait_timeout_ms >= 1, "--wait-timeout (", a.wait_timeout_ms, ") must be >= 1");

  torch::manual_seed(a.seed);
  auto layers = make_model(a.model, mo);
  auto cut = parse_partition(a.partition, layers, a.stages);

  pipeline_options po;
  po.microbatches = a.microbatches;
  po.schedule = parse_schedule_kind(a.schedule);
  po.loss = [](const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); };
  po.optimizer = sgd(a.lr);
  po.threads_per_stage = a.threads;
  po.wait_timeout = std::chrono::milliseconds(a.wait_timeout_ms);

  auto counts = stage_parameter_counts(layers, cut);
  std::cout << "actorpipe train: model " << a.model << ", " << cut.stages() << " stages "
            << cut.to_string() << ", schedule " << a.schedule << ", " << a.microbatches
            << " micro-batches, batch " << a.batch << ", input " << mo.in_channels << 'x'
            << mo.image_size << 'x' << mo.image_size << ", seed " << a.seed << '\n';
  for (std::size_t s = 0; s < cut.stages(); ++s) {
    std::cout << "  stage " << s << ": layers " << layers[cut.begin(s)].name() << ".."
              << layers[cut.end(s) - 1].name() << ", " << counts[s] << " parameters\n";
  }

  engine sys;
  pipeline pipe(sys, layers, cut, po);

  nlohmann::json report;
  report["config"] = {{"model", a.model},
                      {"stages", cut.stages()},
                      {"bounds", cut.bounds},
                      {"microbatches", a.microbatches},
                      {"schedule", a.schedule},
                      {"batch", a.batch},
                      {"image", mo.image_size},
                      {"classes", mo.num_classes},
                      {"lr", a.lr},
                      {"seed", a.seed},
                      {"stage_parameters", counts}};
  report["steps"] = nlohmann::json::array();

  for (std::size_t step = 0; step < a.steps; ++step) {
    auto x = torch::randn({a.batch, mo.in_channels, mo.image_size, mo.image_size});
    auto labels = torch::randint(mo.num_classes, {a.batch}, torch::kLong);
    auto y = torch::nn::functional::one_hot(labels, mo.num_classes).to(torch::kFloat);
    auto r = pipe.train_step(x, y);
    std::cout << "step " << r.step << "/" << a.steps << "  loss " << std::setprecision(9) << r.loss
              << "  time " << std::setprecision(4) << r.wall_ms / 1000.0 << " s\n"
              << std::flush;
    nlohmann::json stages = nlohmann::json::array();
    for (const auto& s : r.stages) {
      stages.push_back({{"stage", s.stage},
                        {"forward_ms", s.forward_ms},
                        {"backward_ms", s.backward_ms},
                        {"wait_ms", s.wait_ms},
                        {"optimizer_ms", s.optimizer_ms},
                        {"peak_stash", s.peak_stash}});
    }
    report["steps"].push_back(
      {{"step", r.step}, {"loss", r.loss}, {"wall_ms", r.wall_ms}, {"stages", stages}});
  }
  if (!a.json.empty()) {
    std::ofstream out(a.json);
    ACTORPIPE_CHECK(out.good(), "--json: cannot write '", a.json, "'");
    out << report.dump(2) << '\n';
  }
  return 0;
}

} // namespace actorpipe::cli
