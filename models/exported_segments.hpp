/// \file
/// Internal to models/: where an exported program is cut (segments by module, by marker, by
/// node) and what each segment takes, returns, reads and writes: the plan a segment layer runs.
#pragma once

#include <cstddef>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <actorpipe/exported.hpp>

#include "models/exported_program.hpp"

namespace actorpipe::exported {

/// What a segment runs.
struct segment_plan {
  std::string name;
  std::size_t begin = 0, end = 0; // nodes
  bool first = false, last = false;
  /// Values live where it starts (the first: the user inputs) and where it ends (the last: the
  /// user outputs), in slot order.
  std::vector<slot> inputs, outputs;
  /// Inputs a node of the segment writes in place (cloned on entry).
  std::set<slot> written_inputs;
  /// State it registers (parameters it reads, buffers it is the first to read) and state it
  /// reads without registering (constants, non-persistent buffers, buffers another registers).
  std::vector<std::size_t> registered, borrowed;
  /// Buffers written back after the segment: (slot of the new value, state index).
  std::vector<std::pair<slot, std::size_t>> mutations;
  /// Values dropped after each node (their last use), indexed by node.
  std::vector<std::vector<slot>> drop;
  bool draws_random = false;
};

/// Cuts `p` as `options.segments` says (<actorpipe/exported.hpp>); invalid_argument for an
/// unknown spelling, a marker spelling without markers.
std::vector<segment_plan> plan_segments(const program& p, const exported_options& options);

/// What a state_dict holds of `p`'s state: parameters and persistent buffers.
std::vector<const state_tensor*> saved_state(const program& p);

/// A loaded archive, shared by its segments: its bytes (what save_exported starts from and nodes
/// are sent), the program, how it was cut.
struct source {
  std::string bytes;
  std::string what;
  exported_options options;
  exported::program program;
  std::size_t segments = 0;
};

/// The layers of `from`'s program.
layer_list layers_of(std::shared_ptr<const source> from);

/// The source `layers` came from when they are all of one load_exported, else nullptr.
const source* source_of(const layer_list& layers);

} // namespace actorpipe::exported
