// The table of model file formats.
#include "models/model_formats.hpp"

#include <actorpipe/torchscript.hpp>

namespace actorpipe::models {
namespace {

bool anything(const std::string&) {
  return true;
}

layer_list load_script(const std::string& bytes, const std::string& what, const exported_options&) {
  return load_torchscript_bytes(bytes, what);
}

} // namespace

const std::vector<model_format>& model_formats() {
  static const std::vector<model_format> table{
    {"a PT2 archive", ".pt2", "torch.export.load(path).module()", /*graph=*/true,
     is_exported_archive, load_exported_bytes, is_exported, save_exported},
    {"TorchScript", ".pt", "torch.jit.load(path)", /*graph=*/false, anything, load_script,
     is_torchscript, save_torchscript},
  };
  return table;
}

const model_format& format_of_bytes(const std::string& bytes) {
  for (const auto& row : model_formats()) {
    if (row.recognises(bytes)) {
      return row;
    }
  }
  return model_formats().back();
}

const model_format* format_of(const layer_list& layers) {
  for (const auto& row : model_formats()) {
    if (row.holds(layers)) {
      return &row;
    }
  }
  return nullptr;
}

bool has_model_suffix(const std::string& path) {
  auto ends_with = [&](const std::string& suffix) {
    return path.size() > suffix.size() &&
           path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (const auto& row : model_formats()) {
    if (ends_with(row.suffix)) {
      return true;
    }
  }
  return ends_with(".pth");
}

} // namespace actorpipe::models

namespace actorpipe {

layer_list load_model_file(const std::string& bytes, const std::string& what,
                           const exported_options& options) {
  return models::format_of_bytes(bytes).load(bytes, what, options);
}

} // namespace actorpipe
