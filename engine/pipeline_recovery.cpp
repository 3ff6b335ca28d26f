// Snapshots of a pipeline's state and its recovery after a lost node: pipeline::snapshot*,
// pipeline::recover and replicated_pipeline::recover (docs/distributed.md).
#include <actorpipe/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <future>
#include <map>

#include <fmt/format.h>

#include <actorpipe/memory.hpp>
#include <actorpipe/replicas.hpp>

#include "engine/futures.hpp"
#include "engine/pipeline_impl.hpp"
#include "logging/log.hpp"
#include "nodes/remote_stages.hpp"

namespace actorpipe {
namespace {

// "a, b, c" or "none": a recovery's lists in the log.
template <class T>
std::string list_or_none(const std::vector<T>& items) {
  return items.empty() ? std::string("none") : fmt::format("{}", fmt::join(items, ", "));
}

// After a step failed on nodes: which nodes answer, and a spare for each that does not.
struct node_census {
  // The nodes that did not answer, in placement order.
  std::vector<std::string> lost;
  // A spare per lost node, in order, among those that answer and hold no stage yet.
  std::map<std::string, std::string> replacement;
  std::vector<std::string> spares_used;
  // The spares that answered, in order (replicas hand them out their own way).
  std::vector<std::string> spares;

  bool is_lost(const std::string& node) const {
    return std::find(lost.begin(), lost.end(), node) != lost.end();
  }
  // `nodes` with each lost node replaced by its spare, or left out when none took it.
  std::vector<std::string> placed(const std::vector<std::string>& nodes) const {
    std::vector<std::string> result;
    for (const auto& n : nodes) {
      if (!is_lost(n)) {
        result.push_back(n);
      } else if (auto it = replacement.find(n); it != replacement.end()) {
        result.push_back(it->second);
      }
    }
    return result;
  }
};

// Asks every node of `nodes` (repeats asked once) and the spares, each within the placement's
// connect timeout, all at once.
node_census take_census(caf::actor_system& sys, const std::vector<std::string>& nodes,
                        const std::map<std::string, caf::actor>& known,
                        const node_placement& placement) {
  std::vector<std::string> distinct;
  for (const auto& n : nodes) {
    if (std::find(distinct.begin(), distinct.end(), n) == distinct.end()) {
      distinct.push_back(n);
    }
  }
  auto alive = nodes::answering(sys, distinct, known, placement);
  node_census census;
  for (std::size_t i = 0; i < distinct.size(); ++i) {
    if (!alive[i]) {
      census.lost.push_back(distinct[i]);
    }
  }
  if (census.lost.empty()) {
    return census;
  }
  std::vector<std::string> candidates;
  for (const auto& spare : placement.spares) {
    if (std::find(distinct.begin(), distinct.end(), spare) == distinct.end() &&
        std::find(candidates.begin(), candidates.end(), spare) == candidates.end()) {
      candidates.push_back(spare);
    }
  }
  auto ready = nodes::answering(sys, candidates, {}, placement);
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    if (ready[i]) {
      census.spares.push_back(candidates[i]);
    }
  }
  for (std::size_t i = 0; i < census.lost.size() && i < census.spares.size(); ++i) {
    census.replacement[census.lost[i]] = census.spares[i];
    census.spares_used.push_back(census.spares[i]);
  }
  return census;
}

// Which replicas go on after a loss, and on which nodes (each replica's nodes given in rank
// order); the replicas that leave go into report.replicas_left, the spares taken into
// report.spares_used.
std::pair<std::vector<std::size_t>, std::vector<std::vector<std::string>>>
whole_replicas(const std::vector<std::vector<std::string>>& replica_nodes,
               const node_census& census, recovery_report& report) {
  // A replica goes on when spares replace every node it lost, the replicas served in rank order
  // (a replica is given spares only when there are enough for all its lost nodes); the others
  // leave.
  std::vector<std::size_t> whole;
  std::vector<std::vector<std::string>> layouts;
  std::size_t next_spare = 0;
  for (std::size_t r = 0; r < replica_nodes.size(); ++r) {
    const auto& nodes = replica_nodes[r];
    std::map<std::string, std::string> replacement;
    for (const auto& n : nodes) {
      if (census.is_lost(n) && replacement.count(n) == 0) {
        auto index = next_spare + replacement.size();
        replacement.emplace(n, index < census.spares.size() ? census.spares[index] : std::string{});
      }
    }
    bool enough = std::all_of(replacement.begin(), replacement.end(),
                              [](const auto& kv) { return !kv.second.empty(); });
    if (!enough) {
      report.replicas_left.push_back(r);
      continue;
    }
    std::vector<std::string> placed;
    for (const auto& n : nodes) {
      auto it = replacement.find(n);
      placed.push_back(it == replacement.end() ? n : it->second);
    }
    for (std::size_t k = 0; k < replacement.size(); ++k) {
      report.spares_used.push_back(census.spares[next_spare++]);
    }
    whole.push_back(r);
    layouts.push_back(std::move(placed));
  }
  return {whole, layouts};
}

} // namespace

std::future<std::shared_ptr<std::map<std::string, torch::Tensor>>>
pipeline::impl::submit_fetch(bool background) {
  auto request = std::make_shared<scheduler::step_request>();
  request->kind = scheduler::request_kind::fetch;
  request->background = background;
  return submit<std::shared_ptr<std::map<std::string, torch::Tensor>>>(
    std::move(request), [](scheduler::step_outcome& o) { return std::move(o.state); });
}

void pipeline::impl::settle_snapshot() {
  if (!pending_snapshot.valid()) {
    return;
  }
  auto number = pending_number;
  try {
    install_snapshot(wait(pending_snapshot, "snapshot"), number);
  } catch (const std::exception& e) {
    // A node lost while its state was on the way: the step after it fails too, and recover()
    // restores the newest snapshot that did arrive.
    log::get()->warn("snapshot {} did not arrive ({}); {} stays the newest", number, e.what(),
                     snapshot_number == 0 ? std::string("the starting state")
                                          : detail::concat("snapshot ", snapshot_number));
    memory::release_free_heap(); // whatever of it did arrive
  }
  pending_snapshot = {};
}

void pipeline::impl::install_snapshot(std::shared_ptr<std::map<std::string, torch::Tensor>> state,
                                      uint64_t number) {
  snapshot = std::make_shared<const stages::tensor_map>(std::move(*state));
  snapshot_number = number;
  // The frames and the snapshot this one replaced were megabytes of heap.
  memory::release_free_heap();
}

uint64_t pipeline::snapshot() {
  auto& self = *impl_;
  self.settle_snapshot();
  auto future = self.submit_fetch(false);
  self.install_snapshot(self.wait(future, "snapshot"), ++self.snapshots_taken);
  return self.snapshot_number;
}

uint64_t pipeline::snapshot_in_background() {
  auto& self = *impl_;
  self.settle_snapshot();
  self.pending_snapshot = self.submit_fetch(true);
  self.pending_number = ++self.snapshots_taken;
  return self.pending_number;
}

uint64_t pipeline::newest_snapshot() {
  auto& self = *impl_;
  self.settle_snapshot();
  return self.snapshot_number;
}

recovery_report pipeline::recover(std::function<partition(std::size_t)> repartition) {
  auto& self = *impl_;
  ACTORPIPE_CHECK(self.remote, "recover: the stages of this pipeline are in this process; "
                               "recover() places stages on nodes again");
  ACTORPIPE_CHECK(!self.replicas, "recover: this pipeline is replica ",
                  self.options.data_parallel.rank, " of ", self.options.data_parallel.replicas,
                  "; the replicas recover together, through replicated_pipeline::recover()");
  auto started = std::chrono::steady_clock::now();
  // A snapshot still on its way arrives (or fails) before the newest is chosen.
  self.settle_snapshot();
  auto& actor_system = self.sys->internals().system;
  // The failed pipeline's proxies go first: a node drops the stages of a proxy that went.
  self.stop_actors();
  auto& placement = self.options.placement;
  auto census = take_census(actor_system, placement.nodes, self.nodes, placement);
  recovery_report report;
  report.lost = census.lost;
  report.spares_used = census.spares_used;
  auto placed = census.placed(placement.nodes);
  if (placed.empty()) {
    throw pipeline_error(
      detail::concat("recover: no node is left (", report.lost.size(), " lost, no spare answered)"),
      error_details{error_kind::node_lost});
  }
  auto cut = self.cut;
  if (placed.size() != placement.nodes.size()) {
    // Fewer stage actors: the model is cut anew over the nodes left, each holding as many
    // chunks as before.
    auto parts = placed.size() * self.options.chunks;
    cut = repartition ? repartition(parts) : partition_by_params(self.layers, parts);
    ACTORPIPE_CHECK(cut.stages() == parts, "recover: the repartition gave ", cut.stages(),
                    " stages for the ", placed.size(), " nodes left (", self.options.chunks,
                    " chunks each)");
  }
  self.cut = cut;
  placement.nodes = placed;
  self.place_on_nodes();
  self.restore(self.snapshot, self.snapshot_number, "recover");
  // The failed pipeline's actors, the local model built again, the snapshot's frames.
  memory::release_free_heap();
  report.nodes = placed;
  report.bounds = cut.bounds;
  report.snapshot = self.snapshot_number;
  report.seconds =
    std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  log::get()->info("pipeline: recovered in {:.2f} s: lost {}, spares used {}, now {} stages on "
                   "{} cut {}, restored snapshot {}",
                   report.seconds, list_or_none(report.lost), list_or_none(report.spares_used),
                   placed.size(), fmt::join(placed, ", "), cut.to_string(), report.snapshot);
  return report;
}

// replicated_pipeline::recover() lives here: it re-places each replica's stages through its
// pipeline::impl, as pipeline::recover() does one pipeline's.
recovery_report replicated_pipeline::recover() {
  auto& first = *replicas_.front()->impl_;
  ACTORPIPE_CHECK(first.remote, "recover: these replicas' stages are in this process; recover() "
                                "places stages on nodes again");
  auto started = std::chrono::steady_clock::now();
  // Replica 0 keeps the snapshots (a snapshot still on its way arrives, or fails, first).
  first.settle_snapshot();
  auto state = first.snapshot;
  auto number = first.snapshot_number;
  auto taken = first.snapshots_taken;
  const auto dp = first.options.data_parallel;
  const auto placement = first.options.placement;
  std::vector<std::string> all;
  std::map<std::string, caf::actor> known;
  for (auto& p : replicas_) {
    auto& r = *p->impl_;
    // The failed step's proxies go first: a node drops the stages of a proxy that went.
    r.stop_actors();
    all.insert(all.end(), r.options.placement.nodes.begin(), r.options.placement.nodes.end());
    known.insert(r.nodes.begin(), r.nodes.end());
  }
  auto census = take_census(first.sys->internals().system, all, known, placement);
  recovery_report report;
  report.lost = census.lost;
  std::vector<std::vector<std::string>> replica_nodes;
  for (const auto& p : replicas_) {
    replica_nodes.push_back(p->impl_->options.placement.nodes);
  }
  auto [whole, layouts] = whole_replicas(replica_nodes, census, report);
  if (whole.empty()) {
    throw pipeline_error(detail::concat("recover: no replica is left whole (lost ",
                                        list_or_none(census.lost), "; ", census.spares.size(),
                                        " spares answered)"),
                         error_details{error_kind::node_lost});
  }
  // Every driver's rendezvous goes before any meets again (rank 0's serves the store that the
  // next rank 0 serves anew), all at once: each waits at its end for the others'.
  std::vector<std::future<void>> leaving;
  for (auto& p : replicas_) {
    leaving.push_back(
      std::async(std::launch::async, [&group = p->impl_->replicas] { group.reset(); }));
  }
  for (auto& f : leaving) {
    f.get(); // each bounded by data_parallel.timeout; the destructor throws nothing
  }
  std::vector<std::unique_ptr<pipeline>> kept;
  for (auto r : whole) {
    kept.push_back(std::move(replicas_[r]));
  }
  replicas_ = std::move(kept);
  const auto world = replicas_.size();
  for (std::size_t k = 0; k < world; ++k) {
    auto& r = *replicas_[k]->impl_;
    r.options.data_parallel.rank = k;
    r.options.data_parallel.replicas = world;
    r.options.placement.nodes = layouts[k];
  }
  auto& lead = *replicas_.front()->impl_;
  lead.snapshot = state;
  lead.snapshot_number = number;
  lead.snapshots_taken = std::max(lead.snapshots_taken, taken);
  // Each replica on a thread of its own: each waits for the others at the rendezvous and at its
  // stages' first collective.
  std::vector<std::future<bool>> placing;
  for (auto& p : replicas_) {
    placing.push_back(std::async(std::launch::async, [&r = *p->impl_, &state, number] {
      r.meet_replicas();
      r.place_on_nodes();
      r.restore(state, number, "recover");
      return true;
    }));
  }
  detail::get_all(
    placing, 2 * dp.timeout + 2 * placement.connect_timeout + std::chrono::seconds(30), "recover");
  memory::release_free_heap();
  for (const auto& nodes : layouts) {
    report.nodes.insert(report.nodes.end(), nodes.begin(), nodes.end());
  }
  report.bounds = lead.cut.bounds;
  report.snapshot = number;
  report.replicas = world;
  report.seconds =
    std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  log::get()->info(
    "replicas: recovered in {:.2f} s: lost {}, spares used {}, replicas left {}, now {} "
    "replicas on {}, restored snapshot {}",
    report.seconds, list_or_none(report.lost), list_or_none(report.spares_used),
    list_or_none(report.replicas_left), world, fmt::join(report.nodes, ", "), report.snapshot);
  return report;
}

} // namespace actorpipe
