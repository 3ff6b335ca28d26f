// The run's membership as one value: the nodes it was given, those lost since and those that
// joined, the census a recovery takes first, and the snapshots it restores from. A pipeline on
// nodes holds one (pipeline::impl), and a set of replicas holds one for all of them
// (replicated_pipeline; replica 0's pipeline keeps the snapshots). Private to engine/.
#pragma once

#include <algorithm>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <fmt/format.h>

#include <actorpipe/options.hpp>
#include <actorpipe/partition.hpp>
#include <actorpipe/results.hpp>

#include "stages/checkpoint.hpp"

namespace actorpipe::nodes {
class join_listener;
}

namespace actorpipe::recovery {

// "a, b, c" or "none": a recovery's lists in the log.
template <class T>
std::string list_or_none(const std::vector<T>& items) {
  return items.empty() ? std::string("none") : fmt::format("{}", fmt::join(items, ", "));
}

inline bool among(const std::vector<std::string>& xs, const std::string& x) {
  return std::find(xs.begin(), xs.end(), x) != xs.end();
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

  bool is_lost(const std::string& node) const { return among(lost, node); }
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
// connect timeout, all at once; the nodes of `found_lost` are lost without a question.
node_census take_census(caf::actor_system& sys, const std::vector<std::string>& nodes,
                        const std::map<std::string, caf::actor>& known,
                        const node_placement& placement,
                        const std::vector<std::string>& found_lost = {});

// The nodes of a run beyond those its stages are on now (node_placement: nodes, spares): those
// it was given, those lost since, and those that joined; and whether the lost answer again.
struct membership {
  // The nodes and cut as built (a pipeline goes back to them when its nodes come back).
  std::vector<std::string> given;
  partition given_cut;
  // The nodes lost since, in the order they were lost, asked again between steps.
  std::vector<std::string> lost;
  // placement.accept_joins: nodes that announce themselves, taken as lost ones that came back;
  // `joined` lists those not taken yet.
  std::unique_ptr<nodes::join_listener> joins;
  std::vector<std::string> joined;
  // The question whether the lost answer again, and when it was last asked.
  std::future<std::vector<bool>> answering;
  std::chrono::steady_clock::time_point asked_at{};

  membership();
  ~membership();
  membership(membership&&) noexcept;
  membership& operator=(membership&&) noexcept;

  // Each of `nodes` not yet among the lost becomes one.
  void lose(const std::vector<std::string>& nodes);

  // The nodes that joined since the last call that are not yet among `in_use`, `spares` or the
  // lost: lost ones to be asked whether they answer, and joined ones.
  void take_joined(const std::vector<std::string>& in_use, const std::vector<std::string>& spares);

  // Whether the lost answer again, asked beside the steps: a call starts the question on a
  // thread of its own, at most once a second (each question reaches out anew, and a host that is
  // gone costs it its connect timeout); a later call takes the answers. Nothing while there is
  // none (yet). The lost that answer leave the lost and are returned, each counted in `report`
  // as joined (taken off `joined`) or rejoined; those now among `in_use` (a spare of the run took
  // stages since) just leave.
  std::optional<std::vector<std::string>> answered(caf::actor_system& sys,
                                                   const node_placement& placement,
                                                   const std::vector<std::string>& in_use,
                                                   recovery_report& report);

  // "host:port" where nodes join; empty without accept_joins.
  std::string join_address() const;
};

// The run's snapshots: the newest, which a recovery restores, and one still arriving.
struct snapshots {
  // The newest (null: the state the stages were built with), and its number.
  std::shared_ptr<const stages::tensor_map> newest;
  uint64_t number = 0;
  // The numbers given so far (the next is one more).
  uint64_t taken = 0;
  // A snapshot still arriving (pipeline::snapshot_in_background), its number and note.
  std::future<std::shared_ptr<std::map<std::string, torch::Tensor>>> pending;
  uint64_t pending_number = 0;
  std::string pending_note;

  // Whether the snapshot still arriving has come, whole or not.
  bool arrived() const {
    return pending.valid() &&
           pending.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
};

} // namespace actorpipe::recovery
