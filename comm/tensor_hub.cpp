#include "comm/tensor_hub.hpp"

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <actorpipe/errors.hpp>

#include "comm/tls.hpp"
#include "logging/log.hpp"

namespace actorpipe::comm {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

constexpr std::size_t challenge_bytes = 32;

std::string endpoint_name(const std::string& host, uint16_t port) {
  return detail::concat(host, ":", port);
}

// The transfers below are plain blocking calls with SO_RCVTIMEO/SO_SNDTIMEO deadlines; Asio
// leaves a socket non-blocking after an asynchronous connect.
void make_blocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) & ~O_NONBLOCK);
}

void set_timeout(int fd, int option, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, option, &tv, sizeof tv);
}

// Reads up to n bytes, fewer only at the end of the stream; throws on errors and timeouts.
std::size_t read_some_exact(int fd, void* out, std::size_t n, const std::string& peer) {
  auto* p = static_cast<char*>(out);
  std::size_t got = 0;
  while (got < n) {
    auto r = ::recv(fd, p + got, n - got, 0);
    if (r == 0) {
      break;
    }
    if (r < 0) {
      if (errno == EINTR) {
        continue;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        throw comm_error(detail::concat("reading from ", peer, " timed out"));
      }
      throw comm_error(detail::concat("reading from ", peer, ": ", std::strerror(errno)));
    }
    got += static_cast<std::size_t>(r);
  }
  return got;
}

void write_all(int fd, std::vector<iovec> parts, const std::string& peer) {
  std::size_t index = 0;
  while (index < parts.size()) {
    msghdr msg{};
    msg.msg_iov = parts.data() + index;
    msg.msg_iovlen = parts.size() - index;
    auto r = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) {
        continue;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        throw comm_error(
          detail::concat("writing to ", peer, " timed out (the peer stopped reading)"));
      }
      throw comm_error(detail::concat("writing to ", peer, ": ", std::strerror(errno)));
    }
    auto sent = static_cast<std::size_t>(r);
    while (index < parts.size() && sent >= parts[index].iov_len) {
      sent -= parts[index].iov_len;
      ++index;
    }
    if (index < parts.size()) {
      parts[index].iov_base = static_cast<char*>(parts[index].iov_base) + sent;
      parts[index].iov_len -= sent;
    }
  }
}

std::string random_bytes(std::size_t n) {
  std::string out(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    throw comm_error("no random bytes for the handshake challenge");
  }
  return out;
}

} // namespace

// Types the hub's own members hold: in a named namespace, since a unity build includes this file
// into another and GCC then warns of a class whose members' types are in an anonymous one.
namespace hub_parts {

// One connection's byte stream, plain or TLS over the same blocking socket.
struct channel {
  int fd = -1;
  std::string peer;
  std::unique_ptr<tls_stream> tls;

  // Runs the TLS handshake when the hub has a context.
  void open(const tls_context* context, bool server) {
    if (context != nullptr) {
      tls = std::make_unique<tls_stream>(*context, fd, server, peer);
    }
  }
  std::size_t read(void* out, std::size_t n) {
    return tls ? tls->read(out, n) : read_some_exact(fd, out, n, peer);
  }
  void write(std::vector<iovec> parts) {
    if (!tls) {
      return write_all(fd, std::move(parts), peer);
    }
    for (const auto& part : parts) {
      tls->write(part.iov_base, part.iov_len);
    }
  }
};

// Payload buffers that outlive their frames: a tensor's deleter gives its buffer back.
class buffer_pool : public std::enable_shared_from_this<buffer_pool> {
public:
  explicit buffer_pool(std::size_t max_bytes) : max_bytes_(max_bytes) {}
  ~buffer_pool() {
    for (auto& [bytes, p] : free_) {
      std::free(p);
    }
  }

  at::Tensor take(const frame_header& h) {
    auto bytes = static_cast<std::size_t>(h.payload_bytes);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        p = it->second;
        free_.erase(it);
        cached_ -= bytes;
      }
    }
    if (p == nullptr) {
      p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
      if (p == nullptr) {
        throw std::bad_alloc();
      }
    }
    auto self = shared_from_this();
    return at::from_blob(
      p, h.shape, [self, bytes](void* q) { self->give(q, bytes); },
      at::TensorOptions().dtype(h.dtype));
  }

  // Frees the buffers kept for reuse (the ones in use come back, and are kept, as before).
  void clear() {
    std::multimap<std::size_t, void*> kept;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      kept.swap(free_);
      cached_ = 0;
    }
    for (auto& [bytes, p] : kept) {
      std::free(p);
    }
  }

private:
  void give(void* p, std::size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_ + bytes <= max_bytes_) {
        free_.emplace(bytes, p);
        cached_ += bytes;
        return;
      }
    }
    std::free(p);
  }

  std::mutex mutex_;
  std::multimap<std::size_t, void*> free_;
  std::size_t cached_ = 0;
  std::size_t max_bytes_;
};

constexpr uint64_t pooled_from_bytes = 1u << 20;

} // namespace hub_parts

using hub_parts::buffer_pool;
using hub_parts::channel;
using hub_parts::pooled_from_bytes;

std::string handshake_answer(const std::string& secret, const std::string& challenge) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(challenge.data()), challenge.size(), out, &len);
  return std::string(reinterpret_cast<const char*>(out), len);
}

std::string read_secret_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw invalid_argument(
      detail::concat("--secret-file '", path, "': cannot read it: ", std::strerror(errno)));
  }
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    throw invalid_argument(
      detail::concat("--secret-file '", path, "' is readable by group or others; chmod 600 it"));
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  auto secret = buffer.str();
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) {
    secret.pop_back();
  }
  if (!in || secret.empty()) {
    throw invalid_argument(detail::concat("--secret-file '", path, "' is empty or unreadable"));
  }
  return secret;
}

bool is_loopback(const std::string& host) {
  if (host == "localhost") {
    return true;
  }
  boost::system::error_code ec;
  auto address = asio::ip::make_address(host, ec);
  return !ec && address.is_loopback();
}

struct tensor_hub::impl {
  hub_options options;
  sink on_frame;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::string host;
  uint16_t port = 0;
  std::thread accept_thread;
  std::atomic<bool> stopping{false};
  std::atomic<uint64_t> received{0};
  std::atomic<uint64_t> rejected{0};
  std::atomic<bool> pinned{false};
  std::shared_ptr<buffer_pool> pool;
  std::unique_ptr<tls_context> tls;

  // Inbound connections by number: their sockets (to shut down) and reader threads; a reader
  // that returned (its peer went) lists its number in `finished`, and the next accept joins it
  // and closes its socket, so that a long-lived node does not keep a thread and a descriptor for
  // every connection it ever had.
  std::mutex readers_mutex;
  std::map<uint64_t, std::shared_ptr<tcp::socket>> inbound;
  std::map<uint64_t, std::thread> readers;
  std::vector<uint64_t> finished;
  uint64_t next_reader = 0;

  // Joins the readers that returned; with readers_mutex held.
  void reap_finished() {
    for (auto id : finished) {
      auto it = readers.find(id);
      if (it != readers.end()) {
        it->second.join();
        readers.erase(it);
      }
      inbound.erase(id);
    }
    finished.clear();
  }

  // Outbound connections by "host:port", each written under its own lock.
  struct connection {
    std::mutex mutex;
    asio::io_context io;
    tcp::socket socket{io};
    channel stream;
    std::string local_address;
  };
  std::mutex outbound_mutex;
  std::map<std::string, std::shared_ptr<connection>> outbound;

  void accept_loop() {
    while (!stopping) {
      auto socket = std::make_shared<tcp::socket>(io);
      boost::system::error_code ec;
      acceptor.accept(*socket, ec);
      if (stopping) {
        return;
      }
      if (ec) {
        log::get()->warn("data listener {}: accept failed: {}", endpoint_name(host, port),
                         ec.message());
        continue;
      }
      std::lock_guard<std::mutex> lock(readers_mutex);
      reap_finished();
      auto id = next_reader++;
      inbound.emplace(id, socket);
      readers.emplace(id, std::thread([this, socket, id] {
                        serve(socket);
                        std::lock_guard<std::mutex> done(readers_mutex);
                        finished.push_back(id);
                      }));
    }
  }

  // One inbound connection: challenge, then frames until the peer closes or misbehaves.
  void serve(const std::shared_ptr<tcp::socket>& socket) {
    boost::system::error_code ec;
    auto remote = socket->remote_endpoint(ec);
    auto peer =
      ec ? std::string("unknown peer") : endpoint_name(remote.address().to_string(), remote.port());
    int fd = socket->native_handle();
    make_blocking(fd);
    channel stream{fd, peer, nullptr};
    try {
      set_timeout(fd, SO_RCVTIMEO, options.io_timeout);
      set_timeout(fd, SO_SNDTIMEO, options.io_timeout);
      stream.open(tls.get(), true);
      auto challenge = random_bytes(challenge_bytes);
      stream.write({{challenge.data(), challenge.size()}});
      auto expected = handshake_answer(options.secret, challenge);
      std::string answer(expected.size(), '\0');
      if (stream.read(answer.data(), answer.size()) < answer.size() ||
          CRYPTO_memcmp(answer.data(), expected.data(), expected.size()) != 0) {
        ++rejected;
        log::get()->error("data listener {}: refused {}: wrong secret in the handshake",
                          endpoint_name(host, port), peer);
        return close(socket);
      }
      char ok = 1;
      stream.write({{&ok, 1}});
    } catch (const std::exception& e) {
      if (!stopping) {
        ++rejected;
        log::get()->error("data listener {}: handshake with {} failed: {}",
                          endpoint_name(host, port), peer, e.what());
      }
      return close(socket);
    }
    comm::allocate_fn allocate = [this](const frame_header& h) {
      if (pinned) {
        // libtorch's pinned-memory cache recycles these as the pool does pageable buffers.
        return at::empty(h.shape, at::TensorOptions().dtype(h.dtype).pinned_memory(true));
      }
      return pool && h.payload_bytes >= pooled_from_bytes
               ? pool->take(h)
               : at::empty(h.shape, at::TensorOptions().dtype(h.dtype));
    };
    bool in_frame = false;
    auto read = [&](void* out, std::size_t n) {
      if (!in_frame) {
        // Idle between frames for as long as the peer likes; once a frame starts, the rest of
        // it must arrive within the deadline.
        set_timeout(fd, SO_RCVTIMEO, std::chrono::milliseconds(0));
        auto got = stream.read(out, n);
        set_timeout(fd, SO_RCVTIMEO, options.io_timeout);
        in_frame = true;
        return got;
      }
      return stream.read(out, n);
    };
    while (!stopping) {
      frame f;
      try {
        in_frame = false;
        if (!read_frame(read, options.limits, f, allocate)) {
          break;
        }
      } catch (const std::exception& e) {
        if (!stopping) {
          ++rejected;
          log::get()->error("data listener {}: dropped the connection from {}: {}",
                            endpoint_name(host, port), peer, e.what());
        }
        break;
      }
      ++received;
      try {
        on_frame(std::move(f));
      } catch (const std::exception& e) {
        log::get()->error("data listener {}: a frame from {} was not taken: {}",
                          endpoint_name(host, port), peer, e.what());
      }
    }
    close(socket);
  }

  static void close(const std::shared_ptr<tcp::socket>& socket) {
    ::shutdown(socket->native_handle(), SHUT_RDWR);
  }

  std::shared_ptr<connection> connect(const std::string& to_host, uint16_t to_port) {
    auto name = endpoint_name(to_host, to_port);
    {
      std::lock_guard<std::mutex> lock(outbound_mutex);
      auto it = outbound.find(name);
      if (it != outbound.end()) {
        return it->second;
      }
    }
    auto c = std::make_shared<connection>();
    boost::system::error_code ec;
    tcp::resolver resolver(c->io);
    auto endpoints = resolver.resolve(to_host, std::to_string(to_port), ec);
    if (ec) {
      throw comm_error(detail::concat("cannot resolve ", name, ": ", ec.message()));
    }
    bool done = false;
    asio::async_connect(c->socket, endpoints, [&](const boost::system::error_code& e, const auto&) {
      ec = e;
      done = true;
    });
    c->io.run_for(options.io_timeout);
    if (!done) {
      c->socket.close();
      throw comm_error(detail::concat("connecting to ", name, " timed out after ",
                                      options.io_timeout.count(), " ms"));
    }
    if (ec) {
      throw comm_error(detail::concat("cannot connect to ", name, ": ", ec.message()));
    }
    c->socket.set_option(tcp::no_delay(true));
    int fd = c->socket.native_handle();
    make_blocking(fd);
    set_timeout(fd, SO_RCVTIMEO, options.io_timeout);
    set_timeout(fd, SO_SNDTIMEO, options.io_timeout);
    c->stream.fd = fd;
    c->stream.peer = name;
    c->stream.open(tls.get(), false);
    std::string challenge(challenge_bytes, '\0');
    if (c->stream.read(challenge.data(), challenge.size()) < challenge.size()) {
      throw comm_error(detail::concat(name, " closed the connection before its challenge"));
    }
    auto answer = handshake_answer(options.secret, challenge);
    c->stream.write({{answer.data(), answer.size()}});
    char ok = 0;
    if (c->stream.read(&ok, 1) < 1 || ok != 1) {
      throw comm_error(
        detail::concat(name, " refused the data connection: wrong secret (check --secret-file)"));
    }
    c->local_address = c->socket.local_endpoint(ec).address().to_string();
    std::lock_guard<std::mutex> lock(outbound_mutex);
    return outbound.emplace(name, c).first->second;
  }

  void forget(const std::string& name, const std::shared_ptr<connection>& c) {
    std::lock_guard<std::mutex> lock(outbound_mutex);
    auto it = outbound.find(name);
    if (it != outbound.end() && it->second == c) {
      outbound.erase(it);
    }
  }
};

tensor_hub::tensor_hub(hub_options options, sink on_frame) : impl_(std::make_unique<impl>()) {
  auto& self = *impl_;
  self.options = std::move(options);
  self.on_frame = std::move(on_frame);
  if (self.options.pool_bytes > 0) {
    self.pool = std::make_shared<buffer_pool>(self.options.pool_bytes);
  }
  if (self.options.tls.enabled()) {
    self.tls = std::make_unique<tls_context>(self.options.tls);
  }
  boost::system::error_code ec;
  auto address = asio::ip::make_address(self.options.host, ec);
  if (ec) {
    tcp::resolver resolver(self.io);
    auto found = resolver.resolve(self.options.host, "0", ec);
    if (ec || found.empty()) {
      throw comm_error(detail::concat("data listener: cannot resolve '", self.options.host, "'"));
    }
    address = found.begin()->endpoint().address();
  }
  tcp::endpoint endpoint(address, self.options.port);
  self.acceptor.open(endpoint.protocol(), ec);
  if (!ec) {
    self.acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    self.acceptor.bind(endpoint, ec);
  }
  if (!ec) {
    self.acceptor.listen(asio::socket_base::max_listen_connections, ec);
  }
  if (ec) {
    throw comm_error(detail::concat("data listener: cannot listen on ",
                                    endpoint_name(self.options.host, self.options.port), ": ",
                                    ec.message()));
  }
  self.host = address.to_string();
  self.port = self.acceptor.local_endpoint().port();
  self.accept_thread = std::thread([&self] { self.accept_loop(); });
}

tensor_hub::~tensor_hub() {
  auto& self = *impl_;
  self.stopping = true;
  ::shutdown(self.acceptor.native_handle(), SHUT_RDWR);
  if (self.accept_thread.joinable()) {
    self.accept_thread.join();
  }
  {
    std::lock_guard<std::mutex> lock(self.readers_mutex);
    for (auto& [id, socket] : self.inbound) {
      impl::close(socket);
    }
  }
  // The accept thread is gone: nothing adds readers now (each takes the lock once, to finish).
  for (auto& [id, t] : self.readers) {
    t.join();
  }
  std::lock_guard<std::mutex> lock(self.outbound_mutex);
  for (auto& [name, c] : self.outbound) {
    ::shutdown(c->socket.native_handle(), SHUT_RDWR);
  }
}

const std::string& tensor_hub::host() const {
  return impl_->host;
}

uint16_t tensor_hub::port() const {
  return impl_->port;
}

void tensor_hub::receive_into_pinned_memory() {
  impl_->pinned = true;
}

void tensor_hub::release_cached_buffers() {
  if (impl_->pool) {
    impl_->pool->clear();
  }
}

std::size_t tensor_hub::inbound_connections() const {
  std::lock_guard<std::mutex> lock(impl_->readers_mutex);
  return impl_->readers.size() - impl_->finished.size();
}

uint64_t tensor_hub::frames_received() const {
  return impl_->received;
}

uint64_t tensor_hub::frames_rejected() const {
  return impl_->rejected;
}

void tensor_hub::send(const std::string& host, uint16_t port, const frame_header& h,
                      const at::Tensor& t) {
  auto name = endpoint_name(host, port);
  auto c = impl_->connect(host, port);
  at::Tensor cpu;
  if (t.device().is_cpu()) {
    cpu = t.is_contiguous() ? t : t.contiguous();
  } else {
    // From a GPU through page-locked memory: one direct copy, no staging in the driver.
    cpu = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    cpu.copy_(t);
  }
  auto header = encode_header(h);
  std::lock_guard<std::mutex> lock(c->mutex);
  try {
    c->stream.write({{header.data(), header.size()},
                     {cpu.data_ptr(), static_cast<std::size_t>(h.payload_bytes)}});
  } catch (const comm_error&) {
    // The stream may hold half a frame: never reuse it.
    ::shutdown(c->socket.native_handle(), SHUT_RDWR);
    impl_->forget(name, c);
    throw;
  }
}

std::string tensor_hub::local_address_towards(const std::string& host, uint16_t port) {
  return impl_->connect(host, port)->local_address;
}

} // namespace actorpipe::comm
