#include "cli/program.hpp"

#include <cstdlib>
#include <iostream>

#include <actorpipe/errors.hpp>
#include <actorpipe/logging.hpp>

#include "cli/bench_command.hpp"

namespace actorpipe::cli {

program::program() {
  app.set_version_flag("--version", std::string{"actorpipe 0.1.0"});
  app.require_subcommand(1);
  // Before or after the subcommand: `actorpipe --log-level debug train` or `... train --log-level`.
  app.fallthrough();
  app
    .add_option("--log-level", log_level,
                "Log to stderr at this level or above: trace (every action), debug (every step), "
                "info (pipelines, rendezvous, checkpoints), warn, error, off")
    ->capture_default_str()
    ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  train_command = add_train_command(app, train);
  plan_command = add_plan_command(app, plan);
  bench_command = add_bench_command(app, bench);
  launch_command = add_launch_command(app, launch);
  node_command = add_node_command(app, node);
}

int program::run() {
  try {
    if (app.count("--log-level") > 0 || std::getenv("ACTORPIPE_LOG_LEVEL") == nullptr) {
      set_log_level(parse_log_level(log_level));
    }
    if (*train_command) {
      return run_train(train);
    }
    if (*plan_command) {
      return run_plan(plan);
    }
    if (*node_command) {
      return run_node(node);
    }
    if (*launch_command) {
      return run_launch(launch);
    }
    if (*bench_command) {
      if (!bench.replicas.empty()) {
        bench::run_replica_sweep(bench);
      } else {
        bench::run_sweep(bench);
      }
      return 0;
    }
  } catch (const invalid_argument& e) {
    std::cerr << "actorpipe: error: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "actorpipe: error: " << e.what() << '\n';
    return 1;
  }
  return 0;
}

} // namespace actorpipe::cli
