#include "cli/train_command.hpp"

#include <fstream>
#include <iomanip>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>
#include <actorpipe/trace.hpp>
#include <actorpipe/training.hpp>

namespace actorpipe::cli {

CLI::App* add_train_command(CLI::App& app, train_args& a) {
  auto* cmd = app.add_subcommand(
    "train", "Train a built-in model pipelined across stage actors: a CNN on Fashion-MNIST by "
             "default, or any model on synthetic data as in the PyTorch RPC pipeline tutorial "
             "(random images, one-hot targets, MSE loss, SGD)");
  add_model_flags(cmd, a.model);
  add_pipeline_flags(cmd, a.plan);
  auto opt = [&](const std::string& name, auto& value, const std::string& help) {
    return cmd->add_option(name, value, help)->capture_default_str();
  };
  opt("--data-dir", a.data_dir,
      "Folder with Fashion-MNIST's IDX files (default: /usr/share/datasets/fashion-mnist)");
  opt("--steps", a.steps, "Synthetic data: training steps (batches)");
  opt("--epochs", a.epochs, "Fashion-MNIST: epochs");
  opt("--lr", a.lr, "Learning rate (fashion-mnist: peak of the cosine schedule)");
  opt("--momentum", a.momentum, "SGD momentum (-1: 0.9 for fashion-mnist, 0 for synthetic)");
  opt("--warmup", a.warmup, "Fashion-MNIST: linear warm-up steps of the cosine schedule");
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
  opt("--trace", a.trace,
      "Synthetic data: write a Chrome trace (Perfetto, chrome://tracing) of every step and print "
      "planned against measured bubbles");
  return cmd;
}

namespace {

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::mse_loss(y, t);
}

torch::Tensor cross_entropy(const torch::Tensor& y, const torch::Tensor& t) {
  return torch::nn::functional::cross_entropy(y, t);
}

void print_plan(const model_setup& setup, const plan_choice& choice) {
  const auto& cut = choice.cut;
  auto counts = stage_parameter_counts(setup.layers, cut);
  auto p = cut.stages() / choice.chunks;
  for (std::size_t k = 0; k < cut.stages(); ++k) {
    std::cout << "  stage " << k % p;
    if (choice.chunks > 1) {
      std::cout << " chunk " << k / p;
    }
    std::cout << ": layers " << setup.layers[cut.begin(k)].name() << ".."
              << setup.layers[cut.end(k) - 1].name() << ", " << counts[k] << " parameters\n";
  }
  std::cout << std::flush;
}

void write_json(const std::string& path, const nlohmann::json& report) {
  if (path.empty()) {
    return;
  }
  std::ofstream out(path);
  ACTORPIPE_CHECK(out.good(), "--json: cannot write '", path, "'");
  out << report.dump(2) << '\n';
}

nlohmann::json config_json(const train_args& a, const model_setup& setup, const plan_choice& c) {
  return {{"data", a.model.data},
          {"model", setup.name},
          {"stages", c.cut.stages() / c.chunks},
          {"chunks", c.chunks},
          {"bounds", c.cut.bounds},
          {"microbatches", c.microbatches},
          {"schedule", c.schedule_name},
          {"batch", setup.batch},
          {"image", setup.options.image_size},
          {"classes", setup.options.num_classes},
          {"lr", a.lr},
          {"seed", a.model.seed},
          {"stage_parameters", stage_parameter_counts(setup.layers, c.cut)}};
}

int run_fashion_mnist(const train_args& a, const model_setup& setup, const plan_choice& choice,
                      pipeline_options po) {
  auto dir = a.data_dir.empty() ? std::string(default_fashion_mnist_dir()) : a.data_dir;
  auto train = load_fashion_mnist(dir, true).head(a.train_samples);
  auto test = load_fashion_mnist(dir, false).head(a.test_samples);
  po.loss = cross_entropy;
  po.optimizer = sgd(a.lr, a.momentum < 0 ? 0.9 : a.momentum);

  train_options to;
  to.epochs = a.epochs;
  to.batch = setup.batch;
  to.seed = a.model.seed;
  to.lr = a.lr;
  to.warmup_steps = a.warmup;
  to.checkpoint_dir = a.checkpoint_dir;
  to.checkpoint_every = a.checkpoint_every;
  to.keep = a.keep;
  to.resume = a.resume;
  to.metrics = a.metrics;
  to.max_steps = a.max_steps;
  to.progress = !a.no_progress;
  to.model = setup.name;
  to.dataset = "fashion-mnist";

  std::cout << "actorpipe train: " << setup.name << " on Fashion-MNIST (" << train.size()
            << " train, " << test.size() << " test), " << choice.cut.stages() / choice.chunks
            << " stages " << choice.cut.to_string() << ", schedule " << choice.schedule_name << ", "
            << choice.microbatches << " micro-batches, batch " << to.batch << ", " << a.epochs
            << " epochs, lr " << a.lr << " (cosine, " << a.warmup << " warm-up steps), seed "
            << a.model.seed << '\n';
  print_plan(setup, choice);

  engine sys;
  pipeline pipe(sys, setup.layers, choice.cut, po);
  auto report = train_classifier(pipe, train, test, to);

  nlohmann::json j;
  j["config"] = config_json(a, setup, choice);
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

int run_synthetic(const train_args& a, const model_setup& setup, const plan_choice& choice,
                  pipeline_options po) {
  const auto& mo = setup.options;
  po.loss = mse;
  po.optimizer = sgd(a.lr, a.momentum < 0 ? 0.0 : a.momentum);
  std::cout << "actorpipe train: " << setup.name << " on synthetic data, "
            << choice.cut.stages() / choice.chunks << " stages " << choice.cut.to_string()
            << ", schedule " << choice.schedule_name << ", " << choice.microbatches
            << " micro-batches, batch " << setup.batch << ", input " << mo.in_channels << 'x'
            << mo.image_size << 'x' << mo.image_size << ", seed " << a.model.seed << '\n';
  print_plan(setup, choice);

  engine sys;
  pipeline pipe(sys, setup.layers, choice.cut, po);
  nlohmann::json report;
  report["config"] = config_json(a, setup, choice);
  report["steps"] = nlohmann::json::array();
  std::vector<step_result> results;
  for (std::size_t step = 0; step < a.steps; ++step) {
    auto x = torch::randn({setup.batch, mo.in_channels, mo.image_size, mo.image_size});
    auto labels = torch::randint(mo.num_classes, {setup.batch}, torch::kLong);
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
    results.push_back(std::move(r));
  }
  write_json(a.json, report);
  if (!a.trace.empty()) {
    write_chrome_trace(a.trace, results);
    std::cout
      << "wrote " << a.trace << " (open in https://ui.perfetto.dev or chrome://tracing)\n"
      << "planned against measured, last step:\n"
      << compare_bubbles(pipe.training_schedule(), choice.microbatches, results.back()).to_string();
  }
  return 0;
}

} // namespace

int run_train(const train_args& a) {
  ACTORPIPE_CHECK(a.wait_timeout_ms >= 1, "--wait-timeout (", a.wait_timeout_ms, ") must be >= 1");
  auto setup = build_model(a.model);
  auto choice = choose_plan(setup.layers, setup.sample(), a.plan);
  pipeline_options po;
  po.microbatches = choice.microbatches;
  po.schedule = choice.kind;
  po.chunks = choice.chunks;
  po.custom_schedule = choice.custom;
  po.threads_per_stage = a.plan.threads;
  po.wait_timeout = std::chrono::milliseconds(a.wait_timeout_ms);
  return a.model.data == "synthetic" ? run_synthetic(a, setup, choice, std::move(po))
                                     : run_fashion_mnist(a, setup, choice, std::move(po));
}

} // namespace actorpipe::cli
