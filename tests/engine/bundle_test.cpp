// Several tensors per hop: bundles of float tensors in the graph, bool and integer tensors and a
// float tensor outside the graph cross every stage boundary, and training equals plain libtorch.
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

#include "oracle.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

namespace {

const std::vector<std::string> fields{"h", "g", "mask", "ids", "side"};

// The tensor `name` (position `index` when the bundle is positional).
const torch::Tensor& pick(const bundle& in, std::size_t index) {
  return in.is_named() ? in.at(fields[index]) : in[index];
}

// Shaped like its input: named if it was.
bundle shaped_like(const bundle& in, std::vector<torch::Tensor> tensors) {
  if (!in.is_named()) {
    return bundle(std::move(tensors));
  }
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    named.emplace_back(fields[i], tensors[i]);
  }
  return bundle::named(std::move(named));
}

// One tensor in, five out: two float tensors in the graph (h, g), a bool mask, int64 ids and a
// float tensor outside the graph (side).
struct FanOutImpl : torch::nn::Module {
  bool named = false;
  torch::nn::Linear fc{nullptr};
  explicit FanOutImpl(bool named_output) : named(named_output) {
    fc = register_module("fc", torch::nn::Linear(6, 8));
  }
  bundle forward(const bundle& in) {
    const auto& x = in.single("fan_out");
    auto h = fc(x);
    return shaped_like(
      named ? bundle::named({{"x", x}}) : bundle(x),
      {h, torch::tanh(h), x.select(1, 0) > 0, x.abs().argmax(1), x.detach().narrow(1, 0, 4) * 0.5});
  }
};
TORCH_MODULE(FanOut);

// Mixes the two paths under the mask; the mask, the ids and the side tensor pass through.
struct MixImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  MixImpl() {
    a = register_module("a", torch::nn::Linear(8, 8));
    b = register_module("b", torch::nn::Linear(8, 8));
  }
  bundle forward(const bundle& in) {
    auto mask = pick(in, 2).to(torch::kFloat).unsqueeze(1);
    auto h = a(pick(in, 0)) * mask + pick(in, 1) * (1 - mask);
    auto g = torch::relu(b(pick(in, 1))) + pick(in, 4).sum(1, true);
    return shaped_like(in, {h, g, pick(in, 2), pick(in, 3), pick(in, 4)});
  }
};
TORCH_MODULE(Mix);

// Both paths and an embedding of the ids: one tensor out.
struct JoinImpl : torch::nn::Module {
  torch::nn::Linear out{nullptr};
  torch::nn::Embedding embed{nullptr};
  JoinImpl() {
    out = register_module("out", torch::nn::Linear(8, 3));
    embed = register_module("embed", torch::nn::Embedding(6, 3));
  }
  bundle forward(const bundle& in) { return out(pick(in, 0) + pick(in, 1)) + embed(pick(in, 3)); }
};
TORCH_MODULE(Join);

layer_list bundle_model(bool named, uint64_t seed = 3) {
  torch::manual_seed(seed);
  layer_list layers;
  layers.push_back(layer::over_bundles("fan_out", torch::nn::AnyModule(FanOut(named))));
  for (int i = 1; i <= 3; ++i) {
    layers.push_back(layer::over_bundles("mix" + std::to_string(i), torch::nn::AnyModule(Mix())));
  }
  layers.push_back(layer::over_bundles("join", torch::nn::AnyModule(Join())));
  return layers;
}

} // namespace

TEST_CASE("bundles with float, bool and integer tensors train like plain libtorch for every "
          "schedule, 1-4 stages and uneven micro-batches") {
  engine sys;
  torch::manual_seed(21);
  auto x = torch::randn({10, 6});
  auto t = torch::randn({10, 3});
  for (bool with_names : {false, true}) {
    for (auto [kind, chunks] : every_schedule()) {
      for (std::size_t stages = 1; stages <= 4; ++stages) {
        if (stages * chunks > 5) {
          continue;
        }
        for (std::size_t m : {1, 3, 4}) {
          if (!takes_microbatches(kind, stages, m)) {
            continue;
          }
          CAPTURE(with_names);
          CAPTURE(to_string(kind));
          CAPTURE(stages);
          CAPTURE(m);
          auto layers = bundle_model(with_names);
          pipeline_options o;
          o.microbatches = m;
          o.schedule = kind;
          o.chunks = chunks;
          o.loss = mse;
          o.optimizer = sgd(0.1, 0.9);
          pipeline pipe(sys, layers, partition_uniform(layers.size(), stages * chunks), o);
          plain_model plain(bundle_model(with_names), sgd(0.1, 0.9));
          for (int step = 0; step < 2; ++step) {
            auto result = pipe.train_step(x, t);
            CHECK(result.loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
          }
          check_close(pipe.named_parameters(), named(plain.layers, false), 1e-5, 1e-6);
        }
      }
    }
  }
}

TEST_CASE("with recomputation, bundles keep which tensors need a gradient, and training still "
          "equals plain libtorch") {
  engine sys;
  torch::manual_seed(22);
  auto x = torch::randn({9, 6});
  auto t = torch::randn({9, 3});
  for (auto mode : {recompute_mode::except_last, recompute_mode::always}) {
    for (auto kind : {schedule_kind::one_f_one_b, schedule_kind::zb_h1}) {
      CAPTURE(to_string(mode));
      CAPTURE(to_string(kind));
      auto layers = bundle_model(true);
      pipeline_options o;
      o.microbatches = 3;
      o.schedule = kind;
      o.recompute = mode;
      o.loss = mse;
      o.optimizer = sgd(0.1, 0.9);
      pipeline pipe(sys, layers, partition_uniform(layers.size(), 3), o);
      plain_model plain(bundle_model(true), sgd(0.1, 0.9));
      for (int step = 0; step < 2; ++step) {
        CHECK(pipe.train_step(x, t).loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
      }
      check_close(pipe.named_parameters(), named(plain.layers, false), 1e-5, 1e-6);
    }
  }
}

TEST_CASE("only the tensors that need a gradient get one back, and the bytes sent say so") {
  engine sys;
  auto layers = bundle_model(false);
  pipeline_options o;
  o.microbatches = 2;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  pipeline pipe(sys, layers, partition_at(layers.size(), {1}), o);
  auto result = pipe.train_step(torch::randn({4, 6}), torch::randn({4, 3}));
  // Per micro-batch of 2: the activation is h, g (2x8 floats each), mask (2 bools), ids (2
  // int64) and side (2x4 floats); the gradient only h and g.
  int64_t activation = 2 * 8 * 4 * 2 + 2 + 2 * 8 + 2 * 4 * 4;
  int64_t gradient = 2 * 8 * 4 * 2;
  int64_t forward_bytes = 0;
  int64_t backward_bytes = 0;
  for (const auto& a : result.stages[0].actions) {
    forward_bytes += a.what.kind == action_kind::forward ? a.bytes_sent : 0;
  }
  for (const auto& a : result.stages[1].actions) {
    backward_bytes += a.what.kind == action_kind::backward ? a.bytes_sent : 0;
  }
  CHECK(forward_bytes == 2 * activation);
  CHECK(backward_bytes == 2 * gradient);
}

TEST_CASE("a one-tensor layer given a bundle fails the step naming the stage, the layer and the "
          "bundle, and changes nothing") {
  engine sys;
  auto layers = bundle_model(true);
  layers.insert(layers.begin() + 1, layer("fc", torch::nn::AnyModule(torch::nn::Linear(8, 8))));
  pipeline_options o;
  o.microbatches = 2;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  pipeline pipe(sys, layers, partition_at(layers.size(), {1}), o);
  auto before = pipe.named_parameters();
  try {
    pipe.train_step(torch::randn({4, 6}), torch::randn({4, 3}));
    FAIL("the step did not fail");
  } catch (const pipeline_error& e) {
    CHECK(e.kind() == error_kind::shape_mismatch);
    CHECK(e.stage() == std::optional<std::size_t>(1));
    CHECK(e.microbatch() == std::optional<int32_t>(0));
    CHECK_MESSAGE(std::string(e.what()).find(
                    "layer 'fc' (model layer 1) takes one tensor, but the activation from stage "
                    "0 is a bundle of 5: (h: Float[2, 8] grad, g: Float[2, 8] grad, mask: "
                    "Bool[2], ids: Long[2], side: Float[2, 4])") != std::string::npos,
                  e.what());
  }
  check_close(pipe.named_parameters(), before, 0, 0);
}
