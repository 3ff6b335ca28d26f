// The memory model from the command line: `plan` counts --recompute in each stage's predicted
// memory, and under --max-memory the planner turns recomputation on when only that fits, and
// `train` runs what it chose.
#include <algorithm>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>

#include "helpers.hpp"
#include "stages/device.hpp"

using namespace actorpipe::test;

namespace {

// Each stage's predicted total and activations, in MB, from plan's per-stage lines.
struct predicted {
  double total = 0;
  double activations = 0;
  double working = 0;
};

std::vector<predicted> stages_of(const std::string& output) {
  static const std::regex line(
    R"(stage [0-9]+: busy .*; memory ([0-9.]+) MB \(parameters [0-9.]+, gradients [0-9.]+, optimizer [0-9.]+, activations ([0-9.]+), working ([0-9.]+), workspace [0-9.]+\))");
  std::vector<predicted> stages;
  for (std::sregex_iterator it(output.begin(), output.end(), line), end; it != end; ++it) {
    stages.push_back({std::stod((*it)[1]), std::stod((*it)[2]), std::stod((*it)[3])});
  }
  return stages;
}

double fullest(const std::vector<predicted>& stages) {
  double most = 0;
  for (const auto& s : stages) {
    most = std::max(most, s.total);
  }
  return most;
}

} // namespace

TEST_CASE("plan counts --recompute in each stage's memory, under --max-memory the planner "
          "recomputes when only that fits, and train runs it") {
  const std::string common = " --data text --stages 2 --microbatches 4 --schedule 1f1b "
                             "--partition uniform --profile-repeats 1";
  auto kept = run("plan" + common);
  auto recomputed = run("plan" + common + " --recompute always");
  CAPTURE(kept.output);
  CAPTURE(recomputed.output);
  REQUIRE(kept.exit_code == 0);
  REQUIRE(recomputed.exit_code == 0);
  CHECK(recomputed.output.find("per parameter, recompute always") != std::string::npos);
  auto k = stages_of(kept.output);
  auto r = stages_of(recomputed.output);
  REQUIRE(k.size() == 2);
  REQUIRE(r.size() == 2);
  {
    // One action's working set as predicted, and as the stages measure it (bench/memory_model.py
    // compares every case).
    auto json = temp_file("memory_cli_working.json");
    auto trained = run("train" + common + " --steps 2 --no-progress --json " + json.string());
    REQUIRE(trained.exit_code == 0);
    std::ifstream in(json);
    auto report = nlohmann::json::parse(in);
    for (const auto& stage : report["steps"][1]["stages"]) {
      auto s = stage["stage"].get<std::size_t>();
      auto measured = static_cast<double>(stage["peak_working_bytes"].get<int64_t>()) / 1e6;
      CAPTURE(s);
      CHECK(k.at(s).working > 0);
      CHECK(measured == doctest::Approx(k.at(s).working).epsilon(0.15));
    }
    std::filesystem::remove(json);
  }
  // Stage 0 stashes two micro-batches under 1F1B; recomputed, one is rebuilt at a time.
  CHECK(r[0].activations < k[0].activations);
  REQUIRE(fullest(r) < fullest(k));

  // A cap between the two: the planner (asked to choose, here the threads) must recompute.
  auto cap = std::to_string(static_cast<long long>((fullest(k) + fullest(r)) / 2 * 1e6)) + "B";
  auto capped = run("plan" + common + " --threads auto --max-memory " + cap);
  CAPTURE(capped.output);
  REQUIRE(capped.exit_code == 0);
  CHECK(std::regex_search(capped.output, std::regex("chosen: 1f1b, .*, recompute always")));
  CHECK(capped.output.find("(over the memory cap)") != std::string::npos);

  auto json = temp_file("memory_cli.json");
  auto trained = run("train" + common + " --threads auto --max-memory " + cap +
                     " --steps 2 --json " + json.string());
  CAPTURE(trained.output);
  REQUIRE(trained.exit_code == 0);
  std::ifstream in(json);
  auto report = nlohmann::json::parse(in);
  CHECK(report["config"]["recompute"] == "always");
  REQUIRE(report["steps"].size() == 2);
  for (const auto& stage : report["steps"][1]["stages"]) {
    CHECK(stage["recomputed"].get<int>() == 4); // every micro-batch of the step
  }
  std::filesystem::remove(json);

  // Told never to recompute, the planner keeps to it and refuses the cap by name.
  auto never = run("plan" + common + " --threads auto --recompute never --max-memory " + cap);
  CAPTURE(never.output);
  CHECK(never.exit_code == 2);
  CHECK(never.output.find("no layout fits the memory cap (--max-memory ") != std::string::npos);
  auto unknown = run("plan" + common + " --recompute sometimes");
  CHECK(unknown.exit_code != 0);
  CHECK(unknown.output.find("unknown recompute mode 'sometimes' (choose never, except_last or "
                            "always)") != std::string::npos);
}

TEST_CASE("plan predicts what split-backward schedules stash, what each B keeps for its W "
          "included, as train measures it") {
  for (std::string schedule : {"zb-h1", "dualpipe-v"}) {
    CAPTURE(schedule);
    const std::string common = " --data text --stages 2 --microbatches 4 --schedule " + schedule +
                               " --partition uniform --profile-repeats 1";
    auto planned = run("plan" + common);
    CAPTURE(planned.output);
    REQUIRE(planned.exit_code == 0);
    auto p = stages_of(planned.output);
    REQUIRE(p.size() == 2);
    auto json = temp_file("memory_cli_split.json");
    auto trained = run("train" + common + " --steps 2 --no-progress --json " + json.string());
    CAPTURE(trained.output);
    REQUIRE(trained.exit_code == 0);
    std::ifstream in(json);
    auto report = nlohmann::json::parse(in);
    for (const auto& stage : report["steps"][1]["stages"]) {
      auto s = stage["stage"].get<std::size_t>();
      auto measured = static_cast<double>(stage["peak_stash_bytes"].get<int64_t>()) / 1e6;
      CAPTURE(s);
      CHECK(measured == doctest::Approx(p.at(s).activations).epsilon(0.05));
    }
    std::filesystem::remove(json);
  }
}

TEST_CASE("plan --profile-device profiles where it is told, and what does not apply is refused "
          "by name, and a stage on the CPU reports no device peak") {
  const std::string common = " --data synthetic --model mlp --batch 16 --profile-repeats 1";
  auto on_cpu = run("plan" + common + " --profile-device cpu");
  CAPTURE(on_cpu.output);
  REQUIRE(on_cpu.exit_code == 0);
  CHECK(stages_of(on_cpu.output).size() == 2);
  auto refused = [&](const std::string& flags, const std::string& message) {
    auto r = run("plan" + common + flags);
    CAPTURE(flags);
    CAPTURE(r.output);
    CHECK(r.exit_code != 0);
    CHECK(r.output.find(message) != std::string::npos);
  };
  refused(" --profile-device gpu:1",
          "--profile-device: 'gpu:1' is no device (cpu, cuda or cuda:N)");
  refused(" --profile-device cpu --stages auto",
          "--profile-device profiles a given layout's layers; with --stages or --threads auto");
  if (!actorpipe::stages::built_with_cuda()) {
    refused(" --profile-device cuda:0",
            "--profile-device: device cuda:0: this build of actorpipe has no CUDA");
  }

  auto json = temp_file("memory_cli_device.json");
  auto trained = run("train" + common + " --steps 1 --no-progress --json " + json.string());
  REQUIRE(trained.exit_code == 0);
  std::ifstream in(json);
  auto report = nlohmann::json::parse(in);
  for (const auto& stage : report["steps"][0]["stages"]) {
    CHECK(stage["device_peak_bytes"].get<int64_t>() == -1);
    CHECK(stage["peak_stash_bytes"].get<int64_t>() > 0);
  }
  std::filesystem::remove(json);
}
