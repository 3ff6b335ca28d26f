#include "engine/census.hpp"

#include <algorithm>

#include "nodes/remote_stages.hpp"

namespace actorpipe::recovery {

// Asks every node of `nodes` (repeats asked once) and the spares, each within the placement's
// connect timeout, all at once; the nodes of `found_lost` are lost without a question.
node_census take_census(caf::actor_system& sys, const std::vector<std::string>& nodes,
                        const std::map<std::string, caf::actor>& known,
                        const node_placement& placement,
                        const std::vector<std::string>& found_lost) {
  std::vector<std::string> distinct, asked;
  for (const auto& n : nodes) {
    if (!among(distinct, n)) {
      distinct.push_back(n);
      if (!among(found_lost, n)) {
        asked.push_back(n);
      }
    }
  }
  auto alive = nodes::answering(sys, asked, known, placement);
  node_census census;
  for (const auto& n : distinct) {
    auto i = std::find(asked.begin(), asked.end(), n) - asked.begin();
    if (static_cast<std::size_t>(i) == asked.size() || !alive[i]) {
      census.lost.push_back(n);
    }
  }
  if (census.lost.empty()) {
    return census;
  }
  std::vector<std::string> candidates;
  for (const auto& spare : placement.spares) {
    if (!among(distinct, spare) && !among(candidates, spare)) {
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

} // namespace actorpipe::recovery
