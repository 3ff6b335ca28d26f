/// \file
/// Internal to models/: the rooms that read a PT2 archive into a `program`
/// (models/exported_program.hpp), each entered here. read_program (exported_program.cpp) walks
/// them in order: the archive (exported_archive.cpp), the graph's signature
/// (exported_signature.cpp), the nodes bound against their ops (exported_binding.cpp). Running
/// the nodes is exported_run.cpp's. Compiled on the PyTorch 2.x line only.
#pragma once

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/utils/generated_serialization_types.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/exported_program.hpp"

namespace actorpipe::exported {

// The archive: its records, its program's JSON, its weights and constants.

/// The zip reader of `bytes`; invalid_argument naming `what` when they are no zip.
std::unique_ptr<caffe2::serialize::PyTorchStreamReader> open_archive(const std::string& bytes,
                                                                     const std::string& what);
/// The record of the program `model` ("models/<model>.json"), or invalid_argument naming those
/// the archive holds.
std::string model_entry(caffe2::serialize::PyTorchStreamReader& reader, const std::string& what,
                        const std::string& model);
std::string record(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name);
/// The program in `text` (the record `entry`), refused unless in this build's schema major.
torch::_export::ExportedProgram parse(const std::string& text, const std::string& what,
                                      const std::string& entry);
/// The tensors `config` lists under `folder` ("data/weights/"), by name.
std::map<std::string, at::Tensor> read_payload(caffe2::serialize::PyTorchStreamReader& reader,
                                               const std::string& folder, const std::string& config,
                                               const std::string& what);
c10::ScalarType scalar_type_of(torch::_export::ScalarType s, const std::string& where);
c10::MemoryFormat memory_format_of(torch::_export::MemoryFormat m, const std::string& where);

// The signature: what each input and output of the graph is.

/// Binds the parameters, buffers and constants to their tensors and the user inputs to the
/// program's input slots; `fixed` receives constant inputs (refused by the caller).
void read_inputs(program& p, const torch::_export::GraphSignature& signature,
                 const std::map<std::string, at::Tensor>& weights,
                 const std::map<std::string, at::Tensor>& constants,
                 std::vector<std::pair<slot, c10::IValue>>& fixed);
void read_outputs(program& p, const torch::_export::GraphSignature& signature);
/// Which output the loss reads (the logits of a model returning a dict or a tuple).
void choose_loss_output(program& p, const torch::_export::ExportedProgram& ep);
void read_batch_dimensions(program& p, const torch::_export::ExportedProgram& ep);

// The nodes: each op resolved and each argument bound, once, at load.

/// Every node of `graph` in order, bound against its op's schema; refused by name where
/// actorpipe cannot run it.
void bind_nodes(program& p, const torch::_export::Graph& graph);
/// Marks the nodes eager runs in train mode only (batch norm's counter).
void mark_training_only(program& p);

} // namespace actorpipe::exported
