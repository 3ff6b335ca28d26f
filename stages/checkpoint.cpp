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

tensor_map unpack_tensors(const torch::Tensor& bytes, const std::string& what) {
  auto fail = [&](const std::string& why) -> pipeline_error {
    return pipeline_error(detail::concat(what, " is not packed state: ", why),
                          error_details{error_kind::io});
  };
  if (!bytes.defined() || bytes.scalar_type() != torch::kUInt8 || bytes.dim() != 1 ||
      !bytes.is_contiguous()) {
    throw fail("not a contiguous uint8 tensor");
  }
  const auto* base = static_cast<const char*>(bytes.data_ptr());
  const auto size = static_cast<std::size_t>(bytes.numel());
  if (reinterpret_cast<std::uintptr_t>(base) % pack_alignment != 0) {
    throw fail("its buffer is not 64-byte aligned");
  }
  std::size_t at = 0;
  auto take = [&](void* p, std::size_t n, const char* field) {
    if (n > size - at) {
      throw fail(detail::concat("truncated in ", field, " at byte ", at, " of ", size));
    }
    std::memcpy(p, base + at, n);
    at += n;
  };
  char magic[4];
  take(magic, 4, "the magic");
  if (std::memcmp(magic, pack_magic, 4) != 0) {
    throw fail("wrong magic");
  }
  uint32_t count = 0;
  take(&count, 4, "the count");
  tensor_map result;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t length = 0;
    take(&length, 4, "a name's length");
    if (length > size - at || length > 4096) {
      throw fail(detail::concat("tensor ", i, "'s name of ", length, " bytes"));
    }
    std::string name(base + at, length);
    at += length;
    uint8_t dtype = 0;
    uint8_t ndim = 0;
    take(&dtype, 1, "a dtype");
    take(&ndim, 1, "a dimension count");
    if (dtype >= static_cast<uint8_t>(c10::ScalarType::NumOptions) ||
        !packable(static_cast<c10::ScalarType>(dtype)) || ndim > 8) {
      throw fail(
        detail::concat("'", name, "' has dtype ", int{dtype}, " and ", int{ndim}, " dimensions"));
    }
    auto type = static_cast<c10::ScalarType>(dtype);
    std::vector<int64_t> shape(ndim);
    uint64_t elements = 1;
    for (auto& d : shape) {
      take(&d, 8, "a dimension");
      if (d < 0 || d > (int64_t{1} << 40)) {
        throw fail(detail::concat("'", name, "' has a dimension of ", d));
      }
    }
    constexpr uint64_t most = uint64_t{1} << 40;
    bool zero = false;
    for (auto d : shape) {
      auto n = static_cast<uint64_t>(d);
      zero = zero || n == 0;
      // Past 2^40 elements it is refused below: saturate instead of overflowing.
      elements = n != 0 && elements > most / n ? most + 1 : elements * std::max<uint64_t>(n, 1);
    }
    elements = zero ? 0 : elements;
    uint64_t payload = 0;
    take(&payload, 8, "a payload size");
    if (elements > (uint64_t{1} << 40) ||
        payload != elements * static_cast<uint64_t>(c10::elementSize(type))) {
      throw fail(
        detail::concat("'", name, "' has ", payload, " bytes for shape ", c10::IntArrayRef(shape)));
    }
    at = std::min(aligned(at), size);
    if (payload > size - at) {
      throw fail(detail::concat("'", name, "' is truncated"));
    }
    // A view of the frame's buffer, which it keeps alive.
    auto keep = bytes;
    result[name] = torch::from_blob(
      const_cast<char*>(base + at), shape, [keep](void*) {}, torch::TensorOptions().dtype(type));
    at += payload;
  }
  if (at != size) {
    throw fail(detail::concat(size - at, " bytes after the last tensor"));
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
