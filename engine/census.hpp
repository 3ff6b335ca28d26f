// What a recovery learns first after a step failed on nodes: which nodes answer, and which
// spares take the place of those that do not (pipeline::recover, replicated_pipeline::recover).
// Private to engine/.
#pragma once

#include <algorithm>
#include <chrono>
#include <future>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <fmt/format.h>

#include <actorpipe/options.hpp>
#include <actorpipe/results.hpp>

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

// Whether the nodes of `lost` answer again, asked beside the steps (rejoin_nodes): a call starts
// the question on a thread of its own, at most once a second since `asked_at` (each question
// reaches out anew, and a host that is gone costs it its connect timeout); a later call takes the
// answers, in the order of `lost` as it was asked. Nothing while there is none (yet).
std::optional<std::vector<bool>> poll_answering(caf::actor_system& sys,
                                                const std::vector<std::string>& lost,
                                                const node_placement& placement,
                                                std::future<std::vector<bool>>& answering,
                                                std::chrono::steady_clock::time_point& asked_at);

// The nodes that joined since the last call (`joins`; none without a listener) that are not yet
// among `in_use`, `spares` or `lost`: added to `lost`, to be asked with the lost ones whether they
// answer (rejoin_nodes), and to `joined`.
void take_joined(nodes::join_listener* joins, const std::vector<std::string>& in_use,
                 const std::vector<std::string>& spares, std::vector<std::string>& lost,
                 std::vector<std::string>& joined);

// A node asked with the lost ones answered: into report.joined where it is one of `joined` (taken
// off it), else into report.rejoined.
void count_answered(const std::string& node, std::vector<std::string>& joined,
                    recovery_report& report);

} // namespace actorpipe::recovery
