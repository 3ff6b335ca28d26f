/// \file
/// `actorpipe train`: trains a built-in model, pipelined, on Fashion-MNIST or synthetic data.
#pragma once

#include <cstdint>
#include <string>

#include <CLI/App.hpp>

namespace actorpipe::cli {

/// Flags of `actorpipe train`. Empty or zero values take the data set's default.
struct train_args {
  std::string data = "fashion-mnist";
  std::string data_dir;
  std::string model;
  std::size_t stages = 2;
  std::size_t microbatches = 4;
  std::string schedule = "1f1b";
  std::string partition = "uniform";
  int64_t batch = 0;
  int64_t image = 128;
  int64_t classes = 0;
  std::size_t steps = 3;
  int64_t epochs = 1;
  double lr = 0.05;
  double momentum = -1;
  int64_t warmup = 100;
  uint64_t seed = 0;
  std::size_t threads = 0;
  int64_t wait_timeout_ms = 60000;
  int64_t train_samples = 0;
  int64_t test_samples = 0;
  int64_t max_steps = 0;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  std::size_t keep = 3;
  std::string resume;
  std::string metrics;
  bool no_progress = false;
  std::string json;
};

/// Adds the `train` subcommand; `args` receives the parsed flags.
CLI::App* add_train_command(CLI::App& app, train_args& args);

/// Runs it: prints per-step loss and time; returns the process exit code.
int run_train(const train_args& args);

} // namespace actorpipe::cli
