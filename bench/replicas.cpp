// The data-parallel grid: replicas x stages on the bench scenario, with the share of each step
// spent in the gradient all-reduce.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>
#include <actorpipe/trace.hpp>

#include "bench/sweep.hpp"
#include "training/progress.hpp"
#include "training/run_plan.hpp"

namespace actorpipe::bench {
namespace {

struct configuration {
  replica_row row;
  std::unique_ptr<replicated_pipeline> replicas;
  std::vector<double> times;
  std::vector<double> syncs;
  std::vector<double> exposed;
  std::vector<double> updates;
  step_result last;
};

// One timed step of `c`: its time, the longest stage's sync, and how much of the sync the
// step's backward did not hide.
void record(configuration& c, step_result r) {
  double sync = 0;
  double last_compute = 0;
  double last_sync = 0;
  int64_t bytes = 0;
  for (const auto& s : r.stages) {
    sync = std::max(sync, s.sync_end_ms - s.sync_start_ms);
    bytes += s.sync_bytes;
    if (!s.actions.empty()) {
      last_compute = std::max(last_compute, s.actions.back().end_ms);
    }
    last_sync = std::max(last_sync, s.sync_end_ms);
  }
  c.exposed.push_back(std::max(0.0, last_sync - last_compute));
  c.times.push_back(r.wall_ms);
  c.syncs.push_back(sync);
  c.row.sync_bytes = bytes;
  c.row.optimizer_bytes = 0;
  c.row.gradient_bytes = 0;
  double update = 0;
  for (const auto& s : r.stages) {
    c.row.optimizer_bytes += s.optimizer_bytes;
    c.row.gradient_bytes += s.gradient_bytes;
    update = std::max(update, s.optimizer_ms);
  }
  c.updates.push_back(update);
  c.row.loss = r.loss;
  c.last = std::move(r);
}

void write_json(const std::string& path, const training::model_setup& setup,
                const std::vector<replica_row>& rows) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : rows) {
    j.push_back({{"replicas", r.replicas},
                 {"stages", r.stages},
                 {"shard", r.shard},
                 {"optimizer_bytes", r.optimizer_bytes},
                 {"gradient_bytes", r.gradient_bytes},
                 {"update_ms", r.update_ms},
                 {"splits", r.splits},
                 {"median_ms", r.median_ms},
                 {"min_ms", r.min_ms},
                 {"max_ms", r.max_ms},
                 {"samples_per_second", r.samples_per_second},
                 {"speedup", r.speedup},
                 {"sync_ms", r.sync_ms},
                 {"sync_share", r.sync_share},
                 {"exposed_sync_ms", r.exposed_sync_ms},
                 {"sync_bytes", r.sync_bytes},
                 {"loss", r.loss}});
  }
  std::ofstream out(path);
  ACTORPIPE_CHECK(out.good(), "--json: cannot write '", path, "'");
  out << nlohmann::json{{"model", setup.name}, {"batch", setup.batch}, {"rows", j}}.dump(2) << '\n';
}

// The configurations of `r` replicas x `p` stages, one per --shard mode, all on one plan (cut,
// micro-batches, threads: cores / (r x p) per stage).
std::vector<configuration> configure(engine& sys, const sweep_options& o,
                                     const training::model_setup& setup, std::size_t r,
                                     std::size_t p) {
  ACTORPIPE_CHECK(r >= 1 && p >= 1, "--replicas and --stage-counts must be >= 1");
  ACTORPIPE_CHECK(setup.batch % static_cast<int64_t>(r) == 0, "--batch (", setup.batch,
                  ") must be a multiple of ", r, " replicas");
  auto cores = std::max<std::size_t>(1, std::thread::hardware_concurrency());
  auto plan_args = o.plan;
  plan_args.stages = p;
  plan_args.threads = std::max<std::size_t>(1, cores / (r * p));
  auto local = setup.sample().slice(0, 0, setup.batch / static_cast<int64_t>(r));
  auto choice = training::plan_layout(setup.layers, local, plan_args).choice();
  std::vector<configuration> out;
  for (const auto& shard : o.shards.empty() ? std::vector<std::string>{"none"} : o.shards) {
    auto po = training::pipeline_options_for(choice, plan_args);
    po.loss = [](const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); };
    po.optimizer = o.optimizer == "adam" ? adam(o.lr) : sgd(o.lr);
    po.data_parallel.shard = parse_shard_mode(shard);
    configuration c;
    c.row.replicas = r;
    c.row.stages = p;
    c.row.shard = shard;
    c.row.splits = choice.microbatches;
    c.replicas = std::make_unique<replicated_pipeline>(
      sys, [&] { return setup.fresh(o.model.seed); }, choice.cut, po, r);
    out.push_back(std::move(c));
  }
  return out;
}

} // namespace

std::vector<replica_row> run_replica_sweep(const sweep_options& o) {
  ACTORPIPE_CHECK(o.steps >= 1, "--steps (", o.steps, ") must be >= 1");
  auto stage_counts =
    o.stage_counts.empty() ? std::vector<std::size_t>{o.plan.stages} : o.stage_counts;
  auto setup = training::build_model(o.model);
  const auto& mo = setup.options;
  auto cores = std::max<std::size_t>(1, std::thread::hardware_concurrency());

  auto batches = make_batches(setup, o.model.seed + 1, o.steps + 1);

  engine sys;
  std::vector<configuration> grid;
  for (auto r : o.replicas) {
    for (auto p : stage_counts) {
      for (auto& c : configure(sys, o, setup, r, p)) {
        grid.push_back(std::move(c));
      }
    }
  }
  ACTORPIPE_CHECK(!grid.empty(), "--replicas needs at least one count");

  std::printf("actorpipe bench (replicas x stages): %s, batch %lld split over the replicas, "
              "input %lldx%lldx%lld, schedule %s, %zu timed steps after 1 warm-up, %zu cores\n",
              setup.name.c_str(), static_cast<long long>(setup.batch),
              static_cast<long long>(mo.in_channels), static_cast<long long>(mo.image_size),
              static_cast<long long>(mo.image_size), o.plan.schedule.c_str(), o.steps, cores);
  std::fflush(stdout);

  training::progress_bar bar("bench", static_cast<int64_t>((o.steps + 1) * grid.size()));
  int64_t done = 0;
  for (std::size_t i = 0; i <= o.steps; ++i) {
    for (auto& c : grid) {
      auto r = c.replicas->train_step(batches[i].first, batches[i].second);
      if (o.progress) {
        bar.update(++done, detail::concat(c.row.replicas, "x", c.row.stages));
      }
      if (i > 0) { // after the warm-up
        record(c, std::move(r));
      }
    }
  }

  std::vector<replica_row> rows;
  std::printf("\n%8s %6s %9s %6s %9s %9s %9s %10s %8s %9s %7s %10s %9s %9s %8s %8s %12s\n",
              "replicas", "stages", "shard", "splits", "median s", "min s", "max s", "samples/s",
              "speedup", "sync ms", "sync%", "exposed ms", "sync MB", "update ms", "opt MB",
              "grad MB", "loss");
  for (auto& c : grid) {
    auto& row = c.row;
    row.median_ms = median(c.times);
    row.min_ms = *std::min_element(c.times.begin(), c.times.end());
    row.max_ms = *std::max_element(c.times.begin(), c.times.end());
    row.samples_per_second = static_cast<double>(setup.batch) / (row.median_ms / 1000);
    row.speedup = grid.front().times.empty() ? 0 : median(grid.front().times) / row.median_ms;
    row.sync_ms = median(c.syncs);
    row.sync_share = row.sync_ms / row.median_ms;
    row.exposed_sync_ms = median(c.exposed);
    row.update_ms = median(c.updates);
    std::printf("%8zu %6zu %9s %6zu %9.3f %9.3f %9.3f %10.1f %7.2fx %9.1f %6.1f%% %10.1f %9.1f "
                "%9.1f %8.1f %8.1f %12.6f\n",
                row.replicas, row.stages, row.shard.c_str(), row.splits, row.median_ms / 1000,
                row.min_ms / 1000, row.max_ms / 1000, row.samples_per_second, row.speedup,
                row.sync_ms, 100 * row.sync_share, row.exposed_sync_ms,
                static_cast<double>(row.sync_bytes) / 1e6, row.update_ms,
                static_cast<double>(row.optimizer_bytes) / 1e6,
                static_cast<double>(row.gradient_bytes) / 1e6, row.loss);
    rows.push_back(row);
  }
  std::printf("update: the longest stage's optimizer step (sharded: with the parameters' "
              "broadcast from their owners); opt MB, grad MB: replica 0's optimizer state and "
              "gradients after the sync (ZeRO-2 keeps its own parameters'), summed over its "
              "stages, at the last step\n");
  std::printf("sync: the longest stage's gradient all-reduce (+ buffer sync) on replica 0, "
              "median over steps; exposed: how long the step ran on after every stage's last "
              "backward (the sync not hidden behind backward). loss: the last step's, over the "
              "whole batch; with batch norm, "
              "replicas normalise over their own samples (as DDP without SyncBatchNorm)\n");
  if (!o.json.empty()) {
    write_json(o.json, setup, rows);
  }
  if (!o.trace.empty()) {
    write_chrome_trace(o.trace, {grid.back().last});
    std::printf("wrote %s (last step of %zu replicas x %zu stages)\n", o.trace.c_str(),
                grid.back().row.replicas, grid.back().row.stages);
  }
  return rows;
}

} // namespace actorpipe::bench
