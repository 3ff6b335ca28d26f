#include "stages/checkpoint.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <regex>
#include <set>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include <actorpipe/errors.hpp>

#include "stages/stage.hpp"

namespace actorpipe::stages {
std::string stage_file(const std::string& dir, std::size_t stage) {
  return detail::concat(dir, "/stage-", stage, ".pt");
}

std::vector<char> pickle_tensors(const tensor_map& tensors) {
  c10::Dict<std::string, torch::Tensor> dict;
  for (const auto& [key, value] : tensors) {
    dict.insert(key, value);
  }
  return torch::pickle_save(dict);
}

tensor_map unpickle_tensors(std::vector<char> bytes, const std::string& what) {
  tensor_map result;
  try {
    auto value = torch::pickle_load(bytes);
    for (const auto& entry : value.toGenericDict()) {
      result[entry.key().toStringRef()] = entry.value().toTensor();
    }
  } catch (const c10::Error& e) {
    throw pipeline_error(detail::concat(what, " is not a tensor file written by actorpipe: ",
                                        detail::first_line(e.what_without_backtrace())),
                         error_details{error_kind::io});
  }
  return result;
}

namespace {

constexpr char pack_magic[4] = {'A', 'P', 'S', '1'};
constexpr std::size_t pack_alignment = 64;

std::size_t aligned(std::size_t offset) {
  return (offset + pack_alignment - 1) / pack_alignment * pack_alignment;
}

bool packable(c10::ScalarType t) {
  switch (t) {
  case c10::kFloat:
  case c10::kDouble:
  case c10::kHalf:
  case c10::kBFloat16:
  case c10::kLong:
  case c10::kInt:
  case c10::kShort:
  case c10::kChar:
  case c10::kByte:
  case c10::kBool:
    return true;
  default:
    return false;
  }
}

} // namespace

packed_bytes pack_tensors(const tensor_map& tensors) {
  packed_bytes out;
  pack_tensors_into(tensors, out);
  return out;
}

void pack_tensors_into(const tensor_map& tensors, packed_bytes& out) {
  std::vector<torch::Tensor> dense;
  std::size_t size = sizeof pack_magic + 4;
  for (const auto& [name, t] : tensors) {
    ACTORPIPE_CHECK(t.defined() && (t.device().is_cpu() || t.device().is_cuda()) &&
                      packable(t.scalar_type()),
                    "pack_tensors: '", name, "' is not a CPU or CUDA tensor of a packable dtype");
    dense.push_back(t.contiguous());
    size = aligned(size + 4 + name.size() + 2 + 8 * static_cast<std::size_t>(t.dim()) + 8) +
           static_cast<std::size_t>(t.nbytes());
  }
  // Not zeroed: every byte is written below (zeroing hundreds of megabytes first costs about as
  // much as the copy). The padding is zeroed where it is skipped.
  out.resize(size);
  std::size_t at = 0;
  auto put = [&](const void* p, std::size_t n) {
    std::memcpy(out.data() + at, p, n);
    at += n;
  };
  put(pack_magic, sizeof pack_magic);
  auto count = static_cast<uint32_t>(tensors.size());
  put(&count, 4);
  std::size_t k = 0;
  for (const auto& [name, original] : tensors) {
    const auto& t = dense[k++];
    auto length = static_cast<uint32_t>(name.size());
    put(&length, 4);
    put(name.data(), name.size());
    auto dtype = static_cast<uint8_t>(t.scalar_type());
    auto ndim = static_cast<uint8_t>(t.dim());
    put(&dtype, 1);
    put(&ndim, 1);
    for (auto d : t.sizes()) {
      int64_t dim = d;
      put(&dim, 8);
    }
    auto bytes = static_cast<uint64_t>(t.nbytes());
    put(&bytes, 8);
    auto padded = aligned(at);
    std::memset(out.data() + at, 0, padded - at);
    at = padded;
    if (bytes > 0 && t.is_cuda()) {
      // Straight from the GPU into the frame (the stage's stream was synchronised after its step).
      torch::from_blob(out.data() + at, t.sizes(), t.options().device(torch::kCPU)).copy_(t);
      at += bytes;
    } else if (bytes > 0) {
      put(t.data_ptr(), bytes);
    }
  }
}

namespace {

// Reads a packed frame front to back; each refusal names the frame (`what`) and the field.
struct pack_reader {
  const char* base;
  std::size_t size;
  const std::string& what;
  std::size_t at = 0;

  pipeline_error fail(const std::string& why) const {
    return pipeline_error(detail::concat(what, " is not packed state: ", why),
                          error_details{error_kind::io});
  }
  void take(void* p, std::size_t n, const char* field) {
    if (n > size - at) {
      throw fail(detail::concat("truncated in ", field, " at byte ", at, " of ", size));
    }
    std::memcpy(p, base + at, n);
    at += n;
  }
};

// One tensor's header in a frame: its name, dtype, shape and payload size, checked.
struct packed_header {
  std::string name;
  c10::ScalarType type;
  std::vector<int64_t> shape;
  uint64_t payload = 0;
};

// The element count of `shape`, saturated past 2^40 (which the caller refuses).
uint64_t element_count(const std::vector<int64_t>& shape) {
  constexpr uint64_t most = uint64_t{1} << 40;
  uint64_t elements = 1;
  for (auto d : shape) {
    auto n = static_cast<uint64_t>(d);
    if (n == 0) {
      return 0;
    }
    elements = elements > most / n ? most + 1 : elements * n;
  }
  return elements;
}

packed_header read_header(pack_reader& in, uint32_t i) {
  packed_header h;
  uint32_t length = 0;
  in.take(&length, 4, "a name's length");
  if (length > in.size - in.at || length > 4096) {
    throw in.fail(detail::concat("tensor ", i, "'s name of ", length, " bytes"));
  }
  h.name.assign(in.base + in.at, length);
  in.at += length;
  uint8_t dtype = 0;
  uint8_t ndim = 0;
  in.take(&dtype, 1, "a dtype");
  in.take(&ndim, 1, "a dimension count");
  if (dtype >= static_cast<uint8_t>(c10::ScalarType::NumOptions) ||
      !packable(static_cast<c10::ScalarType>(dtype)) || ndim > 8) {
    throw in.fail(
      detail::concat("'", h.name, "' has dtype ", int{dtype}, " and ", int{ndim}, " dimensions"));
  }
  h.type = static_cast<c10::ScalarType>(dtype);
  h.shape.resize(ndim);
  for (auto& d : h.shape) {
    in.take(&d, 8, "a dimension");
    if (d < 0 || d > (int64_t{1} << 40)) {
      throw in.fail(detail::concat("'", h.name, "' has a dimension of ", d));
    }
  }
  auto elements = element_count(h.shape);
  in.take(&h.payload, 8, "a payload size");
  if (elements > (uint64_t{1} << 40) ||
      h.payload != elements * static_cast<uint64_t>(c10::elementSize(h.type))) {
    throw in.fail(detail::concat("'", h.name, "' has ", h.payload, " bytes for shape ",
                                 c10::IntArrayRef(h.shape)));
  }
  return h;
}

} // namespace

tensor_map unpack_tensors(const torch::Tensor& bytes, const std::string& what) {
  pack_reader in{nullptr, 0, what};
  if (!bytes.defined() || bytes.scalar_type() != torch::kUInt8 || bytes.dim() != 1 ||
      !bytes.is_contiguous()) {
    throw in.fail("not a contiguous uint8 tensor");
  }
  in.base = static_cast<const char*>(bytes.data_ptr());
  in.size = static_cast<std::size_t>(bytes.numel());
  if (reinterpret_cast<std::uintptr_t>(in.base) % pack_alignment != 0) {
    throw in.fail("its buffer is not 64-byte aligned");
  }
  char magic[4];
  in.take(magic, 4, "the magic");
  if (std::memcmp(magic, pack_magic, 4) != 0) {
    throw in.fail("wrong magic");
  }
  uint32_t count = 0;
  in.take(&count, 4, "the count");
  tensor_map result;
  for (uint32_t i = 0; i < count; ++i) {
    auto h = read_header(in, i);
    in.at = std::min(aligned(in.at), in.size);
    if (h.payload > in.size - in.at) {
      throw in.fail(detail::concat("'", h.name, "' is truncated"));
    }
    // A view of the frame's buffer, which it keeps alive.
    auto keep = bytes;
    result[h.name] = torch::from_blob(
      const_cast<char*>(in.base + in.at), h.shape, [keep](void*) {},
      torch::TensorOptions().dtype(h.type));
    in.at += h.payload;
  }
  if (in.at != in.size) {
    throw in.fail(detail::concat(in.size - in.at, " bytes after the last tensor"));
  }
  return result;
}

namespace {

std::string megabytes(uintmax_t bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / 1e6 << " MB";
  return out.str();
}

// Why writing `size` bytes to `path` failed (`error`: errno then): disk_full where its file
// system had no room (ENOSPC, or less space left than the file needs), io otherwise.
pipeline_error write_failure(const std::string& path, std::size_t size, int error) {
  auto folder = std::filesystem::path(path).parent_path();
  std::error_code ec;
  auto space = std::filesystem::space(folder.empty() ? "." : folder, ec);
  if (error == ENOSPC || (!ec && space.available < size)) {
    return pipeline_error(
      detail::concat("cannot write '", path, "' (", megabytes(size), "): its disk is full (",
                     ec ? std::string("space left unknown") : megabytes(space.available) + " free",
                     "); free space or write elsewhere"),
      error_details{error_kind::disk_full});
  }
  return pipeline_error(detail::concat("cannot write '", path, "'",
                                       error != 0 ? ": " + std::string(std::strerror(error)) : ""),
                        error_details{error_kind::io});
}

} // namespace

void write_bytes(const std::string& path, const char* data, std::size_t size) {
  errno = 0;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data, static_cast<std::streamsize>(size));
  out.flush();
  if (out) {
    out.close(); // a file system may report a full disk only now
  }
  if (!out) {
    throw write_failure(path, size, errno);
  }
}

std::string partial_state_error(const tensor_map& tensors) {
  auto where = tensors.at(partial_state_key);
  return detail::concat(
    "the optimizer state is sharded across ", where[1].item<int64_t>(),
    " replicas (data_parallel_options::shard) and this is replica ", where[0].item<int64_t>(),
    "'s part: a whole state is on replica 0 after pipeline::end_block() on every replica, until "
    "the next step (train() and replicated_pipeline::save_state do this; snapshots of sharded "
    "replicas are not supported)");
}

void save_tensors(const std::string& path, const tensor_map& tensors) {
  if (tensors.count(partial_state_key) != 0) {
    throw invalid_argument(partial_state_error(tensors));
  }
  auto bytes = pickle_tensors(tensors);
  write_bytes(path, bytes.data(), bytes.size());
}

tensor_map load_tensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw pipeline_error(detail::concat("cannot read '", path, "'"), error_details{error_kind::io});
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return unpickle_tensors(std::move(bytes), detail::concat("'", path, "'"));
}

tensor_map read_checkpoint(const std::string& dir) {
  tensor_map all;
  const std::regex stage_file_name{R"(stage-[0-9]+\.pt)"};
  std::size_t files = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (!std::regex_match(entry.path().filename().string(), stage_file_name)) {
      continue;
    }
    ++files;
    for (auto& [key, value] : load_tensors(entry.path().string())) {
      if (!all.emplace(key, std::move(value)).second) {
        throw pipeline_error(
          detail::concat("load_state: tensor '", key, "' appears twice in '", dir, "'"),
          error_details{error_kind::io});
      }
    }
  }
  if (ec || files == 0) {
    throw pipeline_error(detail::concat("load_state: no stage-*.pt files in '", dir, "'",
                                        ec ? ": " + ec.message() : std::string{}),
                         error_details{error_kind::io});
  }
  return all;
}

void check_checkpoint(const tensor_map& all, const std::vector<std::shared_ptr<stage>>& stages,
                      const std::string& dir) {
  std::set<std::string> known;
  for (const auto& st : stages) {
    auto index = st->config().index;
    for (const auto& [key, shape] : st->required_keys()) {
      auto it = all.find(key);
      if (it == all.end()) {
        throw pipeline_error(detail::concat("load_state: '", dir, "' has no tensor '", key,
                                            "' (needed by stage ", index, ")"),
                             error_details{error_kind::io, index});
      }
      if (it->second.sizes().vec() != shape) {
        throw pipeline_error(detail::concat("load_state: tensor '", key, "' in '", dir,
                                            "' has shape ", it->second.sizes(), " but stage ",
                                            index, " needs ", c10::IntArrayRef(shape)),
                             error_details{error_kind::shape_mismatch, index});
      }
      known.insert(key);
    }
  }
  for (const auto& [key, value] : all) {
    auto name = key;
    if (name.rfind("optimizer/", 0) == 0) {
      name = name.substr(10, name.rfind('/') - 10);
    }
    if (known.count(name) == 0) {
      throw pipeline_error(detail::concat("load_state: '", dir, "' holds tensor '", key,
                                          "', which this model does not have"),
                           error_details{error_kind::io});
    }
  }
}

} // namespace actorpipe::stages
