#include "cli/train_command.hpp"

#include <fstream>
#include <future>
#include <iomanip>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>
#include <actorpipe/trace.hpp>
#include <actorpipe/training.hpp>

#include "cli/node_command.hpp"
#include "comm/tensor_hub.hpp"

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
  opt("--replicas", a.replicas,
      "Data parallelism in this process: replicas of the pipeline, each on batch/replicas "
      "samples, averaging gradients per stage (c10d Gloo)");
  opt("--rank", a.rank, "Data parallelism across processes: this process's rank (default: RANK)");
  opt("--world-size", a.world_size,
      "Data parallelism across processes: number of ranks (default: WORLD_SIZE, else 1)");
  opt("--master-addr", a.master_addr,
      "Rendezvous address served by rank 0 (default: MASTER_ADDR, else 127.0.0.1)");
  opt("--master-port", a.master_port, "Rendezvous port (default: MASTER_PORT, else 29500)");
  cmd
    ->add_option("--nodes", a.nodes,
                 "Run stage i on the `actorpipe node` at the i-th HOST:PORT (comma-separated, one "
                 "per stage); activations go node to node")
    ->delimiter(',');
  opt("--secret-file", a.secret_file, "The nodes' shared secret (their --secret-file)");
  add_tls_flags(cmd, a.tls);
  opt("--connect-timeout", a.connect_timeout_ms,
      "Milliseconds to reach each node and for each control request");
  opt("--dp-timeout", a.dp_timeout_ms,
      "Milliseconds to wait for all ranks at the rendezvous and for each all-reduce");
  opt("--buffers", a.buffers,
      "Batch-norm statistics across replicas after each step: broadcast (rank 0's), average, "
      "none")
    ->check(CLI::IsMember({"broadcast", "average", "none"}));
  opt("--max-grad-norm", a.max_grad_norm,
      "Clip the global gradient norm (all stages, all replicas) to this value; 0: off");
  opt("--trace", a.trace,
      "Synthetic data: write a Chrome trace (Perfetto, chrome://tracing) of every step and print "
      "planned against measured bubbles");
  return cmd;
}

namespace {

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

std::string replicas_note(const data_parallel_options& dp) {
  if (dp.replicas <= 1) {
    return {};
  }
  return detail::concat(", ", dp.replicas, " replicas (",
                        dp.local ? "in this process" : "processes", ", ", dp.master_addr, ":",
                        dp.master_port, ")");
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

// In this process, or on nodes when --nodes is given.
std::unique_ptr<pipeline> make_pipeline(engine& sys, const train_args& a, const model_setup& setup,
                                        const plan_choice& choice, pipeline_options po,
                                        const char* loss, optimizer_spec optimizer) {
  if (a.nodes.empty()) {
    return std::make_unique<pipeline>(sys, setup.layers, choice.cut, std::move(po));
  }
  remote_model model;
  model.name = setup.name;
  model.options = setup.options;
  model.seed = a.model.seed;
  model.loss = loss;
  model.optimizer = std::move(optimizer);
  po.placement.nodes = a.nodes;
  if (!a.secret_file.empty()) {
    po.placement.secret = comm::read_secret_file(a.secret_file);
  }
  po.placement.tls = a.tls;
  ACTORPIPE_CHECK(a.connect_timeout_ms >= 1, "--connect-timeout must be >= 1");
  po.placement.connect_timeout = std::chrono::milliseconds(a.connect_timeout_ms);
  return std::make_unique<pipeline>(sys, std::move(model), choice.cut, std::move(po));
}

optimizer_spec sgd_spec(double lr, double momentum) {
  optimizer_spec spec;
  spec.lr = lr;
  spec.momentum = momentum;
  return spec;
}

int run_fashion_mnist(const train_args& a, const model_setup& setup, const plan_choice& choice,
                      pipeline_options po) {
  auto dir = a.data_dir.empty() ? std::string(default_fashion_mnist_dir()) : a.data_dir;
  auto train = load_fashion_mnist(dir, true).head(a.train_samples);
  auto test = load_fashion_mnist(dir, false).head(a.test_samples);
  po.loss = builtin_loss("cross_entropy");
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

  const auto& dp = po.data_parallel;
  to.rank = static_cast<int64_t>(dp.rank);
  to.replicas = static_cast<int64_t>(dp.replicas);
  const bool lead = dp.rank == 0;
  if (lead) {
    std::cout << "actorpipe train: " << setup.name << " on Fashion-MNIST (" << train.size()
              << " train, " << test.size() << " test), " << choice.cut.stages() / choice.chunks
              << " stages " << choice.cut.to_string() << ", schedule " << choice.schedule_name
              << ", " << choice.microbatches << " micro-batches, batch " << to.batch << ", "
              << a.epochs << " epochs, lr " << a.lr << " (cosine, " << a.warmup
              << " warm-up steps), seed " << a.model.seed << replicas_note(dp) << '\n';
    print_plan(setup, choice);
  }

  engine sys;
  auto pipe_ptr = make_pipeline(sys, a, setup, choice, po, "cross_entropy",
                                sgd_spec(a.lr, a.momentum < 0 ? 0.9 : a.momentum));
  auto& pipe = *pipe_ptr;
  auto report = train_classifier(pipe, train, test, to);
  if (!lead) {
    return 0;
  }

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
  po.loss = builtin_loss("mse");
  po.optimizer = sgd(a.lr, a.momentum < 0 ? 0.0 : a.momentum);
  if (po.data_parallel.rank == 0) {
    std::cout << "actorpipe train: " << setup.name << " on synthetic data, "
              << choice.cut.stages() / choice.chunks << " stages " << choice.cut.to_string()
              << ", schedule " << choice.schedule_name << ", " << choice.microbatches
              << " micro-batches, batch " << setup.batch << ", input " << mo.in_channels << 'x'
              << mo.image_size << 'x' << mo.image_size << ", seed " << a.model.seed
              << replicas_note(po.data_parallel) << '\n';
    print_plan(setup, choice);
  }

  const auto& dp = po.data_parallel;
  const bool lead = dp.rank == 0;
  engine sys;
  auto pipe_ptr = make_pipeline(sys, a, setup, choice, po, "mse",
                                sgd_spec(a.lr, a.momentum < 0 ? 0.0 : a.momentum));
  auto& pipe = *pipe_ptr;
  nlohmann::json report;
  report["config"] = config_json(a, setup, choice);
  report["steps"] = nlohmann::json::array();
  std::vector<step_result> results;
  for (std::size_t step = 0; step < a.steps; ++step) {
    // Every rank draws the whole batch from the step's own generator and takes its part.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(a.model.seed * 1000003ULL + step + 1);
    auto x = torch::randn({setup.batch, mo.in_channels, mo.image_size, mo.image_size}, gen,
                          torch::TensorOptions());
    auto labels = torch::randint(mo.num_classes, {setup.batch}, gen, torch::kLong);
    auto y = torch::nn::functional::one_hot(labels, mo.num_classes).to(torch::kFloat);
    if (dp.replicas > 1) {
      auto part = static_cast<std::size_t>(dp.rank);
      x = torch::tensor_split(x, static_cast<int64_t>(dp.replicas), 0).at(part);
      y = torch::tensor_split(y, static_cast<int64_t>(dp.replicas), 0).at(part);
    }
    auto r = pipe.train_step(x, y);
    if (lead) {
      std::cout << "step " << r.step << "/" << a.steps << "  loss " << std::setprecision(9)
                << r.loss << "  time " << std::setprecision(4) << r.wall_ms / 1000.0 << " s\n"
                << std::flush;
    }
    nlohmann::json stages = nlohmann::json::array();
    for (const auto& s : r.stages) {
      stages.push_back({{"stage", s.stage},
                        {"forward_ms", s.forward_ms},
                        {"backward_ms", s.backward_ms},
                        {"wait_ms", s.wait_ms},
                        {"optimizer_ms", s.optimizer_ms},
                        {"sync_ms", s.sync_end_ms - s.sync_start_ms},
                        {"peak_stash", s.peak_stash}});
    }
    report["steps"].push_back(
      {{"step", r.step}, {"loss", r.loss}, {"wall_ms", r.wall_ms}, {"stages", stages}});
    results.push_back(std::move(r));
  }
  if (!lead) {
    return 0;
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
  auto po = pipeline_options_for(choice, a.plan);
  po.wait_timeout = std::chrono::milliseconds(a.wait_timeout_ms);
  ACTORPIPE_CHECK(a.max_grad_norm >= 0, "--max-grad-norm (", a.max_grad_norm, ") must be >= 0");
  po.max_grad_norm = a.max_grad_norm;

  auto& dp = po.data_parallel;
  dp = data_parallel_from_env();
  if (a.world_size > 0) {
    dp.replicas = static_cast<std::size_t>(a.world_size);
  }
  if (a.rank >= 0) {
    dp.rank = static_cast<std::size_t>(a.rank);
  }
  if (!a.master_addr.empty()) {
    dp.master_addr = a.master_addr;
  }
  if (a.master_port > 0) {
    ACTORPIPE_CHECK(a.master_port <= 65535, "--master-port (", a.master_port,
                    ") must be in [1, 65535]");
    dp.master_port = static_cast<uint16_t>(a.master_port);
  }
  ACTORPIPE_CHECK(a.dp_timeout_ms >= 1, "--dp-timeout (", a.dp_timeout_ms, ") must be >= 1");
  dp.timeout = std::chrono::milliseconds(a.dp_timeout_ms);
  dp.buffers = a.buffers == "average" ? buffer_sync::average
               : a.buffers == "none"  ? buffer_sync::none
                                      : buffer_sync::broadcast;
  ACTORPIPE_CHECK(dp.rank < dp.replicas, "--rank ", dp.rank, " must be below --world-size ",
                  dp.replicas);
  ACTORPIPE_CHECK(a.replicas >= 1, "--replicas must be >= 1");
  ACTORPIPE_CHECK(a.nodes.empty() || (a.replicas == 1 && dp.replicas == 1),
                  "--nodes cannot be combined with --replicas or --world-size (yet)");
  ACTORPIPE_CHECK(a.nodes.empty() || a.nodes.size() == choice.cut.stages(), "--nodes lists ",
                  a.nodes.size(), " nodes for ", choice.cut.stages(), " stages");
  ACTORPIPE_CHECK(a.replicas == 1 || dp.replicas == 1,
                  "--replicas (in this process) and --world-size (processes) cannot be combined");
  ACTORPIPE_CHECK(setup.batch % static_cast<int64_t>(std::max(a.replicas, dp.replicas)) == 0,
                  "--batch (", setup.batch, ") must be a multiple of the ",
                  std::max(a.replicas, dp.replicas), " replicas");
  auto run_rank = [&](const model_setup& model, pipeline_options o) {
    return a.model.data == "synthetic" ? run_synthetic(a, model, choice, std::move(o))
                                       : run_fashion_mnist(a, model, choice, std::move(o));
  };
  if (a.replicas == 1) {
    return run_rank(setup, std::move(po));
  }
  // Replicas in this process: one thread each, meeting at an in-process store.
  dp.replicas = a.replicas;
  dp.local = make_local_rendezvous();
  // Each replica owns its modules; built one after another (they seed the global generator).
  std::vector<model_setup> models{setup};
  for (std::size_t r = 1; r < a.replicas; ++r) {
    models.push_back(build_model(a.model));
  }
  std::vector<std::future<int>> ranks;
  for (std::size_t r = 0; r < a.replicas; ++r) {
    auto o = po;
    o.data_parallel.rank = r;
    ranks.push_back(std::async(std::launch::async,
                               [&run_rank, &models, r, o] { return run_rank(models[r], o); }));
  }
  int code = 0;
  std::exception_ptr error;
  for (auto& r : ranks) {
    try {
      code = std::max(code, r.get());
    } catch (...) {
      error = error ? error : std::current_exception();
    }
  }
  if (error) {
    std::rethrow_exception(error);
  }
  return code;
}

} // namespace actorpipe::cli
