#include "engine/recovery/membership.hpp"

#include <algorithm>

#include "nodes/join.hpp"
#include "nodes/remote_stages.hpp"

namespace actorpipe::recovery {

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

membership::membership() = default;
membership::~membership() = default;
membership::membership(membership&&) noexcept = default;
membership& membership::operator=(membership&&) noexcept = default;

void membership::lose(const std::vector<std::string>& nodes) {
  for (const auto& n : nodes) {
    if (!among(lost, n)) {
      lost.push_back(n);
    }
  }
}

void membership::take_joined(const std::vector<std::string>& in_use,
                             const std::vector<std::string>& spares) {
  if (!joins) {
    return;
  }
  for (auto& n : joins->take()) {
    if (!among(in_use, n) && !among(spares, n) && !among(lost, n)) {
      lost.push_back(n);
      joined.push_back(n);
    }
  }
}

namespace {

// The answers to whether the nodes of `lost` answer, in its order as it was asked; nothing while
// none are there (yet), the question started when none is on its way and the last is a second
// old.
std::optional<std::vector<bool>> poll_answering(caf::actor_system& sys,
                                                const std::vector<std::string>& lost,
                                                const node_placement& placement,
                                                std::future<std::vector<bool>>& answering,
                                                std::chrono::steady_clock::time_point& asked_at) {
  if (!answering.valid()) {
    auto now = std::chrono::steady_clock::now();
    if (now - asked_at >= std::chrono::seconds(1)) {
      asked_at = now;
      answering = std::async(std::launch::async, [&sys, lost, placement] {
        return nodes::answering(sys, lost, {}, placement, /*quiet=*/true);
      });
    }
    return std::nullopt;
  }
  if (answering.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    return std::nullopt;
  }
  return answering.get();
}

} // namespace

std::optional<std::vector<std::string>> membership::answered(caf::actor_system& sys,
                                                             const node_placement& placement,
                                                             const std::vector<std::string>& in_use,
                                                             recovery_report& report) {
  if (lost.empty()) {
    return std::nullopt;
  }
  auto alive = poll_answering(sys, lost, placement, answering, asked_at);
  if (!alive) {
    return std::nullopt;
  }
  std::vector<std::string> still_lost, back;
  for (std::size_t i = 0; i < lost.size(); ++i) {
    const auto& n = lost[i];
    if (among(in_use, n)) {
      continue;
    }
    if (i >= alive->size() || !(*alive)[i]) {
      still_lost.push_back(n);
      continue;
    }
    back.push_back(n);
    auto j = std::find(joined.begin(), joined.end(), n);
    if (j == joined.end()) {
      report.rejoined.push_back(n);
    } else {
      report.joined.push_back(n);
      joined.erase(j);
    }
  }
  lost = std::move(still_lost);
  return back;
}

std::string membership::join_address() const {
  return joins ? joins->address() : std::string{};
}

} // namespace actorpipe::recovery
