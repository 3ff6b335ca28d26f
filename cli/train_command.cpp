#include "cli/train_command.hpp"

#include <algorithm>
#include <fstream>
#include <future>
#include <iomanip>
#include <iostream>
#include <optional>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>
#include <actorpipe/exported.hpp>
#include <actorpipe/trace.hpp>
#include <actorpipe/training.hpp>

#include "cli/node_command.hpp"
#include "cli/train_cluster.hpp"
#include "models/model_formats.hpp"
#include "training/run_plan.hpp"

namespace actorpipe::cli {

namespace {

void print_plan(const model_setup& setup, const plan_choice& choice) {
  const auto& cut = choice.cut;
  auto counts = stage_parameter_counts(setup.layers, cut);
  auto p = cut.stages() / choice.chunks;
  for (std::size_t k = 0; k < cut.stages(); ++k) {
    auto holder = holder_of(choice.placement(), p, k);
    std::cout << "  stage " << holder.stage;
    if (choice.chunks > 1) {
      std::cout << " chunk " << holder.chunk;
    }
    std::cout << ": layers " << setup.layers[cut.begin(k)].name() << ".."
              << setup.layers[cut.end(k) - 1].name() << ", " << counts[k] << " parameters\n";
  }
  std::cout << std::flush;
}

// `where`: the replicas' stages are in this process, on nodes, or processes of their own.
std::string replicas_note(const data_parallel_options& dp, const char* where) {
  if (dp.replicas <= 1) {
    return {};
  }
  const auto& b = dp.bmuf;
  auto momentum =
    b.block_momentum < 0 ? 1.0 - 1.0 / static_cast<double>(dp.replicas) : b.block_momentum;
  return detail::concat(
    ", ", dp.replicas, " replicas (", where, ", ", dp.master_addr, ":", dp.master_port, ")",
    b.block_steps > 0
      ? detail::concat(", BMUF: blocks of ", b.block_steps, " steps, block lr ", b.block_lr,
                       ", block momentum ", momentum, b.nesterov ? " (Nesterov)" : "")
      : std::string{});
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
          {"recompute", to_string(c.recompute)},
          {"batch", setup.batch},
          {"image", setup.options.image_size},
          {"classes", setup.options.num_classes},
          {"lr", a.optimizer.lr},
          {"seed", a.model.seed},
          {"stage_parameters", stage_parameter_counts(setup.layers, c.cut)}};
}

// --after-forward and --after-backward: built-ins or TorchScript files.
hook_specs hooks_of(const train_args& a) {
  hook_specs hooks;
  if (!a.after_forward.empty()) {
    hooks.after_forward = hook_from_text(a.after_forward, "--after-forward");
  }
  if (!a.after_backward.empty()) {
    hooks.after_backward = hook_from_text(a.after_backward, "--after-backward");
  }
  return hooks;
}

// One loop for every kind of data (training/: train), then the reports.
// What kind of run the flags ask for: the data and the model decide its defaults.
struct run_kind {
  bool synthetic = false;
  std::string tensor_file; // --data tensors:PATH
  bool tensors = false;
  bool images = false;
  // Streams (synthetic data, tensor files) train --steps batches at a constant rate.
  bool stream = false;
  bool text = false;
  bool lm = false;
  std::string loss;
  double lr = 0;
  // --optimizer and its flags with what was not given filled in (optimizer_for).
  optimizer_spec optimizer;
};

run_kind kind_of(const train_args& a, const model_setup& setup, const text_corpus* corpus) {
  run_kind k;
  k.synthetic = a.model.data == "synthetic";
  k.tensor_file = training::tensor_file_of(a.model.data);
  k.tensors = !k.tensor_file.empty();
  k.images = !setup.images.classes.empty();
  k.stream = k.synthetic || (k.tensors && !tensor_data_set(a));
  k.text = corpus != nullptr;
  k.lm = setup.language_model();
  k.loss = k.synthetic && !k.lm ? "mse" : "cross_entropy";
  if (k.tensors) {
    // build_model read the tensor file (its first batch is the profiles' sample).
    k.loss = !a.loss.empty()                                   ? a.loss
             : setup.file.labels.scalar_type() == torch::kLong ? "cross_entropy"
                                                               : "mse";
  }
  k.lr = k.lm && !(a.given && a.given("--lr")) ? 3e-3 : a.optimizer.lr;
  return k;
}

// One description of the optimizer: built here, or by the nodes from the same spec.
// --optimizer and --momentum, else the default (training::default_optimizer_for).
training::default_optimizer optimizer_of(const train_args& a) {
  auto given = [&a](const char* flag) { return a.given && a.given(flag); };
  auto o = training::default_optimizer_for(a.model);
  o.adam = given("--optimizer") ? a.optimizer.name != "sgd" : o.adam;
  o.momentum = given("--momentum") ? a.optimizer.momentum : o.momentum;
  return o;
}

// The flags' spec with what was not given filled in.
optimizer_spec optimizer_for(const train_args& a, const run_kind& k) {
  auto chosen = optimizer_of(a);
  auto optimizer = a.optimizer;
  optimizer.lr = k.lr;
  optimizer.momentum = chosen.momentum;
  if (chosen.adam) {
    optimizer.name = a.given && a.given("--optimizer") ? a.optimizer.name : "adam";
    optimizer.momentum = 0;
    if (optimizer.name == "adamw" && !(a.given && a.given("--weight-decay"))) {
      optimizer.weight_decay = 1e-2; // torch.optim.AdamW's
    }
    for (const char* flag : {"--momentum", "--nesterov"}) {
      ACTORPIPE_CHECK(!a.given || !a.given(flag), flag,
                      " is SGD's: this run trains with Adam (give --optimizer sgd)");
    }
  }
  ACTORPIPE_CHECK(!optimizer.nesterov || optimizer.momentum > 0,
                  "--nesterov needs momentum: give --momentum (e.g. 0.9)");
  ACTORPIPE_CHECK(a.train.min_lr >= 0 && a.train.min_lr <= k.lr, "--min-lr (", a.train.min_lr,
                  ") must be between 0 and the peak learning rate (", k.lr, ")");
  return optimizer;
}

// The model as start_run takes it: on nodes its description (each node builds its stage from
// it), in this process its layers.
training::run_model run_model_of(const train_args& a, const model_setup& setup, const run_kind& k) {
  training::run_model model;
  if (a.run.pipeline.placement.nodes.empty()) {
    model.layers = setup.layers;
    return model;
  }
  auto& remote = model.remote;
  remote.name = setup.name;
  remote.options = setup.options;
  remote.seed = a.model.seed;
  remote.file = setup.model_file;
  remote.segments = setup.segments;
  remote.loss = k.loss;
  remote.optimizer = k.optimizer;
  return model;
}

// The batches to train on; `steps` (0: the data's own count) becomes a stream's step count.
std::unique_ptr<batch_source> data_for(const train_args& a, const model_setup& setup,
                                       const run_kind& k, const text_corpus* corpus,
                                       int64_t& steps) {
  const auto& mo = setup.options;
  const dataset& file_data = setup.file;
  const auto& tensor_file = k.tensor_file;
  const bool tensors = k.tensors, synthetic = k.synthetic, images = k.images, text = k.text,
             lm = k.lm;
  std::unique_ptr<batch_source> data;
  if (tensors && !k.stream) {
    // A data set: --holdout's part kept apart and evaluated after each epoch.
    auto [kept, held] = hold_out(file_data, a.holdout, a.model.seed);
    auto set =
      std::make_unique<dataset_source>("tensors:" + tensor_file, std::move(kept), std::move(held));
    set->set_shuffle(a.shuffle);
    set->set_evaluation_loss(builtin_loss(k.loss));
    data = std::move(set);
  } else if (tensors) {
    const auto samples = file_data.size();
    data = std::make_unique<tensor_file_source>(tensor_file, file_data, a.shuffle);
    // One pass over the file unless --steps says otherwise.
    steps = steps > 0 ? steps : (samples + setup.batch - 1) / setup.batch;
  } else if (synthetic && lm) {
    data = std::make_unique<synthetic_tokens_source>(mo.vocabulary, mo.context);
    steps = steps > 0 ? steps : 3;
  } else if (synthetic) {
    data = std::make_unique<synthetic_source>(mo.in_channels, mo.image_size, mo.num_classes);
    steps = steps > 0 ? steps : 3;
  } else if (images) {
    image_source_options io;
    io.transform.size = mo.image_size;
    io.transform.channels = mo.in_channels;
    io.workers = a.workers;
    io.bad = a.model.bad_images == "skip" ? bad_image_policy::skip : bad_image_policy::fail;
    data = std::make_unique<image_folder_source>(setup.images, io);
  } else if (text) {
    data = std::make_unique<dataset_source>("text:" + corpus->source,
                                            text_windows(corpus->train, mo.context),
                                            text_windows(corpus->validation, mo.context));
  } else {
    auto dir = a.data_dir.empty() ? std::string(default_fashion_mnist_dir()) : a.data_dir;
    auto train_set = load_fashion_mnist(dir, true).head(a.train_samples);
    auto test_set = load_fashion_mnist(dir, false).head(a.test_samples);
    auto images =
      std::make_unique<dataset_source>("fashion-mnist", std::move(train_set), std::move(test_set));
    if (a.augment) {
      images->set_augmentation({2, true});
    }
    data = std::move(images);
  }
  return data;
}

// The training loop's options from the flags (train() in training/trainer.cpp runs them).
train_options train_options_for(const train_args& a, const model_setup& setup, const run_kind& k,
                                const batch_source& data, const data_parallel_options& dp,
                                int64_t steps) {
  const bool text = k.text, stream = k.stream;
  const double lr = k.lr;
  // What the flags filled; the rest follows from the data, the model and the other flags.
  auto to = a.train;
  // Text's default reaches 2.3 bits per character in about 11 minutes on 2 cores.
  const int64_t epochs = a.epochs != 0 ? a.epochs : (text ? 4 : 1);
  to.epochs = epochs;
  to.batch = setup.batch;
  to.seed = a.model.seed;
  to.lr = lr;
  to.settings = a.settings;
  to.max_steps = steps;
  to.model = setup.name;
  to.dataset = data.name();
  to.rank = static_cast<int64_t>(dp.rank);
  to.replicas = static_cast<int64_t>(dp.replicas);
  // Synthetic runs are few, slow steps at a constant rate: a line per step is their progress.
  // A tensor file trains at a constant rate, as a plain torch.optim loop does, unless a cosine
  // schedule's flag is given.
  auto given = [&a](const char* flag) { return a.given && a.given(flag); };
  to.cosine = !stream && !(k.tensors && !given("--warmup") && !given("--min-lr"));
  if (k.tensors && !given("--warmup")) {
    to.warmup_steps = 0;
  }
  to.log_steps = stream && !a.no_progress;
  to.progress = !stream && !a.no_progress;
  to.keep_results = !a.trace.empty() || (stream && !a.json.empty());
  to.overlap_steps = a.run.pipeline.overlap_steps;
  to.recover_lost_nodes = a.on_node_loss == "continue";
  to.recut_slow_nodes = a.on_slow_node == "recut";
  // The straggler watch is for stages on other machines: in process, stages on a shared machine
  // wander with whatever else runs there, so it watches only when asked (--slow-factor).
  if (a.run.pipeline.placement.nodes.empty() && !(a.given && a.given("--slow-factor"))) {
    to.slow_factor = 0;
  }
  // The nodes left are cut as the run was (--partition; cut:... lists fixed cuts, so by
  // parameter counts then), profiled again for time.
  to.repartition = [&setup, plan = a.run.plan](std::size_t parts) {
    auto args = plan;
    args.stages = parts / std::max<std::size_t>(1, plan.chunks);
    if (args.partition.rfind("cut:", 0) == 0) {
      args.partition = "params";
    }
    return choose_plan(setup.layers, setup.sample(), args).cut;
  };
  return to;
}

// The run's first line: the model, the data, the plan.
// The data the run trains on, and for how long at which rate (the header's middle).
void print_data(const train_args& a, const model_setup& setup, const run_kind& k,
                const batch_source& data_source, const train_options& to,
                const text_corpus* corpus) {
  const auto* data = &data_source;
  const auto& mo = setup.options;
  const bool tensors = k.tensors, synthetic = k.synthetic, images = k.images, text = k.text,
             lm = k.lm;
  const auto& loss = k.loss;
  const auto& optimizer = k.optimizer;
  const double lr = k.lr;
  const int64_t steps = to.max_steps;
  const int64_t epochs = to.epochs;
  if (tensors && !k.stream) {
    std::cout << data->name() << " (" << data->epoch_samples() << " samples to train on, "
              << static_cast<const dataset_source&>(*data).test_samples() << " held out, inputs "
              << setup.example.sizes().slice(1) << ' ' << setup.example.scalar_type() << "), "
              << epochs << " epochs" << (a.shuffle ? " shuffled" : " in file order")
              << (steps > 0 ? detail::concat(" (at most ", steps, " steps)") : "") << ", loss "
              << loss << ", " << optimizer.name << " lr " << lr
              << (to.cosine ? detail::concat(" (cosine to ", a.train.min_lr, ", ",
                                             a.train.warmup_steps, " warm-up steps)")
                            : std::string(" (constant)"));
  } else if (tensors) {
    std::cout << data->name() << " (" << static_cast<const tensor_file_source&>(*data).samples()
              << " samples, inputs " << setup.example.sizes().slice(1) << ' '
              << setup.example.scalar_type() << "), " << steps << " steps, loss " << loss << ", "
              << optimizer.name << " lr " << lr;
  } else if (synthetic && lm) {
    std::cout << "synthetic token sequences (vocabulary " << mo.vocabulary << ", context "
              << mo.context << "), " << steps << " steps";
  } else if (synthetic) {
    std::cout << "synthetic data, input " << mo.in_channels << 'x' << mo.image_size << 'x'
              << mo.image_size << ", " << steps << " steps";
  } else if (text) {
    std::cout << "text from " << corpus->source << " (" << corpus->train.numel()
              << " characters to train on, " << corpus->validation.numel()
              << " held out, vocabulary " << mo.vocabulary << "), sequences of " << mo.context
              << ", " << epochs << " epochs"
              << (steps > 0 ? detail::concat(" (at most ", steps, " steps)") : "") << ", Adam lr "
              << lr << " (cosine, " << a.train.warmup_steps << " warm-up steps)";
  } else if (images) {
    const auto& f = setup.images;
    std::cout << "images from " << f.root << " (" << f.train.size() << " train, "
              << f.validation.size() << " held out, " << f.classes.size() << " classes, "
              << mo.in_channels << 'x' << mo.image_size << 'x' << mo.image_size
              << (f.skipped.empty() ? "" : detail::concat(", ", f.skipped.size(), " skipped"))
              << "; " << a.workers << " loader workers), " << epochs << " epochs"
              << (steps > 0 ? detail::concat(" (at most ", steps, " steps)") : "") << ", lr "
              << a.optimizer.lr << " (cosine, " << a.train.warmup_steps << " warm-up steps)";
  } else {
    std::cout << "Fashion-MNIST (" << data->epoch_samples() << " train), " << epochs << " epochs"
              << (steps > 0 ? detail::concat(" (at most ", steps, " steps)") : "") << ", lr "
              << a.optimizer.lr << " (cosine, " << a.train.warmup_steps << " warm-up steps)";
  }
}

void print_header(const train_args& a, const model_setup& setup, const plan_choice& choice,
                  const run_kind& k, const batch_source& data_source, const train_options& to,
                  const text_corpus* corpus, const data_parallel_options& dp) {
  std::cout << "actorpipe train: " << setup.name << " on ";
  print_data(a, setup, k, data_source, to, corpus);
  std::cout << ", " << choice.cut.stages() / choice.chunks << " stages " << choice.cut.to_string()
            << ", schedule " << choice.schedule_name << ", " << choice.microbatches
            << " micro-batches, batch " << to.batch << ", seed " << a.model.seed
            << replicas_note(dp, a.replicas == 1                          ? "processes"
                                 : a.run.pipeline.placement.nodes.empty() ? "in this process"
                                                                          : "on nodes")
            << '\n';
  print_plan(setup, choice);
}

// What the run measured, after it: accuracy or bits, the loader's waits, the planner's error,
// recoveries.
void print_summary(const train_args& a, const model_setup& setup, const plan_choice& choice,
                   const run_kind& k, const train_report& report, training::run_pipeline& run) {
  const bool text = k.text, stream = k.stream, images = k.images;
  auto& pipe = run.lead();
  if (text && !report.epochs.empty()) {
    std::cout << "validation: " << report.epochs.back().test.bits << " bits per character\n";
  } else if (k.tensors && !stream && !report.epochs.empty()) {
    const auto& test = report.epochs.back().test;
    if (a.holdout > 0) {
      std::cout << "held out: loss " << test.loss
                << (test.classes ? detail::concat(", top-1 ", test.top1) : std::string{}) << '\n';
    }
  } else if (!stream && !report.epochs.empty() && !(images && setup.images.validation.empty())) {
    std::cout << "test accuracy: top-1 " << report.epochs.back().test.top1 << ", top-5 "
              << report.epochs.back().test.top5 << '\n';
  }
  if (images && !report.steps.empty()) {
    // Whether the loader kept ahead: the stages never wait for data when this is about 0.
    std::cout << "data: the training loop waited " << std::setprecision(3)
              << report.data_wait_seconds << " s for batches over " << report.steps.size()
              << " steps ("
              << report.data_wait_seconds * 1000 / static_cast<double>(report.steps.size())
              << " ms per step, " << a.workers << " loader workers)\n"
              << std::setprecision(6);
  }
  if (!choice.ranking.empty() && report.step_ms.size() >= 2) {
    // How close the planner came: the median step after the first (which warms memory).
    std::vector<double> times(report.step_ms.begin() + 1, report.step_ms.end());
    std::sort(times.begin(), times.end());
    auto measured = times[times.size() / 2];
    auto predicted = choice.ranking.front().step_ms;
    std::cout << "planner: predicted " << std::setprecision(4) << predicted
              << " ms per step, measured median " << measured << " ms over " << times.size()
              << " steps after the first (" << std::showpos
              << 100 * (predicted - measured) / measured << std::noshowpos << "%)\n"
              << std::setprecision(6);
  }
  if (!report.recoveries.empty()) {
    std::cout << "nodes: " << report.recoveries.size() << " lost-node recover"
              << (report.recoveries.size() == 1 ? "y" : "ies") << ", "
              << report.replayed_steps.size() << " steps replayed; now "
              << (run.replicated ? detail::concat(run.replicated->replicas(),
                                                  run.replicated->replicas() == 1 ? " replica of "
                                                                                  : " replicas of ")
                                 : std::string{})
              << pipe.stages() << " stages, cut " << pipe.cut().to_string() << '\n';
  }
}

// --json: every step's loss and timings, the epochs, the recoveries.
// The report's steps: each one's loss and, where kept, its time and every stage's figures.
void add_steps(nlohmann::json& j, const train_report& report) {
  j["steps"] = nlohmann::json::array();
  for (std::size_t i = 0; i < report.steps.size(); ++i) {
    nlohmann::json row{{"step", report.steps[i].first}, {"loss", report.steps[i].second}};
    if (i < report.results.size()) {
      const auto& r = report.results[i];
      nlohmann::json stages = nlohmann::json::array();
      for (const auto& st : r.stages) {
        nlohmann::json stage{{"sync_ms", st.sync_end_ms - st.sync_start_ms}};
        visit_scalars(st, [&](const char* name, const auto& value) { stage[name] = value; });
        stages.push_back(std::move(stage));
      }
      row["wall_ms"] = r.wall_ms;
      row["stages"] = stages;
    }
    j["steps"].push_back(row);
  }
}

// What the run met and did about it: recoveries, replayed steps, slow stages, re-cuts, rejoins.
void add_faults(nlohmann::json& j, const train_report& report) {
  j["recoveries"] = nlohmann::json::array();
  for (const auto& r : report.recoveries) {
    j["recoveries"].push_back({{"lost", r.lost},
                               {"spares_used", r.spares_used},
                               {"nodes", r.nodes},
                               {"bounds", r.bounds},
                               {"snapshot", r.snapshot},
                               {"seconds", r.seconds},
                               {"replicas_left", r.replicas_left},
                               {"replicas", r.replicas},
                               {"from_replica", r.from_replica},
                               {"from_nodes", r.from_nodes}});
  }
  j["replayed_steps"] = report.replayed_steps;
  j["slow_stages"] = nlohmann::json::array();
  for (const auto& s : report.slow_stages) {
    j["slow_stages"].push_back({{"step", s.step},
                                {"stage", s.stage},
                                {"node", s.node},
                                {"usual_ms", s.usual_ms},
                                {"recent_ms", s.recent_ms}});
  }
  j["recuts"] = nlohmann::json::array();
  for (const auto& c : report.recuts) {
    j["recuts"].push_back(c.bounds);
  }
  j["rejoins"] = nlohmann::json::array();
  for (const auto& r : report.rejoins) {
    j["rejoins"].push_back({{"rejoined", r.rejoined},
                            {"joined", r.joined},
                            {"spares", r.spares_used},
                            {"nodes", r.nodes},
                            {"bounds", r.bounds},
                            {"snapshot", r.snapshot},
                            {"seconds", r.seconds}});
  }
}

void write_report(const train_args& a, const model_setup& setup, const plan_choice& choice,
                  const train_report& report) {
  nlohmann::json j;
  j["config"] = config_json(a, setup, choice);
  add_steps(j, report);
  j["epochs"] = nlohmann::json::array();
  for (const auto& e : report.epochs) {
    j["epochs"].push_back({{"epoch", e.epoch},
                           {"train_loss", e.train_loss},
                           {"test_loss", e.test.loss},
                           {"top1", e.test.top1},
                           {"top5", e.test.top5},
                           {"bits", e.test.bits},
                           {"seconds", e.seconds}});
  }
  add_faults(j, report);
  write_json(a.json, j);
}

// After the run: the model file written back (--export), a text sample (--sample), the JSON
// report (--json) and the trace (--trace).
void write_outputs(const train_args& a, const model_setup& setup, const plan_choice& choice,
                   const run_kind& k, const train_report& report, pipeline& pipe,
                   const text_corpus* corpus) {
  if (!a.export_path.empty()) {
    pipe.save_model(a.export_path);
    const auto& format = *models::format_of(setup.layers);
    std::cout << "wrote " << a.export_path << " (" << format.name << ": " << format.runs_it
              << " runs it)\n";
  }
  if (!a.save_safetensors.empty()) {
    write_pretrained(a.save_safetensors, weights_for_file(pipe.state_dict(), setup.weights),
                     a.max_shard_bytes, setup.weights.config_folder);
    std::cout << "wrote " << a.save_safetensors << " (safetensors"
              << (setup.weights.config_folder.empty() ? "" : " and config.json")
              << ": from_pretrained(dir) loads it)\n";
  }
  if (k.text && a.sample > 0) {
    // The forward-only path, a character at a time, from the start of a held-out line.
    auto prompt = corpus->decode(corpus->validation.slice(0, 0, 1));
    std::cout << "sample:\n"
              << prompt
              << generate_text(pipe, *corpus, prompt, a.sample, setup.options.context, 0.8,
                               a.model.seed)
              << "\n";
  }
  if (!a.json.empty()) {
    write_report(a, setup, choice, report);
  }
  if (!a.trace.empty() && !report.results.empty()) {
    write_chrome_trace(a.trace, report.results);
    std::cout << "wrote " << a.trace << " (open in https://ui.perfetto.dev or chrome://tracing)\n"
              << "planned against measured, last step:\n"
              << compare_bubbles(pipe.training_schedule(), choice.microbatches,
                                 report.results.back())
                   .to_string();
  }
}

// One pipeline's run (or, with --replicas and --nodes, every replica's), from the plan: the data,
// the header, the pipeline (training::start_run), the loop, then the reports. `rank`: which of
// this process's replica threads this is (--replicas in this process).
int run_training(const train_args& a, const model_setup& setup, const run_kind& k,
                 const training::run_plan& plan, std::optional<std::size_t> rank,
                 const text_corpus* corpus) {
  const auto& choice = plan.choice();
  auto dp = plan.settings().pipeline.data_parallel;
  dp.rank = rank.value_or(dp.rank);
  const bool lead = dp.rank == 0;
  auto steps = static_cast<int64_t>(a.steps > 0 ? a.steps : a.max_steps);
  auto data = data_for(a, setup, k, corpus, steps);
  auto to = train_options_for(a, setup, k, *data, dp, steps);
  if (lead) {
    print_header(a, setup, choice, k, *data, to, corpus, dp);
  }
  if (!a.run.pipeline.placement.nodes.empty()) {
    // This process runs no stage; snapshots and recoveries pass megabytes through its heap.
    memory::map_large_allocations();
  }
  engine sys;
  auto run = training::start_run(sys, run_model_of(a, setup, k), plan, rank);
  if (auto at = run.join_address(); !at.empty()) {
    std::cerr << "actorpipe: nodes may join at " << at << " (actorpipe node --join " << at << ")\n";
  }
  if (run.replicated) {
    // One loop takes each batch whole; the replicas split it.
    to.rank = 0;
    to.replicas = 1;
    to.repartition = nullptr;
  }
  auto report = run.replicated ? train(*run.replicated, *data, to) : train(*run.single, *data, to);
  if (!lead) {
    return 0;
  }
  print_summary(a, setup, choice, k, report, run);
  write_outputs(a, setup, choice, k, report, run.lead(), corpus);
  return 0;
}

// --shard (or its short forms --shard-optimizer, --shard-gradients): what each of `replicas`
// keeps of the optimizer step.
shard_mode shard_for(const train_args& a, std::size_t replicas) {
  const auto given = a.run.pipeline.data_parallel.shard;
  const bool short_form = a.shard_optimizer || a.shard_gradients;
  const char* flag = a.shard_gradients   ? "--shard-gradients"
                     : a.shard_optimizer ? "--shard-optimizer"
                                         : "--shard";
  ACTORPIPE_CHECK(!short_form || given == shard_mode::none, flag,
                  " is a short form of --shard, which was given too: give one");
  const auto mode = a.shard_gradients   ? shard_mode::gradients
                    : a.shard_optimizer ? shard_mode::optimizer
                                        : given;
  if (mode == shard_mode::none) {
    return mode;
  }
  ACTORPIPE_CHECK(replicas > 1, flag,
                  " divides the optimizer's state among replicas: give "
                  "--replicas or --world-size > 1");
  ACTORPIPE_CHECK(a.sync != "bmuf", flag,
                  " cannot be combined with --sync bmuf (BMUF replicas "
                  "step on their own, each with its whole optimizer "
                  "state)");
  ACTORPIPE_CHECK(a.on_node_loss != "continue", flag,
                  " cannot be combined with --on-node-loss continue yet: its snapshots hold "
                  "replica 0's state, and replica 0 holds 1/R of the optimizer's (checkpoints "
                  "gather it whole)");
  return mode;
}

// The replicas' options from the flags and the environment (torchrun's RANK, WORLD_SIZE, ...),
// each checked against the others and the model.
// --batch-norm sync and --sync bmuf: what they need, and BMUF's settings into `dp`.
void check_replica_sync(const train_args& a, const model_setup& setup, data_parallel_options& dp) {
  if (dp.sync_batch_norm) {
    ACTORPIPE_CHECK(std::max(a.replicas, dp.replicas) > 1,
                    "--batch-norm sync synchronises replicas: give --replicas or --world-size > 1");
    ACTORPIPE_CHECK(a.run.pipeline.placement.nodes.empty(),
                    "--batch-norm sync: replicas of stages on nodes (--nodes) do "
                    "not synchronise their batch norms yet");
    ACTORPIPE_CHECK(setup.model_file.empty(),
                    "--batch-norm sync applies to the built-in ResNets' batch norm (a model file's "
                    "BatchNorm normalises each replica's micro-batch by itself)");
    ACTORPIPE_CHECK(count_batch_norms(setup.layers) > 0, "--batch-norm sync: --model ", setup.name,
                    " has no batch norm to synchronise (the ResNets have)");
  }
  if (a.sync == "bmuf") {
    ACTORPIPE_CHECK(std::max(a.replicas, dp.replicas) > 1,
                    "--sync bmuf keeps replicas together: give --replicas or --world-size > 1");
    ACTORPIPE_CHECK(!dp.sync_batch_norm, "--sync bmuf cannot be combined with --batch-norm sync "
                                         "(BMUF replicas do not communicate within a block)");
    ACTORPIPE_CHECK(a.bmuf.block_steps >= 1, "--block-steps (", a.bmuf.block_steps,
                    ") must be >= 1");
    ACTORPIPE_CHECK(a.bmuf.block_lr > 0, "--block-lr (", a.bmuf.block_lr, ") must be > 0");
    ACTORPIPE_CHECK(a.bmuf.block_momentum < 1, "--block-momentum (", a.bmuf.block_momentum,
                    ") must be below 1");
    ACTORPIPE_CHECK(a.bmuf.warmup_steps >= 0, "--bmuf-warmup (", a.bmuf.warmup_steps,
                    ") must be >= 0");
    dp.bmuf = a.bmuf;
  } else {
    for (const char* flag : {"--block-steps", "--block-lr", "--block-momentum", "--block-nesterov",
                             "--reset-momentum", "--bmuf-warmup"}) {
      ACTORPIPE_CHECK(!a.given || !a.given(flag), flag, " applies to --sync bmuf");
    }
  }
}

data_parallel_options data_parallel_for(const train_args& a, const model_setup& setup) {
  auto dp = data_parallel_from_env(a.run.pipeline.data_parallel);
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
  ACTORPIPE_CHECK(dp.rank < dp.replicas, "--rank ", dp.rank, " must be below --world-size ",
                  dp.replicas);
  ACTORPIPE_CHECK(a.replicas >= 1, "--replicas must be >= 1");
  ACTORPIPE_CHECK(a.run.pipeline.placement.nodes.empty() || a.on_node_loss != "continue" ||
                    dp.replicas == 1,
                  "--on-node-loss continue: replicas in processes of their own (--world-size) do "
                  "not recover a lost node; run them in one process with --replicas, which "
                  "recovers them together");
  ACTORPIPE_CHECK(a.replicas == 1 || dp.replicas == 1,
                  "--replicas (in this process) and --world-size (processes) cannot be combined");
  check_replica_sync(a, setup, dp);
  dp.shard = shard_for(a, std::max(a.replicas, dp.replicas));
  ACTORPIPE_CHECK(setup.batch % static_cast<int64_t>(std::max(a.replicas, dp.replicas)) == 0,
                  "--batch (", setup.batch, ") must be a multiple of the ",
                  std::max(a.replicas, dp.replicas), " replicas");
  return dp;
}

// The run's declared settings as the flags and the environment give them: the flags' with the
// replicas' options (a launcher's rank and world) and the trace's device timing.
training::run_settings declared_for(const train_args& a, const model_setup& setup) {
  auto declared = a.run;
  declared.pipeline.device_timing = !a.trace.empty(); // the trace draws the GPU's own times
  declared.pipeline.data_parallel = data_parallel_for(a, setup);
  return declared;
}

// What the command brings to training::settings_for beside them: the data's loss, the model's
// optimizer, the hooks, the nodes and their secret, and --replicas, each on a thread and loop
// of its own in this process (run_local_replicas), or on nodes one replicated_pipeline fed by
// one loop, meeting the replicas' stages at a store served here (--master-addr/-port).
training::run_parts parts_for(const train_args& a, const run_kind& k) {
  training::run_parts parts;
  parts.loss = builtin_loss(k.loss);
  parts.optimizer = k.optimizer;
  parts.hooks = hooks_of(a);
  parts.secret = training::secret_from(a.secret_file);
  parts.nodes = a.run.pipeline.placement.nodes;
  parts.replicas = a.replicas;
  parts.replica_loops = true;
  return parts;
}

// Replicas of stages in this process (--replicas): one thread each, meeting at the plan's
// in-process store; the worst exit code, or the first error.
template <class RunRank>
int run_local_replicas(const train_args& a, const model_setup& setup, const RunRank& run_rank) {
  // Each replica owns its modules; built one after another (they seed the global generator).
  std::vector<model_setup> models{setup};
  for (std::size_t r = 1; r < a.replicas; ++r) {
    models.push_back(build_model(a.model));
  }
  std::vector<std::future<int>> ranks;
  for (std::size_t r = 0; r < a.replicas; ++r) {
    ranks.push_back(
      std::async(std::launch::async, [&run_rank, &models, r] { return run_rank(models[r], r); }));
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

} // namespace

int run_train(const train_args& given) {
  if (auto world = cluster_world_for(given)) {
    return run_train_in_cluster(given, *world);
  }
  auto a = given;
  ACTORPIPE_CHECK(a.sample >= 0, "--sample (", a.sample, ") must be >= 0");
  training::check_model_fits_data(a.model);
  std::optional<text_corpus> corpus;
  if (a.model.data == "text") {
    corpus = load_text(a.text_file.empty() ? std::string(default_fortunes_dir()) : a.text_file);
    a.model.vocabulary = corpus->vocabulary();
  }
  const text_corpus* text = corpus ? &*corpus : nullptr;
  auto setup = build_model(a.model);
  a.run.plan.devices = training::parse_devices(a.devices, a.run.plan);
  check_flags_apply(a, setup);
  // The planner's memory model counts the optimizer's state: Adam keeps 2 tensors per
  // parameter, SGD with momentum 1.
  a.run.plan.optimizer_state = optimizer_of(a).state_tensors();
  auto k = kind_of(a, setup, text);
  k.optimizer = optimizer_for(a, k);
  const auto plan = training::plan_run(
    setup.layers, setup.sample(),
    training::settings_for(declared_for(a, setup), parts_for(a, k), training::flag_for));
  auto run_rank = [&](const model_setup& model, std::optional<std::size_t> rank) {
    return run_training(a, model, k, plan, rank, text);
  };
  if (a.replicas == 1 || !a.run.pipeline.placement.nodes.empty()) {
    return run_rank(setup, std::nullopt);
  }
  return run_local_replicas(a, setup, run_rank);
}

} // namespace actorpipe::cli
