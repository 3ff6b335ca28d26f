// A stage actor's requests on its state between steps: ending a BMUF block (or gathering ZeRO's
// sharded optimizer state), and saving, fetching and loading the state for checkpoints and
// snapshots (actors/stage_state.hpp). Each answers with this stage's refusal or none.
#include <algorithm>
#include <memory>
#include <string>

#include "actors/pipeline_errc.hpp"
#include "actors/stage_state.hpp"
#include "stages/checkpoint.hpp"

namespace actorpipe::actors::stage_parts {
namespace {

// This stage's refusal of a request whose work threw `e`: the kind and fields a pipeline_error
// carried (else `otherwise`), this stage, and `sentence`.
caf::error refusal(const stage_state& s, const std::exception& e, error_kind otherwise,
                   std::string sentence) {
  const auto* pe = dynamic_cast<const pipeline_error*>(&e);
  if (pe == nullptr) {
    return make_stage_refusal(otherwise, s.options.index, "", std::move(sentence));
  }
  return make_pipeline_error(
    error_details{pe->kind(), s.options.index, pe->microbatch(), pe->step()}, std::move(sentence));
}

caf::error io_refusal(const stage_state& s, const std::exception& e) {
  return refusal(s, e, error_kind::io, detail::concat("stage ", s.options.index, ": ", e.what()));
}

// Every chunk's parameters, buffers and optimizer state, on the CPU.
// Sharded: rank 0's, with the other replicas' optimizer state gathered since its last step.
tensor_map state_on_cpu(stage_state& s) {
  tensor_map all;
  for (auto& chunk : s.chunks) {
    all.merge(chunk->checkpoint_state());
  }
  return on_cpu(std::move(all));
}

// ZeRO: gathers every replica's optimizer state on rank 0's chunks, unless nothing has stepped
// since the last gather.
caf::error gather_unless_current(stage_state& s) {
  // Every rank takes the same steps and gathers, so all skip together when nothing has stepped
  // since the last gather (train() ends a run's last epoch, and checkpoints it, on rank 0 only).
  bool current = std::all_of(s.chunks.begin(), s.chunks.end(),
                             [](const auto& chunk) { return chunk->holds_gathered_state(); });
  if (current) {
    return caf::error{};
  }
  try {
    gather_optimizer_state(s);
    s.device->synchronize();
  } catch (const std::exception& e) {
    return make_stage_refusal(
      error_kind::replica_failure, s.options.index, "",
      detail::concat("stage ", s.options.index,
                     ": gathering the sharded optimizer state failed: ", e.what()));
  }
  return caf::error{};
}

} // namespace

caf::error end_block_now(stage_state& s) {
  if (sharded(s)) {
    return gather_unless_current(s);
  }
  auto refused = [&](const std::string& sentence) {
    return make_stage_refusal(error_kind::replica_failure, s.options.index, "",
                              detail::concat("stage ", s.options.index, ": ", sentence));
  };
  if (!s.bmuf()) {
    return refused("ending a block needs BMUF replicas");
  }
  if (s.warmed_up && s.block_position == 0) {
    return caf::error{};
  }
  try {
    end_block(s);
    s.device->synchronize();
  } catch (const std::exception& e) {
    return refused(detail::concat("BMUF block sync failed: ", e.what()));
  }
  return caf::error{};
}

caf::error save_state(stage_state& s, const std::string& path) {
  try {
    stages::save_tensors(path, state_on_cpu(s));
  } catch (const std::exception& e) {
    return io_refusal(s, e);
  }
  return caf::error{};
}

caf::expected<std::shared_ptr<const tensor_map>> fetch_state(stage_state& s) {
  try {
    return std::make_shared<const tensor_map>(state_on_cpu(s));
  } catch (const std::exception& e) {
    return io_refusal(s, e);
  }
}

caf::error load_state(stage_state& s, const tensor_map& all) {
  try {
    for (auto& chunk : s.chunks) {
      chunk->load_state(all);
    }
  } catch (const std::exception& e) {
    return refusal(s, e, error_kind::io, e.what()); // the stage's words name it
  }
  if (s.bmuf()) {
    // A block starts from the loaded parameters (and block momenta), with no warm-up.
    for (auto& chunk : s.chunks) {
      chunk->load_blocks(all);
    }
    s.warmed_up = true;
    s.block_position = 0;
  }
  s.device->synchronize();
  return caf::error{};
}

tensor_map on_cpu(tensor_map all) {
  for (auto& entry : all) {
    entry.second = entry.second.cpu();
  }
  return all;
}

} // namespace actorpipe::actors::stage_parts
