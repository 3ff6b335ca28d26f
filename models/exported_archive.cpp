// The archive reader: a PT2 archive's zip records, its program's JSON in the export schema,
// its weights and constants as tensors, the schema's enums as c10's.
#include "models/exported_reading.hpp"

#include <caffe2/serialize/in_memory_adapter.h>
#include <nlohmann/json.hpp>

#include <cstring>

#include <actorpipe/errors.hpp>

namespace actorpipe::exported {

namespace ex = torch::_export;
using detail::concat;

c10::ScalarType scalar_type_of(ex::ScalarType s, const std::string& where) {
  using S = ex::ScalarType;
  switch (s) {
  case S::BYTE:
    return at::kByte;
  case S::CHAR:
    return at::kChar;
  case S::SHORT:
    return at::kShort;
  case S::INT:
    return at::kInt;
  case S::LONG:
    return at::kLong;
  case S::HALF:
    return at::kHalf;
  case S::FLOAT:
    return at::kFloat;
  case S::DOUBLE:
    return at::kDouble;
  case S::COMPLEXHALF:
    return at::kComplexHalf;
  case S::COMPLEXFLOAT:
    return at::kComplexFloat;
  case S::COMPLEXDOUBLE:
    return at::kComplexDouble;
  case S::BOOL:
    return at::kBool;
  case S::BFLOAT16:
    return at::kBFloat16;
  case S::UINT16:
    return at::kUInt16;
  case S::FLOAT8E4M3FN:
    return at::kFloat8_e4m3fn;
  case S::FLOAT8E5M2:
    return at::kFloat8_e5m2;
  case S::FLOAT8E4M3FNUZ:
    return at::kFloat8_e4m3fnuz;
  case S::FLOAT8E5M2FNUZ:
    return at::kFloat8_e5m2fnuz;
  default:
    break;
  }
  throw invalid_argument(concat(where, ": dtype number ", static_cast<int>(s),
                                " of the export schema has no libtorch dtype"));
}

c10::MemoryFormat memory_format_of(ex::MemoryFormat m, const std::string& where) {
  switch (m) {
  case ex::MemoryFormat::ContiguousFormat:
    return c10::MemoryFormat::Contiguous;
  case ex::MemoryFormat::ChannelsLast:
    return c10::MemoryFormat::ChannelsLast;
  case ex::MemoryFormat::ChannelsLast3d:
    return c10::MemoryFormat::ChannelsLast3d;
  case ex::MemoryFormat::PreserveFormat:
    return c10::MemoryFormat::Preserve;
  default:
    break;
  }
  throw invalid_argument(concat(where, ": memory format ", static_cast<int>(m), " is unknown"));
}

namespace {

int64_t fixed_int(const ex::SymInt& s, const std::string& where) {
  ACTORPIPE_CHECK(s.tag() == ex::SymInt::Tag::AS_INT, where,
                  ": a stored tensor has a symbolic size or stride (",
                  s.get_as_expr().get_expr_str(), ")");
  return s.get_as_int();
}

} // namespace

std::string record(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  auto [data, size] = reader.getRecord(name);
  return std::string(static_cast<const char*>(data.get()), size);
}

namespace {

// --- the archive's weights and constants --------------------------------------------------

// A stored tensor's layout as its metadata gives it, checked: a plain strided tensor.
struct stored_layout {
  c10::ScalarType dtype;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
};

template <class PayloadMeta>
stored_layout layout_of(const PayloadMeta& meta, const std::string& where) {
  ACTORPIPE_CHECK(!meta.get_use_pickle(), where,
                  " is a tensor subclass (pickled in the archive); actorpipe trains plain tensors "
                  "(export a model whose parameters are torch.nn.Parameter of plain tensors)");
  ACTORPIPE_CHECK(meta.get_tensor_meta().has_value(), where, " has no tensor metadata");
  const auto& tm = *meta.get_tensor_meta();
  ACTORPIPE_CHECK(tm.get_layout() == ex::Layout::Strided, where,
                  " is not a strided (dense) tensor");
  stored_layout layout{scalar_type_of(tm.get_dtype(), where), {}, {}, 0};
  for (const auto& s : tm.get_sizes()) {
    layout.sizes.push_back(fixed_int(s, where));
  }
  for (const auto& s : tm.get_strides()) {
    layout.strides.push_back(fixed_int(s, where));
  }
  layout.offset = fixed_int(tm.get_storage_offset(), where);
  return layout;
}

// Whether the storage holds every element the layout reaches.
bool fits(const stored_layout& l, const at::Storage& storage) {
  if (std::find(l.sizes.begin(), l.sizes.end(), 0) != l.sizes.end()) {
    return true; // no element: no byte needed
  }
  int64_t extent = l.offset;
  for (std::size_t d = 0; d < l.sizes.size(); ++d) {
    extent += l.sizes[d] == 0 ? 0 : (l.sizes[d] - 1) * l.strides.at(d);
  }
  return l.sizes.empty() || (extent + 1) * static_cast<int64_t>(c10::elementSize(l.dtype)) <=
                              static_cast<int64_t>(storage.nbytes());
}

} // namespace

// One payload folder (data/weights/ or data/constants/): fqn -> tensor, a tensor stored once
// under several fqns (a tied parameter) shared.
std::map<std::string, at::Tensor> read_payload(caffe2::serialize::PyTorchStreamReader& reader,
                                               const std::string& folder, const std::string& config,
                                               const std::string& what) {
  std::map<std::string, at::Tensor> tensors;
  if (!reader.hasRecord(folder + config)) {
    return tensors;
  }
  ex::PayloadConfig payload;
  try {
    payload = nlohmann::json::parse(record(reader, folder + config)).get<ex::PayloadConfig>();
  } catch (const std::exception& e) {
    throw invalid_argument(concat(what, ": ", folder, config,
                                  " is not the export schema's payload "
                                  "configuration: ",
                                  detail::first_line(e.what())));
  }
  std::map<std::string, at::Storage> storages;
  std::map<std::string, std::pair<std::string, at::Tensor>> seen; // path + layout -> tensor
  for (const auto& [fqn, meta] : payload.get_config()) {
    auto where = concat(what, ": '", fqn, "'");
    auto layout = layout_of(meta, where);
    const auto& path = meta.get_path_name();
    auto key =
      concat(path, layout.sizes, layout.strides, layout.offset, static_cast<int>(layout.dtype));
    if (auto it = seen.find(key); it != seen.end()) {
      tensors[fqn] = it->second.second;
      continue;
    }
    auto stored = storages.find(path);
    if (stored == storages.end()) {
      ACTORPIPE_CHECK(reader.hasRecord(folder + path), where, ": the archive has no ", folder, path,
                      " (truncated?)");
      auto [data, n] = reader.getRecord(folder + path);
      stored = storages
                 .emplace(path, at::Storage(at::Storage::use_byte_size_t(), n, std::move(data),
                                            nullptr, false))
                 .first;
    }
    ACTORPIPE_CHECK(fits(layout, stored->second), where, ": ", folder, path, " holds ",
                    stored->second.nbytes(), " bytes, too few for its shape ",
                    c10::IntArrayRef(layout.sizes), " (truncated?)");
    auto t = at::empty({0}, at::TensorOptions().dtype(layout.dtype));
    t.set_(stored->second, layout.offset, layout.sizes, layout.strides);
    seen.emplace(key, std::make_pair(fqn, t));
    tensors[fqn] = t;
  }
  return tensors;
}

ex::ExportedProgram parse(const std::string& text, const std::string& what,
                          const std::string& entry) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw invalid_argument(
      concat(what, ": ", entry, " is not JSON (truncated?): ", detail::first_line(e.what())));
  }
  int major = -1, minor = -1;
  try {
    major = json.at("schema_version").at("major").get<int>();
    minor = json.at("schema_version").at("minor").get<int>();
  } catch (const std::exception&) {
  }
  ACTORPIPE_CHECK(major == schema_major(), what, ": the program is in the export schema ", major,
                  ".", minor, ", and this actorpipe reads schema ", schema_major(),
                  ".x (built against PyTorch ", TORCH_VERSION,
                  "); export it with a PyTorch whose torch.export writes schema ", schema_major(),
                  ".x, or build actorpipe against the PyTorch that wrote it");
  try {
    return json.get<ex::ExportedProgram>();
  } catch (const std::exception& e) {
    throw invalid_argument(concat(what, ": ", entry, " does not follow the export schema ", major,
                                  ".", minor, ": ", detail::first_line(e.what())));
  }
}

std::unique_ptr<caffe2::serialize::PyTorchStreamReader> open_archive(const std::string& bytes,
                                                                     const std::string& what) {
  try {
    return std::make_unique<caffe2::serialize::PyTorchStreamReader>(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(),
                                                             static_cast<off_t>(bytes.size())));
  } catch (const std::exception& e) {
    throw invalid_argument(concat(what,
                                  " is not a PT2 archive (what torch.export.save writes), or "
                                  "it is truncated: ",
                                  detail::first_line(e.what())));
  }
}

std::string model_entry(caffe2::serialize::PyTorchStreamReader& reader, const std::string& what,
                        const std::string& model) {
  ACTORPIPE_CHECK(reader.hasRecord("archive_format") && record(reader, "archive_format") == "pt2",
                  what,
                  " is a zip file but not a PT2 archive (no archive_format 'pt2'): write it "
                  "with torch.export.save(torch.export.export(model, example), path)");
  auto entry = "models/" + model + ".json";
  if (!reader.hasRecord(entry)) {
    std::string found;
    for (const auto& r : reader.getAllRecords()) {
      if (r.rfind("models/", 0) == 0 && r.size() > 12 && r.compare(r.size() - 5, 5, ".json") == 0) {
        found += (found.empty() ? "" : ", ") + r.substr(7, r.size() - 12);
      }
    }
    throw invalid_argument(concat(what, " holds no program '", model, "' (it holds: ",
                                  found.empty() ? std::string("none") : found, ")"));
  }
  return entry;
}

} // namespace actorpipe::exported
