#include "nodes/kept_snapshots.hpp"

#include <cstring>

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
  return true;
}

std::string kept_snapshots::inventory() const {
  auto all = nlohmann::json::array();
  for (const auto& [index, e] : kept_) {
    all.push_back({{"stage", index}, {"number", e.number}, {"note", e.note}});
  }
  return all.dump();
}

stages::tensor_map kept_snapshots::take(uint32_t index, uint64_t number,
                                        const std::string& node) const {
  auto it = kept_.find(index);
  if (it == kept_.end() || it->second.number != number) {
    throw pipeline_error(
      detail::concat("node ", node, " keeps ",
                     it == kept_.end()
                       ? std::string("no snapshot of stage ")
                       : detail::concat("snapshot ", it->second.number, " of stage "),
                     index, ", not snapshot ", number),
      error_details{error_kind::io});
  }
  // Unpacked from a copy: the tensors are views of 64-byte aligned bytes, which a vector's are not.
  const auto& bytes = *it->second.bytes;
  auto aligned = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(aligned.data_ptr(), bytes.data(), bytes.size());
  return stages::unpack_tensors(aligned, detail::concat("the kept snapshot of stage ", index));
}

void kept_snapshots::release_pending() {
  pending_.clear();
  scratch_.reset();
}

void kept_snapshots::clear() {
  release_pending();
  kept_.clear();
}

void keep_snapshot(caf::actor_system& sys, const std::vector<caf::actor>& nodes, uint64_t number,
                   const std::string& note) {
  // From an actor of this process, which the nodes authenticated (an anonymous message is not).
  caf::scoped_actor self{sys};
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i]) {
      self->send(nodes[i], keep_atom::value, static_cast<uint32_t>(i), number, note);
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
                                   e.value("note", std::string{})});
            }
          }
        },
        [&](const caf::error&) {});
  }
  return result;
}

void restore_kept(caf::actor_system& sys, const std::vector<caf::actor>& nodes,
                  const std::vector<std::string>& addresses, uint64_t number,
                  std::chrono::milliseconds timeout) {
  caf::scoped_actor self{sys};
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    std::string failed;
    self->request(nodes[i], timeout, rrestore_atom::value, static_cast<uint32_t>(i), number)
      .receive([](bool) {}, [&](const caf::error& e) { failed = sys.render(e); });
    if (!failed.empty()) {
      throw pipeline_error(detail::concat("restoring stage ", i, " on node ", addresses.at(i),
                                          " from its kept snapshot ", number, ": ", failed),
                           error_details{error_kind::io});
    }
  }
}

} // namespace actorpipe::nodes
