// The newest snapshot of each stage a node hosts, kept in the node's memory so that a driver
// that died can start again from it (`actorpipe train --resume nodes`, docs/distributed.md).
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
  // with `note` (the driver's: the cut, where in the data). False when the pending state is not
  // that snapshot's (none, or a newer one).
  bool keep(uint32_t index, uint64_t number, std::string note);

  // What is kept, as JSON: [{"stage": index, "number": n, "note": "..."}, ...].
  std::string inventory() const;

  // Stage `index`'s kept snapshot `number`, unpacked; throws pipeline_error (io) naming what this
  // node keeps instead.
  stages::tensor_map take(uint32_t index, uint64_t number, const std::string& node) const;

  // The buffers of states still pending and the scratch buffer go (the node's last stage went);
  // kept ones stay.
  void release_pending();
  // Everything goes (the node has held no stage for its keep time).
  void clear();
  bool empty() const { return kept_.empty(); }

private:
  struct entry {
    uint64_t number = 0;
    std::string note;
    std::shared_ptr<stages::packed_bytes> bytes;
  };
  std::map<uint32_t, entry> pending_;
  std::map<uint32_t, entry> kept_;
  std::shared_ptr<stages::packed_bytes> scratch_;
};

} // namespace actorpipe::nodes
