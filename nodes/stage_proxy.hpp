/// \file
/// The proxy of a stage on a node: a local actor speaking the stage protocol to the scheduler
/// (actors/messages.hpp), so that the scheduler does not know where its stages live. It sends
/// the first stage's inputs and the last stage's targets as frames to its node, then the plan
/// over CAF; it turns the node's reports back into stage reports (waiting for the output frames
/// of forward-only passes), asks the node for abort, update, save and load with deadlines
/// (ask_node), and writes the state frames of a save to the checkpoint file here. When its node
/// is lost (the CAF connection drops: a killed process, a cut link) or falls silent (its
/// heartbeat), it fails the running step naming the node and the stage; a lost node's proxy
/// then terminates, which the scheduler sees as a dead stage. Private to nodes/.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/actor_cast.hpp>
#include <caf/actor_system.hpp>
#include <caf/typed_actor.hpp>
#include <caf/weak_intrusive_ptr.hpp>
#include <torch/torch.h>

#include "actors/messages.hpp"
#include "comm/wire.hpp"
#include "nodes/protocol.hpp"

namespace actorpipe::comm {
class tensor_hub;
}

namespace actorpipe::nodes {

/// A stage on a node as the scheduler sees it: the stage protocol, plus what the node
/// (node_report_listener) and the hub's reader threads send back (output and state frames).
using remote_stage_actor = actors::stage_actor::extend_with<node_report_listener>::extend<
  caf::reacts_to<output_atom, uint64_t, int32_t, torch::Tensor>,
  caf::reacts_to<state_atom, uint32_t, uint64_t, torch::Tensor>,
  // From the stage's heartbeat (nodes/heartbeat.hpp): whether the node answers, and if not why.
  caf::reacts_to<heartbeat_atom, bool, std::string>>;

/// The proxies by stage, for the hub's reader threads (output and state frames). Weak: the hub
/// (owned by the proxies) must not keep them alive.
struct proxy_routes {
  std::mutex mutex;
  std::vector<caf::weak_actor_ptr> proxies;

  remote_stage_actor proxy(uint32_t index) {
    std::lock_guard<std::mutex> lock(mutex);
    if (index >= proxies.size()) {
      throw comm::frame_error(detail::concat("a frame for unknown stage ", index));
    }
    auto strong = proxies[index].lock();
    if (!strong) {
      throw comm::frame_error(detail::concat("stage ", index, "'s proxy is gone"));
    }
    return caf::actor_cast<remote_stage_actor>(strong);
  }
};

/// The proxy of stage `index` on `node` (`label`: "node host:port"), whose stage takes frames at
/// `data`; it reports to `scheduler`, sends frames through `hub` and waits `timeout` for the
/// node's answers.
actors::stage_actor spawn_proxy(caf::actor_system& sys, caf::actor node, std::string label,
                                uint32_t index, endpoint data,
                                actors::stage_listener_actor scheduler,
                                std::shared_ptr<comm::tensor_hub> hub,
                                std::chrono::milliseconds timeout);

} // namespace actorpipe::nodes
