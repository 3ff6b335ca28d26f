// The node's host actor's state (nodes/node.cpp), and what its state-frame handlers
// (nodes/node_state.cpp: checkpoints, snapshots kept for a driver that starts again) share with
// it. Private to nodes/.
#pragma once

#include <chrono>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <caf/all.hpp>

#include "actors/stage_actor.hpp"
#include "comm/tensor_hub.hpp"
#include "comm/tie_group.hpp"
#include "nodes/kept_snapshots.hpp"
#include "nodes/node_host.hpp"
#include "nodes/protocol.hpp"
#include "stages/stage.hpp"

namespace actorpipe::nodes {

// A stage this node hosts.
struct hosted {
  actors::local_stage_actor actor;
  // How long the node waits for its stage actor to answer an abort or an update: the stage's
  // wait deadline, which the scheduler's own requests also use.
  std::chrono::milliseconds deadline{60000};
  // The actor's chunks: chunk c is virtual stage virtual_stage_of(placement, count, index, c).
  std::vector<std::shared_ptr<stages::stage>> chunks;
  chunk_placement placement = chunk_placement::looped;
  node_report_listener proxy;
  peer_table peers;
  // Parameters tied to other stages: the group summing their gradients, and where the other
  // holders are (filled when the stage is wired).
  std::shared_ptr<comm::tie_group> ties;
  std::shared_ptr<std::vector<endpoint>> tie_peers;
  std::vector<actors::stage_peer_actor> links;
  // A plan waiting for its targets.
  bool pending = false;
  actors::step_plan plan;
  std::size_t targets_expected = 0;
  std::map<std::pair<uint64_t, int32_t>, torch::Tensor> targets;
  // Checkpoint state sent by the scheduler, by request id, and loads waiting for it.
  std::map<uint64_t, torch::Tensor> states;
  std::map<uint64_t, caf::typed_response_promise<bool>> loads;
};

struct node_state {
  std::string label;
  std::string secret;
  std::shared_ptr<comm::tensor_hub> hub;
  std::shared_ptr<routes> route;
  std::map<caf::node_id, std::string> challenges;
  std::set<caf::node_id> authorized;
  std::map<uint32_t, hosted> stages;
  // TorchScript models received, by digest, newest last (a few are kept).
  std::size_t max_model_bytes = 0;
  std::vector<std::pair<std::string, std::string>> models;
  // The state frame being sent beside the node's stages (send_state), one at a time; the
  // buffers states are packed into, and the newest snapshot of each stage, kept for `keep_for`
  // after the last stage went (`generation` counts those goings).
  std::future<void> sending;
  kept_snapshots snapshots;
  std::chrono::seconds keep_for{0};
  uint64_t generation = 0;
  // Restores of a copy still on its way (its note here, its bytes not yet), answered when the
  // bytes come; by stage index and snapshot number.
  std::map<std::pair<uint32_t, uint64_t>, caf::response_promise> awaiting_copies;

  static inline const char* name = "actorpipe.node";
};

using node_actor = caf::stateful_actor<node_state>;

// Control messages are taken from this process and from processes that passed the challenge.
bool allowed(node_actor* self, const char* what);
// A refusal of the node itself (no stage of it): `kind`, the node, `sentence`.
caf::error node_refusal(node_actor* self, error_kind kind, std::string sentence);
// The refusal of a request from a sender that has not answered the challenge.
caf::error refused(node_actor* self);
hosted* find_stage(node_actor* self, uint32_t index);
std::string missing_stage(node_actor* self, uint32_t index);
// A refusal in the name of stage `index` on this node: `kind`, the stage, the node, `sentence`.
caf::error stage_refusal(node_actor* self, uint32_t index, error_kind kind, std::string sentence);
// No stage `index` here (or the node does not take the request now), as a refusal.
caf::error no_stage(node_actor* self, uint32_t index);

// Stage `index`'s state as state frame `id` to the scheduler (the stage protocol's save, as a
// node takes it); the refusal, or none.
caf::error send_state(node_actor* self, uint32_t index, uint64_t id, uint64_t keep_as);
// The stage protocol's load as a node takes it: answered once state frame `id` came and loaded.
caf::result<bool> load_state_frame(node_actor* self, uint32_t index, uint64_t id);

// The handlers of kept snapshots and state frames: keep, copy, hold, kept, rrestore, expire and
// the frames themselves (nodes/node_state.cpp).
caf::message_handler state_handlers(node_actor* self);

} // namespace actorpipe::nodes
