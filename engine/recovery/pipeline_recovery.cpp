// A pipeline's recovery after a lost node, and its placement anew: pipeline::recover,
// restore_from_nodes (from the snapshots the nodes keep), rejoin_nodes and repartition
// (docs/distributed.md). It reaches the pipeline through recovery::placed_stages only, the door
// a set of replicas' recovery goes through too (replicas_recovery.cpp).
#include <actorpipe/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <actorpipe/memory.hpp>

#include "engine/recovery/membership.hpp"
#include "engine/recovery/placed_stages.hpp"
#include "logging/log.hpp"
#include "nodes/remote_stages.hpp"

namespace actorpipe::recovery {
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
partition cut_over(const placed_stages& p, std::size_t nodes,
                   const std::function<partition(std::size_t)>& repartition) {
  const auto chunks = p.options().chunks;
  if (nodes == p.options().placement.nodes.size()) {
    return p.cut();
  }
  auto parts = nodes * chunks;
  auto cut = repartition ? repartition(parts) : partition_by_params(p.layers(), parts);
  ACTORPIPE_CHECK(cut.stages() == parts, "recover: the repartition gave ", cut.stages(),
                  " stages for the ", nodes, " nodes left (", chunks, " chunks each)");
  return cut;
}

// Stage actor k, placed on a spare in a lost node's place, takes its part of snapshot `number`
// from the survivor that keeps its copy, sent node to node. False, saying `why`, when none does.
bool hand_over_copy(placed_stages& p, const std::vector<std::vector<nodes::kept_stage>>& kept,
                    const std::vector<std::string>& before, std::size_t k, uint64_t number,
                    std::string& why) {
  const auto& now = p.options().placement.nodes;
  const auto bounds = nlohmann::json(p.cut().bounds);
  std::size_t holder = 0;
  const nodes::kept_stage* copy = nullptr;
  for (std::size_t n = 0; n < now.size() && copy == nullptr; ++n) {
    if (n != k && now[n] == before[n] &&
        (copy = kept_part(kept[n], k, number, bounds)) != nullptr) {
      holder = n;
    }
  }
  if (copy == nullptr) {
    why = detail::concat("no node left keeps a copy of stage ", k, "'s part of it (", before[k],
                         " was lost)");
    return false;
  }
  auto actors = p.stage_nodes();
  if (!nodes::hand_over_kept(p.system(), actors[holder], actors[k], p.stage_data()[k],
                             static_cast<uint32_t>(k), number, copy->note,
                             p.options().step_timeout)) {
    why = detail::concat("stage ", k, "'s copy did not reach ", now[k], " from ", now[holder]);
    return false;
  }
  log::get()->info("pipeline: stage {}'s part of snapshot {} went from {} to {}", k, number,
                   now[holder], now[k]);
  return true;
}

// After a loss, the stage actors placed again on the same cut (spares in the lost nodes'
// places, `before` the nodes before) load snapshot `number` from what the nodes keep: a
// survivor its own part, a spare the copy that the lost node's neighbour holds. False, saying
// `why`, when the nodes do not keep it whole (the caller then restores the driver's snapshot).
bool restore_from_kept(placed_stages& p, const std::vector<std::string>& before, uint64_t number,
                       std::string& why) {
  const auto& now = p.options().placement.nodes;
  if (number == 0) {
    why = "no snapshot taken yet (the starting state)";
    return false;
  }
  if (before.size() != now.size() || p.stage_data().size() != now.size()) {
    why = "another placement";
    return false;
  }
  auto actors = p.stage_nodes();
  auto kept = nodes::kept_by(p.system(), actors, p.options().placement.connect_timeout);
  const auto bounds = nlohmann::json(p.cut().bounds);
  for (std::size_t k = 0; k < now.size(); ++k) {
    if (now[k] != before[k]) {
      if (!hand_over_copy(p, kept, before, k, number, why)) {
        return false;
      }
    } else if (kept_part(kept[k], k, number, bounds) == nullptr) {
      why = detail::concat("node ", now[k], " does not keep stage ", k, "'s part of it");
      return false;
    }
  }
  try {
    nodes::restore_kept(p.system(), actors, now, number, p.options().step_timeout);
  } catch (const std::exception& e) {
    why = e.what();
    return false;
  }
  return true;
}

// The state now becomes the newest snapshot (kept here only), and the stages are placed again on
// `nodes` cut by `cut`, restored from it (`what` names the caller).
void place_again_from_now(placed_stages& p, std::vector<std::string> nodes, partition cut,
                          const char* what) {
  auto& snapshots = p.settled_snapshots();
  snapshots.newest = p.fetch(what);
  snapshots.number = ++snapshots.taken;
  p.stop();
  p.place(std::move(nodes), std::move(cut));
  p.restore(snapshots.newest, snapshots.number, what);
  memory::release_free_heap();
}

double seconds_since(std::chrono::steady_clock::time_point started) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

} // namespace

kept_snapshot kept_on_nodes(placed_stages p) {
  ACTORPIPE_CHECK(p.on_nodes(), "kept_on_nodes: the stages of this pipeline are in this "
                                "process; nodes keep snapshots of the stages they host");
  const auto& addresses = p.options().placement.nodes;
  auto kept = nodes::kept_by(p.system(), p.stage_nodes(), p.options().placement.connect_timeout);
  auto whole = newest_whole(kept, addresses, p.options().chunks);
  if (!whole) {
    throw pipeline_error(detail::concat("the nodes do not keep one snapshot of every stage whole (",
                                        describe_kept(kept, addresses), ")"),
                         error_details{error_kind::io});
  }
  return *whole;
}

void restore_from_nodes(placed_stages p, const kept_snapshot& kept) {
  ACTORPIPE_CHECK(p.on_nodes(), "restore_from_nodes: the stages of this pipeline are in this "
                                "process; nodes keep snapshots of the stages they host");
  auto& snapshots = p.settled_snapshots();
  const auto& placement = p.options().placement;
  if (!kept.nodes.empty() && (kept.nodes != placement.nodes || kept.bounds != p.bounds())) {
    // Placed as when the snapshot was taken: each part loads on the node that keeps it.
    p.stop();
    p.place(kept.nodes, partition{kept.bounds});
    log::get()->info("pipeline: placed as when snapshot {} was taken: {} stages on {}, cut {}",
                     kept.number, placement.nodes.size(), fmt::join(placement.nodes, ", "),
                     p.cut().to_string());
  }
  nodes::restore_kept(p.system(), p.stage_nodes(), placement.nodes, kept.number,
                      p.options().step_timeout);
  snapshots.taken = std::max(snapshots.taken, kept.number);
  auto& members = p.members();
  auto spread = spread_over(placement.nodes, members.given);
  if (spread != placement.nodes) {
    // A part came from a neighbour's copy (its own node keeps nothing: it restarted, or another
    // took its address): the stage actors sharing a node go to the given nodes without one.
    place_again_from_now(p, std::move(spread), p.cut(), "restore_from_nodes");
    log::get()->info("pipeline: spread over the given nodes: {} stages on {}, cut {}",
                     placement.nodes.size(), fmt::join(placement.nodes, ", "), p.cut().to_string());
  } else {
    // What a later recover() restores: the state now (the nodes keep theirs still).
    snapshots.newest = p.fetch("restore_from_nodes");
    snapshots.number = kept.number;
  }
  // The given nodes left without a stage are asked again between steps (rejoin_nodes).
  std::vector<std::string> unplaced;
  std::copy_if(members.given.begin(), members.given.end(), std::back_inserter(unplaced),
               [&](const std::string& n) { return !among(placement.nodes, n); });
  members.lose(unplaced);
}

recovery_report recover(placed_stages p, const std::function<partition(std::size_t)>& repartition,
                        const std::vector<std::string>& found_lost) {
  ACTORPIPE_CHECK(p.on_nodes(), "recover: the stages of this pipeline are in this process; "
                                "recover() places stages on nodes again");
  ACTORPIPE_CHECK(!p.replicated(), "recover: this pipeline is replica ",
                  p.options().data_parallel.rank, " of ", p.options().data_parallel.replicas,
                  "; the replicas recover together, through replicated_pipeline::recover()");
  auto started = std::chrono::steady_clock::now();
  // A snapshot still on its way arrives (or fails) before the newest is chosen.
  auto& snapshots = p.settled_snapshots();
  // The failed pipeline's proxies go first: a node drops the stages of a proxy that went.
  p.stop();
  const auto before = p.options().placement.nodes;
  auto census = take_census(p.system(), before, p.reached(), p.options().placement, found_lost);
  recovery_report report;
  report.lost = census.lost;
  report.spares_used = census.spares_used;
  p.members().lose(census.lost);
  auto placed = census.placed(before);
  if (placed.empty()) {
    throw pipeline_error(
      detail::concat("recover: no node is left (", report.lost.size(), " lost, no spare answered)"),
      error_details{error_kind::node_lost});
  }
  auto cut = cut_over(p, placed.size(), repartition);
  auto same_cut = cut.bounds == p.bounds();
  p.place(placed, cut);
  std::string why = same_cut ? "" : "the model is cut anew over the nodes left";
  report.from_nodes = same_cut && restore_from_kept(p, before, snapshots.number, why);
  if (!report.from_nodes) {
    if (snapshots.number > 0) {
      log::get()->info("pipeline: restoring snapshot {} from the driver: {}", snapshots.number,
                       why);
    }
    p.restore(snapshots.newest, snapshots.number, "recover");
  }
  // The failed pipeline's actors, the local model built again, the snapshot's frames.
  memory::release_free_heap();
  report.nodes = placed;
  report.bounds = cut.bounds;
  report.snapshot = snapshots.number;
  report.seconds = seconds_since(started);
  log::get()->info("pipeline: recovered in {:.2f} s: lost {}, spares used {}, now {} stages on "
                   "{} cut {}, restored snapshot {} from {}",
                   report.seconds, list_or_none(report.lost), list_or_none(report.spares_used),
                   placed.size(), fmt::join(placed, ", "), cut.to_string(), report.snapshot,
                   report.from_nodes ? "the nodes" : "the driver");
  return report;
}

std::optional<recovery_report>
rejoin_nodes(placed_stages p, const std::function<partition(std::size_t)>& repartition) {
  p.take_joined();
  if (!p.on_nodes() || p.replicated()) {
    return std::nullopt;
  }
  const auto& placement = p.options().placement;
  recovery_report report;
  auto& members = p.members();
  auto back = members.answered(p.system(), placement, placement.nodes, report);
  if (!back || back->empty()) {
    return std::nullopt;
  }
  auto started = std::chrono::steady_clock::now();
  const auto given = members.given.size();
  if (placement.nodes.size() >= given) {
    // A spare holds its stages: it stands by for the next loss.
    for (const auto& n : *back) {
      p.add_spare(n);
      report.spares_used.push_back(n);
    }
  } else {
    // Cut anew onto fewer nodes: the stages go over the nodes as built again, from the state now.
    auto nodes = placement.nodes;
    for (const auto& n : *back) {
      if (nodes.size() < given) {
        nodes.push_back(n);
      } else {
        p.add_spare(n);
      }
    }
    const auto chunks = p.options().chunks;
    auto parts = nodes.size() * chunks;
    auto cut = nodes.size() == given ? members.given_cut
               : repartition         ? repartition(parts)
                                     : partition_by_params(p.layers(), parts);
    ACTORPIPE_CHECK(cut.stages() == parts, "rejoin_nodes: the repartition gave ", cut.stages(),
                    " stages for ", nodes.size(), " nodes (", chunks, " chunks each)");
    place_again_from_now(p, nodes, cut, "rejoin_nodes");
  }
  report.nodes = placement.nodes;
  report.bounds = p.bounds();
  report.snapshot = p.kept_snapshots().number;
  report.seconds = seconds_since(started);
  log::get()->info("pipeline: {} back in {:.2f} s: now {} stages on {}, cut {}, spares {}",
                   fmt::join(*back, ", "), report.seconds, placement.nodes.size(),
                   fmt::join(placement.nodes, ", "), p.cut().to_string(),
                   list_or_none(placement.spares));
  return report;
}

uint64_t repartition(placed_stages p, const partition& cut) {
  ACTORPIPE_CHECK(p.on_nodes() && !p.replicated(),
                  "repartition: places the stages of one pipeline on nodes again; this one's are ",
                  p.on_nodes() ? "replicas (they keep one cut)" : "in this process");
  const auto& now = p.cut();
  ACTORPIPE_CHECK(cut.stages() == now.stages() && cut.bounds.back() == now.bounds.back(),
                  "repartition: ", cut.to_string(), " is not a cut of the ", now.bounds.back(),
                  " layers into ", now.stages(), " stages");
  place_again_from_now(p, p.options().placement.nodes, cut, "repartition");
  log::get()->info("pipeline: cut anew into {} on {}", p.cut().to_string(),
                   fmt::join(p.options().placement.nodes, ", "));
  return p.kept_snapshots().number;
}

} // namespace actorpipe::recovery

namespace actorpipe {

// The pipeline's own calls, through the door.
kept_snapshot pipeline::kept_on_nodes() {
  return recovery::kept_on_nodes(recovery::placed(*this));
}

void pipeline::restore_from_nodes(const kept_snapshot& kept) {
  recovery::restore_from_nodes(recovery::placed(*this), kept);
}

recovery_report pipeline::recover(std::function<partition(std::size_t)> repartition,
                                  const std::vector<std::string>& found_lost) {
  return recovery::recover(recovery::placed(*this), repartition, found_lost);
}

std::optional<recovery_report>
pipeline::rejoin_nodes(std::function<partition(std::size_t)> repartition) {
  return recovery::rejoin_nodes(recovery::placed(*this), repartition);
}

uint64_t pipeline::repartition(const partition& cut) {
  return recovery::repartition(recovery::placed(*this), cut);
}

} // namespace actorpipe
