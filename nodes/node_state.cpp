#include "nodes/node_state.hpp"

#include <actorpipe/memory.hpp>

#include "actors/pipeline_errc.hpp"
#include "comm/wire.hpp"
#include "logging/log.hpp"
#include "stages/checkpoint.hpp"

namespace actorpipe::nodes {

bool allowed(node_actor* self, const char* what) {
  auto sender = self->current_sender();
  if (sender &&
      (sender->node() == self->node() || self->state.authorized.count(sender->node()) == 1)) {
    return true;
  }
  ++self->state.route->rejected;
  log::get()->error("node {}: refused '{}' from {}: the sender has not answered the challenge",
                    self->state.label, what,
                    sender ? caf::to_string(sender->node()) : std::string("an anonymous sender"));
  return false;
}

caf::error node_refusal(node_actor* self, error_kind kind, std::string sentence) {
  return actors::make_pipeline_error(
    error_details{kind, std::nullopt, std::nullopt, std::nullopt, self->state.label},
    std::move(sentence));
}

caf::error refused(node_actor* self) {
  return node_refusal(
    self, error_kind::other,
    detail::concat("node ", self->state.label,
                   " refused the request: authenticate first (wrong or missing secret)"));
}

hosted* find_stage(node_actor* self, uint32_t index) {
  auto it = self->state.stages.find(index);
  return it == self->state.stages.end() ? nullptr : &it->second;
}

std::string missing_stage(node_actor* self, uint32_t index) {
  return detail::concat("node ", self->state.label, " hosts no stage ", index);
}

caf::error stage_refusal(node_actor* self, uint32_t index, error_kind kind, std::string sentence) {
  return actors::make_stage_refusal(kind, index, self->state.label, std::move(sentence));
}

caf::error no_stage(node_actor* self, uint32_t index) {
  return stage_refusal(self, index, error_kind::other, missing_stage(self, index));
}

namespace {

// Sends `blob` (bytes that `owner` keeps alive) as the state frame `id` of stage `index` to the
// data port host:port, beside the node's work (the caller waited for the frame before); a failure
// is logged at `level` as `failed`.
void send_beside(node_state& s, torch::Tensor blob, std::shared_ptr<const void> owner,
                 const std::string& host, uint16_t port, uint32_t index, uint64_t id,
                 spdlog::level::level_enum level, std::string failed) {
  s.sending = std::async(std::launch::async, [blob = std::move(blob), owner = std::move(owner),
                                              hub = s.hub, label = s.label, host, port, index, id,
                                              level, failed = std::move(failed)] {
    try {
      hub->send(host, port, comm::describe(comm::frame_kind::state, index, id, 0, 0, blob), blob);
    } catch (const std::exception& e) {
      log::get()->log(level, "node {}: {}: {}", label, failed, e.what());
    }
  });
}

torch::Tensor as_frame(const std::shared_ptr<const stages::packed_bytes>& bytes) {
  return torch::from_blob(const_cast<char*>(bytes->data()), {static_cast<int64_t>(bytes->size())},
                          torch::kUInt8);
}

} // namespace

// Stage `index`'s state as a state frame to the scheduler; for snapshot `keep_as` (> 0), packed
// into the buffer kept if the driver says the snapshot arrived whole.
caf::error send_state(node_actor* self, uint32_t index, uint64_t id, uint64_t keep_as) {
  auto* h = find_stage(self, index);
  if (h == nullptr || !allowed(self, "save")) {
    return stage_refusal(self, index, error_kind::io, missing_stage(self, index));
  }
  auto& s = self->state;
  if (s.sending.valid()) {
    s.sending.wait(); // the previous state first, in order; its buffer is then free again
  }
  // Buffers packed into again at every snapshot: faulting in fresh pages for them cost as much
  // as the copy. Released with the node's last stage (but the kept snapshots).
  auto bytes = s.snapshots.buffer(index, keep_as);
  try {
    // The state as it is now, between two steps (the stage's next plan comes after this
    // message), packed: one copy, all the next step waits for. Sending it runs beside the node,
    // so that the next steps need not wait (a snapshot in the background); the scheduler's side
    // completes its request when the frame has come.
    stages::stage::tensor_map all;
    for (auto& chunk : h->chunks) {
      all.merge(chunk->checkpoint_state(/*copy=*/false));
    }
    stages::pack_tensors_into(all, *bytes);
  } catch (const std::exception& e) {
    return stage_refusal(self, index, kind_of(e, error_kind::io),
                         detail::concat("stage ", index, " on node ", s.label, ": ", e.what()));
  }
  // The scheduler's request for it ends at its deadline, naming this stage, if it does not come.
  send_beside(s, as_frame(bytes), bytes, h->peers.scheduler.host, h->peers.scheduler.port, index,
              id, spdlog::level::err, detail::concat("stage ", index, " could not send its state"));
  return caf::error{};
}

namespace {

// Sends the node's kept snapshot `number` of stage `index` to the node whose data port is
// host:port, which holds it as a copy (hold_atom): the node's own stage's, for the neighbour that
// keeps its copy, or the copy it holds of a lost neighbour's, for the node that takes that
// neighbour's place (restore_kept then loads it there). False when it keeps neither.
bool send_copy(node_actor* self, uint32_t index, uint64_t number, const std::string& host,
               uint16_t port) {
  auto& s = self->state;
  if (s.keep_for.count() == 0) {
    return false; // it keeps no snapshot (node_options::keep_snapshots 0): nothing to say
  }
  auto bytes = s.snapshots.kept_bytes(index, number);
  auto held = bytes ? torch::Tensor{} : s.snapshots.copy_frame(index, number);
  if (!bytes && !held.defined()) {
    log::get()->warn("node {}: asked to send a copy of stage {}'s snapshot {}, which it does not "
                     "keep",
                     s.label, index, number);
    return false;
  }
  if (s.sending.valid()) {
    s.sending.wait(); // one frame at a time; the buffer a later snapshot packs into is then free
  }
  // If it does not come, the neighbour keeps its older copy; a driver that starts again without
  // this node resumes from the snapshot before.
  send_beside(s, bytes ? as_frame(bytes) : held, bytes, host, port, index, number | copy_bit,
              spdlog::level::warn,
              detail::concat("the copy of stage ", index, "'s snapshot ", number, " did not reach ",
                             host, ":", port));
  return true;
}

void finish_load(node_actor* self, uint32_t index, uint64_t id) {
  // A load completes once both its request and its state frame are here.
  auto* h = find_stage(self, index);
  if (h == nullptr || h->loads.count(id) == 0 || h->states.count(id) == 0) {
    return;
  }
  auto rp = h->loads.at(id);
  caf::error outcome;
  {
    auto blob = h->states.at(id);
    h->loads.erase(id);
    h->states.erase(id);
    try {
      auto all = stages::unpack_tensors(blob, "checkpoint state");
      for (auto& chunk : h->chunks) {
        chunk->load_state(all);
      }
    } catch (const std::exception& e) {
      outcome = stage_refusal(
        self, index, kind_of(e, error_kind::io),
        detail::concat("stage ", index, " on node ", self->state.label, ": ", e.what()));
    }
  }
  // The state frame came once (a restore, a resume): its buffer is not kept for reuse.
  self->state.hub->release_cached_buffers();
  memory::release_free_heap();
  if (outcome) {
    rp.deliver(std::move(outcome));
  } else {
    rp.deliver(true);
  }
}

// Loads stage `index` from the node's kept snapshot `number`: none when it did.
caf::error load_kept(node_actor* self, uint32_t index, uint64_t number) {
  auto* h = find_stage(self, index);
  if (h == nullptr) {
    return no_stage(self, index);
  }
  try {
    auto all = self->state.snapshots.take(index, number, self->state.label);
    for (auto& chunk : h->chunks) {
      chunk->load_state(all);
    }
  } catch (const std::exception& e) {
    return stage_refusal(
      self, index, kind_of(e, error_kind::io),
      detail::concat("stage ", index, " on node ", self->state.label, ": ", e.what()));
  }
  memory::release_free_heap();
  return {};
}

// Loads stage `index` from the node's kept snapshot `number` (a driver that started again, or a
// recovery): at once, or, where it is a copy still on its way (hand_over_kept), when its bytes
// have come (the driver's request has its deadline).
caf::result<bool> restore_kept(node_actor* self, uint32_t index, uint64_t number) {
  auto& s = self->state;
  if (find_stage(self, index) == nullptr || !allowed(self, "restore")) {
    return no_stage(self, index);
  }
  if (!s.snapshots.kept_bytes(index, number) && !s.snapshots.copy_frame(index, number).defined() &&
      s.snapshots.copy_coming(index, number)) {
    log::get()->info("node {}: the copy of stage {}'s snapshot {} is on its way: loaded when it "
                     "comes",
                     s.label, index, number);
    auto rp = self->make_response_promise<bool>();
    auto [it, fresh] = s.awaiting_copies.emplace(std::pair(index, number), rp);
    if (!fresh) { // the one before waited past its driver's deadline
      it->second.deliver(
        stage_refusal(self, index, error_kind::io,
                      detail::concat("stage ", index, " on node ", s.label,
                                     ": a newer restore of snapshot ", number, " came")));
      it->second = rp;
    }
    return rp;
  }
  if (auto failed = load_kept(self, index, number)) {
    return failed;
  }
  return true;
}

// A copy's bytes came: a restore waiting for them loads it now.
void restore_awaited(node_actor* self, uint32_t index, uint64_t number) {
  auto& waiting = self->state.awaiting_copies;
  auto it = waiting.find({index, number});
  if (it == waiting.end() || !self->state.snapshots.copy_frame(index, number).defined()) {
    return;
  }
  auto rp = it->second;
  waiting.erase(it);
  if (auto failed = load_kept(self, index, number)) {
    rp.deliver(std::move(failed));
  } else {
    rp.deliver(true);
  }
}

} // namespace

caf::result<bool> load_state_frame(node_actor* self, uint32_t index, uint64_t id) {
  auto* h = find_stage(self, index);
  if (h == nullptr || !allowed(self, "load")) {
    return no_stage(self, index);
  }
  auto rp = self->make_response_promise<bool>();
  h->loads.emplace(id, rp);
  self->send(self, state_atom::value, index, id);
  return rp;
}

caf::message_handler state_handlers(node_actor* self) {
  return {
    [=](keep_atom, uint32_t index, uint64_t number, std::string& note) {
      return allowed(self, "keep") && self->state.keep_for.count() > 0 &&
             self->state.snapshots.keep(index, number, std::move(note));
    },
    [=](copy_atom, uint32_t index, uint64_t number, std::string& host, uint16_t port) {
      return allowed(self, "copy") && send_copy(self, index, number, host, port);
    },
    [=](hold_atom, uint32_t index, uint64_t number, std::string& note) {
      if (!allowed(self, "hold") || self->state.keep_for.count() == 0) {
        return false;
      }
      self->state.snapshots.copy_held(index, number, std::move(note));
      return true;
    },
    [=](kept_atom) -> std::string {
      return allowed(self, "kept") ? self->state.snapshots.inventory() : std::string("[]");
    },
    [=](rrestore_atom, uint32_t index, uint64_t number) -> caf::result<bool> {
      return restore_kept(self, index, number);
    },
    [=](expire_atom, uint64_t generation) {
      auto& s = self->state;
      if (generation == s.generation && s.stages.empty()) {
        log::get()->info("node {}: no driver came back for {} s: its kept snapshots go", s.label,
                         s.keep_for.count());
        s.snapshots.clear();
        memory::release_free_heap();
      }
    },
    [=](state_atom, uint32_t index, uint64_t id, torch::Tensor& blob) {
      if ((id & copy_bit) != 0) {
        // A neighbour's kept snapshot (copy_atom), kept once the driver's note is here too.
        if (self->state.keep_for.count() > 0) {
          self->state.snapshots.copy_arrived(index, id & ~copy_bit, std::move(blob));
          restore_awaited(self, index, id & ~copy_bit);
        }
      } else if (auto* h = find_stage(self, index)) {
        h->states[id] = std::move(blob);
        self->send(self, state_atom::value, index, id);
      }
    },
    [=](state_atom, uint32_t index, uint64_t id) { finish_load(self, index, id); },
  };
}

} // namespace actorpipe::nodes
