#include <doctest/doctest.h>

#include <torch/torch.h>

#include <actorpipe/errors.hpp>

#include "stages/stage.hpp"

using namespace actorpipe;

namespace {

layer_list two_linear() {
  torch::manual_seed(0);
  layer_list layers;
  layers.emplace_back("fc", torch::nn::AnyModule(torch::nn::Linear(4, 3)));
  layers.emplace_back("bn", torch::nn::AnyModule(torch::nn::BatchNorm1d(3)));
  return layers;
}

} // namespace

TEST_CASE("a middle stage stashes each forward until its backward and returns input gradients") {
  stages::stage_config config;
  config.index = 1;
  config.count = 3;
  stages::stage st(config, two_linear());
  st.begin_step(true);
  // Flagged as the previous stage flags its outputs: they need their gradients back.
  auto x0 = torch::randn({5, 4}).requires_grad_(true);
  auto x1 = torch::randn({5, 4}).requires_grad_(true);
  auto y0 = st.forward(0, x0)[0];
  auto y1 = st.forward(1, x1)[0];
  // Detached (no graph leaves the stage), but flagged: the next stage sends its gradient back.
  CHECK(y0.grad_fn() == nullptr);
  CHECK(y0.requires_grad());
  CHECK(st.stash_size() == 2);
  auto g = st.backward(0, torch::ones_like(y0));
  CHECK(st.stash_size() == 1);
  REQUIRE(g.size() == 1);
  CHECK(g[0].sizes() == x0.sizes());
  st.backward(1, torch::ones_like(y1));
  CHECK(st.stash_size() == 0);
  CHECK(st.peak_stash() == 2);
}

TEST_CASE("abort restores batch-norm statistics and drops gradients") {
  stages::stage_config config;
  config.count = 2;
  stages::stage st(config, two_linear());
  st.begin_step(true);
  auto y = st.forward(0, torch::randn({6, 4}) * 5 + 3)[0];
  st.backward(0, torch::ones_like(y));
  CHECK(st.named_tensors(true)[0].second.defined());
  st.abort_step();
  CHECK_FALSE(st.named_tensors(true)[0].second.defined());
  // Running statistics are buffers: forward in train mode changed them, abort put them back.
  st.begin_step(false);
  auto probe = torch::randn({2, 4});
  auto reference = two_linear();
  reference[1].module()->eval();
  CHECK(torch::allclose(st.forward(0, probe)[0], run_layers(reference, probe)));
}

TEST_CASE("a backward without its forward and a wrongly shaped gradient are errors") {
  stages::stage_config config;
  config.index = 0;
  config.count = 2;
  stages::stage st(config, two_linear());
  st.begin_step(true);
  CHECK_THROWS_WITH_AS(
    st.backward(4, torch::ones({5, 3})),
    doctest::Contains("stage 0, microbatch 4: backward without a stashed forward"),
    actorpipe::pipeline_error);
  st.forward(0, torch::randn({5, 4}));
  CHECK_THROWS_WITH_AS(st.backward(0, torch::ones({5, 2})),
                       doctest::Contains("the gradient from stage 1 for output tensor 0 has "
                                         "shape [5, 2] but the output has shape [5, 3]"),
                       actorpipe::pipeline_error);
}

TEST_CASE("a forward the first layer cannot take names stage, micro-batch, layer and shapes") {
  stages::stage_config config;
  config.index = 2;
  config.count = 3;
  config.first_layer = 7;
  stages::stage st(config, two_linear());
  st.begin_step(true);
  CHECK_THROWS_WITH_AS(st.forward(3, torch::randn({5, 9})),
                       doctest::Contains("stage 2, microbatch 3: layer 'fc' (model layer 7) cannot "
                                         "take the activation from stage 1 of shape [5, 9]; it "
                                         "expects [*, 4]"),
                       actorpipe::pipeline_error);
  CHECK(st.stash_size() == 0);
}

TEST_CASE("a stage sends gradients back for exactly the inputs flagged as needing one, and refuses "
          "a gradient bundle of another layout, naming the tensor, with the stash kept") {
  torch::manual_seed(4);
  torch::nn::Linear fc(4, 3);
  layer_list layers;
  // Two float inputs (only the first flagged) and a bool mask in; two float outputs, only the
  // first reached by the graph.
  layers.emplace_back("mix", bundle_function([fc](const bundle& in) mutable {
                        return bundle(std::vector<torch::Tensor>{
                          fc(in[0]) * in[2].to(torch::kFloat).unsqueeze(1), in[1] * 2});
                      }));
  stages::stage_config config;
  config.index = 1;
  config.count = 3;
  stages::stage st(config, layers);
  st.begin_step(true);
  auto a = torch::randn({5, 4}).requires_grad_(true);
  auto c = torch::randn({5, 4});
  auto mask = torch::tensor({true, false, true, true, false});
  auto out = st.forward(0, bundle({a, c, mask}));
  REQUIRE(out.size() == 2);
  CHECK(out[0].requires_grad());
  CHECK_FALSE(out[1].requires_grad());
  CHECK(out.differentiable_count() == 1);
  CHECK_THROWS_WITH_AS(st.backward(0, bundle({torch::ones({5, 3}), torch::ones({5, 4})})),
                       doctest::Contains("stage 1, microbatch 0: the gradients from stage 2 are 2 "
                                         "tensors, but 1 of the stage's outputs need one (tensor "
                                         "0)"),
                       actorpipe::pipeline_error);
  CHECK_THROWS_WITH_AS(st.backward(0, bundle(torch::ones({5, 4}))),
                       doctest::Contains("for output tensor 0 has shape [5, 4] but the output has "
                                         "shape [5, 3]"),
                       actorpipe::pipeline_error);
  CHECK(st.stash_size() == 1);
  auto g = torch::randn({5, 3});
  auto grads = st.backward(0, bundle(g));
  REQUIRE(grads.size() == 1);
  auto expected = torch::matmul(g * mask.to(torch::kFloat).unsqueeze(1), fc->weight).detach();
  CHECK(torch::allclose(grads[0], expected, 1e-5, 1e-6));
  CHECK(st.stash_size() == 0);
}

TEST_CASE("a bundle names its tensors, refuses names given twice, and describes itself") {
  auto b = bundle::named({{"hidden", torch::zeros({2, 3}).requires_grad_(true)},
                          {"mask", torch::ones({2}, torch::kBool)}});
  CHECK(b.contains("mask"));
  CHECK(b.at("hidden").size(1) == 3);
  CHECK(b.describe() == "(hidden: Float[2, 3] grad, mask: Bool[2])");
  CHECK_THROWS_WITH_AS(b.at("positions"),
                       doctest::Contains("no tensor named 'positions' (it has "
                                         "hidden, mask)"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(bundle::named({{"x", torch::ones({1})}, {"x", torch::ones({1})}}),
                       doctest::Contains("the name 'x' is empty or given twice"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(b.single("the loss"),
                       doctest::Contains("the loss takes one tensor, not a "
                                         "bundle of 2"),
                       std::invalid_argument);
  bundle one(torch::ones({4}));
  CHECK(one.single("x").numel() == 4);
  CHECK(one.describe() == "Float[4]");
}
