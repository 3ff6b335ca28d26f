#include <doctest/doctest.h>

#include <torch/torch.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/models.hpp>

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
