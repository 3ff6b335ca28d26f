#include "training/model_setup.hpp"

#include <fstream>
#include <iostream>

#include <actorpipe/exported.hpp>
#include <actorpipe/torchscript.hpp>
#include <torch/torch.h>

#include "models/model_formats.hpp"

namespace actorpipe::training {

bool is_model_file(const std::string& model) {
  return models::has_model_suffix(model) || model.find('/') != std::string::npos;
}

std::string tensor_file_of(const std::string& data) {
  const std::string prefix = "tensors:";
  return data.rfind(prefix, 0) == 0 ? data.substr(prefix.size()) : std::string{};
}

std::string image_folder_of(const std::string& data) {
  const std::string prefix = "images:";
  return data.rfind(prefix, 0) == 0 ? data.substr(prefix.size()) : std::string{};
}

std::string model_name(const model_args& m) {
  return !m.model.empty()                   ? m.model
         : m.data == "synthetic"            ? "resnet50"
         : m.data == "text"                 ? "gpt"
         : !image_folder_of(m.data).empty() ? "resnet18"
                                            : "cnn";
}

void check_model_fits_data(const model_args& m) {
  const bool tensors = !tensor_file_of(m.data).empty();
  ACTORPIPE_CHECK(m.data != "tensors:", "--data tensors:PATH needs the file's path");
  ACTORPIPE_CHECK(m.data != "images:", "--data images:DIR needs the folder's path");
  const bool images = !image_folder_of(m.data).empty();
  if (m.model.empty()) {
    ACTORPIPE_CHECK(!tensors, "--data ", m.data,
                    " has no model of its own: give --model (a PT2 archive of torch.export, "
                    "e.g. model.pt2, a TorchScript file, or a built-in model)");
    return; // the data's own model
  }
  if (is_model_file(m.model)) {
    ACTORPIPE_CHECK(tensors || images || m.data == "fashion-mnist", "--model ", m.model,
                    " (a model file) trains on --data tensors:PATH (its inputs and targets, "
                    "docs/from-pytorch.md), images:DIR or fashion-mnist, not ",
                    m.data);
    return;
  }
  bool gpt = m.model == "gpt";
  ACTORPIPE_CHECK((m.data != "fashion-mnist" && !images) || !gpt, "--data ", m.data,
                  " holds images: train gpt on --data text or synthetic");
  ACTORPIPE_CHECK(m.data != "text" || gpt,
                  "--data text trains a language model: use --model gpt (not ", m.model, ")");
}

namespace {

// An image folder's files and classes (the model's outputs), with its skipped files reported.
void scan_images(model_setup& setup, const model_args& m) {
  auto dir = image_folder_of(m.data);
  if (dir.empty()) {
    return;
  }
  ACTORPIPE_CHECK(m.bad_images == "fail" || m.bad_images == "skip", "--bad-images '", m.bad_images,
                  "' is not fail or skip");
  ACTORPIPE_CHECK(m.channels == 1 || m.channels == 3, "--channels (", m.channels,
                  ") must be 1 (grey) or 3 (RGB)");
  setup.images = scan_image_folder(dir, m.bad_images == "skip" ? bad_image_policy::skip
                                                               : bad_image_policy::fail);
  for (const auto& why : setup.images.skipped) {
    std::cerr << "warning: " << why << " (left out: --bad-images skip)\n";
  }
}

// A tensor file's first batch is what the model sees: profiles take it (any shape, any dtype).
void take_example(model_setup& setup, const model_args& m) {
  auto path = tensor_file_of(m.data);
  if (path.empty()) {
    return;
  }
  setup.file = load_tensor_file(path);
  auto rows = torch::arange(setup.batch, torch::kLong).remainder(setup.file.size());
  setup.example = setup.file.images.index({rows});
}

// --model naming a file: its bytes, kept (nodes and fresh() build from them), and its layers.
model_setup model_from_file(model_setup setup, const model_args& m) {
  ACTORPIPE_CHECK(m.batch >= 0, "--batch (", m.batch, ") must be >= 1");
  std::ifstream in(setup.name, std::ios::binary | std::ios::ate);
  auto size = in.good() ? static_cast<std::streamoff>(in.tellg()) : -1;
  ACTORPIPE_CHECK(in.good() && size >= 0, "--model ", setup.name,
                  ": cannot read the file (a model file is a PT2 archive, model.pt2, or a "
                  "TorchScript file, model.pt)");
  setup.model_file.resize(static_cast<std::size_t>(size));
  in.seekg(0);
  in.read(setup.model_file.data(), static_cast<std::streamsize>(setup.model_file.size()));
  ACTORPIPE_CHECK(in.good(), "--model ", setup.name, ": cannot read the file");
  setup.segments = m.segments;
  setup.layers = load_model_file(setup.model_file, "--model " + setup.name, {setup.segments});
  setup.weights = start_weights(setup.layers, m.init_from, setup.model_file);
  setup.batch = m.batch > 0 ? m.batch : (m.data == "fashion-mnist" ? 64 : 32);
  take_example(setup, m);
  scan_images(setup, m);
  if (!setup.images.classes.empty()) {
    setup.options.in_channels = m.channels;
    setup.options.image_size = m.image;
  }
  return setup;
}

// The built-in model's images and classes as the data has them. Synthetic data: the ResNets
// take RGB images of --image pixels and 1000 classes, as on ImageNet. Fashion-MNIST: 1x28x28
// images of 10 classes, the ResNets with a small-image stem. An image folder: --channels x
// --image x --image images of its classes, the ResNets with the small-image stem up to 64
// pixels.
void shape_to_data(model_setup& setup, const model_args& m, bool resnet) {
  const bool fashion = m.data == "fashion-mnist";
  setup.options.in_channels = resnet && !fashion ? 3 : 1;
  setup.options.image_size = resnet && !fashion ? m.image : 28;
  setup.options.num_classes =
    m.classes > 0 && m.data == "synthetic" ? m.classes : (resnet && !fashion ? 1000 : 10);
  setup.options.small_stem = resnet && fashion;
  scan_images(setup, m);
  if (!setup.images.classes.empty()) {
    setup.options.in_channels = m.channels;
    setup.options.image_size = m.image;
    setup.options.num_classes = static_cast<int64_t>(setup.images.classes.size());
    setup.options.small_stem = resnet && m.image <= 64;
  }
}

} // namespace

weight_names start_weights(const layer_list& layers, const std::string& init_from,
                           std::string& model_file) {
  if (!init_from.empty()) {
    auto names = init_exported(layers, read_pretrained(init_from));
    model_file = exported_bytes(layers);
    return names;
  }
  return is_exported(layers) ? own_weight_names(layers) : weight_names{};
}

model_setup build_model(const model_args& m) {
  model_setup setup;
  setup.name = model_name(m);
  check_model_fits_data(m);
  if (is_model_file(setup.name)) {
    return model_from_file(std::move(setup), m);
  }
  bool resnet = setup.name.rfind("resnet", 0) == 0;
  bool gpt = setup.name == "gpt";
  ACTORPIPE_CHECK(m.batch >= 0, "--batch (", m.batch, ") must be >= 1");
  ACTORPIPE_CHECK(m.image >= 1, "--image (", m.image, ") must be >= 1");
  shape_to_data(setup, m, resnet);
  setup.batch = m.batch > 0 ? m.batch : gpt ? 32 : (m.data == "synthetic" ? 120 : 64);
  setup.options.deferred_batch_norm = m.deferred_batch_norm;
  ACTORPIPE_CHECK(!m.block_layers || resnet,
                  "--resnet-blocks applies to the built-in ResNets "
                  "(one layer per residual block), not to ",
                  model_name(m));
  setup.options.block_layers = m.block_layers;
  if (gpt) {
    auto pick = [](int64_t flag, int64_t fallback) { return flag > 0 ? flag : fallback; };
    setup.options.vocabulary = pick(m.vocabulary, pick(m.classes, 64));
    setup.options.layers = pick(m.layers, default_gpt_layers);
    setup.options.heads = pick(m.heads, default_gpt_heads);
    setup.options.width = pick(m.width, default_gpt_width);
    setup.options.context = pick(m.context, default_gpt_context);
    setup.options.dropout = m.dropout;
  }
  setup.layers = make_seeded_model(setup.name, setup.options, m.seed);
  take_example(setup, m);
  return setup;
}

layer_list model_setup::fresh(uint64_t seed) const {
  if (!model_file.empty()) {
    return load_model_file(model_file, "--model " + name, {segments});
  }
  return make_seeded_model(name, options, seed);
}

torch::Tensor model_setup::sample() const {
  // A generator of its own: profiling must not shift the data drawn from the global one.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(12345);
  if (example.defined()) {
    return example;
  }
  if (language_model()) {
    return torch::randint(options.vocabulary, {batch, options.context}, generator, torch::kLong);
  }
  return torch::randn({batch, options.in_channels, options.image_size, options.image_size},
                      generator);
}

default_optimizer default_optimizer_for(const model_args& args) {
  default_optimizer o;
  o.adam = model_name(args) == "gpt";
  bool stream = args.data == "synthetic" || !tensor_file_of(args.data).empty();
  o.momentum = stream ? 0.0 : 0.9;
  return o;
}

} // namespace actorpipe::training
