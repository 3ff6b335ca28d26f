#include "training/stragglers.hpp"

#include <algorithm>

#include <actorpipe/errors.hpp>

namespace actorpipe::training {
namespace {

double median_of(std::vector<double> xs) {
  if (xs.empty()) {
    return 0;
  }
  auto middle = xs.begin() + static_cast<std::ptrdiff_t>(xs.size() / 2);
  std::nth_element(xs.begin(), middle, xs.end());
  return *middle;
}

} // namespace

std::vector<slow_stage> straggler_watch::observe(uint64_t step,
                                                 const std::vector<stage_stats>& stages) {
  std::vector<slow_stage> found;
  if (factor_ <= 0 || stages.empty()) {
    return found;
  }
  if (first_.size() != stages.size()) {
    reset();
    first_.resize(stages.size());
    last_.resize(stages.size());
    usual_ms_.assign(stages.size(), 0.0);
    named_.assign(stages.size(), false);
  }
  if (seen_++ == 0) {
    return found; // the first step warms up
  }
  for (std::size_t k = 0; k < stages.size(); ++k) {
    double ms = stages[k].forward_ms + stages[k].backward_ms;
    if (first_[k].size() < usual_) {
      first_[k].push_back(ms);
      usual_ms_[k] = median_of(first_[k]);
      continue;
    }
    last_[k].push_back(ms);
    if (last_[k].size() > recent_) {
      last_[k].pop_front();
    }
    if (last_[k].size() < recent_ || usual_ms_[k] <= 0) {
      continue;
    }
    double recent = median_of({last_[k].begin(), last_[k].end()});
    double ratio = recent / usual_ms_[k];
    if (!named_[k] && ratio >= factor_) {
      named_[k] = true;
      found.push_back({step, k, std::string{}, usual_ms_[k], recent});
    } else if (named_[k] && ratio < (1 + factor_) / 2) {
      named_[k] = false;
    }
  }
  return found;
}

std::vector<double> straggler_watch::recent_ms() const {
  std::vector<double> result;
  for (const auto& l : last_) {
    result.push_back(median_of({l.begin(), l.end()}));
  }
  return result;
}

void straggler_watch::reset() {
  seen_ = 0;
  first_.clear();
  last_.clear();
  usual_ms_.clear();
  named_.clear();
}

partition cut_for_speeds(const partition& cut, const std::vector<double>& usual_ms,
                         const std::vector<double>& slowdown,
                         const std::vector<double>& layer_weights) {
  const auto stages = cut.stages();
  const auto layers = cut.bounds.back();
  ACTORPIPE_CHECK(
    usual_ms.size() == stages && slowdown.size() == stages && layer_weights.size() == layers,
    "cut_for_speeds: ", usual_ms.size(), " usual times and ", slowdown.size(), " slowdowns for ",
    stages, " stages, ", layer_weights.size(), " weights for ", layers, " layers");
  // Each layer's cost: its stage's usual time shared by weight (equally where all weigh 0).
  std::vector<double> cost(layers, 0.0);
  for (std::size_t k = 0; k < stages; ++k) {
    double total = 0;
    for (auto l = cut.bounds[k]; l < cut.bounds[k + 1]; ++l) {
      total += layer_weights[l];
    }
    auto count = static_cast<double>(cut.bounds[k + 1] - cut.bounds[k]);
    for (auto l = cut.bounds[k]; l < cut.bounds[k + 1]; ++l) {
      cost[l] = usual_ms[k] * (total > 0 ? layer_weights[l] / total : 1.0 / count);
    }
  }
  return partition_by_cost(cost, stages, slowdown);
}

} // namespace actorpipe::training
