// Reading a PT2 archive's program with PyTorch's own schema types: the rooms in order
// (models/exported_reading.hpp).
#include "models/exported_reading.hpp"

#include <actorpipe/errors.hpp>

namespace actorpipe::exported {

using detail::concat;

slot program::slot_of(const std::string& name) {
  auto [it, added] = slots_.emplace(name, static_cast<slot>(values.size()));
  if (added) {
    values.push_back(name);
  }
  return it->second;
}

int schema_major() {
  return ACTORPIPE_PT2_SCHEMA_MAJOR;
}

program read_program(const std::string& bytes, const std::string& what, const std::string& model) {
  program p;
  p.what = what;
  auto reader = open_archive(bytes, what);
  try {
    auto entry = model_entry(*reader, what, model);
    auto ep = parse(record(*reader, entry), what, entry);
    const auto& verifiers = ep.get_verifiers();
    p.dialect = verifiers.empty() ? std::string("ATEN") : verifiers.front();
    auto weights = read_payload(*reader, "data/weights/", model + "_weights_config.json", what);
    auto constants =
      read_payload(*reader, "data/constants/", model + "_constants_config.json", what);
    const auto& graph_module = ep.get_graph_module();
    std::vector<std::pair<slot, c10::IValue>> fixed;
    read_inputs(p, graph_module.get_signature(), weights, constants, fixed);
    ACTORPIPE_CHECK(fixed.empty(), what, ": forward takes a constant input ('",
                    fixed.empty() ? std::string() : p.name_of(fixed.front().first),
                    "'); export with tensors as the only inputs");
    read_outputs(p, graph_module.get_signature());
    choose_loss_output(p, ep);
    read_batch_dimensions(p, ep);
    bind_nodes(p, graph_module.get_graph());
    mark_training_only(p);
  } catch (const c10::Error& e) {
    throw invalid_argument(concat(what, " is a damaged PT2 archive (truncated?): ",
                                  detail::first_line(e.what_without_backtrace())));
  }
  return p;
}

} // namespace actorpipe::exported
