#include <doctest/doctest.h>

#include <map>
#include <set>

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

TEST_CASE("ResNets as one layer per residual block: the same modules, keys and outputs") {
  for (const std::string name : {"resnet18", "resnet50"}) {
    CAPTURE(name);
    model_options o;
    o.num_classes = 5;
    torch::manual_seed(4);
    auto stages = make_model(name, o);
    o.block_layers = true;
    torch::manual_seed(4);
    auto blocks = make_model(name, o);
    // 4 stem layers, one per block (ResNet-18: 2 per stage, ResNet-50: 3, 4, 6, 3), 3 head layers.
    CHECK(stages.size() == 11);
    CHECK(blocks.size() == (name == "resnet18" ? 15u : 23u));
    CHECK(blocks[4].name() == "layer1.0");
    CHECK(blocks[blocks.size() - 4].name() == (name == "resnet18" ? "layer4.1" : "layer4.2"));
    auto keyed = [](const layer_list& layers) {
      std::map<std::string, torch::Tensor> all;
      for (const auto& l : layers) {
        if (auto m = l.module()) {
          for (const auto& item : m->named_parameters()) {
            all.emplace(l.name() + "." + item.key(), item.value());
          }
          for (const auto& item : m->named_buffers()) {
            all.emplace(l.name() + "." + item.key(), item.value());
          }
        }
      }
      return all;
    };
    auto a = keyed(stages);
    auto b = keyed(blocks);
    REQUIRE(a.size() == b.size());
    for (const auto& [key, t] : a) {
      CAPTURE(key);
      REQUIRE(b.count(key) == 1);
      CHECK(torch::equal(t, b.at(key)));
    }
    CHECK(a.count("layer3.1.conv2.weight") == 1);
    torch::NoGradGuard no_grad;
    for (auto* list : {&stages, &blocks}) {
      for (auto& l : *list) {
        if (auto m = l.module()) {
          m->eval();
        }
      }
    }
    auto x = torch::randn({2, 3, 32, 32});
    CHECK(torch::equal(run_layers(stages, x), run_layers(blocks, x)));
  }
}

TEST_CASE("ResNet-18 runs on small images with any class count") {
  torch::NoGradGuard no_grad;
  model_options o;
  o.num_classes = 7;
  auto layers = make_model("resnet18", o);
  auto y = run_layers(layers, torch::randn({2, 3, 32, 32}));
  CHECK(y.sizes() == torch::IntArrayRef{2, 7});
}

TEST_CASE("a small stem takes 1x28x28 images through a ResNet at half the side, not a quarter") {
  torch::NoGradGuard no_grad;
  model_options o;
  o.in_channels = 1;
  o.num_classes = 10;
  o.small_stem = true;
  for (const std::string name : {"resnet18", "resnet50"}) {
    CAPTURE(name);
    auto layers = make_model(name, o);
    CHECK(names_of(layers) == std::vector<std::string>{"conv1", "bn1", "relu", "maxpool", "layer1",
                                                       "layer2", "layer3", "layer4", "avgpool",
                                                       "flatten", "fc"});
    CHECK(layers[0].module()->named_parameters()["weight"].sizes() ==
          torch::IntArrayRef{64, 1, 3, 3});
    auto x = torch::randn({2, 1, 28, 28});
    CHECK(run_layers(layer_list(layers.begin(), layers.begin() + 4), x).sizes() ==
          torch::IntArrayRef{2, 64, 14, 14});
    CHECK(run_layers(layers, x).sizes() == torch::IntArrayRef{2, 10});
  }
  // torchvision's stem quarters the side.
  o.small_stem = false;
  auto big = make_model("resnet18", o);
  CHECK(big[0].module()->named_parameters()["weight"].sizes() == torch::IntArrayRef{64, 1, 7, 7});
  CHECK(
    run_layers(layer_list(big.begin(), big.begin() + 4), torch::randn({2, 1, 28, 28})).sizes() ==
    torch::IntArrayRef{2, 64, 7, 7});
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

namespace {

int64_t distinct_parameter_count(const layer_list& layers) {
  std::set<const c10::TensorImpl*> seen;
  int64_t total = 0;
  for (const auto& l : layers) {
    if (auto m = l.module()) {
      for (const auto& p : m->parameters()) {
        if (seen.insert(p.unsafeGetTensorImpl()).second) {
          total += p.numel();
        }
      }
    }
  }
  return total;
}

model_options tiny_gpt_options() {
  model_options o;
  o.vocabulary = 13;
  o.layers = 2;
  o.heads = 2;
  o.width = 8;
  o.context = 6;
  return o;
}

} // namespace

TEST_CASE("gpt has GPT-2's parameter count, its layer names, and its head tied to the token "
          "embedding") {
  model_options o; // GPT-2 small: sum(p.numel() for p in GPT2LMHeadModel.parameters())
  o.vocabulary = 50257;
  o.layers = 12;
  o.heads = 12;
  o.width = 768;
  o.context = 1024;
  auto layers = make_model("gpt", o);
  CHECK(distinct_parameter_count(layers) == 124439808);
  auto names = names_of(layers);
  REQUIRE(names.size() == 15);
  CHECK(names.front() == "embed");
  CHECK(names[1] == "block0");
  CHECK(names[12] == "block11");
  CHECK(names[13] == "ln_f");
  CHECK(names.back() == "head");
  auto ties = tied_parameters(layers);
  REQUIRE(ties.size() == 1);
  CHECK(ties[0].name == "embed.token.weight");
  CHECK(ties[0].aliases == std::vector<std::string>{"head.weight"});
}

TEST_CASE("gpt maps token ids to next-token logits and never looks ahead") {
  torch::manual_seed(1);
  auto layers = make_model("gpt", tiny_gpt_options());
  auto x = torch::randint(13, {2, 5});
  auto y = run_layers(layers, x);
  REQUIRE(y.sizes() == torch::IntArrayRef({2, 5, 13}));
  auto changed = x.clone();
  changed.index_put_({0, 3}, (x.index({0, 3}) + 1) % 13);
  auto z = run_layers(layers, changed);
  using torch::indexing::Slice;
  CHECK(torch::allclose(y.index({0, Slice(0, 3)}), z.index({0, Slice(0, 3)})));
  CHECK_FALSE(torch::allclose(y.index({0, Slice(3, 5)}), z.index({0, Slice(3, 5)})));
  CHECK(torch::allclose(y[1], z[1]));
  // A shorter sequence gives the first positions' logits of a longer one.
  CHECK(torch::allclose(run_layers(layers, x.slice(1, 0, 2)), y.slice(1, 0, 2), 1e-5, 1e-6));
}

TEST_CASE("gpt refuses floats, too-long sequences, unknown tokens and sizes that do not fit") {
  torch::manual_seed(1);
  auto layers = make_model("gpt", tiny_gpt_options());
  CHECK_THROWS_WITH(run_layers(layers, torch::randn({2, 5})),
                    doctest::Contains("layer 'embed' takes token ids [N, T] as integers"));
  CHECK_THROWS_WITH(run_layers(layers, torch::zeros({2, 7}, torch::kLong)),
                    doctest::Contains("sequences of 7 tokens, but the context is 1 to 6"));
  CHECK_THROWS_WITH(run_layers(layers, torch::full({1, 3}, 13, torch::kLong)),
                    doctest::Contains("token ids from 13 to 13, but the vocabulary is 0 to 12"));
  auto o = tiny_gpt_options();
  o.heads = 3;
  CHECK_THROWS_WITH(make_model("gpt", o),
                    doctest::Contains("width (8) must be a multiple of heads (3)"));
}

namespace {

// A module of one's own that holds a tied parameter.
struct ScaledHeadImpl : torch::nn::Module, tied_module {
  ScaledHeadImpl() : weight(register_parameter("weight", torch::randn({3, 4}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return 2 * torch::nn::functional::linear(x, weight);
  }
  void parameter_replaced(const std::string&, const torch::Tensor& t) override { weight = t; }
  torch::Tensor weight;
};
TORCH_MODULE(ScaledHead);

} // namespace

TEST_CASE("tie_parameter ties Linear, Embedding and tied_module parameters, and refuses others") {
  auto embedding = torch::nn::Embedding(3, 4);
  layer source("embed", torch::nn::AnyModule(embedding));
  layer linear("head",
               torch::nn::AnyModule(torch::nn::Linear(torch::nn::LinearOptions(4, 3).bias(false))));
  layer custom("scaled", torch::nn::AnyModule(ScaledHead()));
  tie_parameter(linear, "weight", embedding->weight);
  tie_parameter(custom, "weight", embedding->weight);
  auto x = torch::randn({2, 4});
  CHECK(torch::allclose(linear.forward(x), x.matmul(embedding->weight.t())));
  CHECK(torch::allclose(custom.forward(x), 2 * x.matmul(embedding->weight.t())));
  auto ties = tied_parameters({source, linear, custom});
  REQUIRE(ties.size() == 1);
  CHECK(ties[0].aliases == std::vector<std::string>{"head.weight", "scaled.weight"});
  layer conv("conv", torch::nn::AnyModule(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 1))));
  CHECK_THROWS_WITH(tie_parameter(conv, "weight", torch::zeros({4, 3, 1, 1})),
                    doctest::Contains("only Linear and Embedding weights and modules derived from "
                                      "actorpipe::tied_module can be tied"));
  CHECK_THROWS_WITH(tie_parameter(linear, "bias", embedding->weight),
                    doctest::Contains("layer 'head' has no parameter 'bias'"));
  CHECK_THROWS_WITH(tie_parameter(linear, "weight", torch::zeros({5, 4})),
                    doctest::Contains("has shape [3, 4] but the tensor has [5, 4]"));
}
