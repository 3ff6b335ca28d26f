#include "cli/node_command.hpp"

#include <csignal>
#include <iostream>

#include <CLI/CLI.hpp>

#include <actorpipe/errors.hpp>
#include <actorpipe/memory.hpp>

#include "nodes/protocol.hpp"
#include "training/cluster.hpp"
#include <actorpipe/node.hpp>

namespace actorpipe::cli {

CLI::App* add_node_command(CLI::App& app, node_args& a) {
  auto* cmd = app.add_subcommand(
    "node", "Host stage actors for `actorpipe train --nodes` (or the embedding API) in other "
            "processes or on other hosts; runs until SIGINT or SIGTERM");
  cmd
    ->add_option("--listen", a.listen,
                 "HOST:PORT of the control listener (CAF); the data listener takes the same host")
    ->capture_default_str();
  cmd->add_option("--data-port", a.data_port, "Port of the data listener (0: any free port)")
    ->capture_default_str();
  cmd->add_option(
    "--secret-file", a.secret_file,
    "File holding the shared secret schedulers must prove they know (mode 600; not given: "
    "the variable ACTORPIPE_SECRET's text); required to listen on a non-loopback "
    "address unless TLS is on");
  cmd
    ->add_option("--max-model-bytes", a.max_model_bytes,
                 "Largest TorchScript model (bytes) a scheduler may send this node")
    ->capture_default_str()
    ->check(CLI::PositiveNumber);
  cmd
    ->add_option("--keep-snapshots", a.keep_snapshots,
                 "Seconds to keep the newest snapshot of the stages hosted here once none is, for "
                 "a driver that starts again with `train --resume nodes` (0: keep none)")
    ->capture_default_str()
    ->check(CLI::NonNegativeNumber);
  auto* join =
    cmd->add_option("--join", a.join,
                    "HOST:PORT of a running `actorpipe train --accept-joins`: announce this node "
                    "there (proving the secret); the run takes it at its next step, as a spare or "
                    "to cut the model back onto after a loss. --listen must be the address the "
                    "driver reaches this node by");
  cmd
    ->add_option("--join-timeout", a.join_timeout,
                 "Seconds to keep trying to reach the --join driver")
    ->capture_default_str()
    ->check(CLI::PositiveNumber)
    ->needs(join);
  add_tls_flags(cmd, a.tls);
  return cmd;
}

void add_tls_flags(CLI::App* cmd, tls_options& tls) {
  auto* cert = cmd
                 ->add_option("--tls-cert", tls.certificate,
                              "TLS: this process's certificate chain (PEM); control and tensor "
                              "frames then go over mutual TLS")
                 ->check(CLI::ExistingFile);
  auto* key =
    cmd->add_option("--tls-key", tls.private_key, "TLS: the certificate's private key (PEM)")
      ->check(CLI::ExistingFile);
  auto* ca = cmd
               ->add_option("--tls-ca", tls.ca_file,
                            "TLS: CA certificate(s) that must have signed the peers' (PEM)")
               ->check(CLI::ExistingFile);
  cert->needs(key)->needs(ca);
  key->needs(cert)->needs(ca);
  ca->needs(cert)->needs(key);
}

int run_node(const node_args& a) {
  auto [host, port] = nodes::parse_host_port(a.listen, "--listen");
  ACTORPIPE_CHECK(a.data_port >= 0 && a.data_port <= 65535, "--data-port (", a.data_port,
                  ") must be in [0, 65535]");
  node_options options;
  options.host = host;
  options.port = port;
  options.data_port = static_cast<uint16_t>(a.data_port);
  options.secret = training::secret_from(a.secret_file);
  options.tls = a.tls;
  options.max_model_bytes = a.max_model_bytes;
  options.keep_snapshots = std::chrono::seconds(a.keep_snapshots);
  options.join = a.join;
  options.join_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.join_timeout * 1000));
  // Block the signals first so that every thread the node starts inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // Megabytes of state and models pass through the heap of a process that runs for ever.
  memory::map_large_allocations();
  if (!options.join.empty()) {
    nodes::parse_host_port(options.join, "--join");
  }
  node n(options);
  std::cout << "actorpipe node: listening on " << n.address() << " (data port " << n.data_port()
            << (options.secret.empty() ? ", no secret" : ", secret required")
            << (options.tls.enabled() ? ", TLS" : "") << ")" << std::endl;
  int received = 0;
  if (options.join.empty()) {
    sigwait(&signals, &received);
  } else {
    // Until a signal, watching the announcement: a node the driver refused (or never heard)
    // ends with an error rather than wait unused.
    std::cout << "actorpipe node: joining the driver at " << options.join << std::endl;
    bool reported = false;
    timespec tick{0, 200'000'000};
    while ((received = sigtimedwait(&signals, nullptr, &tick)) < 0) {
      auto state = n.joining();
      if (state == node::join_state::failed) {
        std::cerr << "actorpipe node: " << n.join_error() << std::endl;
        return 1;
      }
      if (state == node::join_state::joined && !reported) {
        std::cout << "actorpipe node: joined the driver at " << options.join << std::endl;
        reported = true;
      }
    }
  }
  std::cout << "actorpipe node: " << (received == SIGINT ? "SIGINT" : "SIGTERM") << ", stopping"
            << std::endl;
  return 0;
}

} // namespace actorpipe::cli
