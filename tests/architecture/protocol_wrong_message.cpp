// Against the protocol: a stage takes its plan as a step_plan, not as a step number.
#include <caf/all.hpp>

#include "actors/messages.hpp"

using namespace actorpipe;

void send_wrong_message(caf::event_based_actor* self, const actors::stage_actor& stage) {
  self->send(stage, actors::plan_atom::value, uint64_t{1});
}
