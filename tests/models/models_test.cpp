#include <doctest/doctest.h>

#include <torch/torch.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/models.hpp>

#include "models/pointwise_conv.hpp"

using namespace actorpipe;

namespace {

std::vector<std::string> names_of(const layer_list& layers) {
  std::vector<std::string> names;
  for (const auto& l : layers) {
    names.push_back(l.name());
  }
  return names;
}

} // namespace

TEST_CASE("ResNets have torchvision's parameter counts and layer names") {
  // torchvision.models.resnetNN(num_classes=1000), sum(p.numel() for p in m.parameters()).
  const std::vector<std::pair<std::string, int64_t>> expected{{"resnet18", 11689512},
                                                              {"resnet34", 21797672},
                                                              {"resnet50", 25557032},
                                                              {"resnet101", 44549160}};
  for (const auto& [name, count] : expected) {
    CAPTURE(name);
    auto layers = make_model(name);
    CHECK(parameter_count(layers, 0, layers.size()) == count);
    CHECK(names_of(layers) == std::vector<std::string>{"conv1", "bn1", "relu", "maxpool", "layer1",
                                                       "layer2", "layer3", "layer4", "avgpool",
                                                       "flatten", "fc"});
    CHECK(layers[9].is_function());
  }
}

TEST_CASE("ResNet-50 parameters are named as in torchvision") {
  auto layers = make_model("resnet50");
  auto params = layers[5].module()->named_parameters();
  CHECK(params.contains("0.downsample.0.weight"));
  CHECK(params.contains("3.conv3.weight"));
  CHECK(params["0.conv2.weight"].sizes() == torch::IntArrayRef{128, 128, 3, 3});
}

TEST_CASE("ResNet-18 runs on small images with any class count") {
  torch::NoGradGuard no_grad;
  model_options o;
  o.num_classes = 7;
  auto layers = make_model("resnet18", o);
  auto y = run_layers(layers, torch::randn({2, 3, 32, 32}));
  CHECK(y.sizes() == torch::IntArrayRef{2, 7});
}

TEST_CASE("MLP and CNN map 1x28x28 images to class scores") {
  model_options o;
  o.in_channels = 1;
  o.image_size = 28;
  o.num_classes = 10;
  for (const auto* name : {"mlp", "cnn"}) {
    CAPTURE(name);
    auto layers = make_model(name, o);
    auto y = run_layers(layers, torch::randn({3, 1, 28, 28}));
    CHECK(y.sizes() == torch::IntArrayRef{3, 10});
  }
  CHECK(names_of(make_model("cnn", o)) ==
        std::vector<std::string>{"conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "flatten",
                                 "fc1", "relu3", "fc2"});
}

TEST_CASE("the same seed builds the same parameters") {
  torch::manual_seed(3);
  auto a = make_model("mlp");
  torch::manual_seed(3);
  auto b = make_model("mlp");
  CHECK(torch::equal(a[1].module()->parameters()[0], b[1].module()->parameters()[0]));
}

TEST_CASE("an unknown model name is rejected with the known names") {
  CHECK_THROWS_WITH_AS(make_model("resnet51"),
                       doctest::Contains("unknown model 'resnet51' (known: resnet18"),
                       actorpipe::invalid_argument);
}

TEST_CASE("a Sequential becomes a layer list named by its children") {
  torch::nn::Sequential seq(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2));
  auto layers = to_layer_list(seq);
  REQUIRE(layers.size() == 3);
  CHECK(layers[0].name() == "0");
  CHECK(layers[0].expected_input() == "[*, 4]");
  auto x = torch::randn({5, 4});
  CHECK(torch::allclose(run_layers(layers, x), seq->forward(x)));
}

TEST_CASE("a 1x1 convolution of a small one-thread batch stays on oneDNN and equals Conv2d") {
  // Without oneDNN there is no fast path: PointwiseConv2d is Conv2d, and must still equal it.
  const bool onednn = at::hasMKLDNN();
  auto previous = at::get_num_threads();
  at::set_num_threads(1);
  torch::manual_seed(7);
  models::PointwiseConv2d fast(24, 40, 1);
  torch::nn::Conv2d plain(torch::nn::Conv2dOptions(24, 40, 1).bias(false));
  {
    torch::NoGradGuard no_grad;
    plain->weight.copy_(fast->weight);
  }
  for (int64_t n : {1, 3, 8, 15, 16}) {
    CAPTURE(n);
    auto x = torch::randn({n, 24, 5, 7});
    auto dy = torch::randn({n, 40, 5, 7});
    // The fast path takes exactly the batches libtorch leaves to its native kernel.
    CHECK(models::pointwise_fast_path(*fast, x) == (onednn && n < 16));
    auto xf = x.clone().requires_grad_(true);
    auto xp = x.clone().requires_grad_(true);
    auto yf = fast->forward(xf);
    auto yp = plain->forward(xp);
    CHECK(torch::allclose(yf, yp, 1e-5, 1e-5));
    yf.backward(dy);
    yp.backward(dy);
    CHECK(torch::allclose(xf.grad(), xp.grad(), 1e-5, 1e-5));
    CHECK(torch::allclose(fast->weight.grad(), plain->weight.grad(), 1e-4, 1e-4));
    fast->weight.mutable_grad().zero_();
    plain->weight.mutable_grad().zero_();
  }
  // A strided one, or more threads: libtorch's path.
  models::PointwiseConv2d strided(24, 40, 2);
  CHECK_FALSE(models::pointwise_fast_path(*strided, torch::randn({4, 24, 6, 6})));
  at::set_num_threads(2);
  CHECK_FALSE(models::pointwise_fast_path(*fast, torch::randn({4, 24, 6, 6})));
  at::set_num_threads(previous);
}
