// The newest snapshot of each stage a node hosts, kept in the node's memory so that a driver
// that died can start again from it (`actorpipe train --resume nodes`, docs/distributed.md),
// and a copy of its neighbour's, so that a node lost with the driver loses nothing.
// Private to nodes/.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "stages/checkpoint.hpp"

namespace actorpipe::nodes {

// A snapshot's state frame is packed into the stage's pending buffer; once the driver has every
// stage's frame it says so (keep), and the pending state becomes the kept one, the buffer it
// replaces the next pending one (no fresh pages at every snapshot). What is not a snapshot (a
// checkpoint, named_parameters) is packed into one scratch buffer.
class kept_snapshots {
public:
  // The buffer to pack stage `index`'s state into: for snapshot `number` (> 0) its pending one,
  // else the scratch buffer.
  std::shared_ptr<stages::packed_bytes> buffer(uint32_t index, uint64_t number);

  // Snapshot `number` of stage `index` arrived whole at the driver: its pending state is kept,
  // with `note` (the driver's: the cut, where in the data), and a copy of that stage held from
  // before goes. False when the pending state is not that snapshot's (none, or a newer one).
  bool keep(uint32_t index, uint64_t number, std::string note);

  // Stage `index`'s kept snapshot `number`, packed (null: another or none is kept): what a
  // neighbour is sent a copy of.
  std::shared_ptr<const stages::packed_bytes> kept_bytes(uint32_t index, uint64_t number) const;
  // A neighbour's stage `index`, snapshot `number`, as its frame came (undefined: no such copy
  // held): what a node that takes that neighbour's place after a loss is sent.
  torch::Tensor copy_frame(uint32_t index, uint64_t number) const;

  // A neighbour's stage `index`, snapshot `number`: its bytes came, or the driver's note for it
  // (it came whole to the driver). Once both are here it is kept as that stage's copy, in place
  // of the one before; what came of another snapshot of that stage that is not whole yet goes.
  void copy_arrived(uint32_t index, uint64_t number, torch::Tensor bytes);
  void copy_held(uint32_t index, uint64_t number, std::string note);
  // Whether stage `index`'s snapshot `number` is on its way as a copy: its note or its bytes
  // came, not both yet.
  bool copy_coming(uint32_t index, uint64_t number) const;

  // What is kept, as JSON: [{"stage": index, "number": n, "note": "...", "copy": false}, ...],
  // the node's own stages' first, then the copies it holds for its neighbours.
  std::string inventory() const;

  // Stage `index`'s kept snapshot `number` (its own, else a copy), unpacked; throws
  // pipeline_error (io) naming what this node keeps instead.
  stages::tensor_map take(uint32_t index, uint64_t number, const std::string& node) const;

  // The buffers of states still pending and the scratch buffer go (the node's last stage went);
  // kept ones and neighbours' copies (kept or arriving) stay.
  void release_pending();
  // Everything goes (the node has held no stage for its keep time).
  void clear();
  bool empty() const { return kept_.empty() && copies_.empty(); }

private:
  struct entry {
    uint64_t number = 0;
    std::string note;
    std::shared_ptr<stages::packed_bytes> bytes;
  };
  // A neighbour's: the frame as it came, and whether the driver's note is here.
  struct copy {
    uint64_t number = 0;
    std::string note;
    bool noted = false;
    torch::Tensor bytes;
  };
  copy& arriving(uint32_t index, uint64_t number);
  void settle_copy(uint32_t index);

  std::map<uint32_t, entry> pending_;
  std::map<uint32_t, entry> kept_;
  std::map<uint32_t, copy> arriving_;
  std::map<uint32_t, copy> copies_;
  std::shared_ptr<stages::packed_bytes> scratch_;
};

} // namespace actorpipe::nodes
