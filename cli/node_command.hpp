/// \file
/// `actorpipe node`: a process that hosts stage actors for schedulers elsewhere.
#pragma once

#include <cstdint>
#include <string>

#include <actorpipe/tls.hpp>

namespace CLI {
class App;
}

namespace actorpipe::cli {

struct node_args {
  std::string listen = "127.0.0.1:7000";
  int64_t data_port = 0;
  std::string secret_file;
  tls_options tls;
  std::size_t max_model_bytes = std::size_t{256} << 20;
  int64_t keep_snapshots = 600;
  /// HOST:PORT of a driver's `train --accept-joins`; empty: none.
  std::string join;
  double join_timeout = 60;
};

CLI::App* add_node_command(CLI::App& app, node_args& args);

/// --tls-cert, --tls-key, --tls-ca (all three or none), for `node` and `train --nodes`.
void add_tls_flags(CLI::App* cmd, tls_options& tls);

/// Listens until SIGINT or SIGTERM; returns the exit code.
int run_node(const node_args& args);

} // namespace actorpipe::cli
