// replicated_pipeline::recover() and rejoin_nodes(): each replica's stages placed again through
// recovery::placed_stages, as pipeline::recover() places one pipeline's (docs/distributed.md).
#include <actorpipe/replicas.hpp>

#include <algorithm>
#include <chrono>
#include <future>
#include <iterator>
#include <map>
#include <numeric>
#include <optional>

#include <fmt/format.h>

#include <actorpipe/memory.hpp>

#include "engine/futures.hpp"
#include "engine/recovery/membership.hpp"
#include "engine/recovery/placed_stages.hpp"
#include "logging/log.hpp"
#include "nodes/remote_stages.hpp"

namespace actorpipe {
namespace {

using recovery::among;
using recovery::list_or_none;
using recovery::node_census;
using recovery::placed;
using recovery::take_census;

// Every replica's nodes, replica after replica (each its stage actors' nodes, in stage order).
std::vector<std::string> nodes_of(const std::vector<std::unique_ptr<pipeline>>& replicas) {
  std::vector<std::string> all;
  for (const auto& p : replicas) {
    all.insert(all.end(), p->nodes().begin(), p->nodes().end());
  }
  return all;
}

// The nodes a replica goes on with, or comes back on (`layout`, its stage actors' nodes): each
// one neither lost nor holding another replica's stages (`in_use`) stays, each other one's place
// is taken by the next spare of `spares` that is none of its own; those and its own nodes leave
// `spares`. Nothing, and `spares` untouched, when the spares do not fill every place.
std::optional<std::vector<std::string>> fill_places(const std::vector<std::string>& layout,
                                                    const std::vector<std::string>& lost,
                                                    const std::vector<std::string>& in_use,
                                                    std::vector<std::string>& spares) {
  std::vector<std::string> free;
  std::copy_if(spares.begin(), spares.end(), std::back_inserter(free),
               [&](const std::string& n) { return !among(layout, n); });
  std::map<std::string, std::string> replacement; // a node hosting several stages: one spare
  for (const auto& n : layout) {
    if ((among(lost, n) || among(in_use, n)) && replacement.count(n) == 0) {
      if (replacement.size() == free.size()) {
        return std::nullopt;
      }
      replacement.emplace(n, free[replacement.size()]);
    }
  }
  std::vector<std::string> placed;
  for (const auto& n : layout) {
    auto it = replacement.find(n);
    placed.push_back(it == replacement.end() ? n : it->second);
  }
  spares.erase(std::remove_if(spares.begin(), spares.end(),
                              [&](const std::string& n) { return among(placed, n); }),
               spares.end());
  return placed;
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
  auto spares = census.spares;
  for (std::size_t r = 0; r < replica_nodes.size(); ++r) {
    const auto& nodes = replica_nodes[r];
    auto placed = fill_places(nodes, census.lost, {}, spares);
    if (!placed) {
      report.replicas_left.push_back(r);
      continue;
    }
    for (const auto& n : *placed) {
      if (!among(nodes, n) && !among(report.spares_used, n)) {
        report.spares_used.push_back(n);
      }
    }
    whole.push_back(r);
    layouts.push_back(std::move(*placed));
  }
  return {whole, layouts};
}

// Whether a step failed only because another replica's did (its stages' all-reduce ended):
// such a step changed nothing, on stages that all still hold the last completed step's state.
bool failed_for_another(const std::exception_ptr& outcome) {
  if (!outcome) {
    return false;
  }
  try {
    std::rethrow_exception(outcome);
  } catch (const pipeline_error& e) {
    return e.kind() == error_kind::replica_failure;
  } catch (...) {
    return false;
  }
}

// The replica whose stages' live state the others can take after a loss: the lowest rank whose
// last step completed (its all-reduce had every replica's gradients: its state is that step's,
// `done`), else the lowest whose step failed for another's (the step before's), if all its nodes
// answer; only rank 0 where each replica keeps its own buffers. None (-1) with BMUF or sharded
// optimizer state, where no replica holds the whole state of the last step.
struct live_choice {
  int64_t replica = -1;
  bool done = false;
};
live_choice live_source(caf::actor_system& sys, const std::vector<std::vector<std::string>>& nodes,
                        const std::map<std::string, caf::actor>& known,
                        const std::vector<std::exception_ptr>& outcomes,
                        const pipeline_options& options) {
  const auto& dp = options.data_parallel;
  if (dp.bmuf.block_steps > 0 || dp.shard != shard_mode::none) {
    return {};
  }
  auto candidates = std::min(nodes.size(), dp.buffers == buffer_sync::none
                                             ? std::min<std::size_t>(1, outcomes.size())
                                             : outcomes.size());
  live_choice choice;
  for (std::size_t r = 0; r < candidates && choice.replica < 0; ++r) {
    if (!outcomes[r]) {
      choice = {static_cast<int64_t>(r), true};
    }
  }
  for (std::size_t r = 0; r < candidates && choice.replica < 0; ++r) {
    if (failed_for_another(outcomes[r])) {
      choice = {static_cast<int64_t>(r), false};
    }
  }
  if (choice.replica >= 0) {
    auto alive = nodes::answering(sys, nodes[static_cast<std::size_t>(choice.replica)], known,
                                  options.placement);
    if (!std::all_of(alive.begin(), alive.end(), [](bool a) { return a; })) {
      return {};
    }
  }
  return choice;
}

// The state of replica `source`'s stages now (`r`), or null when it does not come (then the
// snapshot serves, with a warning).
std::shared_ptr<const stages::tensor_map> fetch_live(recovery::placed_stages r, int64_t source) {
  try {
    return r.fetch("recover");
  } catch (const std::exception& e) {
    log::get()->warn("recover: the state of replica {} did not come ({}); restoring the newest "
                     "snapshot instead",
                     source, e.what());
    return nullptr;
  }
}

// Where the replicas were placed: every node, the actors of those reached, each replica's nodes.
struct replica_places {
  std::vector<std::string> all;
  std::map<std::string, caf::actor> known;
  std::vector<std::vector<std::string>> replica_nodes;
};

replica_places places_of(const std::vector<std::unique_ptr<pipeline>>& replicas) {
  replica_places places;
  for (const auto& p : replicas) {
    auto r = recovery::placed(*p);
    const auto& nodes = r.options().placement.nodes;
    places.all.insert(places.all.end(), nodes.begin(), nodes.end());
    places.known.insert(r.reached().begin(), r.reached().end());
    places.replica_nodes.push_back(nodes);
  }
  return places;
}

void log_recovery(const recovery_report& report, uint64_t number) {
  auto restored =
    report.from_replica >= 0
      ? fmt::format("the live state of replica {} (snapshot {})", report.from_replica, number)
      : fmt::format("snapshot {}", number);
  log::get()->info("replicas: recovered in {:.2f} s: lost {}, spares used {}, replicas left {}, "
                   "now {} replicas on {}, restored {}",
                   report.seconds, list_or_none(report.lost), list_or_none(report.spares_used),
                   list_or_none(report.replicas_left), report.replicas,
                   fmt::join(report.nodes, ", "), restored);
}

// The spares standing by: those given that no replica holds, then the nodes `back` (rejoined
// or joined) that no replica holds either.
std::vector<std::string> standing_by(std::vector<std::string> spares,
                                     const std::vector<std::string>& in_use,
                                     const std::vector<std::string>& back) {
  spares.erase(std::remove_if(spares.begin(), spares.end(),
                              [&](const std::string& n) { return among(in_use, n); }),
               spares.end());
  for (const auto& n : back) {
    if (!among(in_use, n) && !among(spares, n)) {
      spares.push_back(n);
    }
  }
  return spares;
}

} // namespace

recovery_report replicated_pipeline::recover() {
  auto first = placed(*replicas_.front());
  ACTORPIPE_CHECK(first.on_nodes(), "recover: these replicas' stages are in this process; "
                                    "recover() places stages on nodes again");
  auto started = std::chrono::steady_clock::now();
  // Replica 0 keeps the snapshots (a snapshot still on its way arrives, or fails, first).
  const auto& kept = first.settled_snapshots();
  auto state = kept.newest;
  auto number = kept.number;
  auto taken = kept.taken;
  const auto placement = first.options().placement;
  auto places = places_of(replicas_);
  auto& actor_system = first.system();
  recovery_report report;
  // A replica that kept its nodes holds the last completed step's state: taken before its
  // stages stop, it spares the steps since the newest snapshot.
  auto source =
    live_source(actor_system, places.replica_nodes, places.known, last_outcomes_, first.options());
  if (source.replica >= 0) {
    auto r = static_cast<std::size_t>(source.replica);
    if (auto live = fetch_live(placed(*replicas_[r]), source.replica)) {
      state = std::move(live);
      number = ++taken;
      report.from_replica = source.replica;
      if (source.done && r < last_results_.size()) {
        report.failed_step = last_results_[r];
      }
    }
  }
  for (auto& p : replicas_) {
    // The failed step's proxies go first: a node drops the stages of a proxy that went (the
    // census's questions come after that on each node's connection).
    placed(*p).stop();
  }
  auto census = take_census(actor_system, places.all, places.known, placement);
  report.lost = census.lost;
  members_->lose(census.lost); // asked again between steps (rejoin_nodes)
  auto [whole, layouts] = whole_replicas(places.replica_nodes, census, report);
  if (whole.empty()) {
    throw pipeline_error(detail::concat("recover: no replica is left whole (lost ",
                                        list_or_none(census.lost), "; ", census.spares.size(),
                                        " spares answered)"),
                         error_details{error_kind::node_lost});
  }
  rejoin(whole, layouts, state, number, taken);
  describe_world(report, number, started);
  log_recovery(report, number);
  return report;
}

void replicated_pipeline::rejoin(
  const std::vector<std::size_t>& whole, const std::vector<std::vector<std::string>>& layouts,
  const std::shared_ptr<const std::map<std::string, torch::Tensor>>& state, uint64_t number,
  uint64_t taken) {
  const auto dp = placed(*replicas_.front()).options().data_parallel;
  const auto placement = placed(*replicas_.front()).options().placement;
  // Every driver's rendezvous goes before any meets again (rank 0's serves the store that the
  // next rank 0 serves anew), all at once: each waits at its end for the others'.
  std::vector<std::future<void>> leaving;
  for (auto& p : replicas_) {
    leaving.push_back(std::async(std::launch::async,
                                 [r = placed(*p)]() mutable { r.stop(/*leave_replicas=*/true); }));
  }
  for (auto& f : leaving) {
    f.get(); // each bounded by data_parallel.timeout; the destructor throws nothing
  }
  std::vector<std::unique_ptr<pipeline>> kept;
  for (std::size_t r = 0; r < replicas_.size(); ++r) {
    if (std::find(whole.begin(), whole.end(), r) != whole.end()) {
      continue;
    }
    // Stopped, with the nodes it had: it comes back when they all answer (rejoin_nodes).
    auto nodes = placed(*replicas_[r]).options().placement.nodes;
    left_.emplace_back(std::move(replicas_[r]), std::move(nodes));
  }
  for (auto r : whole) {
    kept.push_back(std::move(replicas_[r]));
  }
  replicas_ = std::move(kept);
  last_outcomes_.clear();
  last_results_.clear();
  const auto world = replicas_.size();
  for (std::size_t k = 0; k < world; ++k) {
    placed(*replicas_[k]).move_to(layouts[k], k, world);
  }
  auto& lead = placed(*replicas_.front()).kept_snapshots();
  lead.newest = state;
  lead.number = number;
  lead.taken = std::max(lead.taken, taken);
  // Each replica on a thread of its own: each waits for the others at the rendezvous and at its
  // stages' first collective.
  std::vector<std::future<bool>> placing;
  for (auto& p : replicas_) {
    placing.push_back(std::async(std::launch::async, [r = placed(*p), &state, number]() mutable {
      r.start(state, number);
      return true;
    }));
  }
  detail::get_all(
    placing, 2 * dp.timeout + 2 * placement.connect_timeout + std::chrono::seconds(30), "recover");
  memory::release_free_heap();
}

std::optional<recovery_report> replicated_pipeline::rejoin_nodes() {
  auto first = placed(*replicas_.front());
  if (!first.on_nodes()) {
    return std::nullopt;
  }
  auto in_use = nodes_of(replicas_);
  members_->take_joined(in_use, first.options().placement.spares);
  recovery_report report;
  auto back = members_->answered(first.system(), first.options().placement, in_use, report);
  if (!back || back->empty()) {
    return std::nullopt;
  }
  return take_back(std::move(report), std::chrono::steady_clock::now());
}

recovery_report replicated_pipeline::take_back(recovery_report report,
                                               std::chrono::steady_clock::time_point started) {
  // The nodes the replicas hold; a spare standing by may go back to the replica it came from.
  auto in_use = nodes_of(replicas_);
  std::vector<std::string> back = report.rejoined;
  back.insert(back.end(), report.joined.begin(), report.joined.end());
  auto spares = standing_by(placed(*replicas_.front()).options().placement.spares, in_use, back);
  // A replica that left comes back with each node it had that serves again, the others'
  // places taken by spares standing by (in order).
  std::vector<std::size_t> coming;
  std::vector<std::vector<std::string>> coming_layouts;
  for (std::size_t k = 0; k < left_.size(); ++k) {
    if (auto layout = fill_places(left_[k].second, members_->lost, in_use, spares)) {
      coming.push_back(k);
      in_use.insert(in_use.end(), layout->begin(), layout->end());
      coming_layouts.push_back(std::move(*layout));
    }
  }
  for (const auto& n : back) {
    if (among(spares, n)) {
      report.spares_used.push_back(n); // standing by
    }
  }
  auto first = placed(*replicas_.front());
  auto number = first.kept_snapshots().number;
  if (!coming.empty()) {
    // The state now, replica 0's: every replica holds it after a completed step (a snapshot
    // still arriving comes first).
    auto taken = first.settled_snapshots().taken + 1;
    auto state = first.fetch("rejoin_nodes");
    number = taken;
    std::vector<std::vector<std::string>> layouts;
    for (auto& p : replicas_) {
      auto r = placed(*p);
      layouts.push_back(r.options().placement.nodes);
      r.stop(); // they meet again with the replicas that come back
    }
    for (std::size_t c = 0; c < coming.size(); ++c) {
      layouts.push_back(coming_layouts[c]);
      replicas_.push_back(std::move(left_[coming[c]].first));
    }
    for (auto k = coming.rbegin(); k != coming.rend(); ++k) {
      left_.erase(left_.begin() + static_cast<std::ptrdiff_t>(*k));
    }
    std::vector<std::size_t> whole(replicas_.size());
    std::iota(whole.begin(), whole.end(), std::size_t{0});
    rejoin(whole, layouts, state, number, taken);
  }
  for (auto& p : replicas_) {
    placed(*p).set_spares(spares); // the next recovery's census asks them
  }
  describe_world(report, number, started);
  log::get()->info("replicas: {} back in {:.2f} s: now {} replicas on {}, spares {}",
                   fmt::join(back, ", "), report.seconds, report.replicas,
                   fmt::join(report.nodes, ", "),
                   list_or_none(placed(*replicas_.front()).options().placement.spares));
  return report;
}

void replicated_pipeline::describe_world(recovery_report& report, uint64_t number,
                                         std::chrono::steady_clock::time_point started) const {
  report.nodes = nodes_of(replicas_);
  report.bounds = placed(*replicas_.front()).bounds();
  report.snapshot = number;
  report.replicas = replicas_.size();
  report.seconds =
    std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

} // namespace actorpipe
