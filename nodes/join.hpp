/// \file
/// Nodes that join a running driver (`actorpipe node --join`, `train --accept-joins`): the
/// driver publishes a join actor; a node announces its address there and proves the shared
/// secret (an HMAC over the driver's challenge, as a driver proves it to a node); the driver
/// takes the nodes that proved it between steps (pipeline::rejoin_nodes), as spares or to cut
/// the model back onto after a loss (docs/distributed.md, "Nodes that join").
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

namespace actorpipe::nodes {

/// The driver's side: a join actor published on a port of `sys`.
class join_listener {
public:
  /// Listens on `address` ("host:port"; port 0 takes any free one), over TLS when `tls` (the
  /// actor system's TLS identity, as for the nodes). Throws invalid_argument for a malformed
  /// address, pipeline_error when the port cannot be bound.
  join_listener(caf::actor_system& sys, const std::string& address, std::string secret, bool tls);
  ~join_listener();
  join_listener(const join_listener&) = delete;
  join_listener& operator=(const join_listener&) = delete;

  /// "host:port" it listens on (the port taken when 0 was asked).
  std::string address() const;
  /// The addresses of the nodes that proved the secret since the last call, in order.
  std::vector<std::string> take();

  struct queue;

private:
  caf::actor_system& sys_;
  std::shared_ptr<queue> queue_;
  caf::actor actor_;
  std::string host_;
  uint16_t port_ = 0;
};

/// The node's side: the node at `address` announces itself to the join listener at `driver`
/// ("host:port"), proving `secret`, over TLS when `tls`. Tries about every second until
/// `timeout` has passed or `stop` is set. Throws pipeline_error naming the driver when the
/// driver refused the announcement (at once: a wrong secret does not get better) or nobody took
/// it in time.
void announce_join(caf::actor_system& sys, const std::string& driver, const std::string& address,
                   const std::string& secret, bool tls, std::chrono::milliseconds timeout,
                   const std::atomic<bool>& stop);

} // namespace actorpipe::nodes
