// The built-in schedules side by side in the simulator: step time (makespan), against 1F1B, and
// the most micro-batches any stage stashes, with equal costs per stage and optionally a link
// between stages whose transfers take a given share of a stage's compute per micro-batch
// (docs/schedules.md#choosing). What a measured run adds is in BENCHMARKS.md.
//   actorpipe_schedule_table --stages 2,4,8 --microbatches 8,16,32 --link 0,0.33
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <actorpipe/schedule.hpp>

namespace {

using namespace actorpipe;

struct row {
  std::string schedule;
  std::size_t stages = 0;
  std::size_t microbatches = 0;
  double link = 0;
  double makespan = 0;
  double peak_stash = 0;
};

// A stage's F, B and W cost 1 each per micro-batch (Qi et al.'s equal costs), split evenly over
// its chunks; a transfer between virtual stages on different stages costs `link` x 3 (a share of
// the stage's F + B + W), one within a stage (the V's turn, none in a loop) nothing.
std::vector<action_costs> costs_for(const schedule& s, double link) {
  auto p = s.size();
  auto v = chunks_of(s);
  std::vector<action_costs> costs;
  for (std::size_t vs = 0; vs < p * v; ++vs) {
    action_costs c;
    c.forward = c.backward = c.weight = 1.0 / static_cast<double>(v);
    bool crosses = vs + 1 < p * v &&
                   holder_of(s.placement, p, vs).stage != holder_of(s.placement, p, vs + 1).stage;
    c.send = crosses ? 3 * link : 0;
    costs.push_back(c);
  }
  return costs;
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"The built-in schedules in the simulator: step time and stash"};
  std::vector<std::size_t> stage_counts{2, 4, 8};
  std::vector<std::size_t> microbatch_counts{8, 16, 32};
  std::vector<double> links{0};
  std::vector<std::string> names{"1f1b", "zb-h1",  "interleaved", "interleaved-zb",
                                 "zb-v", "v-half", "v-min",       "dualpipe-v"};
  std::string json_path;
  app.add_option("--stages", stage_counts, "Stage counts")->delimiter(',');
  app.add_option("--microbatches", microbatch_counts, "Micro-batch counts")->delimiter(',');
  app
    .add_option("--link", links,
                "Transfer time between stages as a share of a stage's compute per micro-batch")
    ->delimiter(',');
  app.add_option("--schedules", names, "Schedules (1f1b first: the others are against it)")
    ->delimiter(',');
  app.add_option("--json", json_path, "Also write the rows here");
  CLI11_PARSE(app, argc, argv);

  std::vector<row> rows;
  std::printf("| stages | micro-batches | link | schedule | step | vs 1F1B | peak stash |\n"
              "| --- | --- | --- | --- | --- | --- | --- |\n");
  for (auto link : links) {
    for (auto p : stage_counts) {
      for (auto m : microbatch_counts) {
        double baseline = 0;
        for (const auto& name : names) {
          auto kind = parse_schedule_kind(name);
          auto chunks = chunks_for(kind, 2);
          if (!takes_microbatches(kind, p, m)) {
            continue;
          }
          auto s = make_schedule(kind, p, m, interleaves(kind) || in_a_v(kind) ? chunks : 1);
          auto sim = simulate(s, m, costs_for(s, link));
          row r{name,
                p,
                m,
                link,
                sim.makespan,
                *std::max_element(sim.peak_stash.begin(), sim.peak_stash.end())};
          baseline = baseline > 0 ? baseline : r.makespan;
          std::printf("| %zu | %zu | %.2f | %s | %.1f | %.3fx | %.2f |\n", p, m, link, name.c_str(),
                      r.makespan, baseline / r.makespan, r.peak_stash);
          rows.push_back(r);
        }
      }
    }
  }
  if (!json_path.empty()) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : rows) {
      out.push_back({{"schedule", r.schedule},
                     {"stages", r.stages},
                     {"microbatches", r.microbatches},
                     {"link", r.link},
                     {"makespan", r.makespan},
                     {"peak_stash", r.peak_stash}});
    }
    std::ofstream file(json_path);
    if (!(file << out.dump(1) << '\n')) {
      std::fprintf(stderr, "--json: cannot write '%s'\n", json_path.c_str());
      return 1;
    }
  }
  return 0;
}
