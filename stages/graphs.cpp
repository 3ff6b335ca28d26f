#include "stages/graphs.hpp"

#include <algorithm>
#include <sstream>

#include <torch/torch.h>

#include <actorpipe/errors.hpp>

namespace actorpipe::stages {

tensor_signature tensor_signature::of(const bundle& b) {
  tensor_signature s;
  for (const auto& t : b.tensors()) {
    s.shapes.emplace_back(t.defined() ? t.sizes().vec() : std::vector<int64_t>{-1});
    s.types.push_back(t.defined() ? t.scalar_type() : c10::ScalarType::Undefined);
    s.gradients.push_back(t.defined() && bundle::needs_gradient(t));
  }
  return s;
}

tensor_signature tensor_signature::of(const bundle& b, const at::Tensor& target) {
  auto s = of(b);
  s.shapes.push_back(target.sizes().vec());
  s.types.push_back(target.scalar_type());
  s.gradients.push_back(false);
  return s;
}

std::string tensor_signature::str() const {
  std::ostringstream out;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    out << (i > 0 ? ", " : "") << "[";
    for (std::size_t d = 0; d < shapes[i].size(); ++d) {
      out << (d > 0 ? ", " : "") << shapes[i][d];
    }
    out << "] " << c10::toString(types[i]);
  }
  return out.str();
}

graph_book::graph_book(std::string who, cuda_graph_mode mode, bool device_captures,
                       std::size_t warmup_steps)
  : who_(std::move(who)), mode_(mode), warmup_steps_(warmup_steps) {
  if (mode_ == cuda_graph_mode::off) {
    off_ = true;
  } else if (!device_captures) {
    // Asked for by name, a stage that cannot says so; auto chooses quietly.
    if (mode_ == cuda_graph_mode::on) {
      turn_off("its device captures none (CUDA graphs are for stages on GPUs)");
    }
    off_ = true;
  }
}

void graph_book::note(const std::string& line) {
  if (said_.insert(line).second) {
    notes_.push_back(line);
  }
}

void graph_book::turn_off(const std::string& why) {
  if (!off_) {
    note(detail::concat(who_, " runs without CUDA graphs: ", why));
  }
  off_ = true;
  capturing_ = false;
  replaying_ = false;
  this_step_.clear();
}

void graph_book::begin_step(const std::vector<graph_action>& program) {
  this_step_.clear();
  capturing_ = false;
  replaying_ = false;
  if (off_) {
    return;
  }
  ++steps_;
  if (steps_ <= warmup_steps_) {
    return;
  }
  if (captured_program_.empty()) {
    bool split = std::any_of(program.begin(), program.end(), [](const graph_action& a) {
      return a.what == graph_action::kind::weight;
    });
    if (split) {
      turn_off("a split backward (the zero-bubble schedules' B and W) has no graphs yet");
      return;
    }
    if (mode_ == cuda_graph_mode::automatic) {
      double mean = observed_ > 0 ? observed_ms_ / static_cast<double>(observed_) : 0;
      if (observed_ == 0 || mean >= graph_auto_below_ms) {
        turn_off(detail::concat("auto: its eager actions averaged ", mean,
                                " ms on the host over the warm-up, not under ", graph_auto_below_ms,
                                " ms, so launches are not what it waits for"));
        return;
      }
      note(detail::concat(who_, " captures CUDA graphs (auto: its eager actions averaged ", mean,
                          " ms on the host, under ", graph_auto_below_ms, " ms)"));
    }
    captured_program_ = program;
    capturing_ = true;
    return;
  }
  if (program != captured_program_) {
    note(detail::concat(who_, ": a step of another program (", program.size(),
                        " actions; the graphs are of one of ", captured_program_.size(),
                        ") runs eagerly"));
    return;
  }
  replaying_ = true;
}

graph_book::use graph_book::forward(int32_t microbatch, const tensor_signature& signature) {
  auto decided = use::eager;
  if (capturing_) {
    decided = use::capture;
  } else if (replaying_) {
    auto it = signatures_.find(microbatch);
    if (it != signatures_.end() && it->second == signature) {
      decided = use::replay;
    } else if (it != signatures_.end()) {
      note(detail::concat(who_, ": micro-batch ", microbatch, " of ", signature.str(),
                          " runs eagerly: its graphs are of ", it->second.str()));
    }
  }
  this_step_[microbatch] = decided;
  return decided;
}

graph_book::use graph_book::backward(int32_t microbatch) const {
  auto it = this_step_.find(microbatch);
  return it == this_step_.end() ? use::eager : it->second;
}

void graph_book::captured(int32_t microbatch, tensor_signature signature) {
  signatures_[microbatch] = std::move(signature);
}

bool graph_book::abandon_capture() {
  if (!capturing_) {
    return false;
  }
  capturing_ = false;
  captured_program_.clear();
  signatures_.clear();
  this_step_.clear();
  --steps_; // the next step is the capture step again
  return true;
}

void graph_book::observe(double ms) {
  if (!off_ && mode_ == cuda_graph_mode::automatic && steps_ <= warmup_steps_) {
    observed_ms_ += ms;
    ++observed_;
  }
}

std::vector<std::string> graph_book::take_notes() {
  std::vector<std::string> taken;
  taken.swap(notes_);
  return taken;
}

bundle static_copy(const bundle& b) {
  torch::NoGradGuard no_grad;
  auto copy = b;
  for (auto& t : copy.tensors()) {
    if (t.defined()) {
      bool flagged = t.requires_grad();
      t = t.detach().clone();
      if (flagged) {
        t.requires_grad_(true);
      }
    }
  }
  return copy;
}

void copy_into(const bundle& into, const bundle& from) {
  torch::NoGradGuard no_grad;
  ACTORPIPE_ASSERT(into.size() == from.size());
  for (std::size_t i = 0; i < into.size(); ++i) {
    if (into[i].defined()) {
      // Through .data(): a static input's version counter is the graph's business, not autograd's.
      into[i].data().copy_(from[i], /*non_blocking=*/from[i].is_pinned());
    }
  }
}

} // namespace actorpipe::stages
