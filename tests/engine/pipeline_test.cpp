#include <atomic>
#include <future>

#include "oracle.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

// Tolerances: float32 sums taken in another order (per micro-batch, then accumulated) differ
// from the full-batch sums by a few ulps; rtol 1e-5 is ~80 ulps, atol 1e-7 covers entries that
// cancel to ~0, where a relative bound means nothing.

TEST_CASE("gradients and parameters equal plain libtorch for GPipe and 1F1B, 1-4 stages, "
          "1/2/3/5/8 micro-batches and an uneven batch") {
  engine sys;
  auto x = torch::randn({10, 1, 4, 4});
  auto t = torch::randn({10, 3});
  for (auto kind : {schedule_kind::gpipe, schedule_kind::one_f_one_b}) {
    for (std::size_t stages = 1; stages <= 4; ++stages) {
      for (std::size_t m : {1, 2, 3, 5, 8}) {
        CAPTURE(to_string(kind));
        CAPTURE(stages);
        CAPTURE(m);
        auto layers = tiny_mlp();
        pipeline_options o;
        o.microbatches = m;
        o.schedule = kind;
        o.loss = mse;
        o.optimizer = sgd(0.1);
        pipeline pipe(sys, layers, partition_uniform(layers.size(), stages), o);
        plain_model plain(tiny_mlp(), sgd(0.1));
        auto result = pipe.train_step(x, t);
        auto plain_loss = plain.step(x, t);
        CHECK(result.loss == doctest::Approx(plain_loss).epsilon(1e-6));
        CHECK(result.stages.size() == stages);
        check_close(pipe.named_gradients(), named(plain.layers, true));
        check_close(pipe.named_parameters(), named(plain.layers, false));
      }
    }
  }
}

TEST_CASE("several Adam steps in a row give plain libtorch's loss sequence") {
  engine sys;
  auto layers = tiny_mlp(7);
  pipeline_options o;
  o.microbatches = 3;
  o.loss = mse;
  o.optimizer = adam(0.01);
  pipeline pipe(sys, layers, partition_at(layers.size(), {2, 4}), o);
  plain_model plain(tiny_mlp(7), adam(0.01));
  torch::manual_seed(11);
  for (int step = 0; step < 5; ++step) {
    CAPTURE(step);
    auto x = torch::randn({7, 1, 4, 4});
    auto t = torch::randn({7, 3});
    auto r = pipe.train_step(x, t);
    CHECK(r.step == static_cast<uint64_t>(step + 1));
    CHECK(r.loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
  }
  check_close(pipe.named_parameters(), named(plain.layers, false), 1e-4, 1e-6);
}

TEST_CASE("a CNN cut into 3 stages trains like plain libtorch") {
  engine sys;
  auto make = [] {
    torch::manual_seed(5);
    model_options o;
    o.in_channels = 1;
    o.image_size = 8;
    o.num_classes = 4;
    return make_model("cnn", o);
  };
  auto layers = make();
  pipeline_options o;
  o.microbatches = 4;
  o.schedule = schedule_kind::gpipe;
  o.loss = mse;
  o.optimizer = sgd(0.05, 0.9);
  pipeline pipe(sys, layers, partition_by_params(layers, 3), o);
  plain_model plain(make(), sgd(0.05, 0.9));
  for (int step = 0; step < 2; ++step) {
    auto x = torch::randn({6, 1, 8, 8});
    auto t = torch::randn({6, 4});
    CHECK(pipe.train_step(x, t).loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
  }
  check_close(pipe.named_gradients(), named(plain.layers, true), 1e-5, 1e-6);
  check_close(pipe.named_parameters(), named(plain.layers, false), 1e-5, 1e-6);
}

TEST_CASE("a ResNet-18 with batch norm equals plain libtorch with one micro-batch") {
  engine sys;
  auto make = [] {
    torch::manual_seed(2);
    model_options o;
    o.num_classes = 5;
    return make_model("resnet18", o);
  };
  auto layers = make();
  pipeline_options o;
  o.loss = mse;
  o.optimizer = sgd(0.01);
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
  plain_model plain(make(), sgd(0.01));
  auto x = torch::randn({4, 3, 32, 32});
  auto t = torch::randn({4, 5});
  CHECK(pipe.train_step(x, t).loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
  // The two sides sum convolutions over 4x3x32x32 inputs with their own thread counts (each
  // stage its own, plain libtorch the caller's, which earlier tests in the same process
  // change): up to 2.2e-6 apart on conv1's weights (of size 0.2) after one step.
  check_close(pipe.named_parameters(), named(plain.layers, false), 1e-4, 1e-5);
  // Running statistics (buffers) went through the same forward.
  torch::NoGradGuard no_grad;
  for (auto& l : plain.layers) {
    if (auto m = l.module()) {
      m->eval();
    }
  }
  auto probe = torch::randn({2, 3, 32, 32});
  CHECK(torch::allclose(pipe.forward(probe), run_layers(plain.layers, probe), 1e-4, 1e-5));
}

TEST_CASE("a sum-reduced loss accumulates unscaled micro-batch losses") {
  engine sys;
  auto layers = tiny_mlp(4);
  auto sum_loss = [](const torch::Tensor& y, const torch::Tensor& t) {
    return torch::mse_loss(y, t, torch::Reduction::Sum);
  };
  pipeline_options o;
  o.microbatches = 3;
  o.loss = sum_loss;
  o.reduction = loss_reduction::sum;
  o.optimizer = sgd(0.01);
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
  auto plain = tiny_mlp(4);
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randn({8, 3});
  auto plain_loss = sum_loss(run_layers(plain, x), t);
  plain_loss.backward();
  CHECK(pipe.train_step(x, t).loss == doctest::Approx(plain_loss.item<double>()).epsilon(1e-5));
  check_close(pipe.named_gradients(), named(plain, true), 1e-5, 1e-6);
}

TEST_CASE("forward-only returns outputs per micro-batch or concatenated") {
  engine sys;
  auto layers = tiny_mlp(3);
  pipeline_options o;
  o.microbatches = 3;
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 3), o);
  auto plain = tiny_mlp(3);
  auto x = torch::randn({8, 1, 4, 4});
  auto parts = pipe.forward_scattered(x);
  REQUIRE(parts.size() == 3);
  CHECK(parts[0].size(0) == 3);
  CHECK(parts[2].size(0) == 2);
  torch::NoGradGuard no_grad;
  auto expected = run_layers(plain, x);
  CHECK(torch::allclose(pipe.forward(x), expected, 1e-5, 1e-6));
  CHECK_FALSE(pipe.forward(x).requires_grad());
}

TEST_CASE("1F1B stashes at most p - i micro-batches on stage i, GPipe all m") {
  engine sys;
  const std::size_t p = 4;
  for (std::size_t m : {2, 8}) {
    for (auto kind : {schedule_kind::gpipe, schedule_kind::one_f_one_b}) {
      CAPTURE(m);
      CAPTURE(to_string(kind));
      auto layers = tiny_mlp();
      pipeline_options o;
      o.microbatches = m;
      o.schedule = kind;
      o.loss = mse;
      o.optimizer = sgd(0.1);
      pipeline pipe(sys, layers, partition_uniform(layers.size(), p), o);
      auto r = pipe.train_step(torch::randn({16, 1, 4, 4}), torch::randn({16, 3}));
      REQUIRE(r.stages.size() == p);
      for (std::size_t i = 0; i < p; ++i) {
        CAPTURE(i);
        auto bound = kind == schedule_kind::gpipe ? m : std::min(p - i, m);
        CHECK(r.stages[i].peak_stash == bound);
      }
    }
  }
}

TEST_CASE("stage 0 forwards micro-batch k+1 while stage 1 works on micro-batch k") {
  // A rendezvous, not a timing: stage 0's forward of micro-batch 1 and stage 1's forward of
  // micro-batch 0 each wait (with a deadline) until the other has started. Both succeed only
  // if the two stages compute at the same time on different threads.
  std::promise<void> stage0_in_mb1;
  std::promise<void> stage1_in_mb0;
  auto f0 = stage0_in_mb1.get_future().share();
  auto f1 = stage1_in_mb0.get_future().share();
  std::atomic<int> stage0_calls{0};
  std::atomic<int> stage1_calls{0};
  std::atomic<bool> stage0_saw_overlap{false};
  std::atomic<bool> stage1_saw_overlap{false};
  layer_list layers;
  layers.emplace_back("gate0", [&](const torch::Tensor& x) {
    if (stage0_calls++ == 1) {
      stage0_in_mb1.set_value();
      stage0_saw_overlap = f1.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
    }
    return x * 2;
  });
  layers.emplace_back("gate1", [&](const torch::Tensor& x) {
    if (stage1_calls++ == 0) {
      stage1_in_mb0.set_value();
      stage1_saw_overlap = f0.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
    }
    return x + 1;
  });
  engine sys;
  pipeline_options o;
  o.microbatches = 4;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  pipeline pipe(sys, layers, partition_uniform(2, 2), o);
  auto r = pipe.train_step(torch::randn({8, 3}), torch::randn({8, 3}));
  CHECK(stage0_saw_overlap);
  CHECK(stage1_saw_overlap);
  CHECK(r.stages.size() == 2);
}

TEST_CASE("steps submitted together run one after another in order") {
  engine sys;
  auto layers = tiny_mlp(9);
  pipeline_options o;
  o.microbatches = 2;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
  plain_model plain(tiny_mlp(9), sgd(0.1));
  std::vector<torch::Tensor> xs;
  std::vector<torch::Tensor> ts;
  std::vector<std::future<step_result>> futures;
  for (int i = 0; i < 3; ++i) {
    xs.push_back(torch::randn({4, 1, 4, 4}));
    ts.push_back(torch::randn({4, 3}));
    futures.push_back(pipe.train_step_async(xs.back(), ts.back()));
  }
  for (int i = 0; i < 3; ++i) {
    REQUIRE(futures[i].wait_for(std::chrono::seconds(60)) == std::future_status::ready);
    auto r = futures[i].get();
    CHECK(r.step == static_cast<uint64_t>(i + 1));
    CHECK(r.loss == doctest::Approx(plain.step(xs[i], ts[i])).epsilon(1e-5));
  }
}

TEST_CASE("ZB-H1 and interleaved 1F1B give plain libtorch's gradients") {
  engine sys;
  auto x = torch::randn({12, 1, 4, 4});
  auto t = torch::randn({12, 3});
  // ZB-H1 over 1-4 stages and uneven micro-batches.
  for (std::size_t stages = 1; stages <= 4; ++stages) {
    for (std::size_t m : {1, 3, 5, 8}) {
      CAPTURE(stages);
      CAPTURE(m);
      auto layers = tiny_mlp();
      pipeline_options o;
      o.microbatches = m;
      o.schedule = schedule_kind::zb_h1;
      o.loss = mse;
      o.optimizer = sgd(0.1);
      pipeline pipe(sys, layers, partition_uniform(layers.size(), stages), o);
      plain_model plain(tiny_mlp(), sgd(0.1));
      CHECK(pipe.train_step(x, t).loss == doctest::Approx(plain.step(x, t)).epsilon(1e-6));
      check_close(pipe.named_gradients(), named(plain.layers, true));
      check_close(pipe.named_parameters(), named(plain.layers, false));
    }
  }
  // Interleaved: 2 or 3 stage actors with 2 chunks each (4 or 6 model parts).
  for (std::size_t stages : {2, 3}) {
    CAPTURE(stages);
    auto layers = tiny_mlp();
    pipeline_options o;
    o.microbatches = 2 * stages;
    o.schedule = schedule_kind::interleaved;
    o.chunks = 2;
    o.loss = mse;
    o.optimizer = sgd(0.1);
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 2 * stages), o);
    CHECK(pipe.stages() == stages);
    plain_model plain(tiny_mlp(), sgd(0.1));
    auto r = pipe.train_step(x, t);
    CHECK(r.loss == doctest::Approx(plain.step(x, t)).epsilon(1e-6));
    CHECK(r.stages.size() == stages);
    check_close(pipe.named_gradients(), named(plain.layers, true));
    check_close(pipe.named_parameters(), named(plain.layers, false));
    torch::NoGradGuard no_grad;
    CHECK(torch::allclose(pipe.forward(x), run_layers(plain.layers, x), 1e-5, 1e-6));
  }
}

TEST_CASE("a user-supplied schedule runs, and an invalid one is refused up front") {
  engine sys;
  auto layers = tiny_mlp();
  pipeline_options o;
  o.microbatches = 2;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  action f0{action_kind::forward, 0, 0};
  action f1{action_kind::forward, 1, 0};
  action b0{action_kind::backward, 0, 0};
  action b1{action_kind::backward, 1, 0};
  o.custom_schedule = {{f0, f1, b1, b0}, {f1, f0, b0, b1}}; // out of order, yet valid
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
  plain_model plain(tiny_mlp(), sgd(0.1));
  auto x = torch::randn({6, 1, 4, 4});
  auto t = torch::randn({6, 3});
  CHECK(pipe.train_step(x, t).loss == doctest::Approx(plain.step(x, t)).epsilon(1e-6));
  check_close(pipe.named_parameters(), named(plain.layers, false));
  o.custom_schedule = {{f0, b0, f1, b1}, {f1, f0, b1, b0}};
  CHECK_THROWS_WITH_AS(pipeline(sys, tiny_mlp(), partition_uniform(6, 2), o),
                       doctest::Contains("schedule deadlocks"), actorpipe::invalid_argument);
}

TEST_CASE("every stage reports its actions in order with times and bytes sent") {
  engine sys;
  auto layers = tiny_mlp();
  pipeline_options o;
  o.microbatches = 4;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
  auto r = pipe.train_step(torch::randn({8, 1, 4, 4}), torch::randn({8, 3}));
  auto expected = make_schedule(schedule_kind::one_f_one_b, 2, 4);
  for (std::size_t s = 0; s < 2; ++s) {
    CAPTURE(s);
    const auto& actions = r.stages[s].actions;
    REQUIRE(actions.size() == expected[s].size());
    for (std::size_t i = 0; i < actions.size(); ++i) {
      CHECK(actions[i].what == expected[s][i]);
      CHECK(actions[i].start_ms >= 0);
      CHECK(actions[i].end_ms >= actions[i].start_ms);
      CHECK(actions[i].end_ms <= r.wall_ms);
      if (i > 0) {
        CHECK(actions[i].start_ms >= actions[i - 1].end_ms);
      }
      bool sends = (s == 0 && actions[i].what.kind == action_kind::forward) ||
                   (s == 1 && actions[i].what.kind == action_kind::backward);
      // Stage 0 sends activations of 2 x 256 floats (fc1), stage 1 their gradients.
      CHECK(actions[i].bytes_sent == (sends ? 2 * 256 * 4 : 0));
    }
  }
}

TEST_CASE("micro-batches given already split train like the whole batch") {
  engine sys;
  auto layers = tiny_mlp(8);
  pipeline_options o;
  o.microbatches = 3;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
  plain_model plain(tiny_mlp(8), sgd(0.1));
  auto x = torch::randn({9, 1, 4, 4});
  auto t = torch::randn({9, 3});
  // Uneven parts of 2, 3 and 4 samples.
  auto xs = std::vector<torch::Tensor>{x.slice(0, 0, 2), x.slice(0, 2, 5), x.slice(0, 5, 9)};
  auto ts = std::vector<torch::Tensor>{t.slice(0, 0, 2), t.slice(0, 2, 5), t.slice(0, 5, 9)};
  CHECK(pipe.train_step(xs, ts).loss == doctest::Approx(plain.step(x, t)).epsilon(1e-6));
  check_close(pipe.named_parameters(), named(plain.layers, false));
  CHECK_THROWS_WITH_AS(
    pipe.train_step(std::vector<torch::Tensor>{x}, std::vector<torch::Tensor>{t}),
    doctest::Contains("1 input and 1 target micro-batches given for 3"),
    actorpipe::invalid_argument);
}

namespace {

// A loss that needs the inputs: MSE plus a penalty tying each output row's mean to its input's
// mean (per-sample, averaged over the micro-batch, as a mean-reduced loss must be).
torch::Tensor loss_with_inputs(const torch::Tensor& y, const torch::Tensor& t,
                               const torch::Tensor& x) {
  auto tie = (y.mean(1) - x.flatten(1).mean(1)).pow(2).mean();
  return mse(y, t) + 0.5 * tie;
}

} // namespace

TEST_CASE("a loss may see the micro-batch's inputs: every schedule, 1-3 stages, uneven "
          "micro-batches, equals plain libtorch with the same loss on the whole batch") {
  engine sys;
  auto x = torch::randn({10, 1, 4, 4});
  auto t = torch::randn({10, 3});
  for (auto setting : every_schedule()) {
    for (std::size_t stages = 1; stages <= 3; ++stages) {
      CAPTURE(to_string(setting.kind));
      CAPTURE(stages);
      auto layers = tiny_mlp(3);
      pipeline_options o;
      o.microbatches = 6; // 10 samples: uneven parts; a multiple of 1-3 stages (interleaved)
      o.schedule = setting.kind;
      o.chunks = setting.chunks;
      o.loss_with_inputs = loss_with_inputs;
      o.optimizer = sgd(0.1, 0.9);
      pipeline pipe(sys, layers, partition_uniform(layers.size(), stages * setting.chunks), o);
      auto plain_layers = tiny_mlp(3);
      auto optimizer = sgd(0.1, 0.9)(parameters_of(plain_layers));
      for (int step = 0; step < 2; ++step) {
        optimizer->zero_grad();
        auto plain_loss = loss_with_inputs(run_layers(plain_layers, x), t, x);
        plain_loss.backward();
        optimizer->step();
        CHECK(pipe.train_step(x, t).loss ==
              doctest::Approx(plain_loss.item<double>()).epsilon(1e-6));
      }
      check_close(pipe.named_parameters(), named(plain_layers, false));
    }
  }
  // The inputs' term is not negligible: without it the test would prove nothing.
  auto y0 = run_layers(tiny_mlp(3), x);
  CHECK(loss_with_inputs(y0, t, x).item<double>() > mse(y0, t).item<double>() + 1e-3);
  pipeline_options o;
  o.microbatches = 3;
  o.loss = mse;
  o.optimizer = sgd(0.1, 0.9);
  // One of the two losses, not both.
  o.loss_with_inputs = loss_with_inputs;
  CHECK_THROWS_WITH_AS(pipeline(sys, tiny_mlp(3), partition_uniform(6, 2), o),
                       doctest::Contains("both pipeline_options.loss and loss_with_inputs"),
                       actorpipe::invalid_argument);
}

TEST_CASE("64 stage actors of tiny layers in one process train like plain libtorch") {
  // 64 one-thread stage actors on a 2-core machine: the engine's own cost and correctness at
  // scale (docs/scaling.md), for 1F1B and ZB-H1 over 128 micro-batches, three steps. Under
  // ThreadSanitizer (every thread many times slower; this case took 148 s of CI) the same 64
  // actors run 32 micro-batches for two steps.
#if defined(__SANITIZE_THREAD__)
  const std::size_t microbatches = 32;
  const int steps = 2;
#else
  const std::size_t microbatches = 128;
  const int steps = 3;
#endif
  auto make = [] {
    torch::manual_seed(3);
    layer_list layers;
    for (int i = 0; i < 64; ++i) {
      layers.emplace_back("fc" + std::to_string(i), torch::nn::AnyModule(torch::nn::Linear(4, 4)));
      if (i % 2 == 1) {
        layers.emplace_back("tanh" + std::to_string(i),
                            [](const torch::Tensor& x) { return torch::tanh(x); });
      }
    }
    return layers;
  };
  engine sys;
  auto x = torch::randn({256, 4});
  auto t = torch::randn({256, 4});
  for (auto kind : {schedule_kind::one_f_one_b, schedule_kind::zb_h1}) {
    CAPTURE(to_string(kind));
    auto layers = make();
    pipeline_options o;
    o.microbatches = microbatches;
    o.schedule = kind;
    o.loss = mse;
    o.optimizer = sgd(0.5);
    o.threads_per_stage = 1;
    pipeline pipe(sys, layers, partition_by_params(layers, 64), o);
    CHECK(pipe.stages() == 64);
    plain_model plain(make(), sgd(0.5));
    for (int step = 0; step < steps; ++step) {
      auto result = pipe.train_step(x, t);
      auto plain_loss = plain.step(x, t);
      CHECK(result.loss == doctest::Approx(plain_loss).epsilon(1e-5));
      CHECK(result.stages.size() == 64);
    }
    check_close(pipe.named_parameters(), named(plain.layers, false), 1e-4, 1e-6);
  }
}
