/// \file
/// Models written in Python as `torch.export` programs: the PT2 archive that
/// `torch.export.save(torch.export.export(model, example), "model.pt2")` writes, read as a layer
/// list whose layers are segments of the graph, trained with autograd as eager PyTorch trains
/// the module, and written back with the trained weights (docs/from-pytorch.md).
///
/// Read on the PyTorch 2.x line (the archive's schema ships with that libtorch); a build on
/// libtorch 1.13 refuses a PT2 archive by name (exported_programs_supported()).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <actorpipe/layers.hpp>
#include <actorpipe/safetensors.hpp>

namespace actorpipe {

/// How a program becomes layers.
struct exported_options {
  /// Where the graph is cut into layers (segments):
  /// - "auto": at the user's `torch.distributed.pipelining.pipe_split()` markers when the
  ///   program has any, else "blocks" when the model repeats blocks, else "modules" (a model
  ///   whose forward calls a single submodule, such as one nn.Sequential, by the first depth that
  ///   gives more than one segment);
  /// - "blocks": one segment per repeated block, through any wrappers (a transformers decoder
  ///   layer `model.model.layers.3`, a ResNet block `layer2.1`, a ViT encoder layer), named by
  ///   its module path; what runs before the first block (the embedding) and after the last (the
  ///   norm and head) are a segment each; refused when nothing repeats;
  /// - "modules": one segment per top-level submodule, from each node's nn_module_stack
  ///   (`embed`, `layers.0`, ..., `norm`, `head`); "modules:K" per submodule K deep
  ///   (`layers.0.attn`); nodes of an enclosing module, and nodes PyTorch made without one, join
  ///   the segment before them;
  /// - "markers": at the pipe_split() markers only;
  /// - "nodes": every op its own segment (cut anywhere).
  std::string segments = "auto";
  /// The program's name in the archive ("model": what torch.export.save writes).
  std::string program = "model";
};

/// True in a build that reads PT2 archives (the PyTorch 2.x line).
bool exported_programs_supported();

/// The ops Python libraries register (torch.library) that exported programs may call and that
/// actorpipe runs with kernels and autograd formulas of its own, as "namespace::name":
/// transformers' mixture-of-experts grouped product (`transformers::grouped_mm_fallback`). Any
/// other op not registered in this process is refused by name. Empty on the 1.13 line.
std::vector<std::string> library_ops();

/// True when `bytes` are a PT2 archive (a zip with archive_format "pt2"), on either line.
bool is_exported_archive(const std::string& bytes);

/// Reads the PT2 archive at `path` as a layer list. Each layer is a segment of the graph: it
/// takes the bundle of values live where it starts (named by the graph's value names: the
/// residual stream, masks, rotary tables, a U-Net's skips; integer and bool tensors forward only)
/// and returns those live where it ends; the first takes the program's user inputs in order,
/// the last returns the output the loss reads: forward's only tensor, else the entry `logits` of
/// the dict or ModelOutput it returns (transformers' models), else its first tensor (the others
/// are not kept). Parameters are leaf tensors the segments register under their
/// names in the Python module (`layers.0.attn.wq.weight`: layer::qualified), a parameter used by
/// several segments (an embedding tied to the head) is a tied parameter (tied_parameters);
/// buffers the graph writes (batch norm's statistics) change as in eager; train/eval mode
/// follows the layer (dropout and batch norm as `train`/`training` arguments).
///
/// Throws invalid_argument naming the file and, where there is one, the node and op: not a PT2
/// archive or truncated, another schema major version, a higher-order op (none runs), an op not
/// registered in this process (a custom op; the ops of Python libraries actorpipe runs itself
/// are library_ops()), a decomposed graph (run_decompositions()) with an
/// op that has no autograd formula, a tensor-subclass weight, inputs or outputs that are not
/// tensors, an unknown `segments`; on the 1.13 line, every archive, naming the line that reads it.
layer_list load_exported(const std::string& path, const exported_options& options = {});

/// The same from the bytes of such a file (as nodes receive it); `what` names them in errors.
layer_list load_exported_bytes(const std::string& bytes, const std::string& what,
                               const exported_options& options = {});

/// A model file written by Python, told apart by its contents: a PT2 archive (load_exported_bytes)
/// or a TorchScript file (load_torchscript_bytes).
layer_list load_model_file(const std::string& bytes, const std::string& what,
                           const exported_options& options = {});

/// True when `layers` are the layers one load_exported gave (in order, all of them).
bool is_exported(const layer_list& layers);

/// The program's parameters and persistent buffers: (name in the Python module's state_dict,
/// name in the pipeline's state), every name of a tied parameter included. For a state_dict
/// that `model.load_state_dict` accepts.
std::vector<std::pair<std::string, std::string>> exported_state_names(const layer_list& layers);

/// Writes the archive `layers` were loaded from to `path` with its weights taken from `state`
/// (named as exported_state_names' second; tensors not in `state` keep the archive's values):
/// Python's `torch.export.load(path).module()` runs the trained model. Written to a temporary
/// name and renamed, so a failure leaves what was at `path`. Throws invalid_argument when
/// `layers` are not from load_exported or a tensor has another shape, pipeline_error (io) when
/// the file cannot be written.
void save_exported(const layer_list& layers, const std::map<std::string, torch::Tensor>& state,
                   const std::string& path);

/// How the tensors of a weights file and a program's state_dict are named for each other: the
/// same, or one side with one prefix more (a wrapper's `model.`).
struct weight_names {
  /// (name in the file, name in the pipeline's state: exported_state_names' second), in the
  /// file's order.
  std::vector<std::pair<std::string, std::string>> names;
  /// The folder whose config.json came with the weights ("" when none did).
  std::string config_folder;
};

/// Sets the parameters and persistent buffers of `layers` (from load_exported) from `weights`
/// (read_pretrained: a save_pretrained folder or a safetensors file), matched by name: the same
/// names, or the names after the one prefix that all of one side's names start with and the
/// other's lack (`model.` of a wrapper around a transformers model). Everything is checked before
/// anything is set: a tensor the program needs that the file lacks, one the file has that the
/// program does not, or one of another shape or dtype is refused by name (invalid_argument).
/// Tensors are copied one at a time, the file's pages given back after each. Returns the names
/// as matched, for writing the trained weights back under the file's names.
weight_names init_exported(const layer_list& layers, const pretrained_weights& weights);

/// The names the program's state has for itself (each tensor once, under its first name), for
/// writing weights of a program that did not start from a file.
weight_names own_weight_names(const layer_list& layers);

/// The bytes of the PT2 archive `layers` came from, its weights as the program's tensors hold
/// them now (after init_exported): what nodes and further replicas are sent.
std::string exported_bytes(const layer_list& layers);

/// `state` (pipeline::state_dict(): exported_state_names' second names) as `names` has them, for
/// write_pretrained. Throws invalid_argument naming a tensor `state` lacks.
named_tensors weights_for_file(const std::map<std::string, torch::Tensor>& state,
                               const weight_names& names);

} // namespace actorpipe
