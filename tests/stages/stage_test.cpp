#include <atomic>

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

namespace {

// Identity whose backward counts its calls: how often a backward pass runs through it.
std::atomic<int> identity_backwards{0};
struct counting_identity : torch::autograd::Function<counting_identity> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x * 1;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    ++identity_backwards;
    return {g[0]};
  }
};

// y = x (2 w)^T: the weight the matmul sees is computed from the parameter, off the input path.
struct DoubledLinearImpl : torch::nn::Module {
  DoubledLinearImpl() { weight = register_parameter("weight", torch::randn({6, 6}) * 0.3); }
  torch::Tensor forward(const torch::Tensor& x) { return x.mm((weight * 2).t()); }
  torch::Tensor weight;
};
TORCH_MODULE(DoubledLinear);

// y = relu(x w^T) w: one parameter used by two nodes.
struct TiedImpl : torch::nn::Module {
  TiedImpl() { weight = register_parameter("weight", torch::randn({5, 6}) * 0.3); }
  torch::Tensor forward(const torch::Tensor& x) { return x.mm(weight.t()).relu().mm(weight); }
  torch::Tensor weight;
};
TORCH_MODULE(Tied);

// y = w, whatever x is: an output of parameters alone.
struct IgnoresInputImpl : torch::nn::Module {
  IgnoresInputImpl() { weight = register_parameter("weight", torch::randn({1, 6})); }
  torch::Tensor forward(const torch::Tensor& x) { return (weight * 1).expand({x.size(0), 6}); }
  torch::Tensor weight;
};
TORCH_MODULE(IgnoresInput);

layer_list weight_pass_model(const std::string& kind) {
  torch::manual_seed(3);
  layer_list layers;
  if (kind == "conv") {
    layers.emplace_back("conv", torch::nn::AnyModule(
                                  torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1))));
    layers.emplace_back("count",
                        [](const torch::Tensor& x) { return counting_identity::apply(x); });
    layers.emplace_back("bn", torch::nn::AnyModule(torch::nn::BatchNorm2d(4)));
    layers.emplace_back("relu", torch::nn::AnyModule(torch::nn::ReLU()));
    layers.emplace_back("conv2", torch::nn::AnyModule(torch::nn::Conv2d(
                                   torch::nn::Conv2dOptions(4, 2, 1).bias(false))));
    return layers;
  }
  layers.emplace_back("fc1", torch::nn::AnyModule(torch::nn::Linear(6, 6)));
  layers.emplace_back("count", [](const torch::Tensor& x) { return counting_identity::apply(x); });
  layers.emplace_back("ln",
                      torch::nn::AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({6}))));
  if (kind == "doubled") {
    layers.emplace_back("doubled", torch::nn::AnyModule(DoubledLinear()));
  } else if (kind == "tied") {
    layers.emplace_back("tied", torch::nn::AnyModule(Tied()));
  } else if (kind == "ignores_input") {
    layers.emplace_back("ignores", torch::nn::AnyModule(IgnoresInput()));
  }
  layers.emplace_back("tanh", torch::nn::AnyModule(torch::nn::Tanh()));
  layers.emplace_back("fc2", torch::nn::AnyModule(torch::nn::Linear(6, 3)));
  return layers;
}

} // namespace

// Zero-bubble's W (stages/weight_pass.hpp): from what B kept, each weight node computes its
// parameters' gradients alone; nothing between the stage's input and output runs twice.
TEST_CASE("W from what B kept: the fused backward's gradients, no node run twice") {
  for (std::string kind : {"mlp", "conv", "doubled", "tied", "ignores_input"}) {
    for (bool pass : {true, false}) {
      std::string what = kind + (pass ? " with" : " without") + " the weight pass";
      INFO(what);
      stages::stage_config config;
      config.index = 1;
      config.count = 3;
      stages::stage fused(config, weight_pass_model(kind));
      stages::stage split(config, weight_pass_model(kind));
      split.use_weight_pass(pass);
      fused.begin_step(true);
      split.begin_step(true);
      torch::manual_seed(11);
      auto shape = kind == "conv" ? std::vector<int64_t>{2, 3, 5, 5} : std::vector<int64_t>{4, 6};
      std::vector<torch::Tensor> inputs;
      for (int m = 0; m < 3; ++m) {
        inputs.push_back(torch::randn(shape));
      }
      std::vector<torch::Tensor> fused_grads;
      std::vector<torch::Tensor> split_grads;
      identity_backwards = 0;
      for (int m = 0; m < 3; ++m) {
        auto y = fused.forward(m, inputs[m].clone().requires_grad_(true))[0];
        fused_grads.push_back(fused.backward(m, torch::cos(y.detach()))[0]);
      }
      // The output of parameters alone cuts the identity off the graph (and gets no pass).
      bool covered = kind != "ignores_input";
      int once = covered ? 3 : 0;
      CHECK(identity_backwards == once);
      identity_backwards = 0;
      for (int m = 0; m < 3; ++m) {
        auto y = split.forward(m, inputs[m].clone().requires_grad_(true))[0];
        auto before_b = split.peak_stash_bytes();
        split_grads.push_back(split.backward_input(m, torch::cos(y.detach()))[0]);
        if (m == 0) {
          // The gradients kept for the weight pass count in the stash until W.
          CHECK((split.peak_stash_bytes() > before_b) == (pass && covered));
        }
      }
      CHECK(identity_backwards == once); // B: each micro-batch's input gradient
      for (int m = 0; m < 3; ++m) {
        split.backward_weight(m);
      }
      CHECK(split.stash_size() == 0);
      // W: the weight pass runs no node of B again; walking the graph runs every one again.
      CHECK(identity_backwards == (pass ? once : 2 * once));
      auto [passes, walks] = split.weight_passes();
      CHECK(passes == (pass && covered ? 3u : 0u));
      CHECK(walks == (pass && covered ? 0u : 3u));
      for (int m = 0; m < 3; ++m) {
        CHECK(torch::allclose(fused_grads[m], split_grads[m], 1e-6, 1e-7));
      }
      auto a = fused.named_tensors(true);
      auto b = split.named_tensors(true);
      REQUIRE(a.size() == b.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        INFO(a[i].first);
        // Layers cut off the graph (ignores_input) have no gradient either way.
        REQUIRE(a[i].second.defined() == b[i].second.defined());
        bool before_cut = a[i].first.rfind("fc1", 0) == 0 || a[i].first.rfind("ln", 0) == 0;
        REQUIRE(a[i].second.defined() == (covered || !before_cut));
        if (a[i].second.defined()) {
          CHECK(torch::allclose(a[i].second, b[i].second, 1e-5, 1e-6));
        }
      }
    }
  }
}
