#include <atomic>
#include <limits>
#include <thread>

#include "oracle.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

namespace {

pipeline_options step_options(std::size_t microbatches) {
  pipeline_options o;
  o.microbatches = microbatches;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  return o;
}

bool all_equal(const std::vector<std::pair<std::string, torch::Tensor>>& a,
               const std::vector<std::pair<std::string, torch::Tensor>>& b) {
  if (a.size() != b.size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || !torch::equal(a[i].second, b[i].second)) {
      return false;
    }
  }
  return true;
}

// The pipeline_error `run` throws (fails the test when it throws nothing or something else).
template <class F>
pipeline_error error_of(F&& run) {
  try {
    run();
  } catch (const pipeline_error& e) {
    return e;
  }
  FAIL("no pipeline_error was thrown");
  return pipeline_error("");
}

void check_fields(const pipeline_error& e, error_kind kind, std::optional<std::size_t> stage,
                  std::optional<int32_t> microbatch, std::optional<uint64_t> step) {
  CAPTURE(e.what());
  CHECK(to_string(e.kind()) == std::string(to_string(kind)));
  CHECK(e.stage() == stage);
  CHECK(e.microbatch() == microbatch);
  CHECK(e.step() == step);
  CHECK(e.node().empty());
}

} // namespace

TEST_CASE("an activation the next stage cannot take names the stage, micro-batch and shapes") {
  torch::manual_seed(0);
  layer_list layers;
  layers.emplace_back("fc1", torch::nn::AnyModule(torch::nn::Linear(4, 8)));
  layers.emplace_back("fc2", torch::nn::AnyModule(torch::nn::Linear(6, 2)));
  engine sys;
  pipeline pipe(sys, layers, partition_uniform(2, 2), step_options(2));
  auto before = pipe.named_parameters();
  CHECK_THROWS_WITH_AS(pipe.train_step(torch::randn({5, 4}), torch::randn({5, 2})),
                       doctest::Contains("stage 1, microbatch 0: layer 'fc2' (model layer 1) "
                                         "cannot take the activation from stage 0 of shape "
                                         "[3, 8]; it expects [*, 6]"),
                       actorpipe::pipeline_error);
  CHECK(all_equal(before, pipe.named_parameters()));
  // The same as fields: an application can act on them without reading the message.
  auto e = error_of([&] { pipe.train_step(torch::randn({5, 4}), torch::randn({5, 2})); });
  check_fields(e, error_kind::shape_mismatch, 1, 0, 2);
}

TEST_CASE("a step that fails mid-way leaves parameters and batch-norm statistics as they were, "
          "and the next step trains normally") {
  // Stage 1 fails on its forward of micro-batch 2 in step 1 only, after 1F1B has already run
  // backwards (and accumulated gradients) for earlier micro-batches on every stage.
  std::atomic<int> calls{0};
  auto make = [&](bool with_trap) {
    torch::manual_seed(3);
    layer_list layers;
    layers.emplace_back("fc1", torch::nn::AnyModule(torch::nn::Linear(4, 6)));
    layers.emplace_back("bn", torch::nn::AnyModule(torch::nn::BatchNorm1d(6)));
    layers.emplace_back("trap", [&calls, with_trap](const torch::Tensor& x) {
      if (with_trap && calls++ == 2) {
        throw std::runtime_error("trap sprung");
      }
      return x;
    });
    layers.emplace_back("fc2", torch::nn::AnyModule(torch::nn::Linear(6, 2)));
    return layers;
  };
  auto layers = make(true);
  engine sys;
  pipeline pipe(sys, layers, partition_at(4, {2}), step_options(4));
  auto params_before = pipe.named_parameters();
  auto bn = layers[1].module();
  auto mean_before = bn->named_buffers()["running_mean"].clone();
  auto x = torch::randn({8, 4});
  auto t = torch::randn({8, 2});
  CHECK_THROWS_WITH_AS(pipe.train_step(x, t),
                       doctest::Contains("stage 1, microbatch 2: layer 'trap' (model layer 2) "
                                         "cannot take the activation from stage 0 of shape [2, 6]. "
                                         "libtorch: trap sprung"),
                       actorpipe::pipeline_error);
  // A layer's own exception is a stage failure; only libtorch refusing a tensor is a shape
  // mismatch.
  calls = 2;
  check_fields(error_of([&] { pipe.train_step(x, t); }), error_kind::stage_failure, 1, 0, 2);
  CHECK(all_equal(params_before, pipe.named_parameters()));
  CHECK(torch::equal(mean_before, bn->named_buffers()["running_mean"]));
  for (const auto& g : pipe.named_gradients()) {
    CHECK_FALSE(g.second.defined());
  }
  // The pipeline is still usable, and the failed step left no trace: retrying it equals the
  // same step on a pipeline that never failed (batch norm sees micro-batch statistics, so the
  // reference is a pipeline with the same cut, not the plain model).
  auto clean_layers = make(false);
  pipeline clean(sys, clean_layers, partition_at(4, {2}), step_options(4));
  CHECK(pipe.train_step(x, t).loss == doctest::Approx(clean.train_step(x, t).loss).epsilon(1e-6));
  check_close(pipe.named_parameters(), clean.named_parameters(), 1e-6, 1e-7);
  CHECK(torch::allclose(bn->named_buffers()["running_mean"],
                        clean_layers[1].module()->named_buffers()["running_mean"], 1e-6, 1e-7));
}

TEST_CASE("a failed step whose stages stepped their optimizers early puts back their batch-norm "
          "statistics too, with and without overlapping steps") {
  for (bool overlap : {false, true}) {
    CAPTURE(overlap);
    std::atomic<bool> poison{false};
    torch::manual_seed(4);
    layer_list layers;
    layers.emplace_back("fc1", torch::nn::AnyModule(torch::nn::Linear(4, 6)));
    layers.emplace_back("bn", torch::nn::AnyModule(torch::nn::BatchNorm1d(6)));
    layers.emplace_back("fc2", torch::nn::AnyModule(torch::nn::Linear(6, 2)));
    auto o = step_options(2);
    o.optimizer = sgd(0.1, 0.9);
    o.max_grad_norm = 1e9; // checked, never clipping
    o.optimistic_update = !overlap;
    o.overlap_steps = overlap;
    // Stage 0's output scaled by infinity: batch norm's statistics on stage 1 and the gradient
    // norm are no longer finite.
    o.hooks.after_forward = [&](const hook_context& c, torch::Tensor& t) {
      if (poison && c.stage == 0) {
        t = t * std::numeric_limits<float>::infinity();
      }
    };
    engine sys;
    pipeline pipe(sys, layers, partition_at(3, {1, 2}), o);
    auto bn = layers[1].module();
    auto x = torch::randn({8, 4});
    auto t = torch::randn({8, 2});
    auto first = pipe.train_step(x, t);
    // Stage 0 reported last: stages 1 and 2 step early in the next step.
    CHECK(first.stages[0].early_update);
    auto mean = bn->named_buffers()["running_mean"].clone();
    auto variance = bn->named_buffers()["running_var"].clone();
    auto parameters = pipe.named_parameters();
    poison = true;
    CHECK_THROWS_WITH_AS(pipe.train_step(x, t),
                         doctest::Contains("step 2: the global gradient norm is "), pipeline_error);
    poison = false;
    CHECK(torch::equal(bn->named_buffers()["running_mean"], mean));
    CHECK(torch::equal(bn->named_buffers()["running_var"], variance));
    CHECK(all_equal(pipe.named_parameters(), parameters));
  }
}

TEST_CASE("a stage that waits past its deadline says who waits for what") {
  layer_list layers;
  layers.emplace_back("slow", [](const torch::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    return x;
  });
  layers.emplace_back("fc", torch::nn::AnyModule(torch::nn::Linear(3, 3)));
  engine sys;
  auto o = step_options(2);
  o.wait_timeout = std::chrono::milliseconds(200);
  pipeline pipe(sys, layers, partition_uniform(2, 2), o);
  auto before = pipe.named_parameters();
  CHECK_THROWS_WITH_AS(pipe.train_step(torch::randn({4, 3}), torch::randn({4, 3})),
                       doctest::Contains("stage 1 waits for the activation of microbatch 0 from "
                                         "stage 0 (step 1, action 0 of its program) and gave up "
                                         "after 200 ms"),
                       actorpipe::pipeline_error);
  CHECK(all_equal(before, pipe.named_parameters()));
  check_fields(error_of([&] {
                 pipe.train_step(torch::randn({4, 3}), torch::randn({4, 3}));
               }),
               error_kind::timeout, 1, 0, 2);
}

TEST_CASE("a step over its step deadline fails instead of hanging") {
  layer_list layers;
  layers.emplace_back("slow", [](const torch::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    return x;
  });
  engine sys;
  auto o = step_options(1);
  o.step_timeout = std::chrono::milliseconds(100);
  pipeline pipe(sys, layers, partition_uniform(1, 1), o);
  CHECK_THROWS_WITH_AS(pipe.train_step(torch::randn({2, 3}), torch::randn({2, 3})),
                       doctest::Contains("step 1 did not finish within 100 ms"),
                       actorpipe::pipeline_error);
  check_fields(error_of([&] {
                 pipe.train_step(torch::randn({2, 3}), torch::randn({2, 3}));
               }),
               error_kind::timeout, std::nullopt, std::nullopt, 2);
}

// Deadlines are checked by one pending timer per actor that is set again for what is left of the
// wait or step running when it fires: a wait that began after the timer was set gets its whole
// deadline, and later steps still fail past theirs.
TEST_CASE("every step and every wait gets its whole deadline, not only the first") {
  auto delay_ms = std::make_shared<std::atomic<int>>(0);
  layer_list layers;
  layers.emplace_back("sometimes_slow", [delay_ms](const torch::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms->load()));
    return x;
  });
  layers.emplace_back("fc", torch::nn::AnyModule(torch::nn::Linear(3, 3)));
  engine sys;
  auto o = step_options(1);
  SUBCASE("a stage's wait") {
    o.wait_timeout = std::chrono::milliseconds(300);
    pipeline pipe(sys, layers, partition_uniform(2, 2), o);
    auto x = torch::randn({2, 3});
    pipe.train_step(x, x); // stage 1 waits: the timer is set for 300 ms from here
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    // Stage 1 waits 250 ms, the timer fires ~100 ms into it: not past this wait's deadline.
    delay_ms->store(250);
    CHECK_NOTHROW(pipe.train_step(x, x));
    delay_ms->store(1200);
    CHECK_THROWS_WITH_AS(pipe.train_step(x, x),
                         doctest::Contains("stage 1 waits for the activation of microbatch 0 from "
                                           "stage 0 (step 3, action 0 of its program) and gave up "
                                           "after 300 ms"),
                         actorpipe::pipeline_error);
  }
  SUBCASE("a whole step") {
    o.step_timeout = std::chrono::milliseconds(400);
    pipeline pipe(sys, layers, partition_uniform(2, 1), o);
    auto x = torch::randn({2, 3});
    pipe.train_step(x, x);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    delay_ms->store(250);
    CHECK_NOTHROW(pipe.train_step(x, x));
    delay_ms->store(1000);
    CHECK_THROWS_WITH_AS(pipe.train_step(x, x),
                         doctest::Contains("step 3 did not finish within 400 ms"),
                         actorpipe::pipeline_error);
  }
}

TEST_CASE("lingering is a latency choice: the same training with or without it") {
  engine sys;
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randn({8, 3});
  torch::manual_seed(5);
  auto a_layers = tiny_mlp();
  torch::manual_seed(5);
  auto b_layers = tiny_mlp();
  auto polling = step_options(4);
  polling.linger = std::chrono::microseconds(200);
  auto sleeping = step_options(4);
  sleeping.linger = std::chrono::microseconds(0);
  pipeline a(sys, a_layers, partition_uniform(a_layers.size(), 2), polling);
  pipeline b(sys, b_layers, partition_uniform(b_layers.size(), 2), sleeping);
  for (int i = 0; i < 3; ++i) {
    CHECK(a.train_step(x, t).loss == b.train_step(x, t).loss);
  }
  CHECK(all_equal(a.named_parameters(), b.named_parameters()));
  auto negative = step_options(1);
  negative.linger = std::chrono::microseconds(-1);
  CHECK_THROWS_WITH_AS(pipeline(sys, tiny_mlp(), partition_uniform(6, 2), negative),
                       doctest::Contains("linger (-1 us) must be >= 0"),
                       actorpipe::invalid_argument);
}

TEST_CASE("bad pipeline arguments are rejected before anything runs") {
  engine sys;
  auto layers = tiny_mlp();
  auto cut = partition_uniform(layers.size(), 2);
  CHECK_THROWS_WITH_AS(pipeline(sys, layers, cut, step_options(0)),
                       doctest::Contains("microbatches (0) must be >= 1"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(pipeline(sys, layers, partition_uniform(5, 2), step_options(1)),
                       doctest::Contains("does not cover the model's 6 layers"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(pipeline(sys, layer_list{}, cut, step_options(1)),
                       doctest::Contains("the model has no layers"), actorpipe::invalid_argument);
  auto o = step_options(1);
  o.devices = {c10::Device(c10::kCPU)};
  CHECK_THROWS_WITH_AS(pipeline(sys, layers, cut, o),
                       doctest::Contains("1 devices given for 2 stages"),
                       actorpipe::invalid_argument);

  pipeline pipe(sys, layers, cut, step_options(4));
  CHECK_THROWS_WITH_AS(pipe.train_step(torch::randn({3, 1, 4, 4}), torch::randn({3, 3})),
                       doctest::Contains("batch of 3 samples cannot be split into 4 micro-batches"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(pipe.train_step(torch::randn({4, 1, 4, 4}), torch::randn({5, 3})),
                       doctest::Contains("inputs and targets must have the same batch size"),
                       actorpipe::invalid_argument);
  pipeline_options no_loss;
  pipeline eval_only(sys, tiny_mlp(), cut, no_loss);
  CHECK_THROWS_WITH_AS(eval_only.train_step(torch::randn({4, 1, 4, 4}), torch::randn({4, 3})),
                       doctest::Contains("pipeline_options.loss is not set"),
                       actorpipe::invalid_argument);
}

TEST_CASE("a loss function that does not return a scalar fails the step with its shape") {
  engine sys;
  auto layers = tiny_mlp();
  auto o = step_options(2);
  o.loss = [](const torch::Tensor& y, const torch::Tensor& t) { return (y - t).pow(2); };
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
  CHECK_THROWS_WITH_AS(pipe.train_step(torch::randn({4, 1, 4, 4}), torch::randn({4, 3})),
                       doctest::Contains("stage 1, microbatch 0: the loss function must return a "
                                         "scalar, got shape [2, 3]"),
                       actorpipe::pipeline_error);
  check_fields(error_of([&] {
                 pipe.train_step(torch::randn({4, 1, 4, 4}), torch::randn({4, 3}));
               }),
               error_kind::stage_failure, 1, 0, 2);
}

TEST_CASE("a stage on a device this build or machine does not have is refused by name") {
  engine sys;
  auto layers = tiny_mlp();
  pipeline_options o;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  o.devices = {c10::Device(c10::kCPU), c10::Device(c10::kCUDA, 7)};
  try {
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
    FAIL("cuda:7 should have been refused");
  } catch (const invalid_argument& e) {
    std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("pipeline: stage 1: device cuda:7") != std::string::npos);
    // The CPU build, a CUDA build on a machine without a GPU, or one with fewer GPUs.
    CHECK((what.find("has no CUDA") != std::string::npos ||
           what.find("no CUDA device") != std::string::npos ||
           what.find("CUDA device") != std::string::npos));
  }
}
