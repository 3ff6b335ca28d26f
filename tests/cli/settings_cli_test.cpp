// A run's settings, declared once (training/settings.hpp): every row is a flag of each command
// that takes it, with the row's default, and no other command's; a flag sets the run's settings
// through its row; a refusal names the flag; one that does not apply is refused by name.
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/program.hpp"
#include "helpers.hpp"
#include "training/settings.hpp"

using namespace actorpipe::test;
using actorpipe::training::front_end;

namespace {

const CLI::App* command(const actorpipe::cli::program& p, const std::string& name) {
  for (const auto* c : p.app.get_subcommands([](const CLI::App*) { return true; })) {
    if (c->get_name() == name) {
      return c;
    }
  }
  return nullptr;
}

} // namespace

TEST_CASE("every setting is a flag of the commands that take it, with the table's default") {
  actorpipe::cli::program p;
  const std::vector<std::pair<std::string, front_end>> commands{
    {"train", actorpipe::training::train_front},
    {"plan", actorpipe::training::plan_front},
    {"bench", actorpipe::training::bench_front}};
  for (const auto& row : actorpipe::training::setting_table()) {
    for (const auto& [name, front] : commands) {
      const std::string setting = row.name;
      CAPTURE(setting);
      CAPTURE(name);
      const auto* option = command(p, name)->get_option_no_throw(row.flag());
      if (!row.bound_by(front)) {
        // bench's --shard, --recompute and --precision are its own: lists of modes it runs
        // side by side, not the setting.
        const bool side_by_side =
          name == "bench" &&
          (setting == "shard" || setting == "recompute" || setting == "precision");
        CHECK((option == nullptr || side_by_side));
        continue;
      }
      REQUIRE(option != nullptr);
      if (row.kind != actorpipe::training::setting_kind::flag) {
        CHECK(option->get_default_str() == row.shown);
      }
      CHECK(option->get_description() == row.help);
    }
  }
}

TEST_CASE("a setting's flag sets the run's settings through its row, and records it as given") {
  actorpipe::cli::program p;
  // CLI11 takes the arguments last first.
  std::vector<std::string> args{"optimizer", "--shard",        "0",    "--linger-us",
                                "1234",      "--step-timeout", "bf16", "--precision",
                                "auto",      "--stages",       "train"};
  p.app.parse(args);
  const auto& run = p.train.run;
  CHECK(run.plan.stages == 0);
  CHECK(run.plan.stages_given);
  CHECK(run.pipeline.precision == actorpipe::precision_mode::bf16);
  CHECK(run.pipeline.step_timeout == std::chrono::milliseconds(1234));
  CHECK(run.pipeline.data_parallel.shard == actorpipe::shard_mode::optimizer);
  CHECK(run.pipeline.linger == std::chrono::microseconds(0));
  // CLI11 runs the flags' callbacks in the order the flags were added: the table's.
  CHECK(run.given ==
        std::vector<std::string>{"stages", "precision", "linger_us", "step_timeout", "shard"});
}

TEST_CASE("a setting's bad value is the flag's error, and one that does not apply is refused") {
  auto bad = run("train --precision fp16");
  CHECK(bad.exit_code != 0);
  CHECK(bad.output.find("--precision: unknown precision 'fp16' (choose fp32 or bf16)") !=
        std::string::npos);
  auto ms = run("train --step-timeout 0");
  CHECK(ms.exit_code != 0);
  CHECK(ms.output.find("--step-timeout: must be >= 1 (got 0)") != std::string::npos);
  const std::string mlp = " --data synthetic --model mlp --batch 8 --steps 1 --no-progress";
  auto shard = run("train" + mlp + " --shard optimizer");
  CHECK(shard.exit_code == 2);
  CHECK(shard.output.find("--shard divides the optimizer's state among replicas") !=
        std::string::npos);
  auto both = run("train" + mlp + " --replicas 2 --shard gradients --shard-optimizer");
  CHECK(both.exit_code == 2);
  CHECK(both.output.find("--shard-optimizer is a short form of --shard, which was given too") !=
        std::string::npos);
  auto graphs = run("train" + mlp + " --cuda-graphs on");
  CHECK(graphs.exit_code == 2);
  CHECK(graphs.output.find("--cuda-graphs applies to stages on GPUs (--devices cuda:N)") !=
        std::string::npos);
}

TEST_CASE("--step-timeout, which only Python took before the table, bounds a step") {
  // A step of ResNet-18 on 64 images takes far longer than 1 ms: it fails, naming the timeout.
  auto slow = run("train --data synthetic --model resnet18 --batch 8 --image 32 --steps 1 "
                  "--no-progress --step-timeout 1");
  CHECK(slow.exit_code != 0);
  CHECK(slow.output.find("did not finish within 1 ms") != std::string::npos);
}

TEST_CASE("--linger-us, a setting added as one row of the table: the same losses polling or "
          "sleeping at once") {
  const std::string mlp = " --data synthetic --model mlp --batch 16 --steps 3 --no-progress";
  auto polled = temp_file("linger_default.json");
  auto slept = temp_file("linger_zero.json");
  REQUIRE(run("train" + mlp + " --json " + polled.string()).exit_code == 0);
  REQUIRE(run("train" + mlp + " --linger-us 0 --json " + slept.string()).exit_code == 0);
  CHECK(losses(slept) == losses(polled));
}
