/// \file
/// The binary frame that carries one tensor between processes (docs/wire-format.md).
///
/// A frame is a fixed 40-byte header, the shape (8 bytes per dimension) and the tensor's bytes,
/// all little-endian:
///
///     offset  size  field
///          0     4  magic "APW1"
///          4     1  version (2)
///          5     1  kind (frame_kind)
///          6     1  dtype code (see dtype_code)
///          7     1  ndim (0..8)
///          8     4  stage: the stage actor the frame is for (or, for outputs and state, from)
///         12     4  microbatch (int32)
///         16     4  chunk (int32, the receiver's local chunk)
///         20     1  part: this tensor's position in its bundle
///         21     1  parts: the bundle's tensor count (0: an empty bundle, sent as one frame
///                   with an empty payload)
///         22     1  flags: bit 0 = the tensor needs a gradient back (an activation whose
///                   sender's graph reaches it); bit 1 = this part is not a tensor of the
///                   bundle but its names (uint8 bytes, each name ended by a 0 byte; the
///                   bundle's last part); not both; other bits 0
///         23     1  reserved, 0
///         24     8  step (uint64)
///         32     8  payload bytes (uint64) = product(shape) * element size
///         40  8*nd  shape (int64 each)
///
/// A bundle (<actorpipe/bundle.hpp>) crosses as `parts` frames in a row on one connection,
/// parts 0..parts-1. The shape travels with every payload, so variable shapes need no extra
/// round trip. Everything
/// read is checked before it is trusted: a bad magic, version, kind or dtype, too many
/// dimensions, a negative or absurd dimension, a payload length that does not match the shape or
/// exceeds the receiver's limit, and a truncated frame all throw frame_error.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace actorpipe::comm {

/// What a frame carries.
enum class frame_kind : uint8_t {
  /// An activation for stage `stage`, chunk `chunk` (also the first stage's inputs).
  activation = 1,
  /// A gradient for stage `stage`.
  gradient = 2,
  /// A target for the last stage (training).
  target = 3,
  /// A forward-only output of the last stage, back to the scheduler.
  output = 4,
  /// A stage's serialised state (bytes, dtype uint8): a checkpoint going to or from a node.
  state = 5,
  /// A stage's gradients of parameters tied to stage `stage`'s, for the sum of `step`
  /// (comm::tie_group): a bundle of the ties' indices (int64, in tied_parameters order) and
  /// their gradients; `microbatch` is the sending stage.
  tied_gradient = 6,
};

const char* to_string(frame_kind kind);

/// A malformed or truncated frame.
class frame_error : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

constexpr std::size_t fixed_header_bytes = 40;
constexpr std::size_t max_frame_dims = 8;

/// The receiver's limits.
struct frame_limits {
  /// Largest payload accepted (bytes).
  uint64_t max_payload_bytes = uint64_t{16} << 30;
};

struct frame_header {
  frame_kind kind = frame_kind::activation;
  uint32_t stage = 0;
  uint64_t step = 0;
  int32_t microbatch = 0;
  int32_t chunk = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  uint64_t payload_bytes = 0;
  /// This tensor's position in its bundle, the bundle's size, and whether the tensor needs a
  /// gradient back.
  uint8_t part = 0;
  uint8_t parts = 1;
  bool needs_gradient = false;
  /// The part is the names of a named bundle (flags bit 1).
  bool names = false;
};

/// A decoded frame: its header and a tensor that owns the payload (CPU, contiguous).
struct frame {
  frame_header header;
  at::Tensor tensor;
};

/// The wire code of a dtype; throws frame_error for dtypes the format does not carry.
uint8_t dtype_code(c10::ScalarType dtype);

/// The header of a frame carrying `t` (any device; its bytes must be sent contiguous from CPU).
frame_header describe(frame_kind kind, uint32_t stage, uint64_t step, int32_t microbatch,
                      int32_t chunk, const at::Tensor& t);

/// Header bytes (fixed part and shape) of `h`.
std::vector<uint8_t> encode_header(const frame_header& h);

/// The number of shape bytes that follow a fixed header; checks magic, version, kind, dtype,
/// ndim and reserved.
std::size_t shape_bytes(const uint8_t* fixed);

/// Decodes and checks a complete header (`size` = fixed_header_bytes + shape bytes).
frame_header decode_header(const uint8_t* data, std::size_t size, const frame_limits& limits);

/// Reads exactly `n` bytes into `out`; returns how many it got (fewer only at the end of input).
using read_fn = std::function<std::size_t(void* out, std::size_t n)>;

/// Makes the tensor a checked header's payload is read into (default: at::empty).
using allocate_fn = std::function<at::Tensor(const frame_header&)>;

/// Reads one frame with `read`. Returns false on a clean end of input before the first byte;
/// throws frame_error on a malformed or truncated frame. The payload is read straight into the
/// tensor `allocate` makes, only once the header has passed every check.
bool read_frame(const read_fn& read, const frame_limits& limits, frame& out,
                const allocate_fn& allocate = {});

/// A whole frame as bytes (tests, fuzzing and small control payloads).
std::vector<uint8_t> encode_frame(const frame_header& h, const at::Tensor& t);

/// Decodes a frame held in memory; throws frame_error unless `size` is exactly one frame.
frame decode_frame(const uint8_t* data, std::size_t size, const frame_limits& limits = {});

} // namespace actorpipe::comm
