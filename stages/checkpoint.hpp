/// \file
/// Checkpoint files, in one place: the tensor file of a stage (libtorch's pickle format, which
/// torch.load reads in Python), tensors keyed model-wide so that a pipeline cut differently can
/// load them, and reading a checkpoint folder with every tensor checked against what the stages
/// need before any of them changes. Manifests and atomic folders of training runs build on this
/// (training/checkpoint.cpp); nodes send state packed (pack_tensors) in state frames.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace actorpipe::stages {

class stage;

/// Tensors keyed model-wide: "<layer>.<name>" for parameters and buffers,
/// "optimizer/<layer>.<name>/<field>" for optimizer state.
using tensor_map = std::map<std::string, torch::Tensor>;

/// "<dir>/stage-<stage>.pt": where stage `stage` of a pipeline keeps its part of a checkpoint.
std::string stage_file(const std::string& dir, std::size_t stage);

/// The bytes save_tensors writes (libtorch's pickle format).
std::vector<char> pickle_tensors(const tensor_map& tensors);

/// Tensors from pickle_tensors' bytes; throws pipeline_error (io) naming `what` on bad input.
tensor_map unpickle_tensors(std::vector<char> bytes, const std::string& what);

/// An allocator whose elements start uninitialised (a vector<char> would zero them first).
template <class T>
struct default_init_allocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = default_init_allocator<U>;
  };
  using std::allocator<T>::allocator;
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

/// pack_tensors' bytes: every one written once, none zeroed first.
using packed_bytes = std::vector<char, default_init_allocator<char>>;

/// State as it crosses between processes (a state frame's payload): the tensors one after the
/// other without pickling, each payload 64-byte aligned. "APS1", uint32 count, then per tensor
/// uint32 name length, the name, uint8 dtype (c10::ScalarType), uint8 ndim, int64 shape[ndim],
/// uint64 payload bytes, padding to 64, the payload. A pickle goes through libtorch's own
/// buffers at about 110 MB/s (BENCHMARKS.md); this is one copy on the sender and none on the
/// receiver. Tensors on a GPU are copied straight into the bytes (their stream must be done
/// with them); the receiver gets CPU tensors.
packed_bytes pack_tensors(const tensor_map& tensors);

/// The same into `out`, resized to fit: a buffer packed into again is not allocated again (nor
/// are its pages faulted in again), which for hundreds of megabytes costs as much as the copy.
void pack_tensors_into(const tensor_map& tensors, packed_bytes& out);

/// The tensors of pack_tensors' bytes held by `bytes` (a uint8 tensor, 64-byte aligned), as
/// views of its memory that keep it alive: no copy. Everything is checked before it is read;
/// throws pipeline_error (io) naming `what` and the problem.
tensor_map unpack_tensors(const torch::Tensor& bytes, const std::string& what);

/// Writes `size` bytes to `path` (replacing it); throws pipeline_error naming the file: kind
/// disk_full, with its size and the space left, where its file system has no room; io otherwise.
void write_bytes(const std::string& path, const char* data, std::size_t size);

/// The key a stage's state carries when it holds only its replica's part of a sharded optimizer
/// state (stage::checkpoint_state): such a state is never written (save_tensors) nor loaded
/// (stage::load_state); its value is {rank, replicas}.
inline constexpr const char* partial_state_key = "optimizer/:sharded";

/// Why a state with partial_state_key cannot be written or loaded.
std::string partial_state_error(const tensor_map& tensors);

/// Writes `tensors` to `path` in libtorch's pickle format (readable by torch.load in Python).
/// Throws pipeline_error (io, or disk_full: write_bytes) naming the file when it cannot be
/// written, invalid_argument for a state that holds part of a sharded optimizer state.
void save_tensors(const std::string& path, const tensor_map& tensors);

/// Reads a file written by save_tensors. Throws pipeline_error (io) naming the file and the
/// problem.
tensor_map load_tensors(const std::string& path);

/// Every stage-*.pt file of the checkpoint folder `dir`, merged (a pipeline cut another way
/// wrote it). Throws pipeline_error (io) when there is none or a tensor appears twice.
tensor_map read_checkpoint(const std::string& dir);

/// Checks that `all` (read from `dir`) holds every parameter and buffer each of `stages` needs,
/// with its shape, and nothing this model does not have (optimizer state of unknown
/// parameters included), so that a load changes all stages or none. Throws pipeline_error
/// naming the tensor and the stage.
void check_checkpoint(const tensor_map& all, const std::vector<std::shared_ptr<stage>>& stages,
                      const std::string& dir);

} // namespace actorpipe::stages
