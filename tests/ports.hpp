// Loopback ports for tests that need one nobody listens on.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>

#include <doctest/doctest.h>

namespace actorpipe::test {

/// A TCP socket bound to a free loopback port, not listening: connecting to it is refused until
/// the test calls ::listen(fd, ...). Closes the socket when it goes.
struct bound_socket {
  int fd = -1;
  uint16_t port = 0;

  bound_socket() {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof sa;
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
    REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0);
    port = ntohs(sa.sin_port);
  }
  ~bound_socket() {
    if (fd >= 0) {
      ::close(fd);
    }
  }
  bound_socket(const bound_socket&) = delete;
  bound_socket& operator=(const bound_socket&) = delete;
};

/// A loopback port nobody listens on now (bound, read back, closed).
inline int free_port() {
  return bound_socket().port;
}

} // namespace actorpipe::test
