#include "nodes/kept_snapshots.hpp"

#include <chrono>
#include <cstring>
#include <vector>

#include <caf/all.hpp>
#include <nlohmann/json.hpp>

#include <actorpipe/errors.hpp>

#include "nodes/protocol.hpp"
#include "nodes/remote_stages.hpp"

namespace actorpipe::nodes {

std::shared_ptr<stages::packed_bytes> kept_snapshots::buffer(uint32_t index, uint64_t number) {
  if (number == 0) {
    if (!scratch_) {
      scratch_ = std::make_shared<stages::packed_bytes>();
    }
    return scratch_;
  }
  auto& e = pending_[index];
  if (!e.bytes) {
    e.bytes = std::make_shared<stages::packed_bytes>();
  }
  e.number = number;
  return e.bytes;
}

bool kept_snapshots::keep(uint32_t index, uint64_t number, std::string note) {
  auto it = pending_.find(index);
  if (it == pending_.end() || it->second.number != number || number == 0) {
    return false;
  }
  auto& kept = kept_[index];
  std::swap(kept, it->second);
  kept.note = std::move(note);
  // The state it replaced is the next pending one's buffer.
  it->second.number = 0;
  it->second.note.clear();
  // A copy of this stage held from before (it came here as a lost neighbour's, and this node has
  // hosted the stage since) is older: it goes.
  auto held = copies_.find(index);
  if (held != copies_.end() && held->second.number <= number) {
    copies_.erase(held);
  }
  return true;
}

std::shared_ptr<const stages::packed_bytes> kept_snapshots::kept_bytes(uint32_t index,
                                                                       uint64_t number) const {
  auto it = kept_.find(index);
  return it != kept_.end() && it->second.number == number && number > 0 ? it->second.bytes
                                                                        : nullptr;
}

torch::Tensor kept_snapshots::copy_frame(uint32_t index, uint64_t number) const {
  auto it = copies_.find(index);
  return it != copies_.end() && it->second.number == number && number > 0 ? it->second.bytes
                                                                          : torch::Tensor{};
}

kept_snapshots::copy& kept_snapshots::arriving(uint32_t index, uint64_t number) {
  auto& a = arriving_[index];
  if (number != a.number) {
    // Another snapshot's (a new driver numbers from 1 again): what came of the one before goes.
    a = copy{};
    a.number = number;
  }
  return a;
}

void kept_snapshots::settle_copy(uint32_t index) {
  auto it = arriving_.find(index);
  if (it != arriving_.end() && it->second.noted && it->second.bytes.defined()) {
    copies_[index] = std::move(it->second);
    arriving_.erase(it);
  }
}

void kept_snapshots::copy_arrived(uint32_t index, uint64_t number, torch::Tensor bytes) {
  if (number > 0) {
    arriving(index, number).bytes = std::move(bytes);
    settle_copy(index);
  }
}

void kept_snapshots::copy_held(uint32_t index, uint64_t number, std::string note) {
  if (number > 0) {
    auto& a = arriving(index, number);
    a.note = std::move(note);
    a.noted = true;
    settle_copy(index);
  }
}

bool kept_snapshots::copy_coming(uint32_t index, uint64_t number) const {
  auto it = arriving_.find(index);
  return number > 0 && it != arriving_.end() && it->second.number == number;
}

std::string kept_snapshots::inventory() const {
  auto all = nlohmann::json::array();
  for (const auto& [index, e] : kept_) {
    all.push_back({{"stage", index}, {"number", e.number}, {"note", e.note}, {"copy", false}});
  }
  for (const auto& [index, c] : copies_) {
    all.push_back({{"stage", index}, {"number", c.number}, {"note", c.note}, {"copy", true}});
  }
  return all.dump();
}

stages::tensor_map kept_snapshots::take(uint32_t index, uint64_t number,
                                        const std::string& node) const {
  auto what = detail::concat("the kept snapshot of stage ", index);
  if (auto bytes = kept_bytes(index, number)) {
    // Unpacked from a copy: the tensors are views of 64-byte aligned bytes, which a vector's
    // are not.
    auto aligned = torch::empty({static_cast<int64_t>(bytes->size())}, torch::kUInt8);
    std::memcpy(aligned.data_ptr(), bytes->data(), bytes->size());
    return stages::unpack_tensors(aligned, what);
  }
  if (auto frame = copy_frame(index, number); frame.defined()) {
    return stages::unpack_tensors(frame.clone(), what);
  }
  auto c = copies_.find(index);
  auto it = kept_.find(index);
  throw pipeline_error(
    detail::concat("node ", node, " keeps ",
                   it == kept_.end() ? std::string("no snapshot of stage ")
                                     : detail::concat("snapshot ", it->second.number, " of stage "),
                   index,
                   c == copies_.end()
                     ? std::string{}
                     : detail::concat(" (a copy of snapshot ", c->second.number, ")"),
                   ", not snapshot ", number),
    error_details{error_kind::io});
}

void kept_snapshots::release_pending() {
  // A neighbour's copy still arriving stays: its driver may just have gone, after the snapshot
  // came whole (it is what a driver started again resumes from).
  pending_.clear();
  scratch_.reset();
}

void kept_snapshots::clear() {
  release_pending();
  kept_.clear();
  arriving_.clear();
  copies_.clear();
}

void keep_snapshot(caf::actor_system& sys, const std::vector<caf::actor>& nodes,
                   const std::vector<endpoint>& data, uint64_t number, const std::string& note) {
  // From an actor of this process, which the nodes authenticated (an anonymous message is not).
  caf::scoped_actor self{sys};
  const auto n = nodes.size();
  for (std::size_t i = 0; i < n; ++i) {
    if (!nodes[i]) {
      continue;
    }
    auto index = static_cast<uint32_t>(i);
    self->send(nodes[i], keep_atom::value, index, number, note);
    if (data.size() != n) {
      continue;
    }
    for (std::size_t k = 1; k < n; ++k) {
      auto j = (i + k) % n;
      if (nodes[j] && nodes[j] != nodes[i]) {
        // The holder first: the copy is kept once its note and its bytes are both there. After
        // the keep on the same connection: the node sends what it now keeps.
        self->send(nodes[j], hold_atom::value, index, number, note);
        self->send(nodes[i], copy_atom::value, index, number, data[j].host, data[j].port);
        break;
      }
    }
  }
}

std::vector<std::vector<kept_stage>> kept_by(caf::actor_system& sys,
                                             const std::vector<caf::actor>& nodes,
                                             std::chrono::milliseconds timeout) {
  std::vector<std::vector<kept_stage>> result(nodes.size());
  caf::scoped_actor self{sys};
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (!nodes[i]) {
      continue;
    }
    self->request(nodes[i], timeout, kept_atom::value)
      .receive(
        [&](const std::string& text) {
          auto all = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
          if (!all.is_array()) {
            return;
          }
          for (const auto& e : all) {
            if (e.is_object() && e.value("stage", int64_t{-1}) >= 0 &&
                e.value("number", uint64_t{0}) > 0) {
              result[i].push_back({e.value("stage", uint32_t{0}), e.value("number", uint64_t{0}),
                                   e.value("note", std::string{}), e.value("copy", false)});
            }
          }
        },
        [&](const caf::error&) {});
  }
  return result;
}

bool hand_over_kept(caf::actor_system& sys, const caf::actor& from, const caf::actor& to,
                    const endpoint& to_data, uint32_t index, uint64_t number,
                    const std::string& note, std::chrono::milliseconds timeout) {
  caf::scoped_actor self{sys};
  // The holder first: the copy is kept once its note and its bytes are both there, and a
  // restore of it that comes before its bytes waits for them (node_state.cpp).
  bool held = false, sent = false;
  self->request(to, timeout, hold_atom::value, index, number, note)
    .receive([&](bool ok) { held = ok; }, [](const caf::error&) {});
  if (held) {
    self->request(from, timeout, copy_atom::value, index, number, to_data.host, to_data.port)
      .receive([&](bool ok) { sent = ok; }, [](const caf::error&) {});
  }
  return sent;
}

void restore_kept(caf::actor_system& sys, const std::vector<caf::actor>& nodes,
                  const std::vector<std::string>& addresses, uint64_t number,
                  std::chrono::milliseconds timeout) {
  caf::scoped_actor self{sys};
  // All at once: each node loads while the others do.
  using handle =
    decltype(self->request(nodes[0], timeout, rrestore_atom::value, uint32_t{0}, number));
  std::vector<handle> asked;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    asked.push_back(
      self->request(nodes[i], timeout, rrestore_atom::value, static_cast<uint32_t>(i), number));
  }
  std::string failed;
  for (std::size_t i = 0; i < asked.size(); ++i) {
    asked[i].receive([](bool) {},
                     [&](const caf::error& e) {
                       if (failed.empty()) {
                         failed =
                           detail::concat("restoring stage ", i, " on node ", addresses.at(i),
                                          " from its kept snapshot ", number, ": ", sys.render(e));
                       }
                     });
  }
  if (!failed.empty()) {
    throw pipeline_error(failed, error_details{error_kind::io});
  }
}

} // namespace actorpipe::nodes
