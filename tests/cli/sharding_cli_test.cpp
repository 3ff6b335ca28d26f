// `actorpipe train --shard-optimizer` and `--shard-gradients`: replicas in one process and as
// processes train with the losses of unsharded replicas; a sharded run's checkpoint resumes
// unsharded; the flags are refused where they do not apply.
#include <filesystem>

#include "helpers.hpp"

using namespace actorpipe::test;

namespace {

// The per-step losses of `args` (which must succeed), from its --json.
std::vector<double> losses_of(const std::string& args, const std::string& name) {
  auto json = temp_file(name + ".json");
  auto r = run(args + " --json " + json.string());
  CAPTURE(args);
  CAPTURE(r.output);
  REQUIRE(r.exit_code == 0);
  auto l = losses(json);
  std::filesystem::remove(json);
  return l;
}

} // namespace

TEST_CASE("--shard-optimizer and --shard-gradients train with the losses of unsharded replicas, "
          "in one process and as processes, and a sharded checkpoint resumes unsharded") {
  const std::string common = " --data synthetic --model cnn --batch 8 --lr 0.001 --stages 2 "
                             "--microbatches 2 --seed 4 --optimizer adam";
  auto expected = losses_of("train --replicas 2 --steps 6" + common, "unsharded");
  REQUIRE(expected.size() == 6);
  for (const auto& command :
       {std::string("train --replicas 2 --shard-optimizer --steps 6"),
        std::string("train --replicas 2 --shard-gradients --steps 6"),
        std::string("launch --nproc 2 -- train --shard-gradients --steps 6")}) {
    CAPTURE(command);
    auto got = losses_of(command + common, "sharded");
    REQUIRE(got.size() == 6);
    for (std::size_t i = 0; i < got.size(); ++i) {
      CHECK(got[i] == doctest::Approx(expected[i]).epsilon(1e-6));
    }
  }
  // Stopped at step 3 with a sharded optimizer, resumed without: the uninterrupted losses.
  auto dir = temp_file("sharded_ckpt");
  std::filesystem::remove_all(dir);
  auto first = run("train --replicas 2 --shard-gradients --steps 3 --checkpoint-every 3 "
                   "--checkpoint-dir " +
                   dir.string() + common);
  CAPTURE(first.output);
  REQUIRE(first.exit_code == 0);
  auto resumed = losses_of("train --replicas 2 --steps 6 --checkpoint-dir " + dir.string() +
                             " --resume " + dir.string() + common,
                           "resumed");
  REQUIRE(resumed.size() == 3);
  for (std::size_t i = 0; i < resumed.size(); ++i) {
    CHECK(resumed[i] == doctest::Approx(expected[3 + i]).epsilon(1e-6));
  }
  std::filesystem::remove_all(dir);

  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
         {"train --data synthetic --model cnn --steps 1 --shard-optimizer",
          "--shard-optimizer divides the optimizer's state among replicas"},
         {"train --data synthetic --model cnn --steps 1 --replicas 2 --sync bmuf "
          "--shard-gradients",
          "--shard-gradients cannot be combined with --sync bmuf"}}) {
    auto bad = run(args);
    CAPTURE(args);
    CAPTURE(bad.output);
    CHECK(bad.exit_code == 2);
    CHECK(bad.output.find(message) != std::string::npos);
  }
}
