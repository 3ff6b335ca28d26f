/// \file
/// The payload transport between processes: tensors in comm/wire frames over TCP (Boost.Asio),
/// plain or TLS, while CAF carries the control messages.
///
/// A hub listens on one address; every process that moves tensors has one. With TLS options
/// every connection first runs a mutual TLS handshake (comm/tls.hpp) and all bytes after it are
/// encrypted. A connection then starts with a challenge: the listener sends 32 random bytes, the
/// connecting side answers with HMAC-SHA256(secret, challenge), compared in constant time; a wrong
/// answer closes the connection before any frame is read. Each accepted connection then has a
/// reader thread that decodes frames (checked, see wire.hpp) straight into freshly allocated
/// tensors and hands them to the sink. A malformed frame is logged with its peer and closes that
/// connection only.
///
/// send() writes header and tensor bytes with one gathered write (no copy of contiguous CPU
/// tensors), on a connection opened on first use and kept; every connect and write has a
/// deadline, and errors name the peer.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <actorpipe/tls.hpp>

#include "comm/wire.hpp"

namespace actorpipe::comm {

/// A transport failure (connect, handshake, write), naming the peer.
class comm_error : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

struct hub_options {
  /// Address to listen on ("127.0.0.1", "0.0.0.0", a host's address) and port (0: any free).
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  /// Shared secret of the handshake (may be empty on loopback).
  std::string secret;
  /// Certificates for TLS on every connection, in and out (none: plain TCP).
  tls_options tls;
  frame_limits limits;
  /// Deadline of each connect + handshake, and of each frame written.
  std::chrono::milliseconds io_timeout{30000};
  /// Received payloads of at least 1 MB land in buffers recycled when their tensors die, up to
  /// this many bytes kept: the same shapes recur every micro-batch, and fresh 64 MB buffers cost
  /// a page fault per 4 KB (measured: half the loopback throughput). 0 disables the pool.
  std::size_t pool_bytes = std::size_t{1} << 30;
};

class tensor_hub {
public:
  /// Receives every decoded frame, on the connection's reader thread.
  using sink = std::function<void(frame&&)>;

  /// Starts listening; throws comm_error when the address cannot be bound and
  /// invalid_argument when a TLS file cannot be loaded.
  tensor_hub(hub_options options, sink on_frame);
  /// Closes every connection and joins the threads.
  ~tensor_hub();
  tensor_hub(const tensor_hub&) = delete;
  tensor_hub& operator=(const tensor_hub&) = delete;

  const std::string& host() const;
  uint16_t port() const;

  /// Sends `t` (made contiguous on the CPU first; from a GPU through pinned memory) as one frame
  /// described by `h` to the hub at host:port. Thread-safe; frames to one peer keep their order.
  /// Throws comm_error.
  void send(const std::string& host, uint16_t port, const frame_header& h, const at::Tensor& t);

  /// The local address this process uses to reach host:port (connecting when needed): the
  /// address a peer there can use to reach us.
  std::string local_address_towards(const std::string& host, uint16_t port);

  /// From now on frames arrive in pinned (page-locked) host memory, so that a stage on a GPU
  /// copies them onto its device asynchronously, by DMA. A node calls this when it builds a
  /// stage on a GPU (the CUDA build only: the CPU line has no pinned memory).
  void receive_into_pinned_memory();

  /// Frees the receive buffers kept for reuse (frames of 1 MB and more come into buffers that go
  /// back to a pool when their tensors die): after a frame that will not come again soon, such as
  /// a stage's state restored on a node.
  void release_cached_buffers();

  /// Inbound connections whose reader still runs (a reader of a closed connection is joined at
  /// the next accept).
  std::size_t inbound_connections() const;

  /// Frames received and rejected so far (tests and logs).
  uint64_t frames_received() const;
  uint64_t frames_rejected() const;

  struct impl;

private:
  std::unique_ptr<impl> impl_;
};

/// HMAC-SHA256(secret, challenge).
std::string handshake_answer(const std::string& secret, const std::string& challenge);

/// Reads a secret from a file (trailing newline dropped); throws invalid_argument when it cannot
/// be read, is empty, or is readable by others than its owner.
std::string read_secret_file(const std::string& path);

/// True for 127.0.0.0/8, ::1 and "localhost".
bool is_loopback(const std::string& host);

} // namespace actorpipe::comm
