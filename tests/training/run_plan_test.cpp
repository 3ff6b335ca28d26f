// A run's plan (training/run_plan.hpp): one settings value in, the planner's choice out, and the
// pipeline that choice describes, whose steps equal plain libtorch's.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

#include "../engine/oracle.hpp"
#include "training/run_plan.hpp"

using namespace actorpipe;

namespace {

// Two stages of tiny_mlp, interleaved (two chunks each), 4 micro-batches; MSE and SGD.
training::run_settings interleaved_settings() {
  training::run_settings s;
  s.plan.stages = 2;
  s.plan.chunks = 2;
  s.plan.microbatches = 4;
  s.plan.schedule = "interleaved";
  s.plan.partition = "uniform";
  s.plan.threads = 1;
  s.pipeline.loss = mse;
  s.pipeline.optimizer = sgd(0.1, 0.9);
  return s;
}

} // namespace

TEST_CASE("a run's plan is the planner's choice, and the pipeline start_run builds runs it with "
          "the steps of plain libtorch") {
  auto layers = tiny_mlp(3);
  torch::manual_seed(4);
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randn({8, 3});
  const auto plan = training::plan_run(layers, x, interleaved_settings());
  const auto& choice = plan.choice();
  CHECK(choice.stages() == 2);
  CHECK(choice.chunks == 2);
  CHECK(choice.cut.stages() == 4);
  CHECK(choice.microbatches == 4);
  CHECK(choice.kind == schedule_kind::interleaved);
  // The pipeline's options are the settings' with the choice set in.
  auto po = plan.options();
  CHECK(po.microbatches == 4);
  CHECK(po.chunks == 2);
  CHECK(po.schedule == schedule_kind::interleaved);
  CHECK(po.threads_per_stage == 1);
  CHECK(po.loss);

  engine sys;
  training::run_model model;
  model.layers = layers;
  auto run = training::start_run(sys, model, plan);
  REQUIRE(run.single);
  CHECK(!run.replicated);
  auto& pipe = run.lead();
  CHECK(pipe.stages() == 2);
  CHECK(pipe.cut().bounds == choice.cut.bounds);
  CHECK(pipe.training_schedule().programs.size() == 2);
  plain_model plain(tiny_mlp(3), sgd(0.1, 0.9));
  for (int step = 0; step < 2; ++step) {
    CAPTURE(step);
    auto expected = plain.step(x, t);
    CHECK(pipe.train_step(x, t).loss == doctest::Approx(expected).epsilon(1e-5));
  }
  check_close(pipe.named_parameters(), named(plain.layers, false), 1e-5, 1e-6);
}

TEST_CASE("start_run builds settings.replicas replicas in this process from the model's maker, "
          "and refuses them without one by name") {
  auto settings = interleaved_settings();
  settings.replicas = 2;
  torch::manual_seed(5);
  auto x = torch::randn({16, 1, 4, 4});
  auto t = torch::randn({16, 3});
  const auto plan = training::plan_run(tiny_mlp(3), x, settings);
  engine sys;
  training::run_model without;
  without.layers = tiny_mlp(3);
  CHECK_THROWS_WITH_AS(training::start_run(sys, without, plan),
                       doctest::Contains("run_model::replica"), invalid_argument);

  training::run_model model;
  model.replica = [] { return tiny_mlp(3); };
  auto run = training::start_run(sys, model, plan);
  REQUIRE(run.replicated);
  CHECK(!run.single);
  CHECK(run.replicated->replicas() == 2);
  // Two replicas' step is one pipeline's on the whole batch.
  plain_model plain(tiny_mlp(3), sgd(0.1, 0.9));
  auto expected = plain.step(x, t);
  CHECK(run.replicated->train_step(x, t).loss == doctest::Approx(expected).epsilon(1e-5));
  check_close(run.lead().named_parameters(), named(plain.layers, false), 1e-5, 1e-6);
}

TEST_CASE("a given schedule is refused with chunks it cannot take, by flag, before anything "
          "runs") {
  auto settings = interleaved_settings();
  settings.plan.chunks = 1;
  auto x = torch::randn({8, 1, 4, 4});
  CHECK_THROWS_WITH_AS(training::plan_run(tiny_mlp(3), x, settings),
                       doctest::Contains("--schedule interleaved with --chunks 1 interleaves "
                                         "nothing: give --chunks 2 or more, or --schedule 1f1b"),
                       invalid_argument);
  settings.plan.schedule = "v-min";
  settings.plan.chunks = 3;
  CHECK_THROWS_WITH_AS(training::plan_run(tiny_mlp(3), x, settings),
                       doctest::Contains("--schedule v-min runs two chunks per stage in a V: "
                                         "--chunks 3 does not apply"),
                       invalid_argument);
}
