#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include <caf/all.hpp>

namespace actorpipe::nodes {

/// Spawns the heartbeat of stage `index` on the node `node` ("host:port" `address`): every sixth
/// of `timeout`, whether or not the last was answered, it asks the node for a heartbeat_atom;
/// each one the node leaves unanswered past `timeout` (a frozen process, a cut link) it tells the
/// stage's proxy (heartbeat_atom, false, why), which fails the running step (and the next, at the
/// next miss) with error_kind::node_lost naming node and stage and answers aborts without asking
/// the node; a node that answers again is reported (heartbeat_atom, true). It ends with the
/// proxy.
void start_heartbeat(caf::actor_system& sys, caf::actor node, std::string address, uint32_t index,
                     caf::actor proxy, std::chrono::milliseconds timeout);

} // namespace actorpipe::nodes
