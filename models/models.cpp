// Built-in models: torchvision's ResNets, an MLP, a small CNN and a GPT, each as a named layer
// list.
#include <actorpipe/models.hpp>

#include <algorithm>
#include <mutex>

#include <actorpipe/batch_norm.hpp>

#include <torch/nn/init.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/pooling.h>

#include <cmath>
#include <limits>

#include <actorpipe/errors.hpp>

#include "models/pointwise_conv.hpp"

namespace actorpipe {
namespace {

namespace nn = torch::nn;

nn::Conv2d conv3x3(int64_t in, int64_t out, int64_t stride) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false));
}

// Kernel 1, no bias: libtorch's Conv2d, kept on oneDNN for small one-thread micro-batches.
models::PointwiseConv2d conv1x1(int64_t in, int64_t out, int64_t stride) {
  return models::PointwiseConv2d(in, out, stride);
}

// torchvision.models.resnet.BasicBlock (expansion 1).
struct BasicBlockImpl : nn::Module {
  static constexpr int64_t expansion = 1;

  BasicBlockImpl(int64_t inplanes, int64_t planes, int64_t stride, nn::Sequential downsample_)
    : conv1(register_module("conv1", conv3x3(inplanes, planes, stride))),
      bn1(register_module("bn1", DeferredBatchNorm2d(planes))),
      conv2(register_module("conv2", conv3x3(planes, planes, 1))),
      bn2(register_module("bn2", DeferredBatchNorm2d(planes))), downsample(downsample_) {
    if (!downsample.is_empty()) {
      register_module("downsample", downsample);
    }
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto out = bn1(conv1(x)).relu_();
    out = bn2(conv2(out));
    out += downsample.is_empty() ? x : downsample->forward(x);
    return out.relu_();
  }

  nn::Conv2d conv1;
  DeferredBatchNorm2d bn1;
  nn::Conv2d conv2;
  DeferredBatchNorm2d bn2;
  nn::Sequential downsample{nullptr};
};
TORCH_MODULE(BasicBlock);

// torchvision.models.resnet.Bottleneck (ResNet v1.5: stride on the 3x3 convolution).
struct BottleneckImpl : nn::Module {
  static constexpr int64_t expansion = 4;

  BottleneckImpl(int64_t inplanes, int64_t planes, int64_t stride, nn::Sequential downsample_)
    : conv1(register_module("conv1", conv1x1(inplanes, planes, 1))),
      bn1(register_module("bn1", DeferredBatchNorm2d(planes))),
      conv2(register_module("conv2", conv3x3(planes, planes, stride))),
      bn2(register_module("bn2", DeferredBatchNorm2d(planes))),
      conv3(register_module("conv3", conv1x1(planes, planes * expansion, 1))),
      bn3(register_module("bn3", DeferredBatchNorm2d(planes * expansion))),
      downsample(downsample_) {
    if (!downsample.is_empty()) {
      register_module("downsample", downsample);
    }
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto out = bn1(conv1(x)).relu_();
    out = bn2(conv2(out)).relu_();
    out = bn3(conv3(out));
    out += downsample.is_empty() ? x : downsample->forward(x);
    return out.relu_();
  }

  models::PointwiseConv2d conv1;
  DeferredBatchNorm2d bn1;
  nn::Conv2d conv2;
  DeferredBatchNorm2d bn2;
  models::PointwiseConv2d conv3;
  DeferredBatchNorm2d bn3;
  nn::Sequential downsample{nullptr};
};
TORCH_MODULE(Bottleneck);

// A run of residual blocks (torchvision's layer1..layer4). libtorch's Sequential has a templated
// forward, which AnyModule cannot hold; this one takes and returns a Tensor.
struct BlockSequenceImpl : nn::SequentialImpl {
  torch::Tensor forward(torch::Tensor x) { return nn::SequentialImpl::forward(std::move(x)); }
};
TORCH_MODULE(BlockSequence);

layer flatten_layer() {
  return layer("flatten", [](const torch::Tensor& x) { return x.flatten(1); });
}

// torchvision's _make_layer: the first block may change stride and width.
template <class Block>
BlockSequence make_stage(int64_t& inplanes, int64_t planes, int64_t blocks, int64_t stride) {
  nn::Sequential downsample{nullptr};
  if (stride != 1 || inplanes != planes * Block::Impl::expansion) {
    downsample = nn::Sequential(conv1x1(inplanes, planes * Block::Impl::expansion, stride),
                                DeferredBatchNorm2d(planes * Block::Impl::expansion));
  }
  BlockSequence seq;
  seq->push_back(Block(inplanes, planes, stride, downsample));
  inplanes = planes * Block::Impl::expansion;
  for (int64_t i = 1; i < blocks; ++i) {
    seq->push_back(Block(inplanes, planes, 1, nn::Sequential{nullptr}));
  }
  return seq;
}

// torchvision's ResNet.__init__ initialisation: Kaiming-normal (fan_out) convolutions, batch
// norm weight 1 and bias 0; Linear keeps libtorch's default, as in torchvision.
void init_resnet(nn::Module& m) {
  for (auto& sub : m.modules(/*include_self=*/true)) {
    if (auto* conv = dynamic_cast<nn::Conv2dImpl*>(sub.get())) {
      nn::init::kaiming_normal_(conv->weight, 0.0, torch::kFanOut, torch::kReLU);
    } else if (auto* bn = dynamic_cast<nn::BatchNorm2dImpl*>(sub.get())) {
      nn::init::constant_(bn->weight, 1.0);
      nn::init::constant_(bn->bias, 0.0);
    } else if (auto* dbn = dynamic_cast<DeferredBatchNorm2dImpl*>(sub.get())) {
      nn::init::constant_(dbn->weight, 1.0);
      nn::init::constant_(dbn->bias, 0.0);
    }
  }
}

template <class Block>
layer_list make_resnet(const std::vector<int64_t>& blocks, const model_options& o) {
  int64_t inplanes = 64;
  auto conv1 =
    o.small_stem
      ? conv3x3(o.in_channels, 64, 1)
      : nn::Conv2d(nn::Conv2dOptions(o.in_channels, 64, 7).stride(2).padding(3).bias(false));
  auto bn1 = DeferredBatchNorm2d(64);
  // Stages are built in order so that parameters draw from the generator in torchvision's order.
  auto layer1 = make_stage<Block>(inplanes, 64, blocks[0], 1);
  auto layer2 = make_stage<Block>(inplanes, 128, blocks[1], 2);
  auto layer3 = make_stage<Block>(inplanes, 256, blocks[2], 2);
  auto layer4 = make_stage<Block>(inplanes, 512, blocks[3], 2);
  auto fc = nn::Linear(512 * Block::Impl::expansion, o.num_classes);
  for (nn::Module* m : std::initializer_list<nn::Module*>{
         conv1.get(), bn1.get(), layer1.get(), layer2.get(), layer3.get(), layer4.get()}) {
    init_resnet(*m);
  }
  layer_list layers;
  layers.emplace_back("conv1", nn::AnyModule(conv1));
  layers.emplace_back("bn1", nn::AnyModule(bn1));
  layers.emplace_back("relu", nn::AnyModule(nn::ReLU()));
  layers.emplace_back("maxpool",
                      nn::AnyModule(nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(2).padding(1))));
  const std::pair<const char*, BlockSequence> runs[] = {
    {"layer1", layer1}, {"layer2", layer2}, {"layer3", layer3}, {"layer4", layer4}};
  for (const auto& [name, run] : runs) {
    if (!o.block_layers) {
      layers.emplace_back(name, nn::AnyModule(run));
      continue;
    }
    std::size_t i = 0;
    for (const auto& block : *run) {
      layers.emplace_back(std::string(name) + "." + std::to_string(i++), block);
    }
  }
  layers.emplace_back("avgpool",
                      nn::AnyModule(nn::AdaptiveAvgPool2d(nn::AdaptiveAvgPool2dOptions({1, 1}))));
  layers.push_back(flatten_layer());
  layers.emplace_back("fc", nn::AnyModule(fc));
  set_deferred_batch_norm(layers, o.deferred_batch_norm);
  return layers;
}

layer_list make_mlp(const model_options& o) {
  layer_list layers;
  layers.push_back(flatten_layer());
  layers.emplace_back("fc1",
                      nn::AnyModule(nn::Linear(o.in_channels * o.image_size * o.image_size, 256)));
  layers.emplace_back("relu1", nn::AnyModule(nn::ReLU()));
  layers.emplace_back("fc2", nn::AnyModule(nn::Linear(256, 128)));
  layers.emplace_back("relu2", nn::AnyModule(nn::ReLU()));
  layers.emplace_back("fc3", nn::AnyModule(nn::Linear(128, o.num_classes)));
  return layers;
}

layer_list make_cnn(const model_options& o) {
  ACTORPIPE_CHECK(o.image_size % 4 == 0 && o.image_size >= 4, "model 'cnn': image size (",
                  o.image_size, ") must be a positive multiple of 4");
  auto side = o.image_size / 4;
  layer_list layers;
  layers.emplace_back(
    "conv1", nn::AnyModule(nn::Conv2d(nn::Conv2dOptions(o.in_channels, 32, 3).padding(1))));
  layers.emplace_back("relu1", nn::AnyModule(nn::ReLU()));
  layers.emplace_back("pool1", nn::AnyModule(nn::MaxPool2d(nn::MaxPool2dOptions(2))));
  layers.emplace_back("conv2", nn::AnyModule(nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1))));
  layers.emplace_back("relu2", nn::AnyModule(nn::ReLU()));
  layers.emplace_back("pool2", nn::AnyModule(nn::MaxPool2d(nn::MaxPool2dOptions(2))));
  layers.push_back(flatten_layer());
  layers.emplace_back("fc1", nn::AnyModule(nn::Linear(64 * side * side, 128)));
  layers.emplace_back("relu3", nn::AnyModule(nn::ReLU()));
  layers.emplace_back("fc2", nn::AnyModule(nn::Linear(128, o.num_classes)));
  return layers;
}

// GPT-2's token and learned position embeddings: token ids [N, T] -> [N, T, width].
struct GptEmbeddingImpl : nn::Module {
  explicit GptEmbeddingImpl(const model_options& o)
    : token(register_module("token", nn::Embedding(o.vocabulary, o.width))),
      position(register_module("position", nn::Embedding(o.context, o.width))) {
    if (o.dropout > 0) {
      dropout = register_module("dropout", nn::Dropout(o.dropout));
    }
  }

  torch::Tensor forward(const torch::Tensor& ids) {
    auto vocabulary = token->options.num_embeddings();
    auto context = position->options.num_embeddings();
    ACTORPIPE_CHECK(ids.dim() == 2 && !ids.is_floating_point() && ids.scalar_type() != torch::kBool,
                    "layer 'embed' takes token ids [N, T] as integers, not a ", ids.dtype(),
                    " tensor of shape ", ids.sizes());
    ACTORPIPE_CHECK(ids.size(1) >= 1 && ids.size(1) <= context, "layer 'embed': sequences of ",
                    ids.size(1), " tokens, but the context is 1 to ", context,
                    " (model option context)");
    if (ids.numel() > 0) {
      auto range = torch::stack({ids.min(), ids.max()});
      auto low = range[0].item<int64_t>();
      auto high = range[1].item<int64_t>();
      ACTORPIPE_CHECK(low >= 0 && high < vocabulary, "layer 'embed': token ids from ", low, " to ",
                      high, ", but the vocabulary is 0 to ", vocabulary - 1);
    }
    auto x = token(ids.to(torch::kLong)) +
             position(torch::arange(ids.size(1), ids.options().dtype(torch::kLong)));
    return dropout.is_empty() ? x : dropout(x);
  }

  nn::Embedding token;
  nn::Embedding position;
  nn::Dropout dropout{nullptr};
};
TORCH_MODULE(GptEmbedding);

// A pre-LayerNorm transformer block: x + attention(ln1(x)), then + mlp(ln2(x)), with causal
// multi-head self-attention and a GELU MLP four times as wide.
struct GptBlockImpl : nn::Module {
  explicit GptBlockImpl(const model_options& o)
    : ln1(register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({o.width})))),
      qkv(register_module("qkv", nn::Linear(o.width, 3 * o.width))),
      proj(register_module("proj", nn::Linear(o.width, o.width))),
      ln2(register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({o.width})))),
      fc(register_module("fc", nn::Linear(o.width, 4 * o.width))),
      out(register_module("out", nn::Linear(4 * o.width, o.width))), heads(o.heads) {
    if (o.dropout > 0) {
      attention_dropout = register_module("attention_dropout", nn::Dropout(o.dropout));
      residual_dropout = register_module("residual_dropout", nn::Dropout(o.dropout));
    }
  }

  torch::Tensor forward(const torch::Tensor& x) {
    auto n = x.size(0);
    auto t = x.size(1);
    auto c = x.size(2);
    auto d = c / heads;
    // [N, T, 3C] -> three [N, heads, T, d]
    auto parts = qkv(ln1(x)).view({n, t, 3, heads, d}).permute({2, 0, 3, 1, 4});
    auto scores = parts[0].matmul(parts[1].transpose(-2, -1)) * (1.0 / std::sqrt(double(d)));
    auto future = torch::ones({t, t}, x.options().dtype(torch::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity()).softmax(-1);
    if (!attention_dropout.is_empty()) {
      scores = attention_dropout(scores);
    }
    auto y = proj(scores.matmul(parts[2]).transpose(1, 2).reshape({n, t, c}));
    auto h = x + (residual_dropout.is_empty() ? y : residual_dropout(y));
    auto m = out(torch::gelu(fc(ln2(h))));
    return h + (residual_dropout.is_empty() ? m : residual_dropout(m));
  }

  nn::LayerNorm ln1;
  nn::Linear qkv;
  nn::Linear proj;
  nn::LayerNorm ln2;
  nn::Linear fc;
  nn::Linear out;
  nn::Dropout attention_dropout{nullptr};
  nn::Dropout residual_dropout{nullptr};
  int64_t heads;
};
TORCH_MODULE(GptBlock);

// GPT-2's initialisation: N(0, 0.02) for linear and embedding weights, zero biases, the
// projections into the residual stream scaled by 1 / sqrt(2 * layers); LayerNorm 1 and 0.
void init_gpt(nn::Module& m, int64_t layers) {
  torch::NoGradGuard no_grad;
  for (const auto& item : m.named_modules()) {
    if (auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get())) {
      auto residual = item.key() == "proj" || item.key() == "out";
      linear->weight.normal_(0.0, residual ? 0.02 / std::sqrt(2.0 * double(layers)) : 0.02);
      if (linear->bias.defined()) {
        linear->bias.zero_();
      }
    } else if (auto* embedding = dynamic_cast<nn::EmbeddingImpl*>(item.value().get())) {
      embedding->weight.normal_(0.0, 0.02);
    }
  }
}

layer_list make_gpt(const model_options& o) {
  ACTORPIPE_CHECK(
    o.vocabulary >= 2 && o.layers >= 1 && o.heads >= 1 && o.context >= 1 && o.width >= 1,
    "model 'gpt': vocabulary (", o.vocabulary, ") must be >= 2 and layers (", o.layers,
    "), heads (", o.heads, "), width (", o.width, ") and context (", o.context, ") >= 1");
  ACTORPIPE_CHECK(o.width % o.heads == 0, "model 'gpt': width (", o.width,
                  ") must be a multiple of heads (", o.heads, ")");
  ACTORPIPE_CHECK(o.dropout >= 0 && o.dropout < 1, "model 'gpt': dropout (", o.dropout,
                  ") must be in [0, 1)");
  layer_list layers;
  auto embed = GptEmbedding(o);
  init_gpt(*embed, o.layers);
  layers.emplace_back("embed", nn::AnyModule(embed));
  for (int64_t i = 0; i < o.layers; ++i) {
    auto block = GptBlock(o);
    init_gpt(*block, o.layers);
    layers.emplace_back("block" + std::to_string(i), nn::AnyModule(block));
  }
  layers.emplace_back("ln_f", nn::AnyModule(nn::LayerNorm(nn::LayerNormOptions({o.width}))));
  layers.emplace_back(
    "head", nn::AnyModule(nn::Linear(nn::LinearOptions(o.width, o.vocabulary).bias(false))));
  // The LM head is the token embedding, transposed (GPT-2's weight tying).
  tie_parameter(layers.back(), "weight", embed->token->weight);
  return layers;
}

} // namespace

namespace {

struct model_registry {
  std::mutex mutex;
  std::vector<std::pair<std::string, model_factory>> factories;

  static model_registry& get() {
    static model_registry registry;
    return registry;
  }

  model_factory find(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& [n, f] : factories) {
      if (n == name) {
        return f;
      }
    }
    return {};
  }
};

const std::vector<std::string>& builtin_names() {
  static const std::vector<std::string> names{"resnet18", "resnet34", "resnet50", "resnet101",
                                              "mlp",      "cnn",      "gpt"};
  return names;
}

} // namespace

std::vector<std::string> model_names() {
  auto names = builtin_names();
  auto& r = model_registry::get();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& entry : r.factories) {
    names.push_back(entry.first);
  }
  return names;
}

void register_model(const std::string& name, model_factory factory) {
  ACTORPIPE_CHECK(!name.empty() && static_cast<bool>(factory),
                  "register_model: a model needs a name and a factory");
  ACTORPIPE_CHECK(std::find(builtin_names().begin(), builtin_names().end(), name) ==
                    builtin_names().end(),
                  "register_model: '", name, "' is a built-in model's name");
  auto& r = model_registry::get();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto& entry : r.factories) {
    if (entry.first == name) {
      entry.second = std::move(factory);
      return;
    }
  }
  r.factories.emplace_back(name, std::move(factory));
}

layer_list make_seeded_model(const std::string& name, const model_options& options, uint64_t seed) {
  // Recursive: a registered factory may build a seeded model of its own.
  static std::recursive_mutex seeded;
  std::lock_guard<std::recursive_mutex> lock(seeded);
  torch::manual_seed(seed);
  return make_model(name, options);
}

layer_list make_model(const std::string& name, const model_options& o) {
  ACTORPIPE_CHECK(o.num_classes >= 1, "model '", name, "': num_classes (", o.num_classes,
                  ") must be >= 1");
  ACTORPIPE_CHECK(o.in_channels >= 1, "model '", name, "': in_channels (", o.in_channels,
                  ") must be >= 1");
  if (auto factory = model_registry::get().find(name)) {
    auto layers = factory(o);
    ACTORPIPE_CHECK(!layers.empty(), "model '", name, "': its factory gave no layers");
    return layers;
  }
  if (name == "resnet18") {
    return make_resnet<BasicBlock>({2, 2, 2, 2}, o);
  }
  if (name == "resnet34") {
    return make_resnet<BasicBlock>({3, 4, 6, 3}, o);
  }
  if (name == "resnet50") {
    return make_resnet<Bottleneck>({3, 4, 6, 3}, o);
  }
  if (name == "resnet101") {
    return make_resnet<Bottleneck>({3, 4, 23, 3}, o);
  }
  if (name == "mlp") {
    return make_mlp(o);
  }
  if (name == "cnn") {
    return make_cnn(o);
  }
  if (name == "gpt") {
    return make_gpt(o);
  }
  std::string known;
  for (const auto& n : model_names()) {
    known += (known.empty() ? "" : ", ") + n;
  }
  throw invalid_argument(detail::concat("unknown model '", name, "' (known: ", known, ")"));
}

} // namespace actorpipe
