// Per-stage hooks: called where documented, able to replace a tensor, and failing cleanly.
#include <atomic>
#include <mutex>
#include <set>
#include <tuple>

#include "oracle.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

TEST_CASE("hooks see every activation and input gradient sent, and observing changes nothing") {
  engine sys;
  std::mutex m;
  std::multiset<std::tuple<char, std::size_t, int32_t>> calls;
  pipeline_options o;
  o.microbatches = 4;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  o.hooks.after_forward = [&](const hook_context& c, torch::Tensor& t) {
    CHECK(c.train);
    CHECK(t.size(0) == 2);
    std::lock_guard<std::mutex> g{m};
    calls.insert({'F', c.stage, c.microbatch});
  };
  o.hooks.after_backward = [&](const hook_context& c, torch::Tensor&) {
    std::lock_guard<std::mutex> g{m};
    calls.insert({'B', c.stage, c.microbatch});
  };
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randn({8, 3});
  pipeline pipe(sys, tiny_mlp(), partition_uniform(6, 3), o);
  plain_model plain(tiny_mlp(), sgd(0.1));
  pipe.train_step(x, t);
  plain.step(x, t);
  check_close(pipe.named_parameters(), named(plain.layers, false));
  // Forward hooks on the stages that send activations (0, 1), backward hooks on those that send
  // gradients (1, 2); once per micro-batch.
  CHECK(calls.size() == 16);
  for (int32_t mb = 0; mb < 4; ++mb) {
    CHECK(calls.count({'F', 0, mb}) == 1);
    CHECK(calls.count({'F', 1, mb}) == 1);
    CHECK(calls.count({'B', 1, mb}) == 1);
    CHECK(calls.count({'B', 2, mb}) == 1);
  }
}

TEST_CASE("a hook may replace a tensor, and one that throws or changes the shape fails the step") {
  engine sys;
  pipeline_options o;
  o.microbatches = 2;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  std::atomic<int> mode{0};
  o.hooks.after_forward = [&](const hook_context& c, torch::Tensor& t) {
    if (mode == 1 && c.stage == 1) {
      t = t * 2; // forward-only: the last stage's output
    } else if (mode == 2) {
      throw std::runtime_error("boom");
    } else if (mode == 3) {
      t = t.flatten();
    }
  };
  auto layers = tiny_mlp();
  pipeline pipe(sys, layers, partition_uniform(6, 2), o);
  auto x = torch::randn({4, 1, 4, 4});
  auto plain = run_layers(layers, x).detach();
  mode = 1;
  CHECK(torch::allclose(pipe.forward(x), plain * 2, 1e-5, 1e-6));

  auto before = pipe.named_parameters();
  mode = 2;
  CHECK_THROWS_WITH_AS(
    pipe.train_step(x, torch::randn({4, 3})),
    doctest::Contains("stage 0, microbatch 0: the after_forward hook failed on tensor 0: boom"),
    pipeline_error);
  mode = 3;
  CHECK_THROWS_WITH_AS(pipe.train_step(x, torch::randn({4, 3})),
                       doctest::Contains("the after_forward hook replaced tensor 0 of shape"),
                       pipeline_error);
  check_close(pipe.named_parameters(), before, 0, 0);
}
