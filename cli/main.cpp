// actorpipe: pipeline-parallel training on the actor model.
#include <cstdlib>
#include <iostream>

#include <CLI/CLI.hpp>

#include <actorpipe/errors.hpp>
#include <actorpipe/logging.hpp>

#include "cli/bench_command.hpp"
#include "cli/launch_command.hpp"
#include "cli/node_command.hpp"
#include "cli/plan_command.hpp"
#include "cli/train_command.hpp"

int main(int argc, char** argv) {
  CLI::App app{"actorpipe: pipeline-parallel training of neural networks on the actor model"};
  app.set_version_flag("--version", std::string{"actorpipe 0.1.0"});
  app.require_subcommand(1);
  // Before or after the subcommand: `actorpipe --log-level debug train` or `... train --log-level`.
  app.fallthrough();
  std::string log_level = "warn";
  app
    .add_option("--log-level", log_level,
                "Log to stderr at this level or above: trace (every action), debug (every step), "
                "info (pipelines, rendezvous, checkpoints), warn, error, off")
    ->capture_default_str()
    ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  actorpipe::cli::train_args train;
  auto* train_cmd = actorpipe::cli::add_train_command(app, train);
  actorpipe::cli::plan_args plan;
  auto* plan_cmd = actorpipe::cli::add_plan_command(app, plan);
  actorpipe::bench::sweep_options bench;
  auto* bench_cmd = actorpipe::cli::add_bench_command(app, bench);
  actorpipe::cli::launch_args launch;
  auto* launch_cmd = actorpipe::cli::add_launch_command(app, launch);
  actorpipe::cli::node_args node;
  auto* node_cmd = actorpipe::cli::add_node_command(app, node);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every bad flag exits 2 (docs/troubleshooting.md).
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    if (app.count("--log-level") > 0 || std::getenv("ACTORPIPE_LOG_LEVEL") == nullptr) {
      actorpipe::set_log_level(actorpipe::parse_log_level(log_level));
    }
    if (*train_cmd) {
      return actorpipe::cli::run_train(train);
    }
    if (*plan_cmd) {
      return actorpipe::cli::run_plan(plan);
    }
    if (*node_cmd) {
      return actorpipe::cli::run_node(node);
    }
    if (*launch_cmd) {
      return actorpipe::cli::run_launch(launch);
    }
    if (*bench_cmd) {
      if (!bench.replicas.empty()) {
        actorpipe::bench::run_replica_sweep(bench);
        return 0;
      }
      actorpipe::bench::run_sweep(bench);
      return 0;
    }
  } catch (const actorpipe::invalid_argument& e) {
    std::cerr << "actorpipe: error: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "actorpipe: error: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
