// The stage actor on its own: a test actor plays the scheduler and the neighbouring stage.
#include <chrono>

#include <caf/all.hpp>
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <actorpipe/partition.hpp>

#include "actors/messages.hpp"
#include "actors/pipeline_errc.hpp"
#include "actors/stage_actor.hpp"
#include "stages/stage.hpp"

using namespace actorpipe;
using namespace actorpipe::actors;

namespace {

// The configuration every actorpipe system has: stages' refusals render as their sentence.
caf::actor_system_config& with_pipeline_errors(caf::actor_system_config& config) {
  add_pipeline_errors(config);
  return config;
}

struct two_stage_fixture {
  caf::actor_system_config config;
  caf::actor_system system{with_pipeline_errors(config)};
  caf::scoped_actor self{system};
  layer_list layers;
  local_stage_actor stage;

  // Stage 1 of a two-layer model; the test actor is the scheduler and stage 0.
  two_stage_fixture() {
    torch::manual_seed(1);
    layers.emplace_back("fc1", torch::nn::AnyModule(torch::nn::Linear(3, 4)));
    layers.emplace_back("fc2", torch::nn::AnyModule(torch::nn::Linear(4, 2)));
    auto chunk = stages::make_stage(layers, partition_uniform(2, 2), 1, c10::kCPU, {});
    stage_actor_options options;
    options.index = 1;
    options.count = 2;
    options.wait_timeout = std::chrono::milliseconds(300);
    options.threads = 1;
    options.warm_memory = false;
    // The test actor stands in for the listener and for stage 0 (a scoped actor is dynamically
    // typed: the casts say which part of the protocol it plays).
    stage = spawn_stage(system, {chunk}, caf::actor_cast<stage_listener_actor>(self), options);
    self->send(stage, connect_atom::value,
               std::vector<stage_peer_actor>{caf::actor_cast<stage_peer_actor>(self), stage});
  }

  ~two_stage_fixture() { self->send_exit(stage, caf::exit_reason::user_shutdown); }

  void plan_forward(uint64_t step) {
    step_plan plan;
    plan.step = step;
    plan.train = false;
    plan.microbatches = 1;
    plan.program = {{action_kind::forward, 0}};
    self->send(stage, plan_atom::value, std::move(plan));
  }
};

} // namespace

TEST_CASE("a stage actor runs its program on the activation its neighbour sends and reports "
          "the output") {
  two_stage_fixture f;
  auto x = torch::randn({5, 4});
  // The activation may come before the plan: it is kept for the step.
  f.self->send(f.stage, forward_atom::value, uint64_t{1}, int32_t{0}, int32_t{0}, bundle(x));
  f.plan_forward(1);
  bool reported = false;
  f.self->receive(
    [&](done_atom, stage_report& report) {
      reported = true;
      CHECK(report.step == 1);
      CHECK(report.stats.stage == 1);
      REQUIRE(report.outputs.size() == 1);
      torch::NoGradGuard no_grad;
      CHECK(torch::allclose(report.outputs[0], f.layers[1].forward(x)));
      REQUIRE(report.stats.actions.size() == 1);
      CHECK(report.stats.actions[0].what == action{action_kind::forward, 0});
    },
    [&](failed_atom, uint64_t, failure& why) { FAIL(why.message); },
    caf::after(std::chrono::seconds(10)) >> [&] { FAIL("the stage did not report"); });
  CHECK(reported);
}

TEST_CASE("a stage actor whose input never comes fails the step at its deadline, saying what it "
          "waited for") {
  two_stage_fixture f;
  f.plan_forward(1);
  auto start = std::chrono::steady_clock::now();
  bool failed = false;
  f.self->receive(
    [&](failed_atom, uint64_t step, failure& why) {
      failed = true;
      CHECK(step == 1);
      CHECK(why.message.find("stage 1 waits for the activation of microbatch 0 from stage 0") !=
            std::string::npos);
      CHECK(why.details.kind == error_kind::timeout);
      CHECK(why.details.stage == std::optional<std::size_t>(1));
      CHECK(why.details.microbatch == std::optional<int32_t>(0));
    },
    [&](done_atom, stage_report&) { FAIL("the stage reported without its input"); },
    caf::after(std::chrono::seconds(10)) >> [&] { FAIL("the stage neither reported nor failed"); });
  CHECK(failed);
  auto waited = std::chrono::steady_clock::now() - start;
  CHECK(waited >= std::chrono::milliseconds(300));
  CHECK(waited < std::chrono::seconds(5));
  // A late activation of the failed step is dropped; the next step runs normally.
  f.self->send(f.stage, forward_atom::value, uint64_t{1}, int32_t{0}, int32_t{0},
               bundle(torch::randn({2, 4})));
  f.self->send(f.stage, forward_atom::value, uint64_t{2}, int32_t{0}, int32_t{0},
               bundle(torch::randn({3, 4})));
  f.plan_forward(2);
  f.self->receive(
    [&](done_atom, stage_report& report) {
      CHECK(report.step == 2);
      REQUIRE(report.outputs.size() == 1);
      CHECK(report.outputs[0].size(0) == 3);
    },
    [&](failed_atom, uint64_t, failure& why) { FAIL(why.message); },
    caf::after(std::chrono::seconds(10)) >> [&] { FAIL("the stage did not report"); });
}

TEST_CASE("a stage actor answers abort, and an activation of the wrong shape fails with its "
          "fields") {
  two_stage_fixture f;
  f.self->send(f.stage, forward_atom::value, uint64_t{1}, int32_t{0}, int32_t{0},
               bundle(torch::randn({2, 7})));
  f.plan_forward(1);
  f.self->receive(
    [&](failed_atom, uint64_t, failure& why) {
      CHECK(why.details.kind == error_kind::shape_mismatch);
      CHECK(why.details.stage == std::optional<std::size_t>(1));
      CHECK(why.details.microbatch == std::optional<int32_t>(0));
      CHECK(why.message.find("layer 'fc2'") != std::string::npos);
    },
    [&](done_atom, stage_report&) { FAIL("a misshapen activation was taken"); },
    caf::after(std::chrono::seconds(10)) >> [&] { FAIL("the stage neither reported nor failed"); });
  bool confirmed = false;
  f.self->request(f.stage, std::chrono::seconds(5), abort_atom::value, uint64_t{1})
    .receive([&](bool ok) { confirmed = ok; },
             [&](const caf::error& err) { FAIL(f.system.render(err)); });
  CHECK(confirmed);
}

TEST_CASE("a stage actor refuses through CAF's error channel: the kind and the sentence as CAF "
          "error data, and done replies carry no error text") {
  two_stage_fixture f;
  // A file that cannot be written: the save fails as an I/O refusal naming the stage.
  caf::error refusal;
  f.self
    ->request(f.stage, std::chrono::seconds(10), save_atom::value,
              std::string("/nonexistent-dir/stage.pt"))
    .receive([&](bool) { FAIL("the save into a missing folder succeeded"); },
             [&](caf::error& e) { refusal = e; });
  REQUIRE(is_pipeline_error(refusal));
  CHECK(kind_of_pipeline_error(refusal) == error_kind::io);
  auto sentence = f.system.render(refusal);
  CHECK_MESSAGE(sentence.rfind("stage 1: ", 0) == 0, sentence);
  CHECK_MESSAGE(sentence.find("/nonexistent-dir/stage.pt") != std::string::npos, sentence);

  // Ending a block without BMUF or sharding is refused as a replicas' failure.
  f.self->request(f.stage, std::chrono::seconds(10), block_atom::value)
    .receive([&](bool) { FAIL("a block ended without replicas"); },
             [&](caf::error& e) { refusal = e; });
  CHECK(kind_of_pipeline_error(refusal) == error_kind::replica_failure);
  CHECK(f.system.render(refusal) == "stage 1: ending a block needs BMUF replicas");

  // A fetch answers the state itself, and a load of it is done.
  std::shared_ptr<const tensor_map> state;
  f.self->request(f.stage, std::chrono::seconds(10), fetch_atom::value, uint64_t{0})
    .receive([&](std::shared_ptr<const tensor_map>& s) { state = s; },
             [&](caf::error& e) { FAIL(f.system.render(e)); });
  REQUIRE(state);
  CHECK(state->count("fc2.weight") == 1);
  bool loaded = false;
  f.self->request(f.stage, std::chrono::seconds(10), load_atom::value, state)
    .receive([&](bool done) { loaded = done; }, [&](caf::error& e) { FAIL(f.system.render(e)); });
  CHECK(loaded);
  // A state without the stage's keys is refused by name, as an I/O failure.
  auto empty = std::make_shared<const tensor_map>();
  f.self->request(f.stage, std::chrono::seconds(10), load_atom::value, empty)
    .receive([&](bool) { FAIL("an empty state loaded"); }, [&](caf::error& e) { refusal = e; });
  CHECK(kind_of_pipeline_error(refusal) == error_kind::io);
  CHECK_MESSAGE(f.system.render(refusal).find("stage 1: the checkpoint has no tensor 'fc2.") == 0,
                f.system.render(refusal));
}

TEST_CASE(
  "a refusal of every kind is an error, error_kind::other too (CAF takes code 0 for none)") {
  caf::actor_system_config config;
  caf::actor_system system{with_pipeline_errors(config)};
  for (auto kind :
       {error_kind::other, error_kind::timeout, error_kind::io, error_kind::out_of_memory}) {
    CAPTURE(to_string(kind));
    auto e = make_pipeline_error(kind, "what failed, and where");
    CHECK(static_cast<bool>(e));
    CHECK(is_pipeline_error(e));
    CHECK(kind_of_pipeline_error(e) == kind);
    CHECK(system.render(e) == "what failed, and where");
  }
}
