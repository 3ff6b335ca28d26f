// Activation recomputation: the same gradients, dropout masks and batch-norm statistics as
// keeping every activation, for every schedule.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

#include "oracle.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

namespace {

struct run_result {
  std::vector<double> losses;
  std::vector<std::pair<std::string, torch::Tensor>> gradients;
  std::vector<std::pair<std::string, torch::Tensor>> parameters;
  torch::Tensor eval_output;
  // Forwards recomputed per stage actor, in the last step.
  std::vector<std::size_t> recomputed;
};

// Trains `steps` steps of `make()` cut into `parts` parts; the generator is seeded before every
// step so that dropout draws alike in both runs compared.
template <class Make>
run_result train(engine& sys, Make make, std::size_t parts, pipeline_options o,
                 const torch::Tensor& x, const torch::Tensor& t, int steps = 2) {
  auto layers = make();
  pipeline pipe(sys, layers, partition_uniform(layers.size(), parts), o);
  run_result r;
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(100 + step);
    auto result = pipe.train_step(x, t);
    r.losses.push_back(result.loss);
    r.recomputed.clear();
    for (const auto& s : result.stages) {
      r.recomputed.push_back(s.recomputed);
    }
    if (step + 1 < steps) {
      continue;
    }
    r.gradients = pipe.named_gradients();
  }
  r.parameters = pipe.named_parameters();
  r.eval_output = pipe.forward(x);
  return r;
}

void check_same(const run_result& a, const run_result& b, double rtol = 1e-6, double atol = 1e-7) {
  REQUIRE(a.losses.size() == b.losses.size());
  for (std::size_t i = 0; i < a.losses.size(); ++i) {
    CHECK(a.losses[i] == doctest::Approx(b.losses[i]).epsilon(1e-6));
  }
  check_close(a.gradients, b.gradients, rtol, atol);
  check_close(a.parameters, b.parameters, rtol, atol);
  // Running statistics (eval mode) updated once per micro-batch, as without recomputation.
  CHECK(torch::allclose(a.eval_output, b.eval_output, rtol, atol));
}

} // namespace

TEST_CASE("recomputation gives the gradients of keeping every activation, for every schedule, "
          "1-3 stages, except_last and always") {
  engine sys;
  torch::manual_seed(3);
  auto x = torch::randn({10, 1, 4, 4});
  auto t = torch::randn({10, 3});
  for (auto [kind, chunks] : every_schedule()) {
    for (std::size_t stages = 1; stages <= 3; ++stages) {
      CAPTURE(to_string(kind));
      CAPTURE(stages);
      pipeline_options o;
      o.microbatches = microbatches_for(kind, stages, 3);
      o.schedule = kind;
      o.chunks = chunks;
      o.loss = mse;
      o.optimizer = sgd(0.1, 0.9);
      auto kept = train(
        sys, [] { return tiny_mlp(); }, stages * chunks, o, x, t);
      for (auto mode : {recompute_mode::except_last, recompute_mode::always}) {
        CAPTURE(to_string(mode));
        o.recompute = mode;
        auto recomputed = train(
          sys, [] { return tiny_mlp(); }, stages * chunks, o, x, t);
        check_same(recomputed, kept);
        // Each actor runs m forwards per chunk; except_last keeps each chunk's last.
        auto m = o.microbatches;
        auto expected = mode == recompute_mode::always ? m * chunks : (m - 1) * chunks;
        for (auto count : recomputed.recomputed) {
          CHECK(count == expected);
        }
        for (auto count : kept.recomputed) {
          CHECK(count == 0);
        }
      }
    }
  }
}

TEST_CASE("recomputation counts every micro-batch once in batch-norm statistics, deferred or "
          "not") {
  engine sys;
  torch::manual_seed(4);
  auto x = torch::randn({6, 3, 16, 16});
  auto t = torch::randn({6, 5});
  for (bool deferred : {false, true}) {
    CAPTURE(deferred);
    auto make = [deferred] {
      torch::manual_seed(2);
      model_options m;
      m.num_classes = 5;
      m.deferred_batch_norm = deferred;
      return make_model("resnet18", m);
    };
    pipeline_options o;
    o.microbatches = 3;
    o.loss = mse;
    o.optimizer = sgd(0.01);
    auto kept = train(sys, make, 2, o, x, t);
    o.recompute = recompute_mode::always;
    check_same(train(sys, make, 2, o, x, t), kept, 1e-5, 1e-6);
  }
}

TEST_CASE("dropout draws the same masks in a forward and in its recomputation") {
  engine sys;
  torch::manual_seed(5);
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randn({8, 3});
  auto make = [] {
    torch::manual_seed(6);
    layer_list layers;
    layers.emplace_back("flatten", [](const torch::Tensor& v) { return v.flatten(1); });
    layers.emplace_back("fc1", torch::nn::AnyModule(torch::nn::Linear(16, 32)));
    layers.emplace_back("dropout", torch::nn::AnyModule(torch::nn::Dropout(0.5)));
    layers.emplace_back("relu", [](const torch::Tensor& v) { return torch::relu(v); });
    layers.emplace_back("fc2", torch::nn::AnyModule(torch::nn::Linear(32, 3)));
    return layers;
  };
  pipeline_options o;
  o.microbatches = 4;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  // Only stage 0 draws: its forwards draw in micro-batch order in both runs.
  auto kept = train(sys, make, 2, o, x, t);
  o.recompute = recompute_mode::always;
  auto recomputed = train(sys, make, 2, o, x, t);
  check_same(recomputed, kept);
  // The masks mattered: without dropout the gradients differ.
  o.recompute = recompute_mode::never;
  auto without = train(
    sys,
    [&] {
      auto layers = make();
      layers[2] = layer("dropout", [](const torch::Tensor& v) { return v; });
      return layers;
    },
    2, o, x, t);
  CHECK_FALSE(torch::allclose(without.gradients[0].second, kept.gradients[0].second));
}

TEST_CASE("recomputation shrinks what a stage stashes: a 4-stage gpt at 8 micro-batches keeps "
          "over 2x less on stage 0, its inputs and one rebuilt micro-batch") {
  engine sys;
  auto make = [] { return test_gpt(16, 6, 32, 16, 5); };
  torch::manual_seed(6);
  auto x = torch::randint(16, {16, 16});
  auto t = torch::randint(16, {16, 16});
  std::map<recompute_mode, std::vector<int64_t>> bytes;
  std::map<recompute_mode, double> losses;
  for (auto mode : {recompute_mode::never, recompute_mode::except_last, recompute_mode::always}) {
    pipeline_options o;
    o.microbatches = 8;
    o.schedule = schedule_kind::gpipe;
    o.loss = builtin_loss("cross_entropy");
    o.optimizer = sgd(0.1);
    o.recompute = mode;
    auto layers = make();
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 4), o);
    for (int step = 0; step < 2; ++step) {
      auto r = pipe.train_step(x, t);
      losses[mode] = r.loss;
      bytes[mode].clear();
      for (const auto& s : r.stages) {
        bytes[mode].push_back(s.peak_stash_bytes);
      }
    }
  }
  CAPTURE(bytes[recompute_mode::never]);
  CAPTURE(bytes[recompute_mode::except_last]);
  CAPTURE(bytes[recompute_mode::always]);
  // Kept, stage 0 holds 8 micro-batches' graphs; recomputed, 8 micro-batches of token ids and
  // one rebuilt graph.
  auto never = bytes[recompute_mode::never][0];
  auto always = bytes[recompute_mode::always][0];
  CHECK(always > 0);
  CHECK(never >= 2 * always);
  // Every stage keeps less. Recomputed, a stage holds 8 inputs and, while it backs one up,
  // that micro-batch's rebuilt activations: 7 inputs and 1/8 of keeping all (the planner's
  // stashed_bytes). Inputs: 2 rows of 16 token ids, then 2 x 16 x 32 floats.
  for (std::size_t s = 0; s < 4; ++s) {
    CAPTURE(s);
    auto never_s = static_cast<double>(bytes[recompute_mode::never][s]);
    double input = s == 0 ? 2 * 16 * 8 : 2 * 16 * 32 * 4;
    CHECK(bytes[recompute_mode::always][s] < bytes[recompute_mode::never][s]);
    CHECK(static_cast<double>(bytes[recompute_mode::always][s]) ==
          doctest::Approx(never_s / 8 + 7 * input).epsilon(0.01));
    // GPipe backs the last micro-batch up first: except_last's whole one is gone before the
    // first rebuild, so its peak is always's.
    CHECK(bytes[recompute_mode::except_last][s] >= bytes[recompute_mode::always][s]);
    CHECK(bytes[recompute_mode::except_last][s] < bytes[recompute_mode::never][s]);
  }
  CHECK(losses[recompute_mode::always] ==
        doctest::Approx(losses[recompute_mode::never]).epsilon(1e-6));
}
