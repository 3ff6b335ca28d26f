#include "comm/bundle_frames.hpp"

#include <stdexcept>

#include <ATen/ATen.h>

#include <actorpipe/errors.hpp>

#include "comm/tensor_hub.hpp"

namespace actorpipe::comm {

std::vector<std::pair<frame_header, at::Tensor>> bundle_frames(const frame_header& to,
                                                               const bundle& b) {
  std::vector<std::pair<frame_header, at::Tensor>> frames;
  if (b.empty()) {
    auto nothing = at::empty({0});
    auto h = describe(to.kind, to.stage, to.step, to.microbatch, to.chunk, nothing);
    h.parts = 0;
    frames.emplace_back(h, nothing);
    return frames;
  }
  if (b.size() > 255) {
    throw std::invalid_argument(
      detail::concat("a bundle of ", b.size(), " tensors cannot cross the wire (at most 255)"));
  }
  if (b.is_named()) {
    throw std::invalid_argument(
      detail::concat("the named bundle ", b.describe(),
                     " cannot cross the wire: names do not travel between nodes yet; give the "
                     "stage boundary a positional bundle"));
  }
  for (std::size_t i = 0; i < b.size(); ++i) {
    const auto& t = b[i];
    if (!t.defined()) {
      throw std::invalid_argument(
        detail::concat("the bundle ", b.describe(), " has an undefined ", b.label(i)));
    }
    auto h = describe(to.kind, to.stage, to.step, to.microbatch, to.chunk, t);
    h.part = static_cast<uint8_t>(i);
    h.parts = static_cast<uint8_t>(b.size());
    h.needs_gradient = bundle::needs_gradient(t);
    frames.emplace_back(h, t.detach());
  }
  return frames;
}

void send_bundle(tensor_hub& hub, const std::string& host, uint16_t port, const frame_header& to,
                 const bundle& b) {
  for (auto& [header, tensor] : bundle_frames(to, b)) {
    hub.send(host, port, header, tensor);
  }
}

std::optional<bundle> bundle_assembler::add(frame&& f) {
  const auto& h = f.header;
  if (h.parts == 0) {
    return bundle{};
  }
  auto tensor = std::move(f.tensor);
  if (h.needs_gradient) {
    if (!tensor.is_floating_point()) {
      throw frame_error(detail::concat("a frame of ", h.dtype, " says it needs a gradient"));
    }
    tensor.requires_grad_(true);
  }
  if (h.parts == 1) {
    return bundle(std::move(tensor));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  key k{static_cast<uint8_t>(h.kind), h.stage, h.step, h.microbatch, h.chunk};
  auto& p = partial_[k];
  if (p.tensors.empty()) {
    p.tensors.resize(h.parts);
  }
  if (p.tensors.size() != h.parts || p.tensors[h.part].defined()) {
    partial_.erase(k);
    throw frame_error(detail::concat("frame part ", int{h.part}, " of ", int{h.parts},
                                     " repeats a part or does not fit its bundle (",
                                     to_string(h.kind), " for stage ", h.stage, ", step ", h.step,
                                     ", microbatch ", h.microbatch, ")"));
  }
  p.tensors[h.part] = std::move(tensor);
  if (++p.received < h.parts) {
    return std::nullopt;
  }
  bundle result(std::move(p.tensors));
  partial_.erase(k);
  return result;
}

void bundle_assembler::drop_before(uint64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = partial_.begin(); it != partial_.end();) {
    it = std::get<2>(it->first) < step ? partial_.erase(it) : std::next(it);
  }
}

std::size_t bundle_assembler::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return partial_.size();
}

} // namespace actorpipe::comm
