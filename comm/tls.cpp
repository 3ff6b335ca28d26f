#include "comm/tls.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <actorpipe/errors.hpp>

#include "comm/tensor_hub.hpp"

namespace actorpipe::comm {

namespace {

// The queued OpenSSL errors as one line (and the queue emptied).
std::string ssl_errors() {
  std::string out;
  while (auto code = ERR_get_error()) {
    char text[256];
    ERR_error_string_n(code, text, sizeof text);
    if (!out.empty()) {
      out += "; ";
    }
    out += text;
  }
  return out.empty() ? std::string("no detail from OpenSSL") : out;
}

void require_file(const std::string& path, const char* what) {
  if (path.empty()) {
    throw invalid_argument(detail::concat(
      "TLS needs a certificate, its private key and a CA file; the ", what, " is missing"));
  }
}

// Why an SSL_read or SSL_write on a blocking socket with deadlines failed: the deadline (a
// timed-out socket call reads as WANT_READ/WANT_WRITE), the socket's errno, or OpenSSL's queue.
[[noreturn]] void throw_io_error(int code, int saved_errno, const std::string& what,
                                 const char* timed_out) {
  if (code == SSL_ERROR_WANT_READ || code == SSL_ERROR_WANT_WRITE) {
    throw comm_error(detail::concat(what, " ", timed_out));
  }
  throw comm_error(detail::concat(what, ": ",
                                  code == SSL_ERROR_SYSCALL && ERR_peek_error() == 0
                                    ? std::strerror(saved_errno)
                                    : ssl_errors()));
}

} // namespace

tls_context::tls_context(const tls_options& options) {
  require_file(options.certificate, "certificate");
  require_file(options.private_key, "private key");
  require_file(options.ca_file, "CA file");
  ERR_clear_error();
  ctx_ = SSL_CTX_new(TLS_method());
  if (ctx_ == nullptr) {
    throw invalid_argument(detail::concat("cannot create a TLS context: ", ssl_errors()));
  }
  auto fail = [this](const std::string& message) {
    auto text = detail::concat(message, ": ", ssl_errors());
    SSL_CTX_free(ctx_);
    ctx_ = nullptr;
    throw invalid_argument(text);
  };
  SSL_CTX_set_min_proto_version(ctx_, TLS1_2_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx_, options.certificate.c_str()) != 1) {
    fail(detail::concat("TLS certificate '", options.certificate, "' cannot be loaded"));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx_, options.private_key.c_str(), SSL_FILETYPE_PEM) != 1 &&
      ERR_GET_REASON(ERR_peek_last_error()) != X509_R_KEY_VALUES_MISMATCH) {
    fail(detail::concat("TLS private key '", options.private_key, "' cannot be loaded"));
  }
  if (ERR_peek_error() != 0 || SSL_CTX_check_private_key(ctx_) != 1) {
    fail(detail::concat("TLS private key '", options.private_key,
                        "' does not belong to the certificate '", options.certificate, "'"));
  }
  if (SSL_CTX_load_verify_locations(ctx_, options.ca_file.c_str(), nullptr) != 1) {
    fail(detail::concat("TLS CA file '", options.ca_file, "' cannot be loaded"));
  }
  SSL_CTX_set_verify(ctx_, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  SSL_CTX_set_mode(ctx_, SSL_MODE_AUTO_RETRY);
  // Tensor frames are long streams: read records ahead (fewer system calls per 16 KB record)
  // and prefer AES-128-GCM, the fastest AEAD with AES-NI (both ends still negotiate).
  SSL_CTX_set_read_ahead(ctx_, 1);
  SSL_CTX_set_ciphersuites(ctx_, "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:"
                                 "TLS_CHACHA20_POLY1305_SHA256");
#ifdef SSL_OP_IGNORE_UNEXPECTED_EOF
  // A peer that closes without close_notify ends the stream like plain TCP; frames are
  // length-checked, so a cut-short frame is still caught.
  SSL_CTX_set_options(ctx_, SSL_OP_IGNORE_UNEXPECTED_EOF);
#endif
}

tls_context::~tls_context() {
  SSL_CTX_free(ctx_);
}

tls_stream::tls_stream(const tls_context& context, int fd, bool server, const std::string& peer)
  : peer_(peer) {
  ERR_clear_error();
  ssl_ = SSL_new(context.native());
  if (ssl_ == nullptr || SSL_set_fd(ssl_, fd) != 1) {
    SSL_free(ssl_);
    throw comm_error(detail::concat("TLS with ", peer, ": ", ssl_errors()));
  }
  auto ret = server ? SSL_accept(ssl_) : SSL_connect(ssl_);
  if (ret != 1) {
    auto code = SSL_get_error(ssl_, ret);
    auto saved = errno;
    std::string reason;
    if (code == SSL_ERROR_WANT_READ || code == SSL_ERROR_WANT_WRITE) {
      reason = "the handshake timed out";
    } else if (code == SSL_ERROR_SYSCALL && ERR_peek_error() == 0) {
      reason = saved == 0 ? std::string("the peer closed the connection (does it speak TLS "
                                        "with a certificate of our CA?)")
                          : std::string(std::strerror(saved));
    } else {
      reason = ssl_errors();
    }
    SSL_free(ssl_);
    ssl_ = nullptr;
    throw comm_error(detail::concat("TLS handshake with ", peer, " failed: ", reason));
  }
}

tls_stream::~tls_stream() {
  SSL_free(ssl_);
}

namespace {

// Moves n bytes by `op(offset, count)` (SSL_read or SSL_write at that offset of the caller's
// buffer) in pieces an int can count; stops early only where `at_end` says the peer closed
// cleanly. Errors name `what` (reading from / writing to the peer) and, for a deadline,
// `timed_out`.
template <class Op, class AtEnd>
std::size_t ssl_transfer(SSL* ssl, std::size_t n, Op op, AtEnd at_end, const std::string& what,
                         const char* timed_out) {
  std::size_t done = 0;
  while (done < n) {
    auto piece = static_cast<int>(std::min<std::size_t>(n - done, std::size_t{1} << 30));
    errno = 0;
    auto r = op(done, piece);
    if (r > 0) {
      done += static_cast<std::size_t>(r);
      continue;
    }
    auto code = SSL_get_error(ssl, r);
    if (at_end(code)) {
      break;
    }
    throw_io_error(code, errno, what, timed_out);
  }
  return done;
}

} // namespace

std::size_t tls_stream::read(void* out, std::size_t n) {
  auto* p = static_cast<char*>(out);
  auto clean_close = [](int code) {
    return code == SSL_ERROR_ZERO_RETURN ||
           (code == SSL_ERROR_SYSCALL && errno == 0 && ERR_peek_error() == 0);
  };
  return ssl_transfer(
    ssl_, n, [&](std::size_t at, int k) { return SSL_read(ssl_, p + at, k); }, clean_close,
    "reading from " + peer_, "timed out");
}

void tls_stream::write(const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  ssl_transfer(
    ssl_, n, [&](std::size_t at, int k) { return SSL_write(ssl_, p + at, k); },
    [](int) { return false; }, "writing to " + peer_, "timed out (the peer stopped reading)");
}

} // namespace actorpipe::comm
