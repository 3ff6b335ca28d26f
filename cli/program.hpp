/// \file
/// The `actorpipe` program as an object: every subcommand's parser and the values it fills, so
/// that main() and the tests (which read the flags the parser defines) build the same program.
#pragma once

#include <memory>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>

#include "bench/sweep.hpp"
#include "cli/launch_command.hpp"
#include "cli/node_command.hpp"
#include "cli/plan_command.hpp"
#include "cli/train_command.hpp"

namespace actorpipe::cli {

/// The parser and the settings it parses into. Not copyable: the parser holds pointers to the
/// settings.
struct program {
  program();
  program(const program&) = delete;
  program& operator=(const program&) = delete;

  /// Runs the subcommand that was parsed; returns the process exit code. Bad input
  /// (actorpipe::invalid_argument) exits 2, any other failure 1, with the message on stderr.
  int run();

  /// Every flag's value as TOML, defaults included (`--print-config`): what `--config` reads
  /// back to run the same. Keys with an empty value are left out (their default is empty, and
  /// "" would not read back as an empty list).
  std::string settings() const;

  CLI::App app{"actorpipe: pipeline-parallel training of neural networks on the actor model"};
  std::string log_level = "warn";
  train_args train;
  plan_args plan;
  bench::sweep_options bench;
  launch_args launch;
  node_args node;
  CLI::App* train_command = nullptr;
  CLI::App* plan_command = nullptr;
  CLI::App* bench_command = nullptr;
  CLI::App* launch_command = nullptr;
  CLI::App* node_command = nullptr;
};

} // namespace actorpipe::cli
