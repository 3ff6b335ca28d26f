// safetensors files and save_pretrained folders, read mapped and written atomically
// (<actorpipe/safetensors.hpp>).
#include <actorpipe/safetensors.hpp>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/version.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <actorpipe/errors.hpp>

namespace actorpipe {

namespace {

namespace fs = std::filesystem;
using detail::concat;

// An io pipeline_error naming the file unless `ok`.
template <class... Parts>
void io_check(bool ok, const Parts&... parts) {
  if (!ok) {
    throw pipeline_error(concat(parts...), error_details{error_kind::io});
  }
}

// The safetensors reader's own bound on a header (100 MB), which no honest file comes near.
constexpr uint64_t max_header_bytes = 100'000'000;

const std::vector<std::pair<std::string, c10::ScalarType>>& dtypes() {
  static const std::vector<std::pair<std::string, c10::ScalarType>> table {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
      {"I64", at::kLong}, {"I32", at::kInt}, {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte}, {"BOOL", at::kBool},
#if TORCH_VERSION_MAJOR >= 2
      {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2},
#endif
  };
  return table;
}

// A file mapped read-only and private: its pages are the page cache's until given back.
struct mapping {
  const char* data = nullptr;
  std::size_t size = 0;

  mapping(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      throw pipeline_error(concat("cannot open '", path, "': ", std::strerror(errno)),
                           error_details{error_kind::io});
    }
    struct stat st {};
    ::fstat(fd, &st);
    size = static_cast<std::size_t>(st.st_size);
    void* at = size == 0 ? nullptr : ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    auto error = errno;
    ::close(fd);
    if (at == MAP_FAILED) {
      throw pipeline_error(concat("cannot map '", path, "': ", std::strerror(error)),
                           error_details{error_kind::io});
    }
    data = static_cast<const char*>(at);
  }
  mapping(const mapping&) = delete;
  mapping& operator=(const mapping&) = delete;
  ~mapping() {
    if (data != nullptr) {
      ::munmap(const_cast<char*>(data), size);
    }
  }
};

uint64_t checked_numel(const nlohmann::ordered_json& shape, const std::string& where) {
  ACTORPIPE_CHECK(shape.is_array(), where, ": 'shape' is not a list");
  uint64_t n = 1;
  for (const auto& d : shape) {
    ACTORPIPE_CHECK(d.is_number_unsigned(), where, ": 'shape' holds ", d.dump(),
                    ", not a size >= 0");
    auto size = d.get<uint64_t>();
    ACTORPIPE_CHECK(size == 0 || n <= UINT64_MAX / size, where, ": 'shape' ", shape.dump(),
                    " has more elements than a file can hold");
    n *= size;
  }
  return n;
}

// One entry of a header, checked against the bytes that follow it; a view of the mapping.
torch::Tensor tensor_of(const std::string& name, const nlohmann::ordered_json& entry,
                        const std::shared_ptr<const mapping>& file, const char* bytes,
                        uint64_t data_size, const std::string& what) {
  auto where = concat(what, ": tensor '", name, "'");
  ACTORPIPE_CHECK(entry.is_object() && entry.contains("dtype") && entry.contains("shape") &&
                    entry.contains("data_offsets"),
                  where, ": the header gives no dtype, shape and data_offsets");
  const auto& dtype = entry.at("dtype");
  auto known = std::find_if(dtypes().begin(), dtypes().end(),
                            [&](const auto& d) { return dtype.is_string() && d.first == dtype; });
  ACTORPIPE_CHECK(known != dtypes().end(), where, ": dtype ", dtype.dump(),
                  " is not one libtorch has");
  auto numel = checked_numel(entry.at("shape"), where);
  const auto& offsets = entry.at("data_offsets");
  ACTORPIPE_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                    offsets[1].is_number_unsigned(),
                  where, ": 'data_offsets' is not [begin, end]");
  auto begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
  ACTORPIPE_CHECK(begin <= end && end <= data_size, where, ": its bytes [", begin, ", ", end,
                  ") lie outside the ", data_size, " bytes after the header (truncated?)");
  auto element = static_cast<uint64_t>(c10::elementSize(known->second));
  ACTORPIPE_CHECK(numel <= UINT64_MAX / element && numel * element == end - begin, where,
                  ": shape ", entry.at("shape").dump(), " of ", dtype.get<std::string>(), " needs ",
                  numel <= UINT64_MAX / element ? numel * element : UINT64_MAX,
                  " bytes, but data_offsets give ", end - begin);
  std::vector<int64_t> sizes;
  for (const auto& d : entry.at("shape")) {
    sizes.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  auto* at = const_cast<char*>(bytes + begin);
  return at::from_blob(
    at, sizes, [file](void*) {}, at::TensorOptions().dtype(known->second));
}

// Each tensor's bytes in one range of its own: two that overlap are a lying header.
void check_disjoint(const nlohmann::ordered_json& header, const std::string& what) {
  std::vector<std::pair<std::pair<uint64_t, uint64_t>, std::string>> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name != "__metadata__") {
      const auto& o = entry.at("data_offsets");
      ranges.push_back({{o[0].get<uint64_t>(), o[1].get<uint64_t>()}, name});
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t k = 1; k < ranges.size(); ++k) {
    const auto& [a, b] = std::make_pair(ranges[k - 1], ranges[k]);
    ACTORPIPE_CHECK(b.first.first >= a.first.second || a.first.first == a.first.second ||
                      b.first.first == b.first.second,
                    what, ": tensors '", a.second, "' and '", b.second,
                    "' share bytes (a header that lies about its offsets)");
  }
}

named_tensors read_file(const std::string& path, std::vector<std::shared_ptr<const void>>& kept) {
  auto what = concat("'", path, "'");
  auto file = std::make_shared<const mapping>(path);
  ACTORPIPE_CHECK(file->size >= 8, what, " is not a safetensors file: ", file->size,
                  " bytes, fewer than its 8-byte header length");
  uint64_t header_size = 0;
  for (int b = 7; b >= 0; --b) {
    header_size = (header_size << 8) | static_cast<unsigned char>(file->data[b]);
  }
  ACTORPIPE_CHECK(header_size <= max_header_bytes && header_size <= file->size - 8, what,
                  " is not a safetensors file or is truncated: its header length says ",
                  header_size, " bytes and ", file->size - 8, " follow");
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(file->data + 8, file->data + 8 + header_size);
  } catch (const std::exception& e) {
    throw invalid_argument(concat(what, " is not a safetensors file: its header is not JSON (",
                                  detail::first_line(e.what()), ")"));
  }
  ACTORPIPE_CHECK(header.is_object(), what, ": the header is not a JSON object");
  const char* bytes = file->data + 8 + header_size;
  uint64_t data_size = file->size - 8 - header_size;
  std::vector<std::pair<uint64_t, std::pair<std::string, torch::Tensor>>> found;
  for (const auto& [name, entry] : header.items()) {
    if (name != "__metadata__") {
      auto t = tensor_of(name, entry, file, bytes, data_size, what);
      found.push_back({entry["data_offsets"][0].get<uint64_t>(), {name, std::move(t)}});
    }
  }
  check_disjoint(header, what);
  // The file's order: by offset, then as the header lists them.
  std::stable_sort(found.begin(), found.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  named_tensors tensors;
  for (auto& f : found) {
    tensors.push_back(std::move(f.second));
  }
  kept.push_back(file);
  return tensors;
}

// The shards model.safetensors.index.json names, in order of first mention.
std::vector<std::string> shards_of(const fs::path& index) {
  auto what = concat("'", index.string(), "'");
  std::ifstream in(index);
  ACTORPIPE_CHECK(in.good(), "cannot read ", what);
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw invalid_argument(concat(what, " is not JSON: ", detail::first_line(e.what())));
  }
  ACTORPIPE_CHECK(json.is_object() && json.contains("weight_map") && json["weight_map"].is_object(),
                  what, " has no \"weight_map\" object");
  std::vector<std::string> shards;
  for (const auto& [name, shard] : json["weight_map"].items()) {
    ACTORPIPE_CHECK(shard.is_string(), what, ": the shard of '", name, "' is not a file name");
    auto file = shard.get<std::string>();
    ACTORPIPE_CHECK(file.find('/') == std::string::npos && file != ".." && !file.empty(), what,
                    ": the shard of '", name, "' is '", file, "', not a file in the folder");
    if (std::find(shards.begin(), shards.end(), file) == shards.end()) {
      shards.push_back(file);
    }
  }
  std::sort(shards.begin(), shards.end());
  return shards;
}

} // namespace

void pretrained_weights::release(const torch::Tensor& view) const {
  const auto* at = static_cast<const char*>(view.data_ptr());
  auto bytes = static_cast<std::size_t>(view.numel()) * view.element_size();
  for (const auto& m : mappings) {
    const auto* file = static_cast<const mapping*>(m.get());
    if (at < file->data || at + bytes > file->data + file->size) {
      continue;
    }
    auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    auto begin = (reinterpret_cast<std::uintptr_t>(at) + page - 1) / page * page;
    auto end = (reinterpret_cast<std::uintptr_t>(at) + bytes) / page * page;
    if (end > begin) {
      ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
    }
    return;
  }
}

pretrained_weights read_pretrained(const std::string& path) {
  pretrained_weights w;
  w.path = path;
  fs::path given(path);
  std::error_code ec;
  if (!fs::is_directory(given, ec)) {
    ACTORPIPE_CHECK(fs::exists(given, ec), "'", path, "' does not exist");
    w.tensors = read_file(path, w.mappings);
    auto folder = given.parent_path().empty() ? fs::path(".") : given.parent_path();
    w.config_folder = fs::exists(folder / "config.json", ec) ? folder.string() : "";
    return w;
  }
  w.config_folder = fs::exists(given / "config.json", ec) ? given.string() : "";
  if (fs::exists(given / "model.safetensors", ec)) {
    w.tensors = read_file((given / "model.safetensors").string(), w.mappings);
    return w;
  }
  auto index = given / "model.safetensors.index.json";
  ACTORPIPE_CHECK(fs::exists(index, ec), "'", path,
                  "' holds neither model.safetensors nor model.safetensors.index.json (what "
                  "save_pretrained writes)");
  std::set<std::string> names;
  for (const auto& shard : shards_of(index)) {
    auto file = given / shard;
    ACTORPIPE_CHECK(fs::exists(file, ec), "'", index.string(), "' names the shard '", shard,
                    "', which is not in the folder");
    for (auto& [name, t] : read_file(file.string(), w.mappings)) {
      ACTORPIPE_CHECK(names.insert(name).second, "'", path, "': tensor '", name,
                      "' is in two shards (the second: '", shard, "')");
      w.tensors.emplace_back(name, std::move(t));
    }
  }
  return w;
}

std::string safetensors_dtype(c10::ScalarType dtype) {
  for (const auto& [name, type] : dtypes()) {
    if (type == dtype) {
      return name;
    }
  }
  throw invalid_argument(concat("safetensors has no name for dtype ", c10::toString(dtype)));
}

namespace {

void write_or_throw(std::ofstream& out, const std::string& path, const char* data, std::size_t n) {
  out.write(data, static_cast<std::streamsize>(n));
  if (!out) {
    auto error = errno;
    throw pipeline_error(concat("cannot write '", path, "': ", std::strerror(error)),
                         error_details{error == ENOSPC ? error_kind::disk_full : error_kind::io});
  }
}

void write_file(const std::string& path, const named_tensors& tensors) {
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  std::set<std::string> names;
  std::vector<torch::Tensor> host;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    ACTORPIPE_CHECK(names.insert(name).second, "write_safetensors: '", name, "' is given twice");
    auto dtype = safetensors_dtype(t.scalar_type());
    host.push_back(t.detach().to(at::kCPU).contiguous());
    auto bytes = static_cast<uint64_t>(host.back().numel()) * host.back().element_size();
    header[name] = {
      {"dtype", dtype}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  auto text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  char length[8];
  for (int b = 0; b < 8; ++b) {
    length[b] = static_cast<char>((static_cast<uint64_t>(text.size()) >> (8 * b)) & 0xff);
  }
  auto temporary = concat(path, ".tmp-", ::getpid());
  try {
    errno = 0;
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    io_check(out.good(), "cannot open '", temporary, "' for writing");
    write_or_throw(out, path, length, 8);
    write_or_throw(out, path, text.data(), text.size());
    for (const auto& t : host) {
      write_or_throw(out, path, static_cast<const char*>(t.data_ptr()),
                     static_cast<std::size_t>(t.numel()) * t.element_size());
    }
    out.close();
    io_check(!out.fail(), "cannot write '", path, "': ", std::strerror(errno));
    std::error_code ec;
    fs::rename(temporary, path, ec);
    io_check(!ec, "cannot write '", path, "': ", ec.message());
  } catch (...) {
    std::error_code ec;
    fs::remove(temporary, ec);
    throw;
  }
}

void copy_configs(const std::string& from, const fs::path& dir) {
  if (from.empty() || fs::equivalent(fs::path(from), dir)) {
    return;
  }
  for (const char* name : {"config.json", "generation_config.json"}) {
    std::error_code ec;
    if (fs::exists(fs::path(from) / name, ec)) {
      fs::copy_file(fs::path(from) / name, dir / name, fs::copy_options::overwrite_existing, ec);
      io_check(!ec, "cannot copy ", name, " from '", from, "' to '", dir.string(),
               "': ", ec.message());
    }
  }
}

} // namespace

void write_safetensors(const std::string& path, const named_tensors& tensors) {
  write_file(path, tensors);
}

void write_pretrained(const std::string& dir, const named_tensors& tensors,
                      uint64_t max_shard_bytes, const std::string& config_folder) {
  ACTORPIPE_CHECK(max_shard_bytes > 0, "write_pretrained: the shard size must be > 0");
  std::error_code ec;
  fs::create_directories(dir, ec);
  io_check(!ec, "cannot create '", dir, "': ", ec.message());
  std::vector<named_tensors> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const auto& entry : tensors) {
    auto bytes = static_cast<uint64_t>(entry.second.numel()) * entry.second.element_size();
    if (!shards.back().empty() && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(entry);
    in_shard += bytes;
    total += bytes;
  }
  fs::path folder(dir);
  if (shards.size() == 1) {
    write_file((folder / "model.safetensors").string(), tensors);
    fs::remove(folder / "model.safetensors.index.json", ec);
  } else {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = nlohmann::ordered_json::object();
    char name[64];
    for (std::size_t k = 0; k < shards.size(); ++k) {
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
      write_file((folder / name).string(), shards[k]);
      for (const auto& entry : shards[k]) {
        index["weight_map"][entry.first] = name;
      }
    }
    auto path = (folder / "model.safetensors.index.json").string();
    auto text = index.dump(2) + "\n";
    std::ofstream out(path + ".tmp", std::ios::trunc);
    write_or_throw(out, path, text.data(), text.size());
    out.close();
    fs::rename(path + ".tmp", path, ec);
    io_check(!ec, "cannot write '", path, "': ", ec.message());
    fs::remove(folder / "model.safetensors", ec);
  }
  copy_configs(config_folder, folder);
}

} // namespace actorpipe
