// What stages/stage.cpp (a stage's passes), stages/stage_graphs.cpp (the same through CUDA
// graphs) and stages/stage_state.cpp (its optimizer and state) share: the generator's lock, shapes
// in messages, the optimizer's keys, model-wide names. Private to stages/.
#pragma once

#include <map>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <string>

#include <torch/nn/module.h>

#include <actorpipe/bundle.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/torch_compat.hpp>

namespace actorpipe::stages::stage_helpers {

inline std::string shape_of(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

// "[5, 9]" for one tensor, the bundle's description for several.
inline std::string shape_of(const bundle& b) {
  return b.size() == 1 && !b.is_named() ? shape_of(b[0]) : b.describe();
}

// The optimizer keeps per-parameter state keyed by the parameter's TensorImpl address.
inline auto optimizer_key(const torch::Tensor& p) {
  return compat::optimizer_state_key(p.unsafeGetTensorImpl());
}

// Parameters (or buffers) of `layers` by model-wide name; a tied parameter under its tie's
// name (stage_config::tied), once.
template <class F>
void for_each_named(const layer_list& layers, bool buffers,
                    const std::map<std::string, std::string>& tied, F&& f) {
  std::set<std::string> seen;
  for (const auto& l : layers) {
    if (auto m = l.module()) {
      for (const auto& item : buffers ? m->named_buffers() : m->named_parameters()) {
        auto name = l.qualified(item.key());
        if (auto it = tied.find(name); !buffers && it != tied.end()) {
          name = it->second;
          if (!seen.insert(name).second) {
            continue;
          }
        }
        f(name, item.value());
      }
    }
  }
}

// Stages share the CPU generator. A forward that will be recomputed must draw a contiguous run
// of it (recomputation replays the run from its start), so it holds this lock exclusively;
// other forwards that draw hold it shared, and stages that draw nothing never take it.
inline std::shared_mutex& generator_lock() {
  static std::shared_mutex lock;
  return lock;
}

// Detached copies of `y`'s tensors that keep the flag saying they need a gradient.
inline bundle detach_keeping_flags(const bundle& y) {
  auto out = y;
  for (auto& t : out.tensors()) {
    if (t.defined()) {
      bool flagged = bundle::needs_gradient(t);
      t = t.detach();
      if (flagged) {
        t.requires_grad_(true);
      }
    }
  }
  return out;
}

} // namespace actorpipe::stages::stage_helpers
