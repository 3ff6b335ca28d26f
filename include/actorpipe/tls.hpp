/// \file
/// TLS between schedulers and nodes: control through CAF's OpenSSL module, tensor frames through
/// actorpipe's own TLS connections, both with the same certificates (docs/distributed.md).
#pragma once

#include <string>

namespace actorpipe {

/// PEM files of one process's TLS identity. Both ends of every connection present their
/// certificate and accept only a peer whose certificate the CA signed (mutual TLS, TLS 1.2 or
/// newer); host names are not checked, the CA is the trust boundary. All three files are needed
/// once any is given.
struct tls_options {
  /// Certificate chain of this process (PEM).
  std::string certificate;
  /// Private key of that certificate (PEM, unencrypted).
  std::string private_key;
  /// Certificates of the CA(s) that signed the peers' certificates (PEM).
  std::string ca_file;

  bool enabled() const { return !certificate.empty() || !private_key.empty() || !ca_file.empty(); }
  bool operator==(const tls_options& other) const {
    return certificate == other.certificate && private_key == other.private_key &&
           ca_file == other.ca_file;
  }
  bool operator!=(const tls_options& other) const { return !(*this == other); }
};

} // namespace actorpipe
