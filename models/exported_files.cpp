// What both libtorch lines share of PT2 archives: telling them from other files, and the 1.13
// line's refusal (<actorpipe/exported.hpp>; the reader is exported.cpp, on the 2.x line).
#include <actorpipe/exported.hpp>

#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/torch_compat.hpp>

namespace actorpipe {

bool is_exported_archive(const std::string& bytes) {
  if (bytes.size() < 4 || bytes.compare(0, 4, "PK\x03\x04") != 0) {
    return false;
  }
  try {
    caffe2::serialize::PyTorchStreamReader reader(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(),
                                                             static_cast<off_t>(bytes.size())));
    if (!reader.hasRecord("archive_format")) {
      return false;
    }
    auto [data, size] = reader.getRecord("archive_format");
    return std::string(static_cast<const char*>(data.get()), size) == "pt2";
  } catch (const std::exception&) {
    return false;
  }
}

named_tensors weights_for_file(const std::map<std::string, torch::Tensor>& state,
                               const weight_names& names) {
  named_tensors out;
  for (const auto& [file_name, state_name] : names.names) {
    auto it = state.find(state_name);
    ACTORPIPE_CHECK(it != state.end(), "weights: the model's state has no '", state_name,
                    "' (written as '", file_name, "')");
    out.emplace_back(file_name, it->second);
  }
  return out;
}

#if !ACTORPIPE_TORCH_2

namespace {

[[noreturn]] void refuse(const std::string& what) {
  throw invalid_argument(detail::concat(
    what,
    " is a PT2 archive (torch.export), which actorpipe reads on its PyTorch 2.x line "
    "(./setup.sh build --torch pip: the libtorch of PyTorch 2.11's wheel); this build is on "
    "Debian's libtorch ",
    TORCH_VERSION, ", which reads TorchScript files (torch.jit.save) only"));
}

} // namespace

bool exported_programs_supported() {
  return false;
}

std::vector<std::string> library_ops() {
  return {};
}

layer_list load_exported_bytes(const std::string&, const std::string& what,
                               const exported_options&) {
  refuse(what);
}

layer_list load_exported(const std::string& path, const exported_options&) {
  refuse("'" + path + "'");
}

bool is_exported(const layer_list&) {
  return false;
}

std::vector<std::pair<std::string, std::string>> exported_state_names(const layer_list&) {
  throw invalid_argument("exported_state_names: the layers were not loaded by load_exported");
}

void save_exported(const layer_list&, const std::map<std::string, torch::Tensor>&,
                   const std::string&) {
  throw invalid_argument("save_exported: the layers were not loaded by load_exported");
}

weight_names init_exported(const layer_list&, const pretrained_weights& weights) {
  throw invalid_argument(detail::concat(
    "init from '", weights.path,
    "': weights files set a torch.export program's parameters, which this line (libtorch ",
    TORCH_VERSION, ") does not read; a built-in model starts from a checkpoint (--resume)"));
}

weight_names own_weight_names(const layer_list&) {
  throw invalid_argument("the model is not an exported program, whose weights are written as "
                         "safetensors");
}

std::string exported_bytes(const layer_list&) {
  throw invalid_argument("exported_bytes: the layers were not loaded by load_exported");
}

#endif

} // namespace actorpipe
