/// \file
/// A throw-away certificate authority for TLS tests and the wire bench: EC P-256 keys and X.509
/// certificates made with OpenSSL in a folder, so no test depends on committed keys or on the
/// openssl program.
#pragma once

#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <actorpipe/tls.hpp>

namespace actorpipe::testing {

class test_ca {
public:
  /// Makes a self-signed CA named `name` in `dir` (created).
  test_ca(std::filesystem::path dir, const std::string& name) : dir_(std::move(dir)) {
    std::filesystem::create_directories(dir_);
    key_.reset(make_key());
    cert_.reset(make_certificate(name, key_.get(), nullptr, key_.get(), true));
    ca_file_ = (dir_ / (name + "-ca.pem")).string();
    write_certificate(ca_file_, cert_.get());
  }

  const std::string& ca_file() const { return ca_file_; }

  /// A certificate for `name` signed by this CA, with its key; ca_file is this CA's.
  tls_options issue(const std::string& name) const {
    std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(make_key(), EVP_PKEY_free);
    std::unique_ptr<X509, decltype(&X509_free)> cert(
      make_certificate(name, key.get(), cert_.get(), key_.get(), false), X509_free);
    tls_options out;
    out.certificate = (dir_ / (name + ".pem")).string();
    out.private_key = (dir_ / (name + ".key")).string();
    out.ca_file = ca_file_;
    write_certificate(out.certificate, cert.get());
    auto* f = std::fopen(out.private_key.c_str(), "w");
    if (f == nullptr ||
        PEM_write_PrivateKey(f, key.get(), nullptr, nullptr, 0, nullptr, nullptr) != 1) {
      throw std::runtime_error("cannot write " + out.private_key);
    }
    std::fclose(f);
    std::filesystem::permissions(out.private_key, std::filesystem::perms::owner_read |
                                                    std::filesystem::perms::owner_write);
    return out;
  }

private:
  static EVP_PKEY* make_key() {
    auto* key = EVP_EC_gen("P-256");
    if (key == nullptr) {
      throw std::runtime_error("cannot make an EC key");
    }
    return key;
  }

  static void add_extension(X509* cert, X509* issuer, int nid, const char* value) {
    X509V3_CTX ctx;
    X509V3_set_ctx_nodb(&ctx);
    X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
    auto* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
    if (ext == nullptr || X509_add_ext(cert, ext, -1) != 1) {
      throw std::runtime_error("cannot add a certificate extension");
    }
    X509_EXTENSION_free(ext);
  }

  // Signed by issuer_key; issuer null: self-signed.
  static X509* make_certificate(const std::string& name, EVP_PKEY* key, X509* issuer,
                                EVP_PKEY* issuer_key, bool is_ca) {
    static long serial = 1;
    auto* cert = X509_new();
    X509_set_version(cert, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(cert), serial++);
    X509_gmtime_adj(X509_getm_notBefore(cert), -3600);
    X509_gmtime_adj(X509_getm_notAfter(cert), 7L * 24 * 3600);
    X509_set_pubkey(cert, key);
    auto* subject = X509_get_subject_name(cert);
    X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_ASC,
                               reinterpret_cast<const unsigned char*>(name.c_str()), -1, -1, 0);
    X509_set_issuer_name(cert, issuer ? X509_get_subject_name(issuer) : subject);
    add_extension(cert, issuer ? issuer : cert, NID_basic_constraints,
                  is_ca ? "critical,CA:TRUE" : "critical,CA:FALSE");
    if (is_ca) {
      add_extension(cert, cert, NID_key_usage, "critical,keyCertSign,cRLSign");
    }
    if (X509_sign(cert, issuer_key, EVP_sha256()) == 0) {
      throw std::runtime_error("cannot sign a certificate");
    }
    return cert;
  }

  static void write_certificate(const std::string& path, X509* cert) {
    auto* f = std::fopen(path.c_str(), "w");
    if (f == nullptr || PEM_write_X509(f, cert) != 1) {
      throw std::runtime_error("cannot write " + path);
    }
    std::fclose(f);
  }

  std::filesystem::path dir_;
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key_{nullptr, EVP_PKEY_free};
  std::unique_ptr<X509, decltype(&X509_free)> cert_{nullptr, X509_free};
  std::string ca_file_;
};

/// The CA of "our" processes and a stranger's CA, in a folder that goes with the object.
struct test_pki {
  explicit test_pki(std::filesystem::path folder) : dir(std::move(folder)) {}
  ~test_pki() { std::filesystem::remove_all(dir); }
  test_pki(const test_pki&) = delete;
  test_pki& operator=(const test_pki&) = delete;

  std::filesystem::path dir;
  test_ca ca{dir, "cluster"};
  test_ca stranger{dir, "stranger"};
};

} // namespace actorpipe::testing
