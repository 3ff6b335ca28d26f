/// \file
/// Models written in Python: a TorchScript file (`torch.jit.save(torch.jit.script(model))` of
/// an `nn.Sequential`) as a layer list that trains in a pipeline, and the trained model written
/// back as TorchScript (docs/from-pytorch.md).
#pragma once

#include <functional>
#include <map>
#include <string>

#include <actorpipe/layers.hpp>

namespace actorpipe {

/// Reads a TorchScript file saved by Python's `torch.jit.save(torch.jit.script(model))` where
/// `model` is an `nn.Sequential`, as a layer list: its children in order, nested Sequentials
/// flattened (a child "2" of a Sequential "4" is layer "4.2"). Each layer runs the child's
/// scripted forward and holds the child's own parameters and buffers (named as in Python), so
/// training a layer trains the scripted module; train/eval mode follows the pipeline. A child
/// takes tensors (one, several, or one tuple of them) and returns a tensor or a tuple of tensors;
/// several tensors travel between stages as a bundle (<actorpipe/bundle.hpp>). A Parameter that
/// several children share (a head tied to an embedding) is a tied parameter (tied_parameters).
///
/// Throws invalid_argument naming the file and what is wrong: not a TorchScript file (or
/// truncated), a model that is not an nn.Sequential, a Sequential without children, a child that
/// has no forward or whose forward does not take and return tensors (naming child and types).
layer_list load_torchscript(const std::string& path);

/// The same from the bytes of such a file (as nodes receive it); `what` names them in errors.
layer_list load_torchscript_bytes(const std::string& bytes, const std::string& what);

/// A function of one tensor from the bytes of a TorchScript file: a scripted nn.Module whose
/// forward(x: Tensor) -> Tensor it calls without autograd, in eval mode (a hook: hook_spec).
/// Throws invalid_argument naming `what` when the bytes are no TorchScript file or forward does
/// not take one tensor and return one.
std::function<torch::Tensor(const torch::Tensor&)>
load_torchscript_function(const std::string& bytes, const std::string& what);

/// True when `layers` are the layers one load_torchscript gave (in order, all of them).
bool is_torchscript(const layer_list& layers);

/// Writes the model `layers` were loaded from to `path` as TorchScript, its parameters and
/// buffers taken from `state` (named "<layer>.<name>", as pipeline::save_state and
/// named_parameters name them; tensors not in `state` keep the layers' values), ties kept:
/// Python's `torch.jit.load(path)` runs the trained model. The file is written to a temporary
/// name and renamed, so a failure leaves what was at `path`. Throws invalid_argument when
/// `layers` are not from load_torchscript or a tensor has another shape, pipeline_error (io)
/// when the file cannot be written.
void save_torchscript(const layer_list& layers, const std::map<std::string, torch::Tensor>& state,
                      const std::string& path);

} // namespace actorpipe
