// Runs the `actorpipe` program as a user would.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

namespace {

struct run_result {
  int exit_code;
  std::string output;
};

run_result run(const std::string& args) {
  std::string command = std::string(ACTORPIPE_CLI_PATH) + " " + args + " 2>&1";
  std::string output;
  FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) {
    output += buffer;
  }
  int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

std::vector<double> losses(const std::filesystem::path& json_file) {
  std::ifstream in(json_file);
  auto report = nlohmann::json::parse(in);
  std::vector<double> result;
  for (const auto& step : report["steps"]) {
    result.push_back(step["loss"].get<double>());
  }
  return result;
}

std::filesystem::path temp_file(const std::string& name) {
  return std::filesystem::temp_directory_path() /
         ("actorpipe_cli_test_" + std::to_string(::getpid()) + "_" + name);
}

} // namespace

TEST_CASE("train with 1 stage x 1 micro-batch and 3 stages x 5 micro-batches prints the same "
          "losses") {
  auto one = temp_file("one.json");
  auto three = temp_file("three.json");
  const std::string common = " --model cnn --batch 10 --steps 3 --lr 0.1 --seed 4";
  auto a = run("train --stages 1 --microbatches 1 --json " + one.string() + common);
  auto b =
    run("train --stages 3 --microbatches 5 --schedule gpipe --json " + three.string() + common);
  CAPTURE(a.output);
  CAPTURE(b.output);
  REQUIRE(a.exit_code == 0);
  REQUIRE(b.exit_code == 0);
  CHECK(a.output.find("step 3/3") != std::string::npos);
  auto la = losses(one);
  auto lb = losses(three);
  REQUIRE(la.size() == 3);
  REQUIRE(lb.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(lb[i] == doctest::Approx(la[i]).epsilon(1e-5));
  }
  // Training moves: the loss of the last step differs from the first.
  CHECK(la[2] != la[0]);
  std::filesystem::remove(one);
  std::filesystem::remove(three);
}

TEST_CASE("train explains bad flags and exits non-zero") {
  auto unknown_model = run("train --model resnet51 --steps 1");
  CHECK(unknown_model.exit_code == 2);
  CHECK(unknown_model.output.find("unknown model 'resnet51'") != std::string::npos);
  auto too_many = run("train --model mlp --stages 9 --steps 1");
  CHECK(too_many.exit_code == 2);
  CHECK(too_many.output.find("stages (9) must not exceed the model's 6 layers") !=
        std::string::npos);
  auto schedule = run("train --model mlp --schedule zigzag --steps 1");
  CHECK(schedule.exit_code == 2);
  CHECK(schedule.output.find("unknown schedule 'zigzag'") != std::string::npos);
  auto cut = run("train --model mlp --partition cut:9 --stages 2 --steps 1");
  CHECK(cut.exit_code == 2);
  CHECK(cut.output.find("cut point 9 is out of range") != std::string::npos);
  auto zero = run("train --model mlp --microbatches 0 --steps 1");
  CHECK(zero.exit_code == 2);
  CHECK(zero.output.find("microbatches (0) must be >= 1") != std::string::npos);
  auto not_a_number = run("train --batch many");
  CHECK(not_a_number.exit_code != 0);
  CHECK(not_a_number.output.find("--batch") != std::string::npos);
}

TEST_CASE("--help documents every train flag") {
  auto help = run("train --help");
  CHECK(help.exit_code == 0);
  for (const auto* flag : {"--model", "--stages", "--microbatches", "--schedule", "--batch",
                           "--image", "--steps", "--lr", "--seed", "--partition", "--json"}) {
    CAPTURE(flag);
    CHECK(help.output.find(flag) != std::string::npos);
  }
}
