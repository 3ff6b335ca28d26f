#include "stages/checkpoint.hpp"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <set>

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

void write_bytes(const std::string& path, const char* data, std::size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data, static_cast<std::streamsize>(size));
  out.flush();
  if (!out) {
    throw pipeline_error(detail::concat("cannot write '", path, "'"),
                         error_details{error_kind::io});
  }
}

void save_tensors(const std::string& path, const tensor_map& tensors) {
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
