// BMUF (Caffe2's block-wise model update filtering) over replicas, and DataParallel's forward.
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <actorpipe/batch_norm.hpp>
#include <actorpipe/data.hpp>

#include "replicas_fixtures.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

namespace {

// Caffe2's Parallelize_BMUF written out for R plain libtorch models, as its comments state it:
// each model steps its own SGD; after the warm-up every model takes model 0's parameters; after
// each block, per parameter, v = mu v + lr_b (mean(x) - g), g = g + v (Nesterov: g = g - mu (v -
// v_prev), v_prev = v), and every model's x = g; reset_momentum zeroes the SGD momentum buffers.
struct bmuf_reference {
  std::vector<std::unique_ptr<plain_model>> models;
  bmuf_options o;
  double mu;
  std::vector<torch::Tensor> global, momentum, previous;
  int64_t position = 0;
  bool warm;

  bmuf_reference(std::size_t replicas, const bmuf_options& options)
    : o(options), mu(options.block_momentum < 0 ? 1.0 - 1.0 / static_cast<double>(replicas)
                                                : options.block_momentum),
      warm(options.warmup_steps == 0) {
    for (std::size_t r = 0; r < replicas; ++r) {
      models.push_back(std::make_unique<plain_model>(tiny_mlp(1), sgd(0.1, 0.9)));
    }
    start();
  }
  std::vector<torch::Tensor> params(std::size_t r) const {
    return models[r]->optimizer->param_groups().front().params();
  }
  void start() {
    global.clear();
    momentum.clear();
    previous.clear();
    for (const auto& p : params(0)) {
      global.push_back(p.detach().clone());
      momentum.push_back(torch::zeros_like(p));
      previous.push_back(torch::zeros_like(p));
    }
  }
  // One step of every model on its part of the batch; model 0's loss.
  double step(const torch::Tensor& x, const torch::Tensor& t) {
    auto xs = torch::tensor_split(x, static_cast<int64_t>(models.size()), 0);
    auto ts = torch::tensor_split(t, static_cast<int64_t>(models.size()), 0);
    double first = 0;
    for (std::size_t r = 0; r < models.size(); ++r) {
      auto loss = models[r]->step(xs[r], ts[r]);
      first = r == 0 ? loss : first;
    }
    ++position;
    if (position == (warm ? o.block_steps : o.warmup_steps)) {
      end_block();
    }
    return first;
  }
  void end_block() {
    torch::NoGradGuard no_grad;
    if (!warm) {
      for (std::size_t r = 1; r < models.size(); ++r) {
        for (std::size_t i = 0; i < global.size(); ++i) {
          params(r)[i].copy_(params(0)[i]);
        }
      }
      start();
      warm = true;
    } else if (position > 0) {
      for (std::size_t i = 0; i < global.size(); ++i) {
        auto mean = torch::zeros_like(global[i]);
        for (std::size_t r = 0; r < models.size(); ++r) {
          mean += params(r)[i];
        }
        mean /= static_cast<double>(models.size());
        momentum[i] = mu * momentum[i] + o.block_lr * (mean - global[i]);
        global[i] = global[i] + momentum[i];
        if (o.nesterov) {
          global[i] = global[i] - mu * (momentum[i] - previous[i]);
          previous[i] = momentum[i].clone();
        }
        for (std::size_t r = 0; r < models.size(); ++r) {
          params(r)[i].copy_(global[i]);
        }
      }
    }
    if (o.reset_momentum) {
      for (auto& m : models) {
        for (auto& [key, state] : m->optimizer->state()) {
          static_cast<torch::optim::SGDParamState&>(*state).momentum_buffer().zero_();
        }
      }
    }
    position = 0;
  }
};

} // namespace

TEST_CASE("BMUF: replicas train alone for a block, then average with block momentum, like a "
          "reference implementation of Caffe2's algorithm") {
  struct setting {
    std::size_t replicas;
    bmuf_options bmuf;
  };
  std::vector<setting> settings(3);
  settings[0] = {2, {}};
  settings[0].bmuf.block_steps = 2; // block lr 1, block momentum 1 - 1/2
  settings[1] = {3, {}};
  settings[1].bmuf.block_steps = 3;
  settings[1].bmuf.block_lr = 0.8;
  settings[1].bmuf.block_momentum = 0.6;
  settings[1].bmuf.nesterov = true;
  settings[1].bmuf.reset_momentum = true;
  settings[2] = {2, {}};
  settings[2].bmuf.block_steps = 2;
  settings[2].bmuf.warmup_steps = 2;
  settings[2].bmuf.nesterov = true;
  engine sys;
  for (const auto& [replicas, bmuf] : settings) {
    CAPTURE(replicas);
    CAPTURE(bmuf.block_steps);
    CAPTURE(bmuf.warmup_steps);
    auto o = mlp_options(2);
    o.data_parallel.bmuf = bmuf;
    replicated_pipeline pipes(
      sys, [] { return tiny_mlp(1); }, partition_uniform(6, 2), o, replicas);
    bmuf_reference reference(replicas, bmuf);
    // 7 steps: blocks end inside the run, and end_block ends the last, partial one.
    for (int step = 0; step < 7; ++step) {
      auto x = torch::randn({4 * static_cast<int64_t>(replicas), 1, 4, 4});
      auto t = torch::randn({4 * static_cast<int64_t>(replicas), 3});
      auto r = pipes.train_step(x, t);
      CHECK(r.loss == doctest::Approx(reference.step(x, t)).epsilon(1e-5));
      for (const auto& s : r.stages) {
        CHECK(s.sync_bytes == 0); // no gradient all-reduce
      }
    }
    // Mid-block the replicas differ; a block's end makes them equal.
    REQUIRE(reference.position > 0);
    CHECK_FALSE(torch::allclose(pipes.replica(0).named_parameters()[0].second,
                                pipes.replica(1).named_parameters()[0].second));
    pipes.end_block();
    reference.end_block();
    for (std::size_t r = 0; r < replicas; ++r) {
      check_close(pipes.replica(r).named_parameters(), named(reference.models[r]->layers, false));
    }
    // Nothing to end right after a block's end.
    pipes.end_block();
    check_close(pipes.replica(0).named_parameters(), named(reference.models[0]->layers, false));
  }
}

TEST_CASE("BMUF options are checked, and BMUF refuses synchronised batch norm") {
  engine sys;
  auto refused = [&](const std::function<void(pipeline_options&)>& change, const char* message) {
    auto o = mlp_options(1);
    o.data_parallel.replicas = 2;
    o.data_parallel.bmuf.block_steps = 2;
    change(o);
    CAPTURE(message);
    CHECK_THROWS_WITH_AS(pipeline(sys, tiny_mlp(1), partition_uniform(6, 2), o),
                         doctest::Contains(message), invalid_argument);
  };
  refused([](pipeline_options& o) { o.data_parallel.replicas = 1; }, "BMUF needs replicas");
  refused([](pipeline_options& o) { o.data_parallel.bmuf.block_steps = -1; },
          "bmuf.block_steps (-1) must be >= 1");
  refused([](pipeline_options& o) { o.data_parallel.bmuf.block_momentum = 1; },
          "bmuf.block_momentum (1) must be below 1");
  refused([](pipeline_options& o) { o.data_parallel.bmuf.block_lr = 0; },
          "bmuf.block_lr (0) must be > 0");
  refused([](pipeline_options& o) { o.data_parallel.bmuf.warmup_steps = -2; },
          "bmuf.warmup_steps (-2) must be >= 0");
  refused([](pipeline_options& o) { o.data_parallel.sync_batch_norm = true; },
          "their batch norms cannot synchronise");
}

TEST_CASE("DataParallel's forward: every replica runs its part, outputs gathered or left "
          "scattered, inputs already scattered, and a step on scattered parts of any sizes "
          "equals plain libtorch on their concatenation") {
  engine sys;
  auto o = mlp_options(2);
  // Which stage threads produced how many output rows (the last stage's forward-only hook).
  std::mutex mutex;
  std::map<std::thread::id, int64_t> rows;
  o.hooks.after_forward = [&](const hook_context& where, torch::Tensor& output) {
    if (where.stage == 1 && !where.train) {
      std::lock_guard<std::mutex> lock(mutex);
      rows[std::this_thread::get_id()] += output.size(0);
    }
  };
  replicated_pipeline replicas(
    sys, [] { return tiny_mlp(5); }, partition_uniform(6, 2), o, 3);
  auto plain = tiny_mlp(5);
  auto x = torch::randn({10, 1, 4, 4});
  auto expected = run_layers(plain, x);
  auto sizes_of = [](const std::vector<torch::Tensor>& parts) {
    std::multiset<int64_t> sizes;
    for (const auto& p : parts) {
      sizes.insert(p.size(0));
    }
    return sizes;
  };
  auto thread_rows = [&] {
    std::multiset<int64_t> sizes;
    for (const auto& [id, n] : rows) {
      sizes.insert(n);
    }
    rows.clear();
    return sizes;
  };

  // Gathered: the batch split 4, 3, 3 over the three replicas' own stage threads.
  CHECK(torch::allclose(replicas.forward(x), expected, 1e-5, 1e-6));
  CHECK(thread_rows() == std::multiset<int64_t>{4, 3, 3});
  // Scattered: replica r's outputs for its part, in order.
  auto scattered = replicas.forward_scattered(x);
  REQUIRE(scattered.size() == 3);
  CHECK(torch::allclose(scattered[0], expected.slice(0, 0, 4), 1e-5, 1e-6));
  CHECK(torch::allclose(scattered[2], expected.slice(0, 7, 10), 1e-5, 1e-6));
  CHECK(thread_rows() == std::multiset<int64_t>{4, 3, 3});
  // Fewer samples than replicas: the first two replicas.
  CHECK(sizes_of(replicas.forward_scattered(x.slice(0, 0, 2))) == std::multiset<int64_t>{1, 1});
  CHECK(thread_rows() == std::multiset<int64_t>{1, 1});
  // Inputs already scattered, uneven: 1, 5 and 4 samples.
  std::vector<torch::Tensor> parts{x.slice(0, 0, 1), x.slice(0, 1, 6), x.slice(0, 6, 10)};
  CHECK(torch::allclose(replicas.forward(parts), expected, 1e-5, 1e-6));
  CHECK(thread_rows() == std::multiset<int64_t>{1, 5, 4});
  auto kept = replicas.forward_scattered(parts);
  CHECK(kept[1].size(0) == 5);
  CHECK(torch::allclose(kept[1], expected.slice(0, 1, 6), 1e-5, 1e-6));
  thread_rows();

  // Training on scattered parts of 2, 5 and 3 samples equals one model on all 10.
  plain_model reference(tiny_mlp(5), sgd(0.1, 0.9));
  for (int step = 0; step < 3; ++step) {
    auto xb = torch::randn({10, 1, 4, 4});
    auto tb = torch::randn({10, 3});
    auto r =
      replicas.train_step_scattered({xb.slice(0, 0, 2), xb.slice(0, 2, 7), xb.slice(0, 7, 10)},
                                    {tb.slice(0, 0, 2), tb.slice(0, 2, 7), tb.slice(0, 7, 10)});
    CHECK(r.loss == doctest::Approx(reference.step(xb, tb)).epsilon(1e-6));
  }
  for (std::size_t k = 0; k < 3; ++k) {
    check_close(replicas.replica(k).named_parameters(), named(reference.layers, false));
  }

  // Bad parts are named.
  CHECK_THROWS_WITH_AS(replicas.forward_scattered(std::vector<torch::Tensor>(4, x)),
                       doctest::Contains("4 scattered parts for 3 replicas"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(replicas.forward(std::vector<torch::Tensor>{x, x.slice(0, 0, 0)}),
                       doctest::Contains("part 1 holds no samples"), actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(replicas.train_step_scattered({x, x}, {x, x}),
                       doctest::Contains("2 input and 2 target parts for 3 replicas"),
                       actorpipe::invalid_argument);
  auto t = torch::randn({10, 3});
  CHECK_THROWS_WITH_AS(
    replicas.train_step_scattered({x, x, x.slice(0, 0, 4)}, {t, t, t}),
    doctest::Contains("part 2 needs inputs and targets with the same, non-zero number of samples"),
    actorpipe::invalid_argument);
}
