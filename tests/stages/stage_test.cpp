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
  auto x0 = torch::randn({5, 4});
  auto x1 = torch::randn({5, 4});
  auto y0 = st.forward(0, x0);
  auto y1 = st.forward(1, x1);
  CHECK_FALSE(y0.requires_grad());
  CHECK(st.stash_size() == 2);
  auto g = st.backward(0, torch::ones_like(y0));
  CHECK(st.stash_size() == 1);
  CHECK(g.sizes() == x0.sizes());
  st.backward(1, torch::ones_like(y1));
  CHECK(st.stash_size() == 0);
  CHECK(st.peak_stash() == 2);
}

TEST_CASE("abort restores batch-norm statistics and drops gradients") {
  stages::stage_config config;
  config.count = 2;
  stages::stage st(config, two_linear());
  st.begin_step(true);
  auto y = st.forward(0, torch::randn({6, 4}) * 5 + 3);
  st.backward(0, torch::ones_like(y));
  CHECK(st.named_tensors(true)[0].second.defined());
  st.abort_step();
  CHECK_FALSE(st.named_tensors(true)[0].second.defined());
  // Running statistics are buffers: forward in train mode changed them, abort put them back.
  st.begin_step(false);
  auto probe = torch::randn({2, 4});
  auto reference = two_linear();
  reference[1].module()->eval();
  CHECK(torch::allclose(st.forward(0, probe), run_layers(reference, probe)));
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
                       doctest::Contains("gradient from stage 1 has shape [5, 2] but the stage's "
                                         "output has shape [5, 3]"),
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
