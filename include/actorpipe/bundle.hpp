/// \file
/// A bundle: what crosses a stage boundary. One tensor, or several, positional or named
/// (hidden states, an attention mask, position ids, ...).
///
/// Gradients follow the tensors' own autograd flags: a floating-point tensor that requires grad
/// gets its gradient back from the next stage; integer and bool tensors, and floating-point
/// tensors that do not require grad, travel forward only. The layout (how many tensors, their
/// names, dtypes and which need a gradient) travels with every bundle, so the stages on either
/// side of a boundary cannot disagree on how many gradients to exchange: a mismatch is an error
/// naming the stage, the micro-batch and the tensor.
///
/// A tensor converts to a single-tensor bundle, so layers and models over one tensor keep
/// working unchanged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h> // also std::shared_ptr (<memory>, which layering.py reads as memory/)
#include <c10/util/ArrayRef.h>

namespace actorpipe {

/// The point in a device's stream after which a bundle's tensors are complete (a CUDA event
/// recorded by the stage that made them). A stage on another stream makes its own stream wait
/// for it (no host synchronisation); whoever reads the bytes on the host waits for it first.
/// Bundles of CPU tensors carry none.
class ready_event {
public:
  virtual ~ready_event() = default;
  /// Blocks the calling thread until the tensors are complete.
  virtual void synchronize() const = 0;
};

class bundle {
public:
  /// An empty bundle.
  bundle() = default;

  /// A single-tensor bundle (implicit: a tensor is a bundle of one).
  bundle(at::Tensor tensor) : tensors_{std::move(tensor)} {}

  /// Positional tensors.
  explicit bundle(std::vector<at::Tensor> tensors) : tensors_(std::move(tensors)) {}

  /// Named tensors, in this order; names must be unique and not empty.
  static bundle named(std::vector<std::pair<std::string, at::Tensor>> entries) {
    bundle result;
    for (auto& [name, tensor] : entries) {
      if (name.empty() || result.index_of(name) != npos) {
        throw std::invalid_argument("bundle: the name '" + name + "' is empty or given twice");
      }
      result.names_.push_back(std::move(name));
      result.tensors_.push_back(std::move(tensor));
    }
    return result;
  }

  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  std::size_t size() const noexcept { return tensors_.size(); }
  bool empty() const noexcept { return tensors_.empty(); }
  bool is_named() const noexcept { return !names_.empty(); }

  const at::Tensor& operator[](std::size_t i) const { return tensors_.at(i); }
  at::Tensor& operator[](std::size_t i) { return tensors_.at(i); }

  /// The tensor named `name`; throws invalid_argument listing the names there are.
  const at::Tensor& at(const std::string& name) const { return tensors_[checked_index(name)]; }
  at::Tensor& at(const std::string& name) { return tensors_[checked_index(name)]; }

  bool contains(const std::string& name) const { return index_of(name) != npos; }

  /// The position of `name`, or npos.
  std::size_t index_of(const std::string& name) const {
    for (std::size_t i = 0; i < names_.size(); ++i) {
      if (names_[i] == name) {
        return i;
      }
    }
    return npos;
  }

  /// The names, in order (empty for a positional bundle).
  const std::vector<std::string>& names() const noexcept { return names_; }
  const std::vector<at::Tensor>& tensors() const noexcept { return tensors_; }
  std::vector<at::Tensor>& tensors() noexcept { return tensors_; }

  /// "hidden" for a named tensor, "tensor 1" for a positional one.
  std::string label(std::size_t i) const {
    return is_named() ? "'" + names_.at(i) + "'" : "tensor " + std::to_string(i);
  }

  /// The one tensor of a single-tensor bundle; throws invalid_argument naming `who` otherwise.
  const at::Tensor& single(const std::string& who) const {
    if (tensors_.size() != 1) {
      throw std::invalid_argument(who + " takes one tensor, not a bundle of " +
                                  std::to_string(tensors_.size()) + ": " + describe());
    }
    return tensors_.front();
  }

  /// The event after which the tensors are complete on their device (null: they are now).
  const std::shared_ptr<const ready_event>& ready() const noexcept { return ready_; }
  void set_ready(std::shared_ptr<const ready_event> event) { ready_ = std::move(event); }
  /// Waits (blocking the calling thread) until the tensors are complete; for code that reads
  /// them on the host or on a stream of its own.
  void synchronize() const {
    if (ready_) {
      ready_->synchronize();
    }
  }

  /// Bytes of all defined tensors.
  int64_t nbytes() const {
    int64_t total = 0;
    for (const auto& t : tensors_) {
      total += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
    }
    return total;
  }

  /// How many tensors need a gradient (floating point and requiring grad).
  std::size_t differentiable_count() const {
    std::size_t count = 0;
    for (const auto& t : tensors_) {
      count += needs_gradient(t) ? 1 : 0;
    }
    return count;
  }

  /// Whether `t` gets a gradient back across a stage boundary.
  static bool needs_gradient(const at::Tensor& t) {
    return t.defined() && t.is_floating_point() && t.requires_grad();
  }

  /// "(hidden: Float[2, 8, 16] grad, mask: Bool[2, 8])", or "Float[2, 8]" for one positional
  /// tensor: for error messages.
  std::string describe() const {
    std::ostringstream out;
    bool single_positional = tensors_.size() == 1 && !is_named();
    if (!single_positional) {
      out << "(";
    }
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      if (i > 0) {
        out << ", ";
      }
      if (is_named()) {
        out << names_[i] << ": ";
      }
      const auto& t = tensors_[i];
      if (!t.defined()) {
        out << "undefined";
        continue;
      }
      out << t.scalar_type() << t.sizes();
      if (needs_gradient(t)) {
        out << " grad";
      }
    }
    if (!single_positional) {
      out << ")";
    }
    return out.str();
  }

private:
  std::size_t checked_index(const std::string& name) const {
    auto i = index_of(name);
    if (i == npos) {
      std::string known;
      for (const auto& n : names_) {
        known += (known.empty() ? "" : ", ") + n;
      }
      throw std::invalid_argument("bundle: no tensor named '" + name + "' (it has " +
                                  (known.empty() ? std::string("no names") : known) + ")");
    }
    return i;
  }

  std::vector<std::string> names_;
  std::vector<at::Tensor> tensors_;
  std::shared_ptr<const ready_event> ready_;
};

} // namespace actorpipe
