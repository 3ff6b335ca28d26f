/// \file
/// `actorpipe launch --nproc N -- <command args>`: starts N ranks of this program on this host,
/// torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in each environment),
/// and supervises them: when one rank fails, the others are stopped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace actorpipe::cli {

struct launch_args {
  std::size_t nproc = 2;
  std::string master_addr = "127.0.0.1";
  /// 0: a free port is picked.
  int64_t master_port = 0;
  /// Seconds the other ranks get to stop after one failed, before they are killed.
  double grace_seconds = 5;
  std::vector<std::string> command;
};

CLI::App* add_launch_command(CLI::App& app, launch_args& args);

/// Returns 0 when every rank exited with 0, else the first failing rank's exit code (128 +
/// signal for a rank killed by a signal).
int run_launch(const launch_args& args);

} // namespace actorpipe::cli
