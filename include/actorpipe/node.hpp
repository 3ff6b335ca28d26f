/// \file
/// A node hosts stage actors for pipelines in other processes (pipeline_options::placement):
/// `actorpipe node` is this class plus a signal handler, and an application can embed one.
/// Control arrives through CAF's middleman, tensors in actorpipe's frames over TCP
/// (docs/distributed.md). A node builds each stage it is asked for from a model's name, cut and
/// seed (a built-in model or one this program registered with register_model), or from the
/// TorchScript bytes the scheduler sent it (load_torchscript), so no program needs rebuilding.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <actorpipe/tls.hpp>

namespace actorpipe {

struct node_options {
  /// Address of both listeners; a non-loopback address needs a secret or TLS.
  std::string host = "127.0.0.1";
  /// Control port (CAF); 0 takes any free port.
  uint16_t port = 0;
  /// Data port (tensor frames); 0 takes any free port.
  uint16_t data_port = 0;
  /// Shared secret a scheduler must prove it knows (HMAC challenge on both listeners).
  std::string secret;
  /// Largest TorchScript model a scheduler may send (bytes); larger ones are refused, naming
  /// the limit (`actorpipe node --max-model-bytes`).
  std::size_t max_model_bytes = std::size_t{256} << 20;
  /// How long the node keeps the newest snapshot of its stages once it hosts no stage (its
  /// driver stopped or died), for a driver that starts again with `--resume nodes`
  /// (`actorpipe node --keep-snapshots`); 0 keeps none.
  std::chrono::seconds keep_snapshots{600};
  /// Certificates: both listeners then speak only TLS and accept only peers whose certificate
  /// the CA signed (CAF's OpenSSL module for control, comm/tls for frames).
  tls_options tls;
  /// "host:port" of a running driver's join listener (`actorpipe train --accept-joins`): the
  /// node announces its address there, proving the secret, and the driver takes it between
  /// steps, as a spare or to cut the model back onto after a loss (`actorpipe node --join`).
  /// The node's address (host, port) must be the one the driver reaches it by. Empty: none.
  std::string join;
  /// How long the node tries to reach that listener (about once a second).
  std::chrono::milliseconds join_timeout{60000};
};

class node {
public:
  /// Starts listening (its own actor system and threads). Throws invalid_argument for a
  /// non-loopback address without a secret or TLS, or a TLS file that cannot be loaded, and
  /// pipeline_error when a port cannot be bound.
  explicit node(node_options options);
  /// Drops every hosted stage and stops listening.
  ~node();
  node(const node&) = delete;
  node& operator=(const node&) = delete;

  /// "host:port" of the control listener, as schedulers name this node.
  std::string address() const;
  uint16_t port() const;
  uint16_t data_port() const;
  /// Stages hosted now.
  std::size_t stages() const;
  /// Frames and control messages refused so far (malformed, unknown, or unauthenticated).
  uint64_t rejected() const;
  /// With node_options::join: whether the driver took this node, is still being asked, or did
  /// not (join_error() says why: the driver refused the secret, nobody answered in time).
  enum class join_state { none, trying, joined, failed };
  join_state joining() const;
  std::string join_error() const;

  struct impl;

private:
  void start_joining(const node_options& options);

  std::unique_ptr<impl> impl_;
};

} // namespace actorpipe
