// Replicas from the command line: bench's sweeps, ranks started by launch, synchronised batch
// norm and BMUF.
#include <cmath>
#include <map>
#include <regex>

#include "../training/image_folders.hpp"
#include "cli/program.hpp"
#include "cli_fixtures.hpp"
#include "stages/device.hpp"

using namespace actorpipe::test;

TEST_CASE("bench sweeps splits against plain libtorch and writes JSON, CSV and a plot") {
  auto json = temp_file("bench.json");
  auto csv = temp_file("bench.csv");
  auto svg = temp_file("bench.svg");
  auto r = run("bench --model mlp --batch 16 --splits 1,2,4 --steps 1 --no-progress --json " +
               json.string() + " --csv " + csv.string() + " --plot " + svg.string());
  CAPTURE(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("plain libtorch 1t") != std::string::npos);
  std::ifstream in(json);
  auto j = nlohmann::json::parse(in);
  CHECK(j["gflop_per_step"].get<double>() > 0);
  // Plain libtorch on 1 and all cores, plain libtorch accumulating over 2 and 4 micro-batches,
  // and the pipeline at 1, 2 and 4 splits.
  REQUIRE(j["rows"].size() == 7);
  CHECK(j["rows"][2]["accumulated"].get<int>() == 2);
  CHECK(j["rows"][3]["accumulated"].get<int>() == 4);
  CHECK(r.output.find("of plain libtorch accumulating over the same micro-batches") !=
        std::string::npos);
  for (const auto& row : j["rows"]) {
    CAPTURE(row.dump());
    CHECK(row["median_ms"].get<double>() > 0);
    // An MLP has no batch norm: every configuration computes the same losses.
    CHECK(row["loss_difference"].get<double>() < 1e-5);
    if (row["splits"].get<int>() > 0) {
      CHECK(row["lower_bound_ms"].get<double>() > 0);
      CHECK(row["efficiency"].get<double>() > 0);
      CHECK(row["predicted_ms"].get<double>() > 0);
      CHECK(row["speedup_1t"].get<double>() > 0);
    }
    if (row["splits"].get<int>() > 1) {
      CHECK(row["speedup_accumulated"].get<double>() > 0);
      CHECK(row["loss_difference_accumulated"].get<double>() >= 0);
      CHECK(row["loss_difference_accumulated"].get<double>() < 1e-5);
    }
  }
  std::ifstream c(csv);
  std::string header;
  std::getline(c, header);
  CHECK(header.rfind("config,partition,splits,median_ms", 0) == 0);
  std::ifstream s(svg);
  std::string text((std::istreambuf_iterator<char>(s)), std::istreambuf_iterator<char>());
  CHECK(text.find("micro-batches (splits)") != std::string::npos);
  for (const auto& f : {json, csv, svg}) {
    std::filesystem::remove(f);
  }
}

TEST_CASE("2 ranks started by launch, and 2 replicas in one process, print the losses of one "
          "process on the whole batch") {
  auto out = same_losses(
    "--data synthetic --model cnn --batch 8 --steps 3 --stages 2 --microbatches 2 --seed 4",
    {"train", "launch --nproc 2 -- train", "train --replicas 2"}, 3);
  CHECK(out[1].find("2 replicas (processes") != std::string::npos);
  CHECK(out[2].find("2 replicas (in this process") != std::string::npos);
}

TEST_CASE("a missing rank ends the run with an error naming it, and launch stops the others") {
  const std::string common = " --data synthetic --model mlp --batch 8 --steps 1 --dp-timeout 1000";
  auto alone =
    run("train --world-size 2 --rank 0 --master-port " + std::to_string(free_port()) + common);
  CAPTURE(alone.output);
  CHECK(alone.exit_code == 1);
  CHECK(alone.output.find("rank 1 of 2 did not arrive at the rendezvous") != std::string::npos);

  auto orphan = run("train --world-size 2 --rank 1 --master-port 1" + common);
  CAPTURE(orphan.output);
  CHECK(orphan.exit_code == 1);
  CHECK(orphan.output.find("cannot reach the rendezvous store of rank 0 at 127.0.0.1:1") !=
        std::string::npos);

  // One rank fails at once (a bad flag value for it alone is not possible: use a bad model),
  // so launch reports its code and stops the rest.
  auto failing = run("launch --nproc 2 -- train --data synthetic --model resnet51 --steps 1");
  CAPTURE(failing.output);
  CHECK(failing.exit_code == 2);
  CHECK(failing.output.find("exited with code 2") != std::string::npos);

  auto bad = run("train --replicas 2 --world-size 2" + common);
  CHECK(bad.exit_code == 2);
  CHECK(bad.output.find("cannot be combined") != std::string::npos);
}

TEST_CASE("Fashion-MNIST trains as 2 ranks: one report, from rank 0") {
  auto r = run("launch --nproc 2 -- train --train-samples 640 --test-samples 200 --batch 32 "
               "--epochs 1 --warmup 5 --no-progress --threads 1");
  CAPTURE(r.output);
  REQUIRE(r.exit_code == 0);
  auto first = r.output.find("test accuracy");
  REQUIRE(first != std::string::npos);
  CHECK(r.output.find("test accuracy", first + 1) == std::string::npos);
  CHECK(r.output.find("2 replicas (processes") != std::string::npos);
}

TEST_CASE("bench --replicas measures the replicas x stages grid with its all-reduce share") {
  auto json = temp_file("grid.json");
  auto trace = temp_file("grid-trace.json");
  auto r = run("bench --model resnet18 --image 32 --batch 8 --replicas 1,2 --stage-counts 1,2 "
               "--microbatches 2 --steps 1 --no-progress --json " +
               json.string() + " --trace " + trace.string());
  CAPTURE(r.output);
  REQUIRE(r.exit_code == 0);
  std::ifstream in(json);
  auto rows = nlohmann::json::parse(in)["rows"];
  REQUIRE(rows.size() == 4);
  for (const auto& row : rows) {
    CAPTURE(row.dump());
    bool replicated = row["replicas"].get<int>() == 2;
    CHECK((row["sync_bytes"].get<int64_t>() > 0) == replicated);
    CHECK((row["sync_ms"].get<double>() > 0) == replicated);
    CHECK(row["median_ms"].get<double>() > 0);
  }
  // The trace of the largest configuration shows each stage's all-reduce.
  std::ifstream trace_in(trace);
  auto events = nlohmann::json::parse(trace_in)["traceEvents"];
  std::set<int> synced;
  for (const auto& e : events) {
    if (e.value("name", "") == "all-reduce") {
      synced.insert(e["tid"].get<int>());
    }
  }
  CHECK(synced == std::set<int>{0, 1});
  std::filesystem::remove(json);
  std::filesystem::remove(trace);
}

TEST_CASE("--batch-norm sync: 2 ranks, as processes and in one process, train a ResNet like one "
          "process on the whole batch, and local batch norm does not") {
  // One micro-batch: each rank's half of the batch is normalised with the other half.
  const std::string common = "--data synthetic --model resnet18 --image 16 --classes 4 --batch 8 "
                             "--steps 2 --stages 2 --microbatches 1 --seed 4 --lr 0.02";
  same_losses(common,
              {"train", "launch --nproc 2 -- train --batch-norm sync",
               "train --replicas 2 --batch-norm sync"},
              2);
  auto whole = temp_file("syncbn_whole.json");
  auto local = temp_file("syncbn_local.json");
  REQUIRE(run("train --json " + whole.string() + " " + common).exit_code == 0);
  REQUIRE(run("train --replicas 2 --json " + local.string() + " " + common).exit_code == 0);
  CHECK(std::abs(losses(local)[0] - losses(whole)[0]) > 1e-5);
  std::filesystem::remove(whole);
  std::filesystem::remove(local);
}

TEST_CASE("--sync bmuf: 2 ranks as processes train like 2 replicas in one process, a resume "
          "continues with the uninterrupted run's losses, and the block flags are checked") {
  const std::string common = "--data synthetic --model cnn --batch 8 --lr 0.05 --stages 2 "
                             "--microbatches 2 --seed 4 --sync bmuf --block-steps 2";
  same_losses(common + " --steps 5", {"train --replicas 2", "launch --nproc 2 -- train"}, 5);

  // A checkpoint ends a block: a run stopped at step 3 and resumed gives the losses of one that
  // went on, checkpointing at the same steps.
  auto full_dir = temp_file("bmuf_full");
  auto dir = temp_file("bmuf_ckpt");
  auto full = temp_file("bmuf_full.json");
  auto resumed = temp_file("bmuf_resumed.json");
  for (const auto& d : {full_dir, dir}) {
    std::filesystem::remove_all(d);
  }
  const std::string flags = "train --replicas 2 --checkpoint-every 3 " + common;
  auto a =
    run(flags + " --steps 7 --checkpoint-dir " + full_dir.string() + " --json " + full.string());
  auto b = run(flags + " --steps 3 --checkpoint-dir " + dir.string());
  auto c = run(flags + " --steps 7 --checkpoint-dir " + dir.string() + " --resume " + dir.string() +
               " --json " + resumed.string());
  CAPTURE(a.output);
  CAPTURE(c.output);
  REQUIRE(a.exit_code == 0);
  REQUIRE(b.exit_code == 0);
  REQUIRE(c.exit_code == 0);
  CHECK(a.output.find("BMUF: blocks of 2 steps, block lr 1, block momentum 0.5") !=
        std::string::npos);
  auto expected = losses(full);
  auto got = losses(resumed);
  REQUIRE(expected.size() == 7);
  REQUIRE(got.size() == 4);
  for (std::size_t i = 0; i < got.size(); ++i) {
    CHECK(got[i] == doctest::Approx(expected[3 + i]).epsilon(1e-6));
  }
  for (const auto& d : {full_dir, dir, full, resumed}) {
    std::filesystem::remove_all(d);
  }

  const std::string synthetic = "train --data synthetic --model cnn --steps 1";
  struct refusal {
    std::string flags;
    std::string message;
  };
  for (const auto& [args, message] : std::vector<refusal>{
         {synthetic + " --block-steps 4", "--block-steps applies to --sync bmuf"},
         {synthetic + " --replicas 2 --block-nesterov", "--block-nesterov applies to --sync bmuf"},
         {synthetic + " --sync bmuf", "--sync bmuf keeps replicas together"},
         {synthetic + " --replicas 2 --sync bmuf --block-steps 0",
          "--block-steps (0) must be >= 1"},
         {synthetic + " --replicas 2 --sync bmuf --block-momentum 1",
          "--block-momentum (1) must be below 1"},
         {"train --data synthetic --model resnet18 --image 16 --steps 1 --replicas 2 --sync bmuf "
          "--batch-norm sync",
          "--sync bmuf cannot be combined with --batch-norm sync"}}) {
    auto bad = run(args);
    CAPTURE(args);
    CAPTURE(bad.output);
    CHECK(bad.exit_code == 2);
    CHECK(bad.output.find(message) != std::string::npos);
  }
}
