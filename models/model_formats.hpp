/// \file
/// Model files as rows of one table: each format says how it is recognised, loaded, told apart
/// once loaded, written back, and what it is called. Front ends (the CLI, Python, the pipeline,
/// nodes) ask the table instead of switching on the format; a new format is one more row.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <actorpipe/exported.hpp>
#include <actorpipe/layers.hpp>

namespace actorpipe::models {

struct model_format {
  /// For messages: "a PT2 archive", "TorchScript".
  const char* name;
  /// The file name's usual ending (".pt2", ".pt"): what a checkpoint and Python's save call it.
  const char* suffix;
  /// What runs the written file in Python, for messages ("torch.export.load(path).module()").
  const char* runs_it;
  /// A graph: cut anywhere (--segments), its weights named by the program's signature, so they
  /// come from and go to safetensors files (--init-from, --save-safetensors).
  bool graph;
  /// Whether `bytes` are a file of this format (TorchScript, the last row, takes the rest).
  bool (*recognises)(const std::string& bytes);
  layer_list (*load)(const std::string& bytes, const std::string& what,
                     const exported_options& options);
  /// Whether `layers` were loaded from this format.
  bool (*holds)(const layer_list& layers);
  /// Writes `layers` with `state` (their trained weights) as a file of this format.
  void (*save)(const layer_list& layers, const std::map<std::string, torch::Tensor>& state,
               const std::string& path);
};

/// The table: PT2 archives (torch.export; read on the PyTorch 2.x line, refused by name on 1.13),
/// then TorchScript (torch.jit.save). Weights files (safetensors) are no model: they set a loaded
/// model's weights (--init-from) and are written from its state (--save-safetensors).
const std::vector<model_format>& model_formats();

/// The row whose `recognises` takes `bytes` (TorchScript's takes what no other row does).
const model_format& format_of_bytes(const std::string& bytes);

/// The row `layers` were loaded from; null for a built-in model.
const model_format* format_of(const layer_list& layers);

/// Whether `path` ends as a model file does (a row's suffix, or ".pth").
bool has_model_suffix(const std::string& path);

} // namespace actorpipe::models
