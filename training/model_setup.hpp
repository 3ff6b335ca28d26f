/// \file
/// The model a run trains, from a program's settings: a built-in model shaped to its data (the
/// images' size and channels, the classes, the gpt's vocabulary), or a model file (a PT2 archive
/// of torch.export, TorchScript) with its bytes kept for nodes; the batch it trains on, a sample
/// batch to profile with, and the optimizer a run takes where no flag names one. What
/// `actorpipe train`, `plan` and `bench` share; the flags that fill `model_args` are
/// cli/flags.hpp's. Planning the pipeline that runs the model is planning.hpp's.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include <actorpipe/data.hpp>
#include <actorpipe/exported.hpp>
#include <actorpipe/images.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/models.hpp>

namespace actorpipe::training {

/// What model and data a command uses.
struct model_args {
  std::string data = "fashion-mnist";
  std::string model;
  int64_t batch = 0;
  /// Synthetic data and image folders: the images' side.
  int64_t image = 128;
  int64_t classes = 0;
  /// Image folders: 3 (RGB) or 1 (grey) channels, and what to do with a file that is not an
  /// image ("fail" or "skip").
  int64_t channels = 3;
  std::string bad_images = "fail";
  uint64_t seed = 0;
  bool deferred_batch_norm = false;
  /// ResNets: one layer per residual block (model_options::block_layers).
  bool block_layers = false;
  /// gpt: sizes (0: the defaults below) and dropout; the vocabulary comes from the text (or
  /// --classes, else 64, for synthetic tokens).
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t width = 0;
  int64_t context = 0;
  double dropout = 0;
  int64_t vocabulary = 0;
  /// A PT2 archive's cut into layers (--segments).
  std::string segments = "auto";
  /// A PT2 archive's weights from a safetensors file or a save_pretrained folder (--init-from).
  std::string init_from;
};

/// The gpt sizes `actorpipe train --model gpt` takes when no flag says otherwise: 4 blocks of 4
/// heads, width 128, context 64 (a character model of about 0.8 M parameters).
inline constexpr int64_t default_gpt_layers = 4;
inline constexpr int64_t default_gpt_heads = 4;
inline constexpr int64_t default_gpt_width = 128;
inline constexpr int64_t default_gpt_context = 64;

/// True when --model names a model file written in Python rather than a built-in model: a name
/// ending in ".pt", ".pth" (TorchScript) or ".pt2" (a PT2 archive of torch.export), or
/// containing '/'. Which of the two it is, the file's contents say (load_model_file).
bool is_model_file(const std::string& model);

/// The path of `--data tensors:PATH`, or an empty string for other data.
std::string tensor_file_of(const std::string& data);

/// The folder of `--data images:DIR`, or an empty string for other data.
std::string image_folder_of(const std::string& data);

/// A built model with its input shape.
struct model_setup {
  std::string name;
  model_options options;
  layer_list layers;
  int64_t batch = 0;
  /// A model file's bytes (TorchScript or a PT2 archive: what nodes receive); empty for a
  /// built-in model.
  std::string model_file;
  /// A PT2 archive's cut into layers (--segments: exported_options::segments).
  std::string segments = "auto";
  /// A PT2 archive's weights as a weights file names them (--init-from's names, else the
  /// program's), for writing them back (--save-safetensors); empty for other models.
  weight_names weights;
  /// Real inputs [batch, ...] to profile with, when the data gives them (tensor files).
  torch::Tensor example;
  /// --data tensors:PATH: the file's inputs and targets (empty otherwise).
  dataset file;
  /// --data images:DIR: the folder's files and classes (empty otherwise).
  image_folder images;

  /// A random batch shaped like the real one (token ids for a language model), or the tensor
  /// file's first batch.
  torch::Tensor sample() const;
  /// The model again, with modules of its own: a built-in one drawn after
  /// torch::manual_seed(seed), a model file's from its bytes (`seed` unused).
  layer_list fresh(uint64_t seed) const;
  /// A language model (inputs are token ids [N, context], outputs logits per token).
  bool language_model() const { return name == "gpt"; }
};

/// The model a run trains: --model, else the data's own (cnn for Fashion-MNIST, gpt for text,
/// resnet50 for synthetic data).
std::string model_name(const model_args& args);

/// The optimizer `actorpipe train` takes where no flag names one: Adam for the gpt; else SGD with
/// momentum 0.9, or plain SGD on streams (synthetic data, tensor files). `actorpipe plan` counts
/// its state by the same rule.
struct default_optimizer {
  bool adam = false;
  /// SGD's momentum, when SGD is the default or given without --momentum.
  double momentum = 0;
  /// The fp32 tensors it keeps per parameter (planning_args::optimizer_state).
  double state_tensors() const { return adam ? 2.0 : momentum > 0 ? 1.0 : 0.0; }
};
default_optimizer default_optimizer_for(const model_args& args);

/// Throws invalid_argument when --model cannot train on --data (before any data is read).
void check_model_fits_data(const model_args& args);

/// Builds the model (parameters drawn after torch::manual_seed(seed)), or loads a model file
/// (load_model_file: TorchScript or a PT2 archive).
model_setup build_model(const model_args& args);

/// The weights a model file's `layers` start from and are written back under: with `init_from`
/// (a safetensors file or save_pretrained folder) set into them (init_exported), and
/// `model_file` (what nodes and further replicas load) made the archive that carries them; else
/// the program's own names. Empty names for a model that is not a PT2 archive (init_from
/// refused by name).
weight_names start_weights(const layer_list& layers, const std::string& init_from,
                           std::string& model_file);

} // namespace actorpipe::training
