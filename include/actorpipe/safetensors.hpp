/// \file
/// Weights as safetensors files, the format Hugging Face's `save_pretrained` writes and
/// `from_pretrained` reads: an 8-byte little-endian header length, a JSON header naming each
/// tensor's dtype, shape and byte range, then the raw little-endian bytes. A folder holds one
/// `model.safetensors`, or shards and `model.safetensors.index.json` mapping each name to its
/// shard, beside the model's `config.json` (docs/from-pytorch.md, "Fine-tune a transformers
/// model"). Files are mapped, not read: the tensors are views of the mapping.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

namespace actorpipe {

/// Tensors by name in an order (a file's, or a model's).
using named_tensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// The weights of a safetensors file, or of a `save_pretrained` folder: every tensor as a
/// read-only view of the mapped files (copy it before changing it), in the files' order.
struct pretrained_weights {
  named_tensors tensors;
  /// What was given, for messages.
  std::string path;
  /// The folder whose `config.json` describes the model ("" when it has none).
  std::string config_folder;
  /// The mapped files (opaque); kept alive by the views too.
  std::vector<std::shared_ptr<const void>> mappings;

  /// Gives the pages under `view` (one of `tensors`) back to the system after it was copied: a
  /// load of weights as large as memory copies them tensor by tensor without holding the file
  /// and the copies at once. A later read of `view` reads the file again. Anything that is not
  /// a view of the mappings is left alone.
  void release(const torch::Tensor& view) const;
};

/// Reads `path`: a `.safetensors` file, or a folder with `model.safetensors`, or with
/// `model.safetensors.index.json` and the shards it names. Throws invalid_argument naming the file
/// and what is wrong with it (not a safetensors file, truncated, a header that lies about its
/// sizes, offsets or dtypes, a shard the index names that is missing, a tensor in two shards) and
/// pipeline_error (io) when a file cannot be opened or mapped. Nothing is half-read.
pretrained_weights read_pretrained(const std::string& path);

/// Writes `tensors` (any device; contiguous copies are made where needed) as one safetensors
/// file at `path`, with the metadata {"format": "pt"} that `from_pretrained` asks for. Written to
/// a temporary name and renamed. Throws invalid_argument for a name given twice or a dtype the
/// format has no name for, pipeline_error (io, disk_full) when it cannot be written.
void write_safetensors(const std::string& path, const named_tensors& tensors);

/// Writes `tensors` into the folder `dir` (created) as `save_pretrained` does:
/// `model.safetensors`, or, past `max_shard_bytes`, shards `model-0000K-of-0000N.safetensors` and
/// `model.safetensors.index.json`; copies `config.json` and `generation_config.json` from
/// `config_folder` when it has them, so that `AutoModel*.from_pretrained(dir)` loads the result.
void write_pretrained(const std::string& dir, const named_tensors& tensors,
                      uint64_t max_shard_bytes = uint64_t{5} << 30,
                      const std::string& config_folder = "");

/// The safetensors name of `dtype` ("F32", "BF16", ...); invalid_argument for one it has none for.
std::string safetensors_dtype(c10::ScalarType dtype);

} // namespace actorpipe
