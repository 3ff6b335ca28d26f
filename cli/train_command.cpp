#include "cli/train_command.hpp"

#include <fstream>
#include <iomanip>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>
#include <actorpipe/training.hpp>

namespace actorpipe::cli {

CLI::App* add_train_command(CLI::App& app, train_args& a) {
  auto* cmd = app.add_subcommand(
    "train", "Train a built-in model pipelined across stage actors: a CNN on Fashion-MNIST by "
             "default, or any model on synthetic data as in the PyTorch RPC pipeline tutorial "
             "(random images, one-hot targets, MSE loss, SGD)");
  auto opt = [&](const std::string& name, auto& value, const std::string& help) {
    return cmd->add_option(name, value, help)->capture_default_str();
  };
  opt("--data", a.data, "Data: fashion-mnist (real, 1x28x28, 10 classes) or synthetic")
    ->check(CLI::IsMember({"fashion-mnist", "synthetic"}));
  opt("--data-dir", a.data_dir,
      "Folder with Fashion-MNIST's IDX files (default: /usr/share/datasets/fashion-mnist)");
  opt("--model", a.model,
      "Model: resnet18, resnet34, resnet50, resnet101, mlp, cnn (default: cnn for "
      "fashion-mnist, resnet50 for synthetic)");
  opt("--stages", a.stages, "Pipeline stages (stage actors), >= 1");
  opt("--microbatches", a.microbatches, "Micro-batches per batch, >= 1");
  opt("--schedule", a.schedule, "Schedule: gpipe or 1f1b");
  opt("--partition", a.partition,
      "How to cut the layer list: uniform (by layer count), params (balance parameters) or "
      "cut:I,J (stages start at layers I, J)");
  opt("--batch", a.batch, "Samples per batch (0: 64 for fashion-mnist, 120 for synthetic)");
  opt("--image", a.image, "Synthetic data: image side length for the ResNets");
  opt("--classes", a.classes, "Synthetic data: output classes (0: 1000 for ResNets, else 10)");
  opt("--steps", a.steps, "Synthetic data: training steps (batches)");
  opt("--epochs", a.epochs, "Fashion-MNIST: epochs");
  opt("--lr", a.lr, "Learning rate (fashion-mnist: peak of the cosine schedule)");
  opt("--momentum", a.momentum, "SGD momentum (-1: 0.9 for fashion-mnist, 0 for synthetic)");
  opt("--warmup", a.warmup, "Fashion-MNIST: linear warm-up steps of the cosine schedule");
  opt("--seed", a.seed, "Seed for parameters and data order");
  opt("--threads", a.threads, "Intra-op threads per stage (0: cores divided among the stages)");
  opt("--wait-timeout", a.wait_timeout_ms,
      "Milliseconds a stage waits for an input before failing the step");
  opt("--train-samples", a.train_samples, "Fashion-MNIST: use only the first N training samples");
  opt("--test-samples", a.test_samples, "Fashion-MNIST: use only the first N test samples");
  opt("--max-steps", a.max_steps, "Fashion-MNIST: stop (and checkpoint) after N steps in total");
  opt("--checkpoint-dir", a.checkpoint_dir, "Fashion-MNIST: write checkpoints into this folder");
  opt("--checkpoint-every", a.checkpoint_every,
      "Fashion-MNIST: checkpoint every N steps (0: only at the end)");
  opt("--keep", a.keep, "Fashion-MNIST: checkpoints to keep");
  opt("--resume", a.resume,
      "Fashion-MNIST: continue from a checkpoint (or the newest in a folder); the stage count "
      "may differ");
  opt("--metrics", a.metrics, "Fashion-MNIST: per-epoch metrics file (.csv, else JSON lines)");
  cmd->add_flag("--no-progress", a.no_progress, "Fashion-MNIST: no progress bar");
  opt("--json", a.json, "Write every step's loss (full precision) and timings to this JSON file");
  return cmd;
}

namespace {

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

torch::Tensor cross_entropy(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::nn::functional::cross_entropy(y, t);
}

void print_plan(const std::string& model, const layer_list& layers, const partition& cut) {
  auto counts = stage_parameter_counts(layers, cut);
  for (std::size_t s = 0; s < cut.stages(); ++s) {
    std::cout << "  stage " << s << ": layers " << layers[cut.begin(s)].name() << ".."
              << layers[cut.end(s) - 1].name() << ", " << counts[s] << " parameters\n";
  }
}

void write_json(const std::string& path, const nlohmann::json& report) {
  if (path.empty()) {
    return;
  }
  std::ofstream out(path);
  ACTORPIPE_CHECK(out.good(), "--json: cannot write '", path, "'");
  out << report.dump(2) << '\n';
}

int run_fashion_mnist(const train_args& a, pipeline_options po) {
  std::string model = a.model.empty() ? "cnn" : a.model;
  ACTORPIPE_CHECK(model.rfind("resnet", 0) != 0, "--data fashion-mnist takes 1x28x28 images: use "
                  "--model cnn or mlp (ResNets train on --data synthetic)");
  auto dir = a.data_dir.empty() ? std::string(default_fashion_mnist_dir()) : a.data_dir;
  auto train = load_fashion_mnist(dir, true).head(a.train_samples);
  auto test = load_fashion_mnist(dir, false).head(a.test_samples);

  model_options mo;
  mo.in_channels = 1;
  mo.image_size = 28;
  mo.num_classes = 10;
  torch::manual_seed(a.seed);
  auto layers = make_model(model, mo);
  auto cut = parse_partition(a.partition, layers, a.stages);
  po.loss = cross_entropy;
  po.optimizer = sgd(a.lr, a.momentum < 0 ? 0.9 : a.momentum);

  train_options to;
  to.epochs = a.epochs;
  to.batch = a.batch > 0 ? a.batch : 64;
  to.seed = a.seed;
  to.lr = a.lr;
  to.warmup_steps = a.warmup;
  to.checkpoint_dir = a.checkpoint_dir;
  to.checkpoint_every = a.checkpoint_every;
  to.keep = a.keep;
  to.resume = a.resume;
  to.metrics = a.metrics;
  to.max_steps = a.max_steps;
  to.progress = !a.no_progress;
  to.model = model;
  to.dataset = "fashion-mnist";

  std::cout << "actorpipe train: " << model << " on Fashion-MNIST (" << train.size() << " train, "
            << test.size() << " test), " << cut.stages() << " stages " << cut.to_string()
            << ", schedule " << a.schedule << ", " << a.microbatches << " micro-batches, batch "
            << to.batch << ", " << a.epochs << " epochs, lr " << a.lr << " (cosine, "
            << a.warmup << " warm-up steps), seed " << a.seed << '\n';
  print_plan(model, layers, cut);
  std::cout << std::flush;

  engine sys;
  pipeline pipe(sys, layers, cut, po);
  auto report = train_classifier(pipe, train, test, to);

  nlohmann::json j;
  j["config"] = {{"data", "fashion-mnist"}, {"model", model},       {"stages", cut.stages()},
                 {"bounds", cut.bounds},    {"batch", to.batch},     {"seed", a.seed},
                 {"microbatches", a.microbatches}, {"schedule", a.schedule}};
  j["steps"] = nlohmann::json::array();
  for (const auto& [step, loss] : report.steps) {
    j["steps"].push_back({{"step", step}, {"loss", loss}});
  }
  j["epochs"] = nlohmann::json::array();
  for (const auto& e : report.epochs) {
    j["epochs"].push_back({{"epoch", e.epoch},
                           {"train_loss", e.train_loss},
                           {"test_loss", e.test.loss},
                           {"top1", e.test.top1},
                           {"top5", e.test.top5},
                           {"seconds", e.seconds}});
  }
  if (!report.epochs.empty()) {
    std::cout << "test accuracy: top-1 " << report.epochs.back().test.top1 << ", top-5 "
              << report.epochs.back().test.top5 << '\n';
  }
  write_json(a.json, j);
  return 0;
}

int run_synthetic(const train_args& a, pipeline_options po) {
  std::string model = a.model.empty() ? "resnet50" : a.model;
  bool resnet = model.rfind("resnet", 0) == 0;
  model_options mo;
  mo.in_channels = resnet ? 3 : 1;
  mo.image_size = resnet ? a.image : 28;
  mo.num_classes = a.classes > 0 ? a.classes : (resnet ? 1000 : 10);
  int64_t batch = a.batch > 0 ? a.batch : 120;
  ACTORPIPE_CHECK(a.image >= 1, "--image (", a.image, ") must be >= 1");

  torch::manual_seed(a.seed);
  auto layers = make_model(model, mo);
  auto cut = parse_partition(a.partition, layers, a.stages);
  po.loss = mse;
  po.optimizer = sgd(a.lr, a.momentum < 0 ? 0.0 : a.momentum);

  std::cout << "actorpipe train: " << model << " on synthetic data, " << cut.stages()
            << " stages " << cut.to_string() << ", schedule " << a.schedule << ", "
            << a.microbatches << " micro-batches, batch " << batch << ", input "
            << mo.in_channels << 'x' << mo.image_size << 'x' << mo.image_size << ", seed "
            << a.seed << '\n';
  print_plan(model, layers, cut);
  std::cout << std::flush;

  engine sys;
  pipeline pipe(sys, layers, cut, po);

  nlohmann::json report;
  report["config"] = {{"data", "synthetic"},          {"model", model},
                      {"stages", cut.stages()},       {"bounds", cut.bounds},
                      {"microbatches", a.microbatches}, {"schedule", a.schedule},
                      {"batch", batch},               {"image", mo.image_size},
                      {"classes", mo.num_classes},    {"lr", a.lr},
                      {"seed", a.seed},               {"stage_parameters", stage_parameter_counts(layers, cut)}};
  report["steps"] = nlohmann::json::array();
  for (std::size_t step = 0; step < a.steps; ++step) {
    auto x = torch::randn({batch, mo.in_channels, mo.image_size, mo.image_size});
    auto labels = torch::randint(mo.num_classes, {batch}, torch::kLong);
    auto y = torch::nn::functional::one_hot(labels, mo.num_classes).to(torch::kFloat);
    auto r = pipe.train_step(x, y);
    std::cout << "step " << r.step << "/" << a.steps << "  loss " << std::setprecision(9)
              << r.loss << "  time " << std::setprecision(4) << r.wall_ms / 1000.0 << " s\n"
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
  write_json(a.json, report);
  return 0;
}

} // namespace

int run_train(const train_args& a) {
  ACTORPIPE_CHECK(a.batch >= 0, "--batch (", a.batch, ") must be >= 1");
  ACTORPIPE_CHECK(a.wait_timeout_ms >= 1, "--wait-timeout (", a.wait_timeout_ms,
                  ") must be >= 1");
  pipeline_options po;
  po.microbatches = a.microbatches;
  po.schedule = parse_schedule_kind(a.schedule);
  po.threads_per_stage = a.threads;
  po.wait_timeout = std::chrono::milliseconds(a.wait_timeout_ms);
  return a.data == "synthetic" ? run_synthetic(a, std::move(po)) : run_fashion_mnist(a, std::move(po));
}

} // namespace actorpipe::cli
