/// \file
/// Bundles over the wire: a bundle (<actorpipe/bundle.hpp>) crosses as its frames in a row,
/// each saying its part, the bundle's size and whether the tensor needs a gradient back
/// (comm/wire.hpp), a named bundle's names in one more frame after them; the receiver puts
/// them together again.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <actorpipe/bundle.hpp>

#include "comm/wire.hpp"

namespace actorpipe::comm {

class tensor_hub;

/// The frames (headers and tensors) that carry `b` to where `to` says (its kind, stage, step,
/// microbatch and chunk; the rest is filled in per tensor); an empty bundle is one frame of no
/// parts.
/// Throws invalid_argument for a bundle the wire cannot carry (more than 255 parts, a name with
/// a 0 byte, an undefined tensor), naming it.
std::vector<std::pair<frame_header, at::Tensor>> bundle_frames(const frame_header& to,
                                                               const bundle& b);

/// Sends `b` to the hub at host:port as its frames in a row. Throws like bundle_frames and
/// tensor_hub::send.
void send_bundle(tensor_hub& hub, const std::string& host, uint16_t port, const frame_header& to,
                 const bundle& b);

/// Puts bundles together from their frames (thread-safe: a hub's reader threads share it).
class bundle_assembler {
public:
  /// Takes one frame of a bundle; returns the bundle once its last part came. Throws frame_error
  /// for a part that repeats one or does not fit the bundle it belongs to.
  std::optional<bundle> add(frame&& f);

  /// Drops the parts of bundles of steps before `step` that never completed.
  void drop_before(uint64_t step);

  /// Bundles waiting for parts.
  std::size_t pending() const;

private:
  using key = std::tuple<uint8_t, uint32_t, uint64_t, int32_t, int32_t>;
  struct partial {
    std::vector<at::Tensor> tensors;
    std::size_t received = 0;
    // The last part is the bundle's names.
    bool named = false;
  };
  // The named bundle of `parts` (the tensors, then the names frame's bytes).
  static bundle named_bundle(std::vector<at::Tensor> parts);
  mutable std::mutex mutex_;
  std::map<key, partial> partial_;
};

} // namespace actorpipe::comm
