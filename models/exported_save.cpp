// Writing a trained exported program back as a PT2 archive (save_exported,
// <actorpipe/exported.hpp>): the loaded archive's records, its weights' bytes replaced.
#include <actorpipe/exported.hpp>

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include <unistd.h>

#include <actorpipe/errors.hpp>

#include "models/exported_segments.hpp"

namespace actorpipe {

namespace {

using detail::concat;

// The trained value of each stored weight: path_name -> its bytes, laid out as the archive's
// meta says (a tensor stored under several names written once).
std::map<std::string, std::string>
trained_payloads(caffe2::serialize::PyTorchStreamReader& reader, const exported::source& from,
                 const std::map<std::string, torch::Tensor>& state) {
  const auto folder = std::string("data/weights/");
  const auto config = folder + from.options.program + "_weights_config.json";
  std::map<std::string, std::string> written;
  if (!reader.hasRecord(config)) {
    return written;
  }
  auto [data, size] = reader.getRecord(config);
  auto json = nlohmann::json::parse(std::string(static_cast<const char*>(data.get()), size));
  std::map<std::string, std::string> state_name;
  for (const auto& s : from.program.state) {
    for (const auto& n : s.names) {
      state_name[n] = s.name;
    }
  }
  for (const auto& [fqn, meta] : json.at("config").items()) {
    auto it = state_name.count(fqn) != 0 ? state.find(state_name[fqn]) : state.end();
    if (it == state.end()) {
      continue; // keeps the archive's value
    }
    const auto& path = meta.at("path_name").get<std::string>();
    if (written.count(path) == 0) {
      auto [bytes, n] = reader.getRecord(folder + path);
      written[path] = std::string(static_cast<const char*>(bytes.get()), n);
    }
    // The loaded tensor's layout is the stored one: write the trained values through it.
    const exported::state_tensor* loaded = nullptr;
    for (const auto& s : from.program.state) {
      if (s.name == state_name[fqn]) {
        loaded = &s;
      }
    }
    const auto& t = loaded->tensor;
    ACTORPIPE_CHECK(it->second.sizes() == t.sizes(), "save_exported: '", fqn, "' has shape ",
                    it->second.sizes(), " in the trained state but ", t.sizes(), " in ", from.what);
    auto& buffer = written[path];
    auto storage = at::from_blob(buffer.data(), {static_cast<int64_t>(buffer.size())},
                                 at::TensorOptions().dtype(at::kByte));
    auto view = at::empty({0}, t.options().requires_grad(false).device(at::kCPU));
    view.set_(storage.storage(), t.storage_offset(), t.sizes(), t.strides());
    torch::NoGradGuard no_grad;
    view.copy_(it->second.detach().to(at::kCPU));
  }
  return written;
}

// The archive with `state`'s weights, each record handed to `write` in turn.
void write_archive(const exported::source& from, const std::map<std::string, torch::Tensor>& state,
                   const std::function<std::size_t(const void*, std::size_t)>& write) {
  caffe2::serialize::PyTorchStreamReader reader(
    std::make_shared<caffe2::serialize::MemoryReadAdapter>(from.bytes.data(),
                                                           static_cast<off_t>(from.bytes.size())));
  auto weights = trained_payloads(reader, from, state);
  caffe2::serialize::PyTorchStreamWriter writer(write);
  // What the writer writes itself.
  static const std::set<std::string> own{".data/version", "version", "byteorder",
                                         ".data/serialization_id"};
  for (const auto& name : reader.getAllRecords()) {
    if (own.count(name) != 0) {
      continue;
    }
    auto trained =
      name.rfind("data/weights/", 0) == 0 ? weights.find(name.substr(13)) : weights.end();
    if (trained != weights.end()) {
      writer.writeRecord(name, trained->second.data(), trained->second.size());
      continue;
    }
    auto [data, n] = reader.getRecord(name);
    writer.writeRecord(name, data.get(), n);
  }
  writer.writeEndOfFile();
}

void write_archive(const exported::source& from, const std::map<std::string, torch::Tensor>& state,
                   const std::string& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  ACTORPIPE_CHECK(out.good(), "save_exported: cannot open '", path, "' for writing");
  write_archive(from, state, [&](const void* data, std::size_t n) {
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    return out.good() ? n : 0;
  });
  out.close();
  ACTORPIPE_CHECK(!out.fail(), "save_exported: writing '", path, "' failed");
}

} // namespace

void save_exported(const layer_list& layers, const std::map<std::string, torch::Tensor>& state,
                   const std::string& path) {
  const auto* from = exported::source_of(layers);
  ACTORPIPE_CHECK(from != nullptr, "save_exported: the model was not loaded by load_exported "
                                   "(only an exported program can be written back as one)");
  auto temporary = path + ".tmp-" + std::to_string(::getpid());
  try {
    write_archive(*from, state, temporary);
  } catch (const invalid_argument&) {
    std::filesystem::remove(temporary);
    throw;
  } catch (const std::exception& e) {
    std::filesystem::remove(temporary);
    throw pipeline_error(
      concat("save_exported: cannot write '", path, "': ", detail::first_line(e.what())),
      error_details{error_kind::io});
  }
  std::error_code ec;
  std::filesystem::rename(temporary, path, ec);
  if (ec) {
    std::filesystem::remove(temporary);
    throw pipeline_error(concat("save_exported: cannot write '", path, "': ", ec.message()),
                         error_details{error_kind::io});
  }
}

std::string exported_bytes(const layer_list& layers) {
  const auto* from = exported::source_of(layers);
  ACTORPIPE_CHECK(from != nullptr, "exported_bytes: the model was not loaded by load_exported");
  std::map<std::string, torch::Tensor> state;
  for (const auto& s : from->program.state) {
    state[s.name] = s.tensor;
  }
  std::string bytes;
  bytes.reserve(from->bytes.size());
  write_archive(*from, state, [&](const void* data, std::size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  return bytes;
}

} // namespace actorpipe
