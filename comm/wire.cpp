#include "comm/wire.hpp"

#include <cstring>
#include <limits>

#include <ATen/ops/empty.h>

#include <actorpipe/errors.hpp>

namespace actorpipe::comm {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the wire format is little-endian; add byte swapping for this host");

constexpr std::array<uint8_t, 4> magic = {'A', 'P', 'W', '1'};
constexpr uint8_t version = 2;
// A dimension this large is an attack or a bug, whatever the payload limit says.
constexpr int64_t max_dim = int64_t{1} << 40;

struct dtype_entry {
  uint8_t code;
  c10::ScalarType type;
};

constexpr dtype_entry dtypes[] = {
  {1, c10::ScalarType::Float},    {2, c10::ScalarType::Double}, {3, c10::ScalarType::Half},
  {4, c10::ScalarType::BFloat16}, {5, c10::ScalarType::Long},   {6, c10::ScalarType::Int},
  {7, c10::ScalarType::Short},    {8, c10::ScalarType::Char},   {9, c10::ScalarType::Byte},
  {10, c10::ScalarType::Bool},
};

c10::ScalarType dtype_of(uint8_t code) {
  for (const auto& e : dtypes) {
    if (e.code == code) {
      return e.type;
    }
  }
  throw frame_error(detail::concat("frame has unknown dtype code ", int{code}));
}

template <class T>
void put(std::vector<uint8_t>& out, std::size_t offset, T value) {
  std::memcpy(out.data() + offset, &value, sizeof value);
}

template <class T>
T get(const uint8_t* in, std::size_t offset) {
  T value;
  std::memcpy(&value, in + offset, sizeof value);
  return value;
}

} // namespace

const char* to_string(frame_kind kind) {
  switch (kind) {
  case frame_kind::activation:
    return "activation";
  case frame_kind::gradient:
    return "gradient";
  case frame_kind::target:
    return "target";
  case frame_kind::output:
    return "output";
  case frame_kind::state:
    return "state";
  case frame_kind::tied_gradient:
    return "tied gradient";
  }
  return "unknown";
}

uint8_t dtype_code(c10::ScalarType dtype) {
  for (const auto& e : dtypes) {
    if (e.type == dtype) {
      return e.code;
    }
  }
  throw frame_error(detail::concat("tensors of dtype ", dtype, " cannot cross the wire"));
}

frame_header describe(frame_kind kind, uint32_t stage, uint64_t step, int32_t microbatch,
                      int32_t chunk, const at::Tensor& t) {
  frame_header h;
  h.kind = kind;
  h.stage = stage;
  h.step = step;
  h.microbatch = microbatch;
  h.chunk = chunk;
  h.dtype = t.scalar_type();
  dtype_code(h.dtype);
  h.shape = t.sizes().vec();
  h.payload_bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
  ACTORPIPE_CHECK(h.shape.size() <= max_frame_dims, "a tensor of ", h.shape.size(),
                  " dimensions cannot cross the wire (at most ", max_frame_dims, ")");
  return h;
}

std::vector<uint8_t> encode_header(const frame_header& h) {
  std::vector<uint8_t> out(fixed_header_bytes + 8 * h.shape.size(), 0);
  std::memcpy(out.data(), magic.data(), magic.size());
  out[4] = version;
  out[5] = static_cast<uint8_t>(h.kind);
  out[6] = dtype_code(h.dtype);
  out[7] = static_cast<uint8_t>(h.shape.size());
  put(out, 8, h.stage);
  put(out, 12, h.microbatch);
  put(out, 16, h.chunk);
  out[20] = h.part;
  out[21] = h.parts;
  out[22] = static_cast<uint8_t>((h.needs_gradient ? 1 : 0) | (h.names ? 2 : 0));
  put(out, 24, h.step);
  put(out, 32, h.payload_bytes);
  for (std::size_t d = 0; d < h.shape.size(); ++d) {
    put(out, fixed_header_bytes + 8 * d, h.shape[d]);
  }
  return out;
}

std::size_t shape_bytes(const uint8_t* fixed) {
  if (std::memcmp(fixed, magic.data(), magic.size()) != 0) {
    throw frame_error("frame does not start with the magic \"APW1\" (not an actorpipe peer, or "
                      "the stream lost its place)");
  }
  if (fixed[4] != version) {
    throw frame_error(
      detail::concat("frame has version ", int{fixed[4]}, ", this build reads ", int{version}));
  }
  if (fixed[5] < 1 || fixed[5] > static_cast<uint8_t>(frame_kind::tied_gradient)) {
    throw frame_error(detail::concat("frame has unknown kind ", int{fixed[5]}));
  }
  dtype_of(fixed[6]);
  if (fixed[7] > max_frame_dims) {
    throw frame_error(
      detail::concat("frame has ", int{fixed[7]}, " dimensions (at most ", max_frame_dims, ")"));
  }
  if (fixed[22] > 2 || fixed[23] != 0) {
    throw frame_error("frame has unknown flags or non-zero reserved bytes");
  }
  if (fixed[21] == 0 ? fixed[20] != 0 : fixed[20] >= fixed[21]) {
    throw frame_error(detail::concat("frame is part ", int{fixed[20]}, " of a bundle of ",
                                     int{fixed[21]}, " tensors"));
  }
  return 8 * std::size_t{fixed[7]};
}

frame_header decode_header(const uint8_t* data, std::size_t size, const frame_limits& limits) {
  if (size < fixed_header_bytes) {
    throw frame_error(
      detail::concat("truncated frame header: ", size, " of ", fixed_header_bytes, " bytes"));
  }
  auto extra = shape_bytes(data);
  if (size != fixed_header_bytes + extra) {
    throw frame_error(
      detail::concat("frame header of ", size, " bytes, expected ", fixed_header_bytes + extra));
  }
  frame_header h;
  h.kind = static_cast<frame_kind>(data[5]);
  h.dtype = dtype_of(data[6]);
  h.stage = get<uint32_t>(data, 8);
  h.microbatch = get<int32_t>(data, 12);
  h.chunk = get<int32_t>(data, 16);
  h.part = data[20];
  h.parts = data[21];
  h.needs_gradient = data[22] == 1;
  h.names = data[22] == 2;
  h.step = get<uint64_t>(data, 24);
  h.payload_bytes = get<uint64_t>(data, 32);
  uint64_t elements = 1;
  for (std::size_t d = 0; d < data[7]; ++d) {
    auto dim = get<int64_t>(data, fixed_header_bytes + 8 * d);
    if (dim < 0 || dim > max_dim) {
      throw frame_error(detail::concat("frame has dimension ", d, " of size ", dim));
    }
    h.shape.push_back(dim);
    if (dim != 0 && elements > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(dim)) {
      throw frame_error("frame shape overflows the element count");
    }
    elements *= static_cast<uint64_t>(dim);
  }
  auto element_size = static_cast<uint64_t>(c10::elementSize(h.dtype));
  if (elements > std::numeric_limits<uint64_t>::max() / element_size ||
      elements * element_size != h.payload_bytes) {
    throw frame_error(detail::concat("frame payload of ", h.payload_bytes,
                                     " bytes does not match its shape ", c10::IntArrayRef(h.shape),
                                     " of ", h.dtype));
  }
  if (h.payload_bytes > limits.max_payload_bytes) {
    throw frame_error(detail::concat("frame payload of ", h.payload_bytes,
                                     " bytes exceeds the limit of ", limits.max_payload_bytes));
  }
  return h;
}

bool read_frame(const read_fn& read, const frame_limits& limits, frame& out,
                const allocate_fn& allocate) {
  std::vector<uint8_t> head(fixed_header_bytes);
  auto got = read(head.data(), fixed_header_bytes);
  if (got == 0) {
    return false;
  }
  if (got < fixed_header_bytes) {
    throw frame_error(
      detail::concat("truncated frame header: ", got, " of ", fixed_header_bytes, " bytes"));
  }
  auto extra = shape_bytes(head.data());
  head.resize(fixed_header_bytes + extra);
  if (extra > 0 && read(head.data() + fixed_header_bytes, extra) < extra) {
    throw frame_error("truncated frame: the shape is cut short");
  }
  out.header = decode_header(head.data(), head.size(), limits);
  out.tensor = allocate ? allocate(out.header)
                        : at::empty(out.header.shape, at::TensorOptions().dtype(out.header.dtype));
  if (out.header.payload_bytes > 0) {
    auto n = static_cast<std::size_t>(out.header.payload_bytes);
    auto payload = read(out.tensor.data_ptr(), n);
    if (payload < n) {
      throw frame_error(detail::concat("truncated frame: ", payload, " of ", n, " payload bytes"));
    }
  }
  return true;
}

std::vector<uint8_t> encode_frame(const frame_header& h, const at::Tensor& t) {
  auto bytes = encode_header(h);
  auto cpu = t.cpu().contiguous();
  auto* p = static_cast<const uint8_t*>(cpu.data_ptr());
  bytes.insert(bytes.end(), p, p + h.payload_bytes);
  return bytes;
}

frame decode_frame(const uint8_t* data, std::size_t size, const frame_limits& limits) {
  std::size_t pos = 0;
  auto read = [&](void* out, std::size_t n) {
    auto k = std::min(n, size - pos);
    if (k > 0) {
      std::memcpy(out, data + pos, k);
    }
    pos += k;
    return k;
  };
  frame f;
  if (!read_frame(read, limits, f)) {
    throw frame_error("empty input holds no frame");
  }
  if (pos != size) {
    throw frame_error(detail::concat(size - pos, " bytes follow the frame"));
  }
  return f;
}

} // namespace actorpipe::comm
