#include <actorpipe/data.hpp>

#include <torch/serialize.h>

#include <fstream>
#include <iterator>

namespace actorpipe {

dataset load_tensor_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  ACTORPIPE_CHECK(in.good(), "cannot read the tensor file '", path, "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw invalid_argument(detail::concat(
      "'", path,
      "' is not a tensor file written by torch.save({\"inputs\": X, \"targets\": Y}, "
      "path) (or it is truncated): ",
      detail::first_line(e.what())));
  }
  ACTORPIPE_CHECK(value.isGenericDict(), "'", path, "' holds a ", value.tagKind(),
                  ", not a dict {\"inputs\": X, \"targets\": Y}");
  auto dict = value.toGenericDict();
  std::string keys;
  for (const auto& item : dict) {
    keys += (keys.empty() ? "" : ", ") +
            (item.key().isString() ? "'" + item.key().toStringRef() + "'" : item.key().tagKind());
  }
  auto get = [&](const char* key) {
    auto it = dict.find(c10::IValue(std::string(key)));
    ACTORPIPE_CHECK(it != dict.end(), "'", path, "' has no key '", key, "' (it has ",
                    keys.empty() ? "none" : keys, "; expected 'inputs' and 'targets')");
    ACTORPIPE_CHECK(it->value().isTensor(), "'", path, "': '", key, "' is a ",
                    it->value().tagKind(), ", not a tensor");
    auto t = it->value().toTensor();
    ACTORPIPE_CHECK(t.dim() >= 1 && t.size(0) > 0, "'", path, "': '", key, "' has shape ",
                    t.sizes(), "; its first dimension counts the samples and must be >= 1");
    return t;
  };
  dataset d;
  d.images = get("inputs");
  d.labels = get("targets");
  ACTORPIPE_CHECK(d.images.size(0) == d.labels.size(0), "'", path, "': inputs ", d.images.sizes(),
                  " and targets ", d.labels.sizes(), " hold different numbers of samples");
  return d;
}

void save_tensor_file(const std::string& path, const torch::Tensor& inputs,
                      const torch::Tensor& targets) {
  c10::Dict<std::string, torch::Tensor> dict;
  dict.insert("inputs", inputs);
  dict.insert("targets", targets);
  auto bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out.good()) {
    throw pipeline_error(detail::concat("cannot write the tensor file '", path, "'"),
                         error_details{error_kind::io});
  }
}

} // namespace actorpipe
