// Against the protocol: a neighbour's handle (activations and gradients only) cannot stand in
// for a stage the scheduler plans.
#include <caf/all.hpp>

#include "actors/messages.hpp"

using namespace actorpipe;

actors::stage_actor as_stage(const actors::stage_peer_actor& peer) {
  return peer;
}
