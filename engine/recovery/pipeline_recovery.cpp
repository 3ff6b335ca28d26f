// Snapshots of a pipeline's state and its recovery after a lost node: pipeline::snapshot*,
// pipeline::recover, rejoin_nodes and the snapshots the nodes keep (docs/distributed.md).
#include <actorpipe/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <future>
#include <iterator>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <actorpipe/memory.hpp>
#include <actorpipe/replicas.hpp>

#include "engine/futures.hpp"
#include "engine/pipeline_impl.hpp"
#include "engine/recovery/membership.hpp"
#include "engine/recovery/placed_stages.hpp"
#include "logging/log.hpp"
#include "nodes/remote_stages.hpp"

namespace actorpipe {
namespace {

using recovery::among;
using recovery::list_or_none;
using recovery::take_census;

} // namespace

std::future<std::shared_ptr<std::map<std::string, torch::Tensor>>>
pipeline::impl::submit_fetch(bool background, uint64_t keep_as) {
  auto request = std::make_shared<scheduler::step_request>();
  request->kind = scheduler::request_kind::fetch;
  request->background = background;
  request->keep_as = keep_as;
  return submit<std::shared_ptr<std::map<std::string, torch::Tensor>>>(
    std::move(request), [](scheduler::step_outcome& o) { return std::move(o.state); });
}

void pipeline::impl::settle_snapshot() {
  if (!snapshots.pending.valid()) {
    return;
  }
  auto number = snapshots.pending_number;
  try {
    install_snapshot(wait(snapshots.pending, "snapshot"), number, snapshots.pending_note);
  } catch (const std::exception& e) {
    // A node lost while its state was on the way: the step after it fails too, and recover()
    // restores the newest snapshot that did arrive.
    log::get()->warn("snapshot {} did not arrive ({}); {} stays the newest", number, e.what(),
                     snapshots.number == 0 ? std::string("the starting state")
                                           : detail::concat("snapshot ", snapshots.number));
    memory::release_free_heap(); // whatever of it did arrive
  }
  snapshots.pending = {};
}

void pipeline::impl::install_snapshot(std::shared_ptr<std::map<std::string, torch::Tensor>> state,
                                      uint64_t number, const std::string& note) {
  snapshots.newest = std::make_shared<const stages::tensor_map>(std::move(*state));
  snapshots.number = number;
  if (remote) {
    // Complete here: every node keeps its stages' copy, tagged with the cut it was taken on,
    // and, but for replicas (the other replicas' same stages are as good), its neighbour's.
    nodes::keep_snapshot(system(), stage_nodes(),
                         replicas ? std::vector<nodes::endpoint>{} : stage_data, number,
                         nlohmann::json{{"bounds", cut.bounds}, {"note", note}}.dump());
  }
  // The frames and the snapshot this one replaced were megabytes of heap.
  memory::release_free_heap();
}

std::vector<caf::actor> pipeline::impl::stage_nodes() const {
  std::vector<caf::actor> result;
  for (const auto& address : options.placement.nodes) {
    auto it = nodes.find(address);
    result.push_back(it == nodes.end() ? caf::actor{} : it->second);
  }
  return result;
}

uint64_t pipeline::snapshot(const std::string& note) {
  auto& self = *impl_;
  self.settle_snapshot();
  auto number = ++self.snapshots.taken;
  auto future = self.submit_fetch(false, number);
  self.install_snapshot(self.wait(future, "snapshot"), number, note);
  return self.snapshots.number;
}

uint64_t pipeline::snapshot_in_background(const std::string& note) {
  auto& self = *impl_;
  self.settle_snapshot();
  self.snapshots.pending_number = ++self.snapshots.taken;
  self.snapshots.pending_note = note;
  self.snapshots.pending = self.submit_fetch(true, self.snapshots.pending_number);
  return self.snapshots.pending_number;
}

namespace {

// The newest snapshot kept whole by `kept` (what each of `addresses` keeps): one part for each of
// its stage actors (its cut's stages over `chunks`), each on the node that keeps it: the node of
// its own stage, else the neighbour holding its copy (which then holds two stage actors).
std::optional<kept_snapshot> newest_whole(const std::vector<std::vector<nodes::kept_stage>>& kept,
                                          const std::vector<std::string>& addresses,
                                          std::size_t chunks) {
  // By (number, tag): which node keeps which stage actor's part, its own first.
  std::map<std::pair<uint64_t, std::string>, std::map<uint32_t, std::size_t>> parts;
  for (bool copies : {false, true}) {
    for (std::size_t n = 0; n < kept.size(); ++n) {
      for (const auto& e : kept[n]) {
        if (e.copy == copies) {
          parts[{e.number, e.note}].emplace(e.stage, n);
        }
      }
    }
  }
  for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
    auto tag = nlohmann::json::parse(it->first.second, nullptr, false);
    if (!tag.is_object() || !tag.contains("bounds") || !tag["bounds"].is_array() ||
        !std::all_of(tag["bounds"].begin(), tag["bounds"].end(),
                     [](const auto& b) { return b.is_number_unsigned(); })) {
      continue; // not a tag this driver writes (install_snapshot)
    }
    kept_snapshot whole{it->first.first,
                        tag.value("note", std::string{}),
                        {},
                        tag["bounds"].get<std::vector<std::size_t>>()};
    auto actors = whole.bounds.size() < 2 ? 0 : (whole.bounds.size() - 1) / chunks;
    for (uint32_t k = 0; k < actors && it->second.count(k) != 0; ++k) {
      whole.nodes.push_back(addresses[it->second.at(k)]);
    }
    if (actors > 0 && whole.nodes.size() == actors) {
      return whole;
    }
  }
  return std::nullopt;
}

std::string describe_kept(const std::vector<std::vector<nodes::kept_stage>>& kept,
                          const std::vector<std::string>& addresses) {
  std::string held;
  for (std::size_t n = 0; n < kept.size(); ++n) {
    std::string parts;
    for (const auto& e : kept[n]) {
      auto tag = nlohmann::json::parse(e.note, nullptr, false);
      parts += detail::concat(
        parts.empty() ? "" : ", ", "stage ", e.stage, "'s snapshot ", e.number, " of cut ",
        tag.is_object() && tag.contains("bounds") ? tag["bounds"].dump() : std::string("?"),
        e.copy ? " (a neighbour's copy)" : "");
    }
    held += detail::concat(n == 0 ? "" : "; ", addresses[n], ": ", parts.empty() ? "none" : parts);
  }
  return held;
}

// `placed` with each stage actor that shares a node more often than the given nodes do (a part
// restored from a neighbour's copy) moved to a given node left without one, in order.
std::vector<std::string> spread_over(std::vector<std::string> placed,
                                     const std::vector<std::string>& given) {
  std::vector<std::string> unused;
  std::map<std::string, std::size_t> allowed, seen;
  for (const auto& n : given) {
    ++allowed[n];
    if (!among(placed, n) && !among(unused, n)) {
      unused.push_back(n);
    }
  }
  std::size_t next = 0;
  for (auto& n : placed) {
    if (++seen[n] > std::max<std::size_t>(1, allowed[n]) && next < unused.size()) {
      n = unused[next++];
    }
  }
  return placed;
}

// Stage actor k's part of snapshot `number` of the cut `bounds`, as a node keeps it (its own or
// a copy); none when the node keeps no such part.
const nodes::kept_stage* kept_part(const std::vector<nodes::kept_stage>& kept, std::size_t k,
                                   uint64_t number, const nlohmann::json& bounds) {
  for (const auto& e : kept) {
    auto tag = nlohmann::json::parse(e.note, nullptr, false);
    if (e.stage == k && e.number == number && tag.is_object() && tag.contains("bounds") &&
        tag["bounds"] == bounds) {
      return &e;
    }
  }
  return nullptr;
}

// The cut over the `nodes` left: the same when every stage actor kept its node, else cut anew
// (by `repartition`, or by parameters), each node holding as many chunks as before.
partition cut_over(const pipeline::impl& self, std::size_t nodes,
                   const std::function<partition(std::size_t)>& repartition) {
  if (nodes == self.options.placement.nodes.size()) {
    return self.cut;
  }
  auto parts = nodes * self.options.chunks;
  auto cut = repartition ? repartition(parts) : partition_by_params(self.layers, parts);
  ACTORPIPE_CHECK(cut.stages() == parts, "recover: the repartition gave ", cut.stages(),
                  " stages for the ", nodes, " nodes left (", self.options.chunks, " chunks each)");
  return cut;
}

} // namespace

kept_snapshot pipeline::kept_on_nodes() {
  auto& self = *impl_;
  ACTORPIPE_CHECK(self.remote, "kept_on_nodes: the stages of this pipeline are in this process; "
                               "nodes keep snapshots of the stages they host");
  const auto& addresses = self.options.placement.nodes;
  auto kept =
    nodes::kept_by(self.system(), self.stage_nodes(), self.options.placement.connect_timeout);
  auto whole = newest_whole(kept, addresses, self.options.chunks);
  if (!whole) {
    throw pipeline_error(detail::concat("the nodes do not keep one snapshot of every stage whole (",
                                        describe_kept(kept, addresses), ")"),
                         error_details{error_kind::io});
  }
  return *whole;
}

void pipeline::restore_from_nodes(const kept_snapshot& kept) {
  auto& self = *impl_;
  ACTORPIPE_CHECK(self.remote, "restore_from_nodes: the stages of this pipeline are in this "
                               "process; nodes keep snapshots of the stages they host");
  self.settle_snapshot();
  auto& placement = self.options.placement;
  if (!kept.nodes.empty() && (kept.nodes != placement.nodes || kept.bounds != self.cut.bounds)) {
    // Placed as when the snapshot was taken: each part loads on the node that keeps it.
    self.stop_actors();
    self.cut = partition{kept.bounds};
    placement.nodes = kept.nodes;
    self.place_on_nodes();
    log::get()->info("pipeline: placed as when snapshot {} was taken: {} stages on {}, cut {}",
                     kept.number, placement.nodes.size(), fmt::join(placement.nodes, ", "),
                     self.cut.to_string());
  }
  nodes::restore_kept(self.system(), self.stage_nodes(), placement.nodes, kept.number,
                      self.options.step_timeout);
  self.snapshots.taken = std::max(self.snapshots.taken, kept.number);
  auto spread = spread_over(placement.nodes, self.members.given);
  if (spread != placement.nodes) {
    // A part came from a neighbour's copy (its own node keeps nothing: it restarted, or another
    // took its address): the stage actors sharing a node go to the given nodes without one.
    self.place_again_from_now(std::move(spread), self.cut, "restore_from_nodes");
    log::get()->info("pipeline: spread over the given nodes: {} stages on {}, cut {}",
                     placement.nodes.size(), fmt::join(placement.nodes, ", "),
                     self.cut.to_string());
  } else {
    // What a later recover() restores: the state now (the nodes keep theirs still).
    self.snapshots.newest = self.fetch_now("restore_from_nodes");
    self.snapshots.number = kept.number;
  }
  // The given nodes left without a stage are asked again between steps (rejoin_nodes).
  std::vector<std::string> unplaced;
  std::copy_if(self.members.given.begin(), self.members.given.end(), std::back_inserter(unplaced),
               [&](const std::string& n) { return !among(placement.nodes, n); });
  self.members.lose(unplaced);
}

uint64_t pipeline::newest_snapshot() {
  auto& self = *impl_;
  self.settle_snapshot();
  return self.snapshots.number;
}

recovery_report pipeline::recover(std::function<partition(std::size_t)> repartition,
                                  const std::vector<std::string>& found_lost) {
  auto& self = *impl_;
  ACTORPIPE_CHECK(self.remote, "recover: the stages of this pipeline are in this process; "
                               "recover() places stages on nodes again");
  ACTORPIPE_CHECK(!self.replicas, "recover: this pipeline is replica ",
                  self.options.data_parallel.rank, " of ", self.options.data_parallel.replicas,
                  "; the replicas recover together, through replicated_pipeline::recover()");
  auto started = std::chrono::steady_clock::now();
  // A snapshot still on its way arrives (or fails) before the newest is chosen.
  self.settle_snapshot();
  auto& actor_system = self.system();
  // The failed pipeline's proxies go first: a node drops the stages of a proxy that went.
  self.stop_actors();
  auto& placement = self.options.placement;
  auto census = take_census(actor_system, placement.nodes, self.nodes, placement, found_lost);
  recovery_report report;
  report.lost = census.lost;
  report.spares_used = census.spares_used;
  self.members.lose(census.lost);
  auto placed = census.placed(placement.nodes);
  if (placed.empty()) {
    throw pipeline_error(
      detail::concat("recover: no node is left (", report.lost.size(), " lost, no spare answered)"),
      error_details{error_kind::node_lost});
  }
  auto cut = cut_over(self, placed.size(), repartition);
  auto before = placement.nodes;
  auto same_cut = cut.bounds == self.cut.bounds;
  self.cut = cut;
  placement.nodes = placed;
  self.place_on_nodes();
  std::string why = same_cut ? "" : "the model is cut anew over the nodes left";
  report.from_nodes = same_cut && self.restore_from_kept(before, self.snapshots.number, why);
  if (!report.from_nodes) {
    if (self.snapshots.number > 0) {
      log::get()->info("pipeline: restoring snapshot {} from the driver: {}", self.snapshots.number,
                       why);
    }
    self.restore(self.snapshots.newest, self.snapshots.number, "recover");
  }
  // The failed pipeline's actors, the local model built again, the snapshot's frames.
  memory::release_free_heap();
  report.nodes = placed;
  report.bounds = cut.bounds;
  report.snapshot = self.snapshots.number;
  report.seconds =
    std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  log::get()->info("pipeline: recovered in {:.2f} s: lost {}, spares used {}, now {} stages on "
                   "{} cut {}, restored snapshot {} from {}",
                   report.seconds, list_or_none(report.lost), list_or_none(report.spares_used),
                   placed.size(), fmt::join(placed, ", "), cut.to_string(), report.snapshot,
                   report.from_nodes ? "the nodes" : "the driver");
  return report;
}

bool pipeline::impl::restore_from_kept(const std::vector<std::string>& before, uint64_t number,
                                       std::string& why) {
  const auto& now = options.placement.nodes;
  if (number == 0) {
    why = "no snapshot taken yet (the starting state)";
    return false;
  }
  if (before.size() != now.size() || stage_data.size() != now.size()) {
    why = "another placement";
    return false;
  }
  auto& actor_system = system();
  auto actors = stage_nodes();
  auto kept = nodes::kept_by(actor_system, actors, options.placement.connect_timeout);
  const auto bounds = nlohmann::json(cut.bounds);
  auto part = [&](std::size_t n, std::size_t k) { return kept_part(kept[n], k, number, bounds); };
  for (std::size_t k = 0; k < now.size(); ++k) {
    if (now[k] == before[k]) {
      if (part(k, k) == nullptr) {
        why = detail::concat("node ", now[k], " does not keep stage ", k, "'s part of it");
        return false;
      }
      continue;
    }
    // A spare in a lost node's place: the part comes from the survivor that keeps its copy.
    std::size_t holder = 0;
    const nodes::kept_stage* copy = nullptr;
    for (std::size_t n = 0; n < now.size() && copy == nullptr; ++n) {
      if (n != k && now[n] == before[n] && (copy = part(n, k)) != nullptr) {
        holder = n;
      }
    }
    if (copy == nullptr) {
      why = detail::concat("no node left keeps a copy of stage ", k, "'s part of it (", before[k],
                           " was lost)");
      return false;
    }
    if (!nodes::hand_over_kept(actor_system, actors[holder], actors[k], stage_data[k],
                               static_cast<uint32_t>(k), number, copy->note,
                               options.step_timeout)) {
      why = detail::concat("stage ", k, "'s copy did not reach ", now[k], " from ", now[holder]);
      return false;
    }
    log::get()->info("pipeline: stage {}'s part of snapshot {} went from {} to {}", k, number,
                     now[holder], now[k]);
  }
  try {
    nodes::restore_kept(actor_system, actors, now, number, options.step_timeout);
  } catch (const std::exception& e) {
    why = e.what();
    return false;
  }
  return true;
}

std::optional<recovery_report>
pipeline::rejoin_nodes(std::function<partition(std::size_t)> repartition) {
  auto& self = *impl_;
  auto& placement = self.options.placement;
  self.members.take_joined(placement.nodes, placement.spares);
  if (!self.remote || self.replicas) {
    return std::nullopt;
  }
  recovery_report report;
  auto back = self.members.answered(self.system(), placement, placement.nodes, report);
  if (!back || back->empty()) {
    return std::nullopt;
  }
  auto started = std::chrono::steady_clock::now();
  const auto given = self.members.given.size();
  if (placement.nodes.size() >= given) {
    // A spare holds its stages: it stands by for the next loss.
    for (const auto& n : *back) {
      if (!among(placement.spares, n)) {
        placement.spares.push_back(n);
      }
      report.spares_used.push_back(n);
    }
  } else {
    // Cut anew onto fewer nodes: the stages go over the nodes as built again, from the state now.
    auto nodes = placement.nodes;
    for (const auto& n : *back) {
      if (nodes.size() < given) {
        nodes.push_back(n);
      } else if (!among(placement.spares, n)) {
        placement.spares.push_back(n);
      }
    }
    auto parts = nodes.size() * self.options.chunks;
    auto cut = nodes.size() == given ? self.members.given_cut
               : repartition         ? repartition(parts)
                                     : partition_by_params(self.layers, parts);
    ACTORPIPE_CHECK(cut.stages() == parts, "rejoin_nodes: the repartition gave ", cut.stages(),
                    " stages for ", nodes.size(), " nodes (", self.options.chunks, " chunks each)");
    self.place_again_from_now(nodes, cut, "rejoin_nodes");
  }
  report.nodes = placement.nodes;
  report.bounds = self.cut.bounds;
  report.snapshot = self.snapshots.number;
  report.seconds =
    std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  log::get()->info("pipeline: {} back in {:.2f} s: now {} stages on {}, cut {}, spares {}",
                   fmt::join(*back, ", "), report.seconds, placement.nodes.size(),
                   fmt::join(placement.nodes, ", "), self.cut.to_string(),
                   list_or_none(placement.spares));
  return report;
}

void pipeline::impl::place_again_from_now(std::vector<std::string> new_nodes, partition new_cut,
                                          const char* what) {
  // The state now, kept here for the stages placed anew (and for a later recover()); the nodes
  // keep the newest snapshot train() noted.
  settle_snapshot();
  snapshots.newest = fetch_now(what);
  snapshots.number = ++snapshots.taken;
  stop_actors();
  cut = std::move(new_cut);
  options.placement.nodes = std::move(new_nodes);
  place_on_nodes();
  restore(snapshots.newest, snapshots.number, what);
  memory::release_free_heap();
}

uint64_t pipeline::repartition(const partition& cut) {
  auto& self = *impl_;
  ACTORPIPE_CHECK(self.remote && !self.replicas,
                  "repartition: places the stages of one pipeline on nodes again; this one's are ",
                  self.remote ? "replicas (they keep one cut)" : "in this process");
  ACTORPIPE_CHECK(cut.stages() == self.cut.stages() && cut.bounds.back() == self.cut.bounds.back(),
                  "repartition: ", cut.to_string(), " is not a cut of the ", self.cut.bounds.back(),
                  " layers into ", self.cut.stages(), " stages");
  self.place_again_from_now(self.options.placement.nodes, cut, "repartition");
  log::get()->info("pipeline: cut anew into {} on {}", self.cut.to_string(),
                   fmt::join(self.options.placement.nodes, ", "));
  return self.snapshots.number;
}

} // namespace actorpipe

namespace actorpipe {

recovery::placed_stages pipeline::placed(const recovery::access&) {
  return recovery::placed_stages(*impl_);
}

namespace recovery {

bool placed_stages::on_nodes() const {
  return p_->remote.has_value();
}

const pipeline_options& placed_stages::options() const {
  return p_->options;
}

const std::map<std::string, caf::actor>& placed_stages::reached() const {
  return p_->nodes;
}

const std::vector<std::size_t>& placed_stages::bounds() const {
  return p_->cut.bounds;
}

caf::actor_system& placed_stages::system() const {
  return p_->system();
}

recovery::snapshots& placed_stages::settled_snapshots() {
  p_->settle_snapshot();
  return p_->snapshots;
}

recovery::snapshots& placed_stages::kept_snapshots() {
  return p_->snapshots;
}

std::shared_ptr<const stages::tensor_map> placed_stages::fetch(const char* what) {
  return p_->fetch_now(what);
}

void placed_stages::stop(bool leave_replicas) {
  p_->stop_actors();
  if (leave_replicas) {
    p_->replicas.reset();
  }
}

void placed_stages::move_to(std::vector<std::string> nodes, std::size_t rank, std::size_t world) {
  p_->options.data_parallel.rank = rank;
  p_->options.data_parallel.replicas = world;
  p_->options.placement.nodes = std::move(nodes);
}

void placed_stages::start(const std::shared_ptr<const stages::tensor_map>& state, uint64_t number) {
  p_->meet_replicas();
  p_->place_on_nodes();
  p_->restore(state, number, "recover");
}

void placed_stages::set_spares(std::vector<std::string> spares) {
  p_->options.placement.spares = std::move(spares);
}

} // namespace recovery
} // namespace actorpipe
