#include "comm/bundle_frames.hpp"

#include <cstring>
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
  // A named bundle's names follow its tensors as one more part.
  auto parts = b.size() + (b.is_named() ? 1 : 0);
  if (parts > 255) {
    throw std::invalid_argument(detail::concat("the named bundle ", b.describe(), " of ", b.size(),
                                               " tensors cannot cross the wire (at most 254)"));
  }
  for (std::size_t i = 0; i < b.size(); ++i) {
    const auto& t = b[i];
    if (!t.defined()) {
      throw std::invalid_argument(
        detail::concat("the bundle ", b.describe(), " has an undefined ", b.label(i)));
    }
    auto h = describe(to.kind, to.stage, to.step, to.microbatch, to.chunk, t);
    h.part = static_cast<uint8_t>(i);
    h.parts = static_cast<uint8_t>(parts);
    h.needs_gradient = bundle::needs_gradient(t);
    frames.emplace_back(h, t.detach());
  }
  if (b.is_named()) {
    std::string names;
    for (std::size_t i = 0; i < b.size(); ++i) {
      const auto& name = b.names()[i];
      if (name.find('\0') != std::string::npos) {
        // (Not the name itself: a message stops at its 0 byte.)
        throw std::invalid_argument(detail::concat("a named bundle cannot cross the wire: the name "
                                                   "of its tensor ",
                                                   i, " holds a 0 byte"));
      }
      names += name;
      names.push_back('\0');
    }
    auto bytes = at::empty({static_cast<int64_t>(names.size())}, at::kByte);
    std::memcpy(bytes.data_ptr(), names.data(), names.size());
    auto h = describe(to.kind, to.stage, to.step, to.microbatch, to.chunk, bytes);
    h.part = static_cast<uint8_t>(b.size());
    h.parts = static_cast<uint8_t>(parts);
    h.names = true;
    frames.emplace_back(h, bytes);
  }
  return frames;
}

void send_bundle(tensor_hub& hub, const std::string& host, uint16_t port, const frame_header& to,
                 const bundle& b) {
  // Tensors made on a GPU stream are complete before their bytes are copied out.
  b.synchronize();
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
  if (h.names && (h.part + 1 != h.parts || h.parts < 2 || tensor.scalar_type() != at::kByte ||
                  tensor.dim() != 1)) {
    throw frame_error(detail::concat("a names frame must be the last part (of 2 or more) and hold "
                                     "bytes, not part ",
                                     int{h.part}, " of ", int{h.parts}, " of ", h.dtype));
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
  p.named = p.named || h.names;
  if (++p.received < h.parts) {
    return std::nullopt;
  }
  auto done = std::move(p);
  partial_.erase(k);
  if (!done.named) {
    return bundle(std::move(done.tensors));
  }
  return named_bundle(std::move(done.tensors));
}

bundle bundle_assembler::named_bundle(std::vector<at::Tensor> parts) {
  auto bytes = parts.back().contiguous();
  parts.pop_back();
  std::string text(static_cast<const char*>(bytes.data_ptr()),
                   static_cast<std::size_t>(bytes.numel()));
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::size_t at = 0;
  for (auto& t : parts) {
    auto end = text.find('\0', at);
    if (end == std::string::npos) {
      throw frame_error(detail::concat("a names frame names ", named.size(), " of the bundle's ",
                                       parts.size(), " tensors"));
    }
    named.emplace_back(text.substr(at, end - at), std::move(t));
    at = end + 1;
  }
  if (at != text.size()) {
    throw frame_error(
      detail::concat("a names frame names more than the bundle's ", parts.size(), " tensors"));
  }
  try {
    return bundle::named(std::move(named));
  } catch (const std::exception& e) {
    throw frame_error(detail::concat("a names frame: ", e.what()));
  }
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
