// Runs the `actorpipe` program as a user would: training, its flags and their documentation,
// Fashion-MNIST, resuming, checkpoints, traces.
#include <cmath>
#include <map>
#include <regex>

#include "../training/image_folders.hpp"
#include "cli/program.hpp"
#include "cli_fixtures.hpp"
#include "stages/device.hpp"

using namespace actorpipe::test;

TEST_CASE("train with 1 stage x 1 micro-batch and 3 stages x 5 micro-batches prints the same "
          "losses") {
  auto out = same_losses(
    "--data synthetic --model cnn --batch 10 --steps 3 --lr 0.1 --seed 4",
    {"train --stages 1 --microbatches 1", "train --stages 3 --microbatches 5 --schedule gpipe"}, 3);
  CHECK(out[0].find("step 3/3") != std::string::npos);
}

TEST_CASE("train explains bad flags and exits non-zero") {
  auto unknown_model = run("train --data synthetic --model resnet51 --steps 1");
  CHECK(unknown_model.exit_code == 2);
  CHECK(unknown_model.output.find("unknown model 'resnet51'") != std::string::npos);
  auto too_many = run("train --data synthetic --model mlp --stages 9 --steps 1");
  CHECK(too_many.exit_code == 2);
  CHECK(too_many.output.find("stages (9) must not exceed the model's 6 layers") !=
        std::string::npos);
  auto schedule = run("train --data synthetic --model mlp --schedule zigzag --steps 1");
  CHECK(schedule.exit_code == 2);
  CHECK(schedule.output.find("unknown schedule 'zigzag'") != std::string::npos);
  auto cut = run("train --data synthetic --model mlp --partition cut:9 --stages 2 --steps 1");
  CHECK(cut.exit_code == 2);
  CHECK(cut.output.find("cut point 9 is out of range") != std::string::npos);
  auto zero = run("train --data synthetic --model mlp --microbatches 0 --steps 1");
  CHECK(zero.exit_code == 2);
  CHECK(zero.output.find("microbatches (0) must be >= 1") != std::string::npos);
  auto recompute = run("train --data synthetic --model mlp --recompute sometimes --steps 1");
  CHECK(recompute.exit_code == 2);
  CHECK(recompute.output.find("unknown recompute mode 'sometimes' (choose never, except_last or "
                              "always)") != std::string::npos);
  auto not_a_number = run("train --batch many");
  CHECK(not_a_number.exit_code != 0);
  CHECK(not_a_number.output.find("--batch") != std::string::npos);
}

namespace {

// Every long flag each subcommand's parser defines ("--stages"), with the default it shows.
std::map<std::string, std::map<std::string, std::string>> flags_of_every_command() {
  actorpipe::cli::program program;
  std::map<std::string, std::map<std::string, std::string>> flags;
  for (auto* command : program.app.get_subcommands({})) {
    for (const auto* option : command->get_options()) {
      for (const auto& name : option->get_lnames()) {
        if (name != "help") {
          flags[command->get_name()]["--" + name] = option->get_default_str();
        }
      }
    }
  }
  return flags;
}

// docs/cli.md's flag table of `actorpipe <command>`: the rows between the heading line that
// names the command and the next blank line, as flag -> default cell.
std::map<std::string, std::string> readme_table(const std::string& command) {
  std::ifstream in(std::string(ACTORPIPE_SOURCE_DIR) + "/docs/cli.md");
  REQUIRE(in.good());
  std::string line;
  std::string marker = "<!-- flags: " + command + " -->";
  while (std::getline(in, line) && line.find(marker) == std::string::npos) {
  }
  std::map<std::string, std::string> rows;
  while (std::getline(in, line) && !line.empty()) {
    if (line.rfind("| `--", 0) != 0) {
      continue;
    }
    auto first = line.find('|', 1);
    auto second = line.find('|', first + 1);
    auto names = line.substr(1, first - 1);
    auto default_cell = line.substr(first + 1, second - first - 1);
    // A row may name several flags: "`--rank`, `--world-size`" or "`--json FILE`".
    for (auto at = names.find("`--"); at != std::string::npos; at = names.find("`--", at + 1)) {
      auto end = names.find_first_of("` ", at + 1);
      rows[names.substr(at + 1, end - at - 1)] = default_cell;
    }
  }
  return rows;
}

} // namespace

TEST_CASE("--help documents every flag the parser defines, for every command") {
  auto flags = flags_of_every_command();
  REQUIRE(flags.size() == 5);
  REQUIRE(flags["train"].size() > 40);
  for (const auto& [command, options] : flags) {
    auto help = run(command + " --help");
    CHECK(help.exit_code == 0);
    for (const auto& [flag, default_value] : options) {
      CAPTURE(command);
      CAPTURE(flag);
      CHECK(help.output.find(flag) != std::string::npos);
    }
  }
}

TEST_CASE("docs/cli.md's table of each command has a row for every flag with its default, and no "
          "row for a flag that does not exist") {
  for (const auto& [command, options] : flags_of_every_command()) {
    CAPTURE(command);
    auto rows = readme_table(command);
    REQUIRE_MESSAGE(!rows.empty(), "docs/cli.md has no table after <!-- flags: ", command, " -->");
    for (const auto& [flag, default_value] : options) {
      CAPTURE(flag);
      auto row = rows.find(flag);
      REQUIRE_MESSAGE(row != rows.end(), "no docs/cli.md row for ", flag);
      if (!default_value.empty()) {
        CAPTURE(default_value);
        CAPTURE(row->second);
        CHECK(row->second.find(default_value) != std::string::npos);
      }
    }
    for (const auto& [flag, cell] : rows) {
      CAPTURE(flag);
      CHECK_MESSAGE(options.count(flag) == 1, "docs/cli.md names ", flag, ", which `", command,
                    "` does not define");
    }
  }
}

TEST_CASE("Fashion-MNIST training prints progress and test accuracy, and pipelining does not "
          "change it") {
  auto one = temp_file("fm_one.json");
  auto two = temp_file("fm_two.json");
  auto metrics = temp_file("fm_metrics.csv");
  auto a = run(small_fashion + " --stages 1 --json " + one.string());
  auto b =
    run(small_fashion + " --stages 2 --json " + two.string() + " --metrics " + metrics.string());
  CAPTURE(a.output);
  CAPTURE(b.output);
  REQUIRE(a.exit_code == 0);
  REQUIRE(b.exit_code == 0);
  CHECK(b.output.find("test accuracy: top-1 ") != std::string::npos);
  CHECK(last_top1(one) == last_top1(two));
  CHECK(last_top1(one) > 0.5); // 40 steps on 640 samples: far better than chance (0.1)
  auto la = step_losses(one);
  auto lb = step_losses(two);
  REQUIRE(la.size() == 40);
  REQUIRE(lb.size() == 40);
  for (std::size_t i = 0; i < la.size(); ++i) {
    CHECK(lb[i].second == doctest::Approx(la[i].second).epsilon(1e-5));
  }
  std::ifstream m(metrics);
  std::string header;
  std::getline(m, header);
  CHECK(header == "epoch,step,lr,train_loss,test_loss,top1,top5,seconds,samples_per_second,bits");
  int rows = 0;
  for (std::string line; std::getline(m, line);) {
    ++rows;
  }
  CHECK(rows == 2);
  for (const auto& f : {one, two, metrics}) {
    std::filesystem::remove(f);
  }
}

TEST_CASE("a resumed run continues with exactly the losses of an uninterrupted one, also on "
          "another stage count") {
  auto full = temp_file("full.json");
  auto resumed = temp_file("resumed.json");
  auto repartitioned = temp_file("repartitioned.json");
  auto dir = temp_file("ckpt");
  std::filesystem::remove_all(dir);
  REQUIRE(run(small_fashion + " --stages 2 --json " + full.string()).exit_code == 0);
  auto first = run(small_fashion + " --stages 2 --max-steps 25 --checkpoint-dir " + dir.string());
  CAPTURE(first.output);
  REQUIRE(first.exit_code == 0);
  REQUIRE(std::filesystem::exists(dir / "step-25" / "manifest.json"));
  auto second =
    run(small_fashion + " --stages 2 --resume " + dir.string() + " --json " + resumed.string());
  CAPTURE(second.output);
  REQUIRE(second.exit_code == 0);
  auto third = run(small_fashion + " --stages 3 --resume " + (dir / "step-25").string() +
                   " --json " + repartitioned.string());
  CAPTURE(third.output);
  REQUIRE(third.exit_code == 0);

  auto expected = step_losses(full);
  auto got = step_losses(resumed);
  auto got3 = step_losses(repartitioned);
  REQUIRE(expected.size() == 40);
  REQUIRE(got.size() == 15);
  REQUIRE(got3.size() == 15);
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].first == expected[25 + i].first);
    CHECK(got[i].second == expected[25 + i].second);
    CHECK(got3[i].second == doctest::Approx(expected[25 + i].second).epsilon(1e-5));
  }
  CHECK(last_top1(resumed) == last_top1(full));
  for (const auto& f : {full, resumed, repartitioned}) {
    std::filesystem::remove(f);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("killing the process during a checkpoint write leaves the previous checkpoint "
          "loadable") {
  auto dir = temp_file("ckpt_kill");
  std::filesystem::remove_all(dir);
  REQUIRE(run(small_fashion + " --max-steps 5 --checkpoint-dir " + dir.string()).exit_code == 0);
  auto killed = run("ACTORPIPE_FAULT=checkpoint-before-rename " + std::string(ACTORPIPE_CLI_PATH) +
                      " " + small_fashion + " --max-steps 10 --resume " + dir.string() +
                      " --checkpoint-dir " + dir.string(),
                    /*prefix_cli=*/false);
  CHECK(killed.exit_code != 0);
  CHECK(std::filesystem::exists(dir / ".tmp-step-10"));
  CHECK_FALSE(std::filesystem::exists(dir / "step-10"));
  auto resumed = run(small_fashion + " --max-steps 10 --resume " + dir.string() +
                     " --checkpoint-dir " + dir.string());
  CAPTURE(resumed.output);
  CHECK(resumed.exit_code == 0);
  CHECK(resumed.output.find("resumed from " + (dir / "step-5").string()) != std::string::npos);
  CHECK(std::filesystem::exists(dir / "step-10" / "manifest.json"));
  CHECK_FALSE(std::filesystem::exists(dir / ".tmp-step-10"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a missing data folder names the file and the package") {
  auto r = run("train --data-dir /nonexistent/fm --epochs 1");
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("/nonexistent/fm/train-images-idx3-ubyte.gz' not found; install Debian's "
                      "package dataset-fashion-mnist") != std::string::npos);
}

TEST_CASE("a traced run writes a Chrome trace with a track per stage and send arrows, and "
          "reports planned against measured bubbles") {
  auto trace = temp_file("trace.json");
  auto r = run("train --data synthetic --model mlp --batch 16 --stages 3 --microbatches 4 "
               "--steps 2 --schedule zb-h1 --trace " +
               trace.string());
  CAPTURE(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("planned against measured") != std::string::npos);
  CHECK(r.output.find("stage 2 bubble: planned") != std::string::npos);
  std::ifstream in(trace);
  auto j = nlohmann::json::parse(in);
  std::map<std::string, int> phases;
  std::set<int> tracks;
  for (const auto& e : j["traceEvents"]) {
    phases[e["ph"].get<std::string>()]++;
    if (e["ph"] == "X") {
      tracks.insert(e["tid"].get<int>());
      CHECK(e["dur"].get<double>() >= 0);
    }
  }
  // A track per stage, and the training loop's wait for each batch on a track of its own.
  CHECK(tracks == std::set<int>{0, 1, 2, 3});
  // 2 steps x 3 stages x 4 micro-batches x (F, B, W), and 2 waits for a batch.
  CHECK(phases["X"] == 72 + 2);
  // Per step: activations 0->1, 1->2 and gradients 2->1, 1->0, for 4 micro-batches each.
  CHECK(phases["s"] == 32);
  CHECK(phases["f"] == 32);
  CHECK(phases["M"] == 4);
  std::filesystem::remove(trace);
}
