// How a node's stages reach stages elsewhere: a link actor per neighbour that sends their
// activations and gradients as frames, and the tie group's frames both ways.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <pthread.h>

#include <torch/torch.h>

#include "actors/messages.hpp"
#include "comm/bundle_frames.hpp"
#include "nodes/node_host.hpp"

namespace actorpipe::nodes {

using namespace actorpipe::actors;

// Sends one neighbour's activations or gradients as frames, on a thread of its own so that the
// stage computes while the bytes go out.
stage_peer_actor::behavior_type link_actor(stage_peer_actor::pointer self,
                                           std::shared_ptr<comm::tensor_hub> hub, endpoint to,
                                           uint32_t to_stage, uint32_t from_stage,
                                           caf::actor host) {
  pthread_setname_np(pthread_self(), "ap.link");
  auto send = [=](comm::frame_kind kind, uint64_t step, int32_t microbatch, int32_t chunk,
                  const bundle& b) {
    try {
      comm::frame_header address;
      address.kind = kind;
      address.stage = to_stage;
      address.step = step;
      address.microbatch = microbatch;
      address.chunk = chunk;
      comm::send_bundle(*hub, to.host, to.port, address, b);
    } catch (const std::exception& e) {
      // The node checks who sends (a typed actor may not send() to a dynamically typed one).
      caf::unsafe_send_as(
        self, host, link_failed_atom::value, from_stage, step, microbatch, to.node,
        detail::concat("stage ", from_stage, " could not send the ", comm::to_string(kind),
                       " of microbatch ", microbatch, " to stage ", to_stage, " on node ", to.node,
                       ": ", e.what()));
    }
  };
  return {
    [=](forward_atom, uint64_t step, int32_t microbatch, int32_t chunk, const bundle& b) {
      send(comm::frame_kind::activation, step, microbatch, chunk, b);
    },
    [=](backward_atom, uint64_t step, int32_t microbatch, int32_t chunk, const bundle& b) {
      send(comm::frame_kind::gradient, step, microbatch, chunk, b);
    },
  };
}

// Sends a member's tied gradients to the node of stage `to`: one bundle of the ties' indices in
// `names` and the gradients, as a tied_gradient frame from stage `from`.
comm::tie_group::sender tie_sender(std::shared_ptr<comm::tensor_hub> hub,
                                   std::shared_ptr<std::vector<endpoint>> peers,
                                   std::vector<std::string> names) {
  return [hub, peers, names](std::size_t to, uint64_t step, std::size_t from,
                             const std::map<std::string, torch::Tensor>& part) {
    ACTORPIPE_CHECK(to < peers->size(), "stage ", to, " has no address (the stage is not wired)");
    std::vector<int64_t> indices;
    std::vector<torch::Tensor> tensors{torch::Tensor()};
    for (const auto& [name, g] : part) {
      auto it = std::find(names.begin(), names.end(), name);
      ACTORPIPE_CHECK(it != names.end(), "'", name, "' is no tied parameter of the model");
      indices.push_back(it - names.begin());
      tensors.push_back(g);
    }
    tensors.front() = torch::tensor(indices, torch::kLong);
    comm::frame_header address;
    address.kind = comm::frame_kind::tied_gradient;
    address.stage = static_cast<uint32_t>(to);
    address.step = step;
    address.microbatch = static_cast<int32_t>(from);
    const auto& where = (*peers)[to];
    comm::send_bundle(*hub, where.host, where.port, address, bundle(std::move(tensors)));
  };
}

// A tied_gradient bundle (the ties' indices, then their gradients) into the stage's tie group.
void receive_tied_gradients(const routes::tie_route& tie, uint64_t step, int32_t from,
                            const bundle& b) {
  auto group = tie.group.lock();
  if (!group) {
    return;
  }
  if (b.size() < 1 || b[0].scalar_type() != torch::kLong || b[0].dim() != 1 ||
      b[0].numel() + 1 != static_cast<int64_t>(b.size()) || from < 0) {
    throw comm::frame_error(detail::concat("a tied-gradient bundle from stage ", from,
                                           " must be the ties' indices (int64) and as many "
                                           "gradients, not ",
                                           b.describe()));
  }
  std::map<std::string, torch::Tensor> part;
  for (int64_t i = 0; i < b[0].numel(); ++i) {
    auto index = b[0][i].item<int64_t>();
    if (index < 0 || index >= static_cast<int64_t>(tie.names.size())) {
      throw comm::frame_error(detail::concat("a tied-gradient bundle from stage ", from,
                                             " names tie ", index, " of ", tie.names.size()));
    }
    part[tie.names[static_cast<std::size_t>(index)]] = b[static_cast<std::size_t>(i + 1)];
  }
  group->deliver(step, static_cast<std::size_t>(from), std::move(part));
}

} // namespace actorpipe::nodes
