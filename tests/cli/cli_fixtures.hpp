// What the CLI tests of training share: runs compared loss for loss, refusals, bench rows, a
// small Fashion-MNIST run and its report's losses.
#pragma once

#include "helpers.hpp"

namespace actorpipe::test {

// Each command of `commands` ("train --stages 2", "launch --nproc 2 -- train", ...) run with
// `common` appended: every one must succeed with `steps` losses (from --json), equal to the first
// one's within float tolerance, and training must move. Returns their outputs.
inline std::vector<std::string> same_losses(const std::string& common,
                                            const std::vector<std::string>& commands,
                                            std::size_t steps) {
  std::vector<std::string> outputs;
  std::vector<double> first;
  for (const auto& command : commands) {
    auto json = temp_file("same_losses.json");
    auto r = run(command + " --json " + json.string() + " " + common);
    CAPTURE(command);
    CAPTURE(r.output);
    REQUIRE(r.exit_code == 0);
    auto l = losses(json);
    std::filesystem::remove(json);
    REQUIRE(l.size() == steps);
    if (first.empty()) {
      first = l;
      // Training moves: the loss of the last step differs from the first.
      CHECK(l.back() != l.front());
    }
    for (std::size_t i = 0; i < steps; ++i) {
      CHECK(l[i] == doctest::Approx(first[i]).epsilon(1e-5));
    }
    outputs.push_back(r.output);
  }
  return outputs;
}

// `args` fails (exit code 2: a refusal, not a crash) with a message containing `expected`.
inline void refused(const std::string& args, const std::string& expected) {
  auto r = run(args);
  INFO(args);
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find(expected) != std::string::npos);
}

// Runs `bench <flags> --json FILE` (which must succeed) and returns its rows; `output` gets what
// it printed.
inline nlohmann::json bench_rows(const std::string& flags, std::string* output = nullptr) {
  auto json = temp_file("bench_rows.json");
  auto r = run("bench " + flags + " --json " + json.string());
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::ifstream in(json);
  auto rows = nlohmann::json::parse(in)["rows"];
  std::filesystem::remove(json);
  if (output != nullptr) {
    *output = r.output;
  }
  return rows;
}

inline const std::string small_fashion =
  "train --train-samples 640 --test-samples 200 --batch 32 --epochs 2 --warmup 5 --no-progress "
  "--threads 1";

inline std::vector<std::pair<uint64_t, double>>
step_losses(const std::filesystem::path& json_file) {
  std::ifstream in(json_file);
  auto report = nlohmann::json::parse(in);
  std::vector<std::pair<uint64_t, double>> result;
  for (const auto& step : report["steps"]) {
    result.emplace_back(step["step"].get<uint64_t>(), step["loss"].get<double>());
  }
  return result;
}

inline double last_top1(const std::filesystem::path& json_file) {
  std::ifstream in(json_file);
  return nlohmann::json::parse(in)["epochs"].back()["top1"].get<double>();
}

} // namespace actorpipe::test
