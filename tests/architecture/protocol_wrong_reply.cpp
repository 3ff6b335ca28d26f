// Against the protocol: a stage confirms an abort with a bool, not with text.
#include <caf/all.hpp>

#include "actors/messages.hpp"

using namespace actorpipe;

void expect_wrong_reply(caf::event_based_actor* self, const actors::stage_actor& stage) {
  self->request(stage, caf::infinite, actors::abort_atom::value, uint64_t{1})
    .then([](std::string&) {});
}
