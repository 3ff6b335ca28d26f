/// \file
/// TLS for tensor_hub's data connections (OpenSSL on the hub's blocking sockets, whose
/// SO_RCVTIMEO/SO_SNDTIMEO deadlines bound every handshake, read and write).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include <actorpipe/tls.hpp>

struct ssl_st;
struct ssl_ctx_st;

namespace actorpipe::comm {

/// One process's TLS identity: its certificate and key, and the CA its peers must be signed by.
class tls_context {
public:
  /// Loads and checks the files; throws invalid_argument naming the file that is missing,
  /// unreadable or does not match (the key must belong to the certificate).
  explicit tls_context(const tls_options& options);
  ~tls_context();
  tls_context(const tls_context&) = delete;
  tls_context& operator=(const tls_context&) = delete;

  ssl_ctx_st* native() const { return ctx_; }

private:
  ssl_ctx_st* ctx_ = nullptr;
};

/// One TLS connection over a connected blocking socket (not owned).
class tls_stream {
public:
  /// Runs the handshake as server (accepting) or client; throws comm_error naming `peer` when it
  /// fails (a peer without a certificate of our CA, plain TCP, a timeout).
  tls_stream(const tls_context& context, int fd, bool server, const std::string& peer);
  ~tls_stream();
  tls_stream(const tls_stream&) = delete;
  tls_stream& operator=(const tls_stream&) = delete;

  /// Reads up to n bytes, fewer only at the end of the stream; throws comm_error on errors and
  /// timeouts.
  std::size_t read(void* out, std::size_t n);
  /// Writes all n bytes or throws comm_error.
  void write(const void* data, std::size_t n);

private:
  ssl_st* ssl_ = nullptr;
  std::string peer_;
};

} // namespace actorpipe::comm
