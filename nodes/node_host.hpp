// What the node's public class (nodes/node_process.cpp) and its host actor (nodes/node.cpp)
// share: the routes from the data hub's reader threads to the node's stages, and the actor's
// start. Private to nodes/.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <caf/all.hpp>

#include <actorpipe/errors.hpp>

#include "actors/stage_actor.hpp"
#include "comm/bundle_frames.hpp"
#include "comm/tensor_hub.hpp"
#include "comm/tie_group.hpp"
#include "comm/wire.hpp"
#include "nodes/protocol.hpp"

namespace actorpipe::nodes {

// Where frames for this node's stages go; read by the hub's reader threads. Weak: the hub
// (owned by the node actor) must not keep the actors alive. Not in the anonymous namespace:
// node::impl holds one, and GCC warns of that when a unity build includes this file into another.
struct routes {
  std::mutex mutex;
  std::map<uint32_t, caf::weak_actor_ptr> stages;
  caf::weak_actor_ptr host_ptr;
  std::atomic<uint64_t> rejected{0};
  // Activation and gradient bundles, put together from their frames.
  comm::bundle_assembler bundles;
  // The tie groups of stages holding parameters tied to other stages, and the ties' names in
  // tied_parameters order (a tied-gradient frame names a tie by its index there).
  struct tie_route {
    std::weak_ptr<comm::tie_group> group;
    std::vector<std::string> names;
  };
  std::map<uint32_t, tie_route> ties;

  tie_route tie(uint32_t index) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = ties.find(index);
    if (it == ties.end()) {
      throw comm::frame_error(
        detail::concat("stage ", index, " on this node holds no tied parameter"));
    }
    return it->second;
  }

  actors::stage_peer_actor stage(uint32_t index) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = stages.find(index);
    auto strong = it == stages.end() ? caf::strong_actor_ptr{} : it->second.lock();
    if (!strong) {
      throw comm::frame_error(detail::concat("no stage ", index, " on this node"));
    }
    return caf::actor_cast<actors::stage_peer_actor>(strong);
  }

  caf::actor host() {
    std::lock_guard<std::mutex> lock(mutex);
    return caf::actor_cast<caf::actor>(host_ptr.lock());
  }
};

/// Tells the node's host actor the address it is known by (log lines, errors).
using label_atom = caf::atom_constant<caf::atom("label")>;
/// A link actor could not send a stage's frame (nodes/node_links.cpp -> the host actor).
using link_failed_atom = caf::atom_constant<caf::atom("linkfail")>;

// nodes/node_links.cpp:

/// Sends one neighbour's activations or gradients as frames, on a thread of its own so that the
/// stage computes while the bytes go out; a failure goes to `host` as link_failed_atom.
actors::stage_peer_actor::behavior_type link_actor(actors::stage_peer_actor::pointer self,
                                                   std::shared_ptr<comm::tensor_hub> hub,
                                                   endpoint to, uint32_t to_stage,
                                                   uint32_t from_stage, caf::actor host);
/// Sends a stage's share of its tied parameters' gradients to the other holders, as frames.
comm::tie_group::sender tie_sender(std::shared_ptr<comm::tensor_hub> hub,
                                   std::shared_ptr<std::vector<endpoint>> peers,
                                   std::vector<std::string> names);
/// A tied-gradient bundle (the ties' indices, then their gradients) into the stage's tie group.
void receive_tied_gradients(const routes::tie_route& tie, uint64_t step, int32_t from,
                            const bundle& b);

/// Spawns the node's host actor: it answers the driver's control messages, builds and hosts
/// stages, and relays their reports (nodes/node.cpp).
caf::actor spawn_node_host(caf::actor_system& sys, std::string secret,
                           std::shared_ptr<comm::tensor_hub> hub, std::shared_ptr<routes> route,
                           std::size_t max_model_bytes, std::chrono::seconds keep_snapshots);

} // namespace actorpipe::nodes
