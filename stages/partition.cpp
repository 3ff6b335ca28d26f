#include <actorpipe/partition.hpp>

#include <algorithm>
#include <limits>
#include <sstream>

#include <actorpipe/errors.hpp>

namespace actorpipe {
namespace {

void check_stage_count(std::size_t layers, std::size_t stages) {
  ACTORPIPE_CHECK(stages >= 1, "stages (", stages, ") must be >= 1");
  ACTORPIPE_CHECK(stages <= layers, "stages (", stages, ") must not exceed the model's ", layers,
                  " layers: every stage needs at least one layer");
}

std::vector<std::size_t> parse_cuts(const std::string& text) {
  std::vector<std::size_t> cuts;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    ACTORPIPE_CHECK(!item.empty() && item.find_first_not_of("0123456789") == std::string::npos,
                    "partition 'cut:", text, "': '", item, "' is not a layer index");
    cuts.push_back(std::stoul(item));
  }
  ACTORPIPE_CHECK(!cuts.empty(), "partition 'cut:' needs at least one layer index, e.g. cut:3,7");
  return cuts;
}

} // namespace

std::string partition::to_string() const {
  std::ostringstream out;
  for (std::size_t s = 0; s < stages(); ++s) {
    out << (s ? " " : "") << '[' << begin(s) << ", " << end(s) << ')';
  }
  return out.str();
}

partition partition_at(std::size_t layers, const std::vector<std::size_t>& cuts) {
  partition p;
  p.bounds.push_back(0);
  for (auto c : cuts) {
    ACTORPIPE_CHECK(c >= 1 && c < layers, "cut point ", c, " is out of range: cuts must lie in 1..",
                    layers - 1, " for a model of ", layers, " layers");
    ACTORPIPE_CHECK(c > p.bounds.back(), "cut points must be strictly increasing, got ", c,
                    " after ", p.bounds.back());
    p.bounds.push_back(c);
  }
  p.bounds.push_back(layers);
  return p;
}

partition partition_uniform(std::size_t layers, std::size_t stages) {
  check_stage_count(layers, stages);
  partition p;
  p.bounds.push_back(0);
  auto base = layers / stages;
  auto extra = layers % stages;
  for (std::size_t s = 0; s < stages; ++s) {
    p.bounds.push_back(p.bounds.back() + base + (s < extra ? 1 : 0));
  }
  return p;
}

partition partition_by_cost(const std::vector<double>& costs, std::size_t stages,
                            const std::vector<double>& slowdown) {
  auto n = costs.size();
  check_stage_count(n, stages);
  ACTORPIPE_CHECK(slowdown.empty() || slowdown.size() == stages,
                  "partition_by_cost: ", slowdown.size(), " slowdowns for ", stages, " stages");
  std::vector<double> prefix(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) {
    prefix[i + 1] = prefix[i] + costs[i];
  }
  // best[k][i]: smallest possible largest stage over the first i layers cut into k stages.
  constexpr auto inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<std::size_t>> from(stages + 1, std::vector<std::size_t>(n + 1, 0));
  best[0][0] = 0;
  for (std::size_t k = 1; k <= stages; ++k) {
    for (std::size_t i = k; i <= n; ++i) {
      for (std::size_t j = k - 1; j < i; ++j) {
        auto stage = (prefix[i] - prefix[j]) * (slowdown.empty() ? 1.0 : slowdown[k - 1]);
        auto cost = std::max(best[k - 1][j], stage);
        if (cost < best[k][i]) {
          best[k][i] = cost;
          from[k][i] = j;
        }
      }
    }
  }
  partition p;
  p.bounds.assign(stages + 1, 0);
  p.bounds[stages] = n;
  for (std::size_t k = stages; k > 0; --k) {
    p.bounds[k - 1] = from[k][p.bounds[k]];
  }
  return p;
}

partition partition_by_params(const layer_list& layers, std::size_t stages) {
  // Parameter counts stay far below 2^53, so doubles hold them exactly.
  std::vector<double> counts;
  for (const auto& l : layers) {
    counts.push_back(static_cast<double>(l.parameter_count()));
  }
  return partition_by_cost(counts, stages);
}

partition parse_partition(const std::string& spec, const layer_list& layers, std::size_t stages) {
  if (spec == "uniform") {
    return partition_uniform(layers.size(), stages);
  }
  if (spec == "params") {
    return partition_by_params(layers, stages);
  }
  if (spec.rfind("cut:", 0) == 0) {
    auto p = partition_at(layers.size(), parse_cuts(spec.substr(4)));
    ACTORPIPE_CHECK(stages == 0 || p.stages() == stages, "partition '", spec, "' makes ",
                    p.stages(), " stages but ", stages, " were asked for");
    return p;
  }
  throw invalid_argument(
    detail::concat("unknown partition '", spec, "' (known: uniform, params, cut:I,J,...)"));
}

std::vector<int64_t> stage_parameter_counts(const layer_list& layers, const partition& p) {
  std::vector<int64_t> counts;
  for (std::size_t s = 0; s < p.stages(); ++s) {
    counts.push_back(parameter_count(layers, p.begin(s), p.end(s)));
  }
  return counts;
}

} // namespace actorpipe
