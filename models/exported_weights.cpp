// An exported program's weights from a safetensors file or a save_pretrained folder, matched by
// name, and the names to write them back under (<actorpipe/exported.hpp>: init_exported).
#include <actorpipe/exported.hpp>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <map>

#include <actorpipe/errors.hpp>

#include "models/exported_segments.hpp"

namespace actorpipe {

namespace {

using detail::concat;
using exported::saved_state;
using exported::state_tensor;

// "model." when every name starts with that one component, else "".
template <class Names>
std::string common_prefix(const Names& names) {
  std::string prefix;
  for (const auto& n : names) {
    auto dot = n.find('.');
    if (dot == std::string::npos) {
      return {};
    }
    auto first = n.substr(0, dot + 1);
    if (prefix.empty()) {
      prefix = first;
    } else if (first != prefix) {
      return {};
    }
  }
  return prefix;
}

// A way to name a program's tensor in the file: strip `from` (the program's prefix), add `to`.
struct naming {
  std::string from, to;
  std::string file_name(const std::string& program_name) const {
    if (program_name.compare(0, from.size(), from) != 0) {
      return {};
    }
    return to + program_name.substr(from.size());
  }
};

// Each state tensor's file name under `how` (or "" where the file has none of its names).
std::vector<std::pair<std::string, std::string>>
match(const std::vector<const state_tensor*>& state, const std::map<std::string, std::size_t>& file,
      const naming& how, std::size_t& found) {
  std::vector<std::pair<std::string, std::string>> matched; // (file name, program name)
  found = 0;
  for (const auto* s : state) {
    std::pair<std::string, std::string> m;
    for (const auto& n : s->names) {
      auto f = how.file_name(n);
      if (!f.empty() && file.count(f) != 0) {
        m = {f, n};
        break;
      }
    }
    found += m.first.empty() ? 0 : 1;
    matched.push_back(std::move(m));
  }
  return matched;
}

std::string list(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t k = 0; k < names.size() && k < 5; ++k) {
    out += concat(k == 0 ? "" : ", ", "'", names[k], "'");
  }
  return names.size() > 5 ? concat(out, " and ", names.size() - 5, " more") : out;
}

std::string described(const torch::Tensor& t) {
  return concat(c10::toString(t.scalar_type()), " ", t.sizes());
}

// The naming under which the file has the most of the program's tensors: the same names, the
// program's with a prefix more, or the file's; with each state tensor's (file name, program
// name) under it ("" where the file has none of its names).
std::pair<naming, std::vector<std::pair<std::string, std::string>>>
best_naming(const std::vector<const state_tensor*>& state,
            const std::map<std::string, std::size_t>& file,
            const std::vector<std::string>& file_names) {
  std::vector<std::string> program_names;
  for (const auto* s : state) {
    program_names.insert(program_names.end(), s->names.begin(), s->names.end());
  }
  std::vector<naming> ways{{"", ""}};
  if (auto p = common_prefix(program_names); !p.empty()) {
    ways.push_back({p, ""});
  }
  if (auto f = common_prefix(file_names); !f.empty()) {
    ways.push_back({"", f});
  }
  std::pair<naming, std::vector<std::pair<std::string, std::string>>> best;
  std::size_t best_found = 0, found = 0;
  for (const auto& way : ways) {
    auto m = match(state, file, way, found);
    if (best.second.empty() || found > best_found) {
      best = {way, std::move(m)};
      best_found = found;
    }
  }
  return best;
}

} // namespace

weight_names init_exported(const layer_list& layers, const pretrained_weights& weights) {
  const auto* from = exported::source_of(layers);
  ACTORPIPE_CHECK(from != nullptr, "init from '", weights.path,
                  "': the model is not an exported program (weights files set a torch.export "
                  "program's parameters; a built-in model starts from a checkpoint: --resume)");
  auto state = saved_state(from->program);
  std::map<std::string, std::size_t> file;
  std::vector<std::string> file_names;
  for (std::size_t i = 0; i < weights.tensors.size(); ++i) {
    file[weights.tensors[i].first] = i;
    file_names.push_back(weights.tensors[i].first);
  }
  auto [how, matched] = best_naming(state, file, file_names);
  // Every file name any name of a matched tensor has (a tied tensor's second one included), with
  // the tensor's name in the pipeline's state.
  std::map<std::string, std::string> state_of;
  std::vector<std::string> missing, unused, wrong;
  for (std::size_t k = 0; k < state.size(); ++k) {
    const auto& [file_name, program_name] = matched[k];
    if (file_name.empty()) {
      missing.push_back(state[k]->name);
      continue;
    }
    const auto& t = weights.tensors[file.at(file_name)].second;
    const auto& want = state[k]->tensor;
    if (t.sizes() != want.sizes() || t.scalar_type() != want.scalar_type()) {
      wrong.push_back(concat(file_name, "' is ", described(t), " in the file and ", described(want),
                             " in the program ('", program_name));
    }
    for (const auto& n : state[k]->names) {
      state_of.emplace(how.file_name(n), state[k]->name);
    }
  }
  for (const auto& n : file_names) {
    if (state_of.count(n) == 0) {
      unused.push_back(n);
    }
  }
  auto where = concat("init from '", weights.path, "'");
  ACTORPIPE_CHECK(missing.empty(), where, ": the file has no tensor for ", list(missing),
                  " of the program (", missing.size(), " of ", state.size(), ")");
  ACTORPIPE_CHECK(unused.empty(), where, ": the program has no tensor ", list(unused),
                  " of the file (a weights file of another model, or of the model with another "
                  "head?)");
  ACTORPIPE_CHECK(wrong.empty(), where, ": '", wrong.empty() ? std::string() : wrong.front(), "')",
                  wrong.size() > 1 ? concat(" and ", wrong.size() - 1, " more") : "");
  torch::NoGradGuard no_grad;
  for (std::size_t k = 0; k < state.size(); ++k) {
    const auto& t = weights.tensors[file.at(matched[k].first)].second;
    state[k]->tensor.copy_(t);
    weights.release(t);
  }
  weight_names names;
  names.config_folder = weights.config_folder;
  for (const auto& n : file_names) { // the file's order, every name it had
    names.names.emplace_back(n, state_of.at(n));
  }
  return names;
}

weight_names own_weight_names(const layer_list& layers) {
  const auto* from = exported::source_of(layers);
  ACTORPIPE_CHECK(from != nullptr, "the model is not an exported program, whose weights are "
                                   "written as safetensors");
  weight_names names;
  for (const auto* s : saved_state(from->program)) {
    names.names.emplace_back(s->name, s->name);
  }
  return names;
}

} // namespace actorpipe
