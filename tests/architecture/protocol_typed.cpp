// The stage and scheduler protocols are typed: this file uses them as they are and builds.
#include <caf/all.hpp>

#include "scheduler/scheduler_actor.hpp"

using namespace actorpipe;

void use_protocols(caf::event_based_actor* self, const actors::stage_actor& stage,
                   const actors::local_stage_actor& local,
                   const scheduler::scheduler_actor& scheduler) {
  self->send(stage, actors::plan_atom::value, actors::step_plan{});
  self->send(local, actors::forward_atom::value, uint64_t{1}, int32_t{0}, int32_t{0},
             bundle(torch::Tensor{}));
  self->send(scheduler, actors::connect_atom::value, std::vector<actors::stage_actor>{stage});
  self->request(stage, caf::infinite, actors::abort_atom::value, uint64_t{1}).then([](bool) {});
  self->request(stage, caf::infinite, actors::update_atom::value, uint64_t{1}, 0.1, 1.0)
    .then([](double) {});
  self->request(stage, caf::infinite, actors::save_atom::value, std::string{"f"})
    .then([](bool) {}, [](caf::error&) {});
  self->request(stage, caf::infinite, actors::fetch_atom::value, uint64_t{0})
    .then([](std::shared_ptr<const actors::tensor_map>&) {});
}
