#include "cli/program.hpp"

#include <cstdlib>
#include <iostream>

#include <torch/version.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/logging.hpp>

#include "cli/bench_command.hpp"

namespace actorpipe::cli {

program::program() {
  app.set_version_flag("--version", std::string{"actorpipe 0.1.0 (libtorch " TORCH_VERSION ")"});
  app.require_subcommand(1);
  // Before or after the subcommand: `actorpipe --log-level debug train` or `... train --log-level`.
  app.fallthrough();
  // A run as a file: `actorpipe train --config run.toml` (keys as --print-config writes them,
  // `train.lr = 0.1`, or under a [train] section); the command line overrides the file, and a key
  // that is no flag is refused.
  app.set_config("--config", "",
                 "Read flags from this TOML file (as `actorpipe train --print-config` writes "
                 "them); flags on the command line override it (docs/config.md)");
  app.allow_config_extras(CLI::config_extras_mode::error);
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

std::string program::settings() const {
  // The program's own flag, then the train command's, as `train.KEY`.
  std::istringstream in("log-level=\"" + log_level + "\"\n" +
                        app.get_config_formatter()->to_config(train_command, /*default_also=*/true,
                                                              /*write_description=*/false,
                                                              "train."));
  std::string out = "# actorpipe's settings: `actorpipe train --config FILE` runs them again.\n"
                    "# Flags left at their defaults are comments: uncomment one to set it.\n";
  std::string line;
  while (std::getline(in, line)) {
    auto eq = line.find('=');
    if (line.empty() || eq == std::string::npos || line.compare(eq, 3, "=\"\"") == 0) {
      continue;
    }
    // A default read back from the file would count as given, and a flag given where it does
    // not apply is refused: defaults stay comments.
    auto key = line.substr(0, eq);
    const CLI::Option* option = key.rfind("train.", 0) == 0
                                  ? train_command->get_option_no_throw("--" + key.substr(6))
                                  : app.get_option_no_throw("--" + key);
    bool given = option != nullptr && option->count() > 0;
    out += (given ? "" : "# ") + line + "\n";
  }
  return out;
}

int program::run() {
  try {
    if (app.count("--log-level") > 0 || std::getenv("ACTORPIPE_LOG_LEVEL") == nullptr) {
      set_log_level(parse_log_level(log_level));
    }
    if (*train_command) {
      train.settings = settings();
      if (train.print_config) {
        std::cout << train.settings;
        return 0;
      }
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
        ACTORPIPE_CHECK(bench.shards.empty() && bench.optimizer == "sgd",
                        "--shard and --optimizer apply to the replica grid (--replicas)");
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
