/// \file
/// `actorpipe train`: trains a built-in model, pipelined, on synthetic data.
#pragma once

#include <cstdint>
#include <string>

#include <CLI/App.hpp>

namespace actorpipe::cli {

struct train_args {
  std::string model = "resnet50";
  std::size_t stages = 2;
  std::size_t microbatches = 4;
  std::string schedule = "1f1b";
  std::string partition = "uniform";
  int64_t batch = 120;
  int64_t image = 128;
  int64_t classes = 0;
  std::size_t steps = 3;
  double lr = 0.05;
  uint64_t seed = 0;
  std::size_t threads = 0;
  int64_t wait_timeout_ms = 60000;
  std::string json;
};

/// Adds the `train` subcommand; `args` receives the parsed flags.
CLI::App* add_train_command(CLI::App& app, train_args& args);

/// Runs it: prints per-step loss and time; returns the process exit code.
int run_train(const train_args& args);

} // namespace actorpipe::cli
