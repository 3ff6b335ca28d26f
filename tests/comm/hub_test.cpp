// The tensor transport: frames between hubs, the secret handshake, TLS, malformed peers,
// deadlines.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <actorpipe/errors.hpp>

#include "../ports.hpp"
#include "comm/tensor_hub.hpp"
#include "comm/test_certificates.hpp"

using namespace actorpipe::comm;
using namespace std::chrono_literals;

namespace {

// Collects frames from a hub's reader threads.
struct inbox {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<frame> frames;

  tensor_hub::sink sink() {
    return [this](frame&& f) {
      std::lock_guard<std::mutex> lock(mutex);
      frames.push_back(std::move(f));
      cv.notify_all();
    };
  }

  std::vector<frame> wait_for(std::size_t n, std::chrono::milliseconds timeout = 10s) {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait_for(lock, timeout, [&] { return frames.size() >= n; });
    return {std::make_move_iterator(frames.begin()), std::make_move_iterator(frames.end())};
  }
};

hub_options options(const std::string& secret, std::chrono::milliseconds io = 5000ms) {
  hub_options o;
  o.secret = secret;
  o.io_timeout = io;
  return o;
}

// A raw TCP client, connected to 127.0.0.1:port.
int raw_connect(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  return fd;
}

// Answers a hub's challenge on a raw socket; returns the hub's verdict byte (1: accepted).
int raw_handshake(int fd, const std::string& secret) {
  std::string challenge(32, '\0');
  REQUIRE(::recv(fd, challenge.data(), 32, MSG_WAITALL) == 32);
  auto answer = handshake_answer(secret, challenge);
  REQUIRE(::send(fd, answer.data(), answer.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(answer.size()));
  char ok = 0;
  return ::recv(fd, &ok, 1, MSG_WAITALL) == 1 ? ok : -1;
}

} // namespace

TEST_CASE("frames cross between hubs in order, with their headers and values") {
  inbox received;
  tensor_hub b(options("s3cret"), received.sink());
  tensor_hub a(options("s3cret"), [](frame&&) {});
  std::vector<torch::Tensor> sent = {torch::randn({4, 8}), torch::randn({3, 2, 5}),
                                     torch::randint(0, 9, {6}, torch::kLong), torch::randn({0, 3})};
  for (std::size_t i = 0; i < sent.size(); ++i) {
    a.send(b.host(), b.port(),
           describe(frame_kind::gradient, 2, 5, static_cast<int32_t>(i), 0, sent[i]), sent[i]);
  }
  auto frames = received.wait_for(sent.size());
  REQUIRE(frames.size() == sent.size());
  for (std::size_t i = 0; i < sent.size(); ++i) {
    CHECK((frames[i].header.kind == frame_kind::gradient));
    CHECK(frames[i].header.stage == 2);
    CHECK(frames[i].header.step == 5);
    CHECK(frames[i].header.microbatch == static_cast<int32_t>(i));
    CHECK(torch::equal(frames[i].tensor, sent[i]));
  }
  CHECK(b.frames_received() == sent.size());
  CHECK(b.frames_rejected() == 0);
}

TEST_CASE("a 64 MB activation crosses intact") {
  inbox received;
  tensor_hub b(options(""), received.sink());
  tensor_hub a(options(""), [](frame&&) {});
  auto t = torch::randn({16, 1024, 1024});
  a.send(b.host(), b.port(), describe(frame_kind::activation, 0, 1, 0, 0, t), t);
  auto frames = received.wait_for(1, 30s);
  REQUIRE(frames.size() == 1);
  CHECK(torch::equal(frames[0].tensor, t));
}

TEST_CASE("a hub joins the reader of a connection its peer closed: peers that come and go leave "
          "no thread behind") {
  inbox received;
  tensor_hub b(options("k"), received.sink());
  auto t = torch::randn({300, 1024}); // 1.2 MB: received into a pooled buffer
  for (int peer = 0; peer < 6; ++peer) {
    // A peer (a driver's hub of one placement, a node that was lost) sends, then goes.
    tensor_hub a(options("k"), [](frame&&) {});
    a.send(b.host(), b.port(), describe(frame_kind::activation, 0, 1, peer, 0, t), t);
    REQUIRE(received.wait_for(static_cast<std::size_t>(peer + 1)).size() ==
            static_cast<std::size_t>(peer + 1));
  }
  // The last peer's reader may still be finishing; each accept joins those before it.
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (b.inbound_connections() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  CHECK(b.inbound_connections() == 0);
  tensor_hub last(options("k"), [](frame&&) {});
  last.send(b.host(), b.port(), describe(frame_kind::activation, 0, 2, 0, 0, t), t);
  auto frames = received.wait_for(7);
  REQUIRE(frames.size() == 7);
  CHECK(torch::equal(frames.back().tensor, t));
  CHECK(b.inbound_connections() == 1);
  // Buffers kept for reuse go when asked; a frame received after that gets a new one.
  frames.clear();
  received.frames.clear();
  b.release_cached_buffers();
  last.send(b.host(), b.port(), describe(frame_kind::activation, 0, 3, 0, 0, t), t);
  REQUIRE(received.wait_for(1).size() == 1);
}

TEST_CASE("a wrong secret is refused before any frame is read") {
  inbox received;
  tensor_hub b(options("right"), received.sink());
  tensor_hub a(options("wrong"), [](frame&&) {});
  auto t = torch::ones({2});
  CHECK_THROWS_WITH_AS(
    a.send(b.host(), b.port(), describe(frame_kind::activation, 0, 1, 0, 0, t), t),
    doctest::Contains("wrong secret"), comm_error);
  CHECK(received.wait_for(1, 200ms).empty());
  CHECK(b.frames_rejected() >= 1);
}

TEST_CASE("a malformed frame closes only its connection, and the hub keeps serving") {
  inbox received;
  tensor_hub b(options("k"), received.sink());
  int fd = raw_connect(b.port());
  REQUIRE(raw_handshake(fd, "k") == 1);
  // A header claiming a payload that does not match its shape.
  auto t = torch::ones({4});
  auto h = describe(frame_kind::activation, 0, 1, 0, 0, t);
  h.payload_bytes = 15;
  auto bytes = encode_header(h);
  REQUIRE(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(bytes.size()));
  // The hub closes the connection: the next read sees the end of the stream.
  char c;
  CHECK(::recv(fd, &c, 1, 0) <= 0);
  ::close(fd);
  CHECK(b.frames_rejected() == 1);
  // Garbage without a handshake answer is refused too.
  fd = raw_connect(b.port());
  std::string challenge(32, '\0');
  REQUIRE(::recv(fd, challenge.data(), 32, MSG_WAITALL) == 32);
  std::string junk(64, 'x');
  ::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
  CHECK(::recv(fd, &c, 1, 0) <= 0);
  ::close(fd);
  // A well-behaved peer still gets through.
  tensor_hub a(options("k"), [](frame&&) {});
  a.send(b.host(), b.port(), describe(frame_kind::activation, 0, 1, 0, 0, t), t);
  auto frames = received.wait_for(1);
  REQUIRE(frames.size() == 1);
  CHECK(torch::equal(frames[0].tensor, t));
}

TEST_CASE("a frame cut short by its peer is rejected") {
  inbox received;
  tensor_hub b(options("k"), received.sink());
  int fd = raw_connect(b.port());
  REQUIRE(raw_handshake(fd, "k") == 1);
  auto t = torch::ones({1000});
  auto bytes = encode_frame(describe(frame_kind::activation, 0, 1, 0, 0, t), t);
  REQUIRE(::send(fd, bytes.data(), bytes.size() / 2, MSG_NOSIGNAL) > 0);
  ::close(fd);
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (b.frames_rejected() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  CHECK(b.frames_rejected() == 1);
  CHECK(received.wait_for(1, 100ms).empty());
}

TEST_CASE("connecting has a deadline and names the peer") {
  tensor_hub a(options("", 300ms), [](frame&&) {});
  auto t = torch::ones({1});
  // Nobody listens.
  actorpipe::test::bound_socket silent;
  auto port = silent.port;
  CHECK_THROWS_WITH_AS(
    a.send("127.0.0.1", port, describe(frame_kind::activation, 0, 1, 0, 0, t), t),
    doctest::Contains((std::string("127.0.0.1:") + std::to_string(port)).c_str()), comm_error);
  // Listening but silent (never sends its challenge): the handshake times out.
  REQUIRE(::listen(silent.fd, 4) == 0);
  auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(
    a.send("127.0.0.1", port, describe(frame_kind::activation, 0, 1, 0, 0, t), t),
    doctest::Contains("timed out"), comm_error);
  CHECK(std::chrono::steady_clock::now() - start < 3s);
}

TEST_CASE("secrets come from private files only") {
  auto path = std::string("/tmp/actorpipe-secret-test-") + std::to_string(::getpid());
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    std::fputs("hunter2\n", f);
    std::fclose(f);
  }
  ::chmod(path.c_str(), 0644);
  CHECK_THROWS_WITH(read_secret_file(path), doctest::Contains("chmod 600"));
  ::chmod(path.c_str(), 0600);
  CHECK(read_secret_file(path) == "hunter2");
  ::unlink(path.c_str());
  CHECK_THROWS_WITH(read_secret_file(path), doctest::Contains("cannot read it"));
  CHECK(is_loopback("127.0.0.1"));
  CHECK(is_loopback("localhost"));
  CHECK(is_loopback("::1"));
  CHECK_FALSE(is_loopback("10.0.0.1"));
  CHECK_FALSE(is_loopback("0.0.0.0"));
}

namespace {

// Our CA and a stranger's, in a folder of this test process.
struct tls_fixture : actorpipe::testing::test_pki {
  tls_fixture()
    : test_pki(std::filesystem::temp_directory_path() /
               ("actorpipe-tls-test-" + std::to_string(::getpid()))) {}

  hub_options with(const actorpipe::tls_options& tls, const std::string& secret = "") const {
    auto o = options(secret);
    o.tls = tls;
    return o;
  }
};

} // namespace

TEST_CASE("TLS: frames cross between hubs whose certificates one CA signed") {
  tls_fixture pki;
  inbox received;
  tensor_hub b(pki.with(pki.ca.issue("b")), received.sink());
  tensor_hub a(pki.with(pki.ca.issue("a")), [](frame&&) {});
  std::vector<torch::Tensor> sent = {torch::randn({4, 8}), torch::randn({1 << 22}),
                                     torch::arange(10, torch::kInt64)};
  for (std::size_t i = 0; i < sent.size(); ++i) {
    a.send(b.host(), b.port(), describe(frame_kind::gradient, 2, 5, i, 0, sent[i]), sent[i]);
  }
  auto frames = received.wait_for(sent.size());
  REQUIRE(frames.size() == sent.size());
  for (std::size_t i = 0; i < sent.size(); ++i) {
    CHECK(frames[i].header.microbatch == i);
    CHECK(frames[i].tensor.equal(sent[i]));
  }
  CHECK(b.frames_rejected() == 0);
}

// The listener logs and counts a refusal; nothing gets through.
static void check_refused(const tensor_hub& listener, inbox& received) {
  for (int i = 0; i < 100 && listener.frames_rejected() == 0; ++i) {
    std::this_thread::sleep_for(20ms);
  }
  CHECK(listener.frames_rejected() >= 1);
  CHECK(received.wait_for(1, 100ms).empty());
}

TEST_CASE("TLS: a peer without a certificate of our CA, or without TLS, is refused") {
  tls_fixture pki;
  inbox received;
  tensor_hub b(pki.with(pki.ca.issue("b")), received.sink());
  auto t = torch::ones({3});
  auto h = describe(frame_kind::activation, 0, 1, 0, 0, t);
  SUBCASE("another CA's certificate") {
    tensor_hub intruder(pki.with(pki.stranger.issue("intruder")), [](frame&&) {});
    CHECK_THROWS_WITH_AS(intruder.send(b.host(), b.port(), h, t),
                         doctest::Contains("TLS handshake with 127.0.0.1:"), comm_error);
    check_refused(b, received);
  }
  SUBCASE("plain TCP that knows the secret protocol: both sides give up at the deadline") {
    tensor_hub plain(options(""), [](frame&&) {});
    auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(plain.send(b.host(), b.port(), h, t), comm_error);
    CHECK(std::chrono::steady_clock::now() - start < 8s);
    check_refused(b, received);
  }
}

TEST_CASE("TLS: a hub with certificates does not talk to a plain listener") {
  tls_fixture pki;
  tensor_hub plain(options(""), [](frame&&) {});
  tensor_hub a(pki.with(pki.ca.issue("a")), [](frame&&) {});
  auto t = torch::ones({3});
  CHECK_THROWS_WITH_AS(
    a.send(plain.host(), plain.port(), describe(frame_kind::activation, 0, 1, 0, 0, t), t),
    doctest::Contains("TLS handshake"), comm_error);
}

TEST_CASE("TLS: the bytes on the wire are not the plain protocol") {
  tls_fixture pki;
  inbox received;
  tensor_hub b(pki.with(pki.ca.issue("b")), received.sink());
  // A plain client sees no 32-byte challenge: a TLS server speaks only after a ClientHello.
  int fd = raw_connect(b.port());
  timeval tv{0, 300000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buffer[32];
  CHECK(::recv(fd, buffer, sizeof buffer, 0) < 0);
  // What a plain peer then sends (a frame) is no ClientHello: the server refuses it and closes
  // the connection, rather than waiting on it.
  auto t = torch::ones({4});
  auto bytes = encode_frame(describe(frame_kind::activation, 0, 1, 0, 0, t), t);
  REQUIRE(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) > 0);
  timeval patient{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &patient, sizeof patient);
  auto start = std::chrono::steady_clock::now();
  ssize_t got = 0;
  // The server may answer with a TLS alert before it closes; read until the end of the stream.
  do {
    got = ::recv(fd, buffer, sizeof buffer, 0);
  } while (got > 0);
  CHECK(got == 0);
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  ::close(fd);
  check_refused(b, received);
}

TEST_CASE("TLS: files that are missing, unreadable or do not belong together are named") {
  tls_fixture pki;
  auto good = pki.ca.issue("good");
  auto other = pki.ca.issue("other");
  auto only_cert = good;
  only_cert.private_key.clear();
  CHECK_THROWS_WITH_AS(tensor_hub(pki.with(only_cert), [](frame&&) {}),
                       doctest::Contains("private key is missing"), actorpipe::invalid_argument);
  auto mismatched = good;
  mismatched.private_key = other.private_key;
  CHECK_THROWS_WITH_AS(tensor_hub(pki.with(mismatched), [](frame&&) {}),
                       doctest::Contains("does not belong to the certificate"),
                       actorpipe::invalid_argument);
  auto absent = good;
  absent.ca_file = (pki.dir / "absent.pem").string();
  CHECK_THROWS_WITH_AS(tensor_hub(pki.with(absent), [](frame&&) {}),
                       doctest::Contains("absent.pem' cannot be loaded"),
                       actorpipe::invalid_argument);
}
