// Runs the `actorpipe` program as a user would.
#include <cmath>
#include <map>
#include <regex>

#include "../training/image_folders.hpp"
#include "cli/program.hpp"
#include "helpers.hpp"
#include "stages/device.hpp"

using namespace actorpipe::test;

namespace {

// Each command of `commands` ("train --stages 2", "launch --nproc 2 -- train", ...) run with
// `common` appended: every one must succeed with `steps` losses (from --json), equal to the first
// one's within float tolerance, and training must move. Returns their outputs.
std::vector<std::string> same_losses(const std::string& common,
                                     const std::vector<std::string>& commands, std::size_t steps) {
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
void refused(const std::string& args, const std::string& expected) {
  auto r = run(args);
  INFO(args);
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find(expected) != std::string::npos);
}

// Runs `bench <flags> --json FILE` (which must succeed) and returns its rows; `output` gets what
// it printed.
nlohmann::json bench_rows(const std::string& flags, std::string* output = nullptr) {
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

} // namespace

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

// The README's flag table of `actorpipe <command>`: the rows between the heading line that
// names the command and the next blank line, as flag -> default cell.
std::map<std::string, std::string> readme_table(const std::string& command) {
  std::ifstream in(std::string(ACTORPIPE_SOURCE_DIR) + "/README.md");
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

TEST_CASE("the README's table of each command has a row for every flag with its default, and no "
          "row for a flag that does not exist") {
  for (const auto& [command, options] : flags_of_every_command()) {
    CAPTURE(command);
    auto rows = readme_table(command);
    REQUIRE_MESSAGE(!rows.empty(), "README.md has no table after <!-- flags: ", command, " -->");
    for (const auto& [flag, default_value] : options) {
      CAPTURE(flag);
      auto row = rows.find(flag);
      REQUIRE_MESSAGE(row != rows.end(), "no README row for ", flag);
      if (!default_value.empty()) {
        CAPTURE(default_value);
        CAPTURE(row->second);
        CHECK(row->second.find(default_value) != std::string::npos);
      }
    }
    for (const auto& [flag, cell] : rows) {
      CAPTURE(flag);
      CHECK_MESSAGE(options.count(flag) == 1, "the README names ", flag, ", which `", command,
                    "` does not define");
    }
  }
}

namespace {

const std::string small_fashion =
  "train --train-samples 640 --test-samples 200 --batch 32 --epochs 2 --warmup 5 --no-progress "
  "--threads 1";

std::vector<std::pair<uint64_t, double>> step_losses(const std::filesystem::path& json_file) {
  std::ifstream in(json_file);
  auto report = nlohmann::json::parse(in);
  std::vector<std::pair<uint64_t, double>> result;
  for (const auto& step : report["steps"]) {
    result.emplace_back(step["step"].get<uint64_t>(), step["loss"].get<double>());
  }
  return result;
}

double last_top1(const std::filesystem::path& json_file) {
  std::ifstream in(json_file);
  return nlohmann::json::parse(in)["epochs"].back()["top1"].get<double>();
}

} // namespace

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

TEST_CASE("plan profiles the model, prints the cut and draws the schedule") {
  auto svg = temp_file("plan.svg");
  auto r = run("plan --data synthetic --model resnet18 --image 32 --batch 8 --stages 2 "
               "--partition time --schedule interleaved --chunks 2 --microbatches 4 --svg " +
               svg.string());
  CAPTURE(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("simulated step:") != std::string::npos);
  CHECK(r.output.find("stage 1: busy") != std::string::npos);
  std::ifstream in(svg);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text.rfind("<svg", 0) == 0);
  CHECK(text.find("planned interleaved") != std::string::npos);
  std::filesystem::remove(svg);
}

TEST_CASE("--stages auto ranks layouts by simulated step, trains the fastest to the same losses, "
          "and plan shows the ranking without training") {
  const std::string common = "--data synthetic --model mlp --batch 16 --steps 3 --lr 0.1";
  auto outputs = same_losses(
    common,
    {"train --stages 1 --microbatches 1", "train --stages auto --profile-repeats 2 --threads auto"},
    3);
  const auto& automatic = outputs[1];
  CHECK(automatic.find("layouts ranked by simulated step") != std::string::npos);
  CHECK(automatic.find("chosen: ") != std::string::npos);
  CHECK(automatic.find("predicted") != std::string::npos);
  CHECK(automatic.find("planner: predicted ") != std::string::npos);
  CHECK(automatic.find(" steps after the first (") != std::string::npos);
  // One stage with every core is always among the candidates (shown even when not in the top).
  CHECK(std::regex_search(automatic, std::regex(R"(\n +[0-9]+ +1 +[0-9]+ +[0-9]+ +1f1b )")));

  auto plan = run("plan --data synthetic --model mlp --batch 16 --stages auto --max-stages 2 "
                  "--max-stash 1 --profile-repeats 2");
  CAPTURE(plan.output);
  REQUIRE(plan.exit_code == 0);
  CHECK(plan.output.find("rank stages threads") != std::string::npos);
  CHECK(plan.output.find("profile spread") != std::string::npos);
  CHECK(plan.output.find("(over the memory cap)") != std::string::npos);
  CHECK(plan.output.find("simulated step:") != std::string::npos);
  // A cap in bytes, too small for anything: named, with what the smallest layout needs.
  auto tiny = run("plan --data synthetic --model mlp --batch 16 --stages auto --max-stash 10B "
                  "--profile-repeats 1");
  CHECK(tiny.exit_code == 2);
  CHECK(tiny.output.find("no layout fits the memory cap (--max-stash 10 bytes)") !=
        std::string::npos);
  // The memory model: each stage's predicted peak, and a cap on it, in bytes with a unit.
  CHECK(plan.output.find("mem MB") != std::string::npos);
  CHECK(std::regex_search(
    plan.output,
    std::regex(
      R"(stage 0: busy .*; memory [0-9.]+ MB \(parameters [0-9.]+, gradients [0-9.]+, optimizer [0-9.]+, activations [0-9.]+, working [0-9.]+, workspace [0-9.]+\))")));
  auto small = run("plan --data synthetic --model mlp --batch 16 --stages auto --max-memory 10KB "
                   "--profile-repeats 1");
  CAPTURE(small.output);
  CHECK(small.exit_code == 2);
  CHECK(small.output.find("no layout fits the memory cap (--max-memory 10000 bytes per stage); "
                          "the smallest needs ") != std::string::npos);
  refused("plan --data synthetic --model mlp --stages auto --max-memory 5",
          "'5' needs a unit (e.g. 512MB, 2GiB)");

  refused("train --data synthetic --model mlp --stages 0 --steps 1",
          "'0' is neither a count >= 1 nor auto");
  refused("train --data synthetic --model mlp --stages many --steps 1",
          "'many' is neither a count >= 1 nor auto");
  refused("train --data synthetic --model mlp --threads some --steps 1",
          "'some' is neither a count nor auto");
  refused("train --data synthetic --model mlp --stages auto --max-stash 3XB --steps 1",
          "unknown unit 'XB'");
  refused("train --data synthetic --model mlp --stages auto --replicas 2 --steps 1",
          "--stages auto plans one pipeline on this machine's cores");
  refused("train --data synthetic --model mlp --threads auto --nodes 127.0.0.1:1 --steps 1",
          "--threads auto plans stages on this machine's cores");
  refused("train --data synthetic --model mlp --stages auto --schedule file:x.json --steps 1",
          "do not apply");
}

TEST_CASE(
  "plan --devices projects a step onto other machines, pipelines and replicas over a link") {
  auto r = run("plan --data synthetic --model mlp --batch 64 --microbatches 8 --devices 2,4 "
               "--link 10,0.01 --profile-repeats 1");
  CAPTURE(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("link 10 GB/s, 0.01 ms per message") != std::string::npos);
  CHECK(r.output.find("the fastest layout of each device count:") != std::string::npos);
  CHECK(r.output.find("a pipeline only (every device a stage):") != std::string::npos);
  // Rows for 1 (the reference), 2 and 4 devices in both tables.
  CHECK(std::regex_search(r.output, std::regex(R"(\n +1 +1 +1 +[0-9]+ +1f1b)")));
  CHECK(std::regex_search(r.output, std::regex(R"(\n +4 +4 +1 +[0-9]+ )")));
  refused("plan --model mlp --data synthetic --devices 4 --link 10",
          "--link '10' is not GBPS,LATENCY_MS");
  refused("plan --model mlp --data synthetic --devices 4 --link 0,1",
          "--link '0,1' is not GBPS,LATENCY_MS");
  refused("plan --model mlp --data synthetic --link 10,0.01", "--link applies to projections");
  refused("plan --model mlp --data synthetic --devices 4 --stages 2",
          "--stages, --max-stages and --threads auto do not apply");
}

TEST_CASE("bench --stages auto measures the planner's layout beside the sweep") {
  auto r = run("bench --model mlp --batch 16 --stages auto --splits 1,2 --steps 1 --no-progress "
               "--profile-repeats 1");
  CAPTURE(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("plan: ") != std::string::npos);
  CHECK(r.output.find("planner: plan: ") != std::string::npos);
  CHECK(r.output.find("planned / fastest") != std::string::npos);
}

TEST_CASE("train takes a schedule from a JSON file or picks one itself") {
  auto file = temp_file("schedule.json");
  {
    std::ofstream out(file);
    out << R"({"programs": [["F0", "F1", "B1", "B0"], ["F0", "B0", "F1", "B1"]]})";
  }
  auto from_file = run("train --data synthetic --model mlp --batch 8 --stages 2 --microbatches 2 "
                       "--steps 1 --schedule file:" +
                       file.string());
  CAPTURE(from_file.output);
  CHECK(from_file.exit_code == 0);
  auto automatic = run("train --data synthetic --model mlp --batch 16 --stages 2 --microbatches 0 "
                       "--steps 1 --schedule auto --max-stash 2");
  CAPTURE(automatic.output);
  CHECK(automatic.exit_code == 0);
  CHECK(automatic.output.find("chosen: ") != std::string::npos);
  CHECK(automatic.output.find("(over the memory cap)") != std::string::npos);
  {
    std::ofstream out(file);
    out << R"({"programs": [["F0", "B0", "F1", "B1"], ["F1", "F0", "B1", "B0"]]})";
  }
  auto deadlock = run("train --data synthetic --model mlp --batch 8 --stages 2 --microbatches 2 "
                      "--steps 1 --schedule file:" +
                      file.string());
  CHECK(deadlock.exit_code == 2);
  CHECK(deadlock.output.find("schedule deadlocks: stage 0 waits at action 1 (B0)") !=
        std::string::npos);
  std::filesystem::remove(file);
}

TEST_CASE("--overlap-steps trains Fashion-MNIST to the same losses bit for bit, checkpoints after "
          "the right steps, and is refused where it does not apply") {
  auto plain = temp_file("overlap_plain.json");
  auto overlapped = temp_file("overlap_on.json");
  auto resumed = temp_file("overlap_resumed.json");
  auto dir = temp_file("overlap_ckpt");
  std::filesystem::remove_all(dir);
  const std::string run_args = small_fashion + " --stages 2 --schedule zb-h1";
  auto a = run(run_args + " --json " + plain.string());
  auto b = run(run_args + " --overlap-steps --checkpoint-every 7 --keep 10 --checkpoint-dir " +
               dir.string() + " --json " + overlapped.string());
  CAPTURE(a.output);
  CAPTURE(b.output);
  REQUIRE(a.exit_code == 0);
  REQUIRE(b.exit_code == 0);
  auto expected = step_losses(plain);
  REQUIRE(expected.size() == 40);
  CHECK(step_losses(overlapped) == expected);
  CHECK(last_top1(overlapped) == last_top1(plain));
  // The checkpoint after step 14 holds the state after step 14, not after the step submitted
  // behind it: a run resumed from it continues with the same losses.
  REQUIRE(std::filesystem::exists(dir / "step-14" / "manifest.json"));
  auto c =
    run(run_args + " --resume " + (dir / "step-14").string() + " --json " + resumed.string());
  CAPTURE(c.output);
  REQUIRE(c.exit_code == 0);
  auto continued = step_losses(resumed);
  REQUIRE(continued.size() == 26);
  for (std::size_t i = 0; i < continued.size(); ++i) {
    CHECK(continued[i] == expected[14 + i]);
  }
  std::filesystem::remove_all(dir);
  refused("train --data synthetic --model mlp --replicas 2 --overlap-steps --steps 1",
          "--overlap-steps applies to one pipeline");
  refused("train --data synthetic --model mlp --nodes 127.0.0.1:1,127.0.0.1:2 --overlap-steps "
          "--steps 1",
          "--overlap-steps runs stages in this process");
}

TEST_CASE("--schedule zb-v and v-half run a gpt in a V: the losses of one stage, and stage 0 holds "
          "the embedding and the head") {
  auto trace = temp_file("v_trace.json");
  auto out =
    same_losses("--data synthetic --model gpt --layers 2 --width 32 --heads 2 "
                "--context 8 --classes 9 --batch 16 --steps 3 --lr 0.01 --seed 2 "
                "--no-progress",
                {"train --stages 1 --microbatches 1",
                 "train --stages 2 --microbatches 4 --schedule zb-v --trace " + trace.string(),
                 "train --stages 2 --microbatches 4 --schedule v-half --chunks 2"},
                3);
  for (std::size_t i : {1, 2}) {
    CAPTURE(out[i]);
    // Down the stages and back: the turn on stage 1, the head back on stage 0.
    CHECK(out[i].find("  stage 0 chunk 0: layers embed..") != std::string::npos);
    CHECK(out[i].find("  stage 1 chunk 0: layers ") != std::string::npos);
    CHECK(out[i].find("  stage 1 chunk 1: layers ") != std::string::npos);
    CHECK(out[i].find("  stage 0 chunk 1: layers ") != std::string::npos);
    CHECK(out[i].find("..head, ") > out[i].find("  stage 0 chunk 1: layers "));
    CHECK(out[i].find("  stage 1 chunk 1: layers ") < out[i].find("  stage 0 chunk 1: layers "));
  }
  // The trace follows the V: per step, 4 micro-batches x 3 hops each way (the turn on stage 1
  // included, a send to itself), and 2 stages x 2 chunks x 4 micro-batches x (F, B, W).
  CHECK(out[1].find("planned against measured") != std::string::npos);
  std::ifstream in(trace);
  auto j = nlohmann::json::parse(in);
  std::map<std::string, int> phases;
  for (const auto& e : j["traceEvents"]) {
    phases[e["ph"].get<std::string>()]++;
  }
  CHECK(phases["s"] == 3 * 24);
  CHECK(phases["X"] == 3 * 48 + 3);
  std::filesystem::remove(trace);
  refused("train --data synthetic --model mlp --schedule zb-v --chunks 3 --steps 1",
          "--schedule zb-v runs two chunks per stage in a V: --chunks 3 does not apply");
}

TEST_CASE("--schedule interleaved-zb, v-min and dualpipe-v train a gpt with the losses of one "
          "stage, and refuse the sizes they cannot take by name") {
  same_losses("--data synthetic --model gpt --layers 2 --width 32 --heads 2 --context 8 "
              "--classes 9 --batch 16 --steps 3 --lr 0.01 --seed 2 --no-progress",
              {"train --stages 1 --microbatches 1",
               "train --stages 2 --microbatches 4 --schedule interleaved-zb --chunks 2",
               "train --stages 2 --microbatches 4 --schedule v-min",
               "train --stages 2 --microbatches 4 --schedule dualpipe-v"},
              3);
  refused("train --data synthetic --model mlp --stages 2 --microbatches 3 --schedule dualpipe-v "
          "--steps 1",
          "dualpipe-v schedule needs microbatches (3) >= 2 x stages (4)");
  refused("train --data synthetic --model mlp --stages 2 --microbatches 4 --schedule "
          "interleaved-zb --steps 1",
          "--schedule interleaved-zb with --chunks 1 interleaves nothing: give --chunks 2 or "
          "more, or --schedule zb-h1");
  refused("train --data synthetic --model mlp --stages 2 --microbatches 4 --schedule v-min "
          "--chunks 3 --steps 1",
          "--schedule v-min runs two chunks per stage in a V: --chunks 3 does not apply");
}

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

TEST_CASE("one training loop for every kind of data: --steps, checkpoints, resume and metrics "
          "work on synthetic data, --steps and --trace on Fashion-MNIST") {
  const std::string synthetic =
    "train --data synthetic --model mlp --image 8 --classes 4 --batch 8 --seed 5 --lr 0.1";
  auto full = temp_file("stream_full.json");
  auto resumed = temp_file("stream_resumed.json");
  auto metrics = temp_file("stream_metrics.csv");
  auto dir = temp_file("stream_ckpt");
  std::filesystem::remove_all(dir);
  std::filesystem::remove(metrics);
  REQUIRE(run(synthetic + " --steps 4 --json " + full.string()).exit_code == 0);
  auto first = run(synthetic + " --steps 2 --checkpoint-dir " + dir.string());
  CAPTURE(first.output);
  REQUIRE(first.exit_code == 0);
  REQUIRE(std::filesystem::exists(dir / "step-2" / "manifest.json"));
  auto second = run(synthetic + " --steps 4 --resume " + dir.string() + " --json " +
                    resumed.string() + " --metrics " + metrics.string());
  CAPTURE(second.output);
  REQUIRE(second.exit_code == 0);
  auto expected = step_losses(full);
  auto got = step_losses(resumed);
  REQUIRE(expected.size() == 4);
  REQUIRE(got.size() == 2);
  for (std::size_t i = 0; i < got.size(); ++i) {
    CHECK(got[i].first == expected[2 + i].first);
    CHECK(got[i].second == expected[2 + i].second);
  }
  std::ifstream rows(metrics);
  std::string header;
  std::string row;
  REQUIRE(std::getline(rows, header));
  REQUIRE(std::getline(rows, row));
  CHECK(row.rfind("1,4,", 0) == 0); // one row for the run: "epoch" 1, at step 4

  auto fashion_json = temp_file("fashion_steps.json");
  auto fashion_trace = temp_file("fashion_trace.json");
  auto fashion = run(small_fashion + " --steps 3 --json " + fashion_json.string() + " --trace " +
                     fashion_trace.string());
  CAPTURE(fashion.output);
  REQUIRE(fashion.exit_code == 0);
  CHECK(step_losses(fashion_json).size() == 3);
  std::ifstream trace_in(fashion_trace);
  auto trace = nlohmann::json::parse(trace_in);
  CHECK(trace["traceEvents"].size() > 3 * 2 * 4);
  for (const auto& f : {full, resumed, metrics, fashion_json, fashion_trace}) {
    std::filesystem::remove(f);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a flag that does not apply to the chosen data or schedule is an error naming it") {
  auto epochs = run("train --data synthetic --model mlp --epochs 2 --steps 1");
  CHECK(epochs.exit_code == 2);
  CHECK(epochs.output.find("--epochs does not apply to --data synthetic") != std::string::npos);
  auto warmup = run("train --data synthetic --model mlp --warmup 5 --steps 1");
  CHECK(warmup.exit_code == 2);
  CHECK(warmup.output.find("--warmup does not apply to --data synthetic") != std::string::npos);
  auto image = run("train --image 64 --steps 1");
  CHECK(image.exit_code == 2);
  CHECK(image.output.find("--image sets the side of synthetic images and of images:DIR") !=
        std::string::npos);
  auto both = run("train --data synthetic --model mlp --steps 2 --max-steps 2");
  CHECK(both.exit_code == 2);
  CHECK(both.output.find("--steps and --max-steps") != std::string::npos);
  auto interleaved = run("train --data synthetic --model mlp --schedule interleaved --steps 1");
  CHECK(interleaved.exit_code == 2);
  CHECK(interleaved.output.find("--schedule interleaved with --chunks 1 interleaves nothing") !=
        std::string::npos);
}

TEST_CASE("--recompute trains to the same losses as keeping every activation") {
  auto losses = [](const std::string& mode) {
    auto r = run("train --data synthetic --model mlp --stages 2 --microbatches 4 --batch 8 "
                 "--steps 2 --recompute " +
                 mode);
    REQUIRE(r.exit_code == 0);
    std::vector<std::string> found;
    std::size_t at = 0;
    while ((at = r.output.find("  loss ", at)) != std::string::npos) {
      at += 7;
      found.push_back(r.output.substr(at, r.output.find(' ', at) - at));
    }
    return found;
  };
  auto kept = losses("never");
  REQUIRE(kept.size() == 2);
  CHECK(losses("always") == kept);
  CHECK(losses("except_last") == kept);
}

TEST_CASE("gpt trains on a text file with validation bits per character, checkpoints, resumes and "
          "writes a sample, and on synthetic tokens its loss falls") {
  auto text = temp_file("corpus.txt");
  {
    std::ofstream out(text);
    for (int i = 0; i < 60; ++i) {
      out << "the quick brown fox jumps over the lazy dog " << i % 7 << "\n";
    }
  }
  const std::string gpt = "train --data text --text-file " + text.string() +
                          " --layers 2 --heads 2 --width 16 --context 16 --batch 8 --stages 2 "
                          "--microbatches 2 --warmup 2 --no-progress --seed 3";
  auto dir = temp_file("gpt_ckpt");
  std::filesystem::remove_all(dir);
  auto first = run(gpt + " --epochs 2 --checkpoint-dir " + dir.string() + " --sample 40");
  CAPTURE(first.output);
  REQUIRE(first.exit_code == 0);
  CHECK(first.output.find("text from " + text.string()) != std::string::npos);
  CHECK(first.output.find("epoch 2/2") != std::string::npos);
  CHECK(first.output.find("bits/char ") != std::string::npos);
  CHECK(first.output.find("bits per character") != std::string::npos);
  auto sample = first.output.find("sample:\n");
  REQUIRE(sample != std::string::npos);
  CHECK(first.output.size() >= sample + 8 + 41); // the prompt and 40 characters
  auto resumed = run(gpt + " --epochs 3 --resume " + dir.string() + " --sample 0");
  CAPTURE(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  CHECK(resumed.output.find("epoch 3/3") != std::string::npos);
  CHECK(resumed.output.find("epoch 1/3") == std::string::npos);
  CHECK(resumed.output.find("sample:") == std::string::npos);

  auto json = temp_file("gpt_synthetic.json");
  auto synthetic = run("train --data synthetic --model gpt --layers 1 --width 32 --heads 2 "
                       "--context 8 --classes 9 --batch 16 --steps 150 --stages 2 --lr 0.01 "
                       "--no-progress --json " +
                       json.string());
  CAPTURE(synthetic.output);
  REQUIRE(synthetic.exit_code == 0);
  auto l = losses(json);
  REQUIRE(l.size() == 150);
  // Counting by a stride is learnable: ln 9 = 2.2 at first, 1.2-1.4 after 150 steps (seeds 0-2).
  CHECK(l.back() < 0.75 * l.front());
  for (const auto& f : {text, json}) {
    std::filesystem::remove(f);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("flags of gpt and of text are refused where they do not apply") {
  auto layers = run("train --data synthetic --model mlp --layers 3 --steps 1");
  CHECK(layers.exit_code == 2);
  CHECK(layers.output.find("--layers sets a size of --model gpt") != std::string::npos);
  auto text_file = run("train --data synthetic --model gpt --text-file x --steps 1");
  CHECK(text_file.exit_code == 2);
  CHECK(text_file.output.find("--text-file applies to --data text") != std::string::npos);
  auto momentum = run("train --data synthetic --model gpt --momentum 0.9 --steps 1");
  CHECK(momentum.exit_code == 2);
  CHECK(momentum.output.find("--momentum is SGD's: gpt trains with Adam") != std::string::npos);
  auto cnn = run("train --data text --model cnn --text-file /etc/hostname");
  CHECK(cnn.exit_code == 2);
  CHECK(cnn.output.find("--data text trains a language model: use --model gpt") !=
        std::string::npos);
  auto fashion = run("train --model gpt");
  CHECK(fashion.exit_code == 2);
  CHECK(fashion.output.find("gpt on --data text or synthetic") != std::string::npos);
  for (const char* command : {"train", "plan", "bench"}) {
    auto blocks = run(std::string(command) + " --data synthetic --model mlp --resnet-blocks");
    CHECK(blocks.exit_code == 2);
    CHECK(blocks.output.find("--resnet-blocks applies to the built-in ResNets (one layer per "
                             "residual block), not to mlp") != std::string::npos);
  }
  auto missing = run("train --data text --text-file /nonexistent/corpus");
  CHECK(missing.exit_code == 2);
  CHECK(missing.output.find("'/nonexistent/corpus' is neither a file nor a folder") !=
        std::string::npos);
}

TEST_CASE("--precision bf16 trains a gpt close to fp32, bench measures precisions and "
          "recomputation side by side, and an unknown precision is refused") {
  auto json = [](const std::string& precision) {
    auto file = temp_file("precision_" + precision + ".json");
    auto r = run("train --data synthetic --model gpt --layers 2 --width 16 --heads 2 --context 8 "
                 "--classes 9 --batch 8 --steps 4 --stages 2 --microbatches 2 --no-progress "
                 "--precision " +
                 precision + " --json " + file.string());
    CAPTURE(r.output);
    REQUIRE(r.exit_code == 0);
    auto l = step_losses(file);
    std::filesystem::remove(file);
    return l;
  };
  auto fp32 = json("fp32");
  auto bf16 = json("bf16");
  REQUIRE(fp32.size() == 4);
  REQUIRE(bf16.size() == 4);
  CHECK(bf16[0].second != fp32[0].second);
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(bf16[i].second == doctest::Approx(fp32[i].second).epsilon(0.02));
  }

  std::string printed;
  auto rows = bench_rows("--model gpt --layers 2 --width 16 --heads 2 --context 8 --batch 8 "
                         "--splits 4 --steps 1 --no-progress --no-accumulated --precision "
                         "fp32,bf16 --recompute never,always",
                         &printed);
  // Plain libtorch on 1 and all cores in each precision, then the pipeline in each precision
  // and recomputation mode.
  REQUIRE(rows.size() == 8);
  std::map<std::string, double> stash;
  for (const auto& row : rows) {
    CAPTURE(row.dump());
    if (row["splits"].get<int>() > 0) {
      stash[row["precision"].get<std::string>() + " " + row["recompute"].get<std::string>()] =
        row["stash_mb"].get<double>();
    }
  }
  REQUIRE(stash.size() == 4);
  CHECK(stash["fp32 always"] < stash["fp32 never"]);
  CHECK(stash["bf16 always"] < stash["bf16 never"]);
  CHECK(printed.find("1f1b uniform 2p bf16 rc always") != std::string::npos);

  auto wrong = run("train --data synthetic --model mlp --steps 1 --precision fp16");
  CHECK(wrong.exit_code == 2);
  CHECK(wrong.output.find("unknown precision 'fp16' (choose fp32 or bf16)") != std::string::npos);
}

TEST_CASE("bench sweeps stage counts side by side and reports a language model's tokens per "
          "second") {
  std::string printed;
  auto rows = bench_rows("--model gpt --layers 3 --width 16 --heads 2 --context 8 --batch 8 "
                         "--splits 2 --stage-counts 1,2,3 --steps 1 --no-progress --no-baselines",
                         &printed);
  CHECK(printed.find("tokens/s") != std::string::npos);
  REQUIRE(rows.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(rows[i].dump());
    CHECK(rows[i]["stages"].get<std::size_t>() == i + 1);
    // 8 sequences of 8 tokens per step.
    CHECK(rows[i]["per_second"].get<double>() ==
          doctest::Approx(64 / (rows[i]["median_ms"].get<double>() / 1000)));
  }
}

TEST_CASE("bench measures schedules and optimizer updates side by side, with the same losses") {
  auto rows = bench_rows("--model gpt --layers 2 --width 16 --heads 2 --context 8 --batch 8 "
                         "--splits 4 --schedules 1f1b,zb-h1,gpipe,zb-v --steps 2 --no-progress "
                         "--no-baselines --updates wait,early,overlap");
  // Overlapping steps: every configuration trains twice per batch, and the losses still agree.
  REQUIRE(rows.size() == 12);
  std::vector<std::string> names;
  for (const auto& row : rows) {
    CAPTURE(row.dump());
    names.push_back(row["config"].get<std::string>());
    // Every schedule computes the same step: losses as the first configuration's.
    CHECK(row["loss_difference"].get<double>() < 1e-5);
  }
  CHECK(names[0].rfind("1f1b", 0) == 0);
  CHECK(names[0].find("update wait") != std::string::npos);
  CHECK(names[1].rfind("1f1b", 0) == 0);
  CHECK(names[1].find("update early") != std::string::npos);
  CHECK(names[2].rfind("1f1b", 0) == 0);
  CHECK(names[2].find("update overlap") != std::string::npos);
  CHECK(names[3].rfind("zb-h1", 0) == 0);
  CHECK(names[6].rfind("gpipe", 0) == 0);
  CHECK(names[9].rfind("zb-v", 0) == 0);

  auto both = run("bench --model mlp --schedule gpipe --schedules 1f1b,zb-h1 --steps 1");
  CHECK(both.exit_code == 2);
  CHECK(both.output.find("--schedule excludes --schedules") != std::string::npos);
}

TEST_CASE(
  "PyTorch is the oracle: train --model PATH.pt --data tensors:PATH reaches python3-torch's "
  "losses over 2 stages and on 2 nodes, exports a model Python runs, and checkpoints") {
  auto dir = temp_file("script");
  auto [model, data] = make_oracle_model("residual", dir);
  auto expected = oracle_losses("--model " + model + " --data " + data +
                                " --steps 5 --batch 8 --microbatches 4 --loss mse --optimizer adam "
                                "--lr 0.01 --weight-decay 0.01");
  const std::string flags = "train --model " + model + " --data tensors:" + data +
                            " --stages 2 --microbatches 4 --batch 8 --steps 5 --optimizer adam "
                            "--lr 0.01 --weight-decay 0.01";
  auto json = dir / "run.json";
  auto exported = dir / "trained.pt";
  auto r = run(flags + " --json " + json.string() + " --export " + exported.string() +
               " --checkpoint-dir " + (dir / "ckpt").string());
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("tensors:" + data + " (24 samples, inputs [6] Float)") != std::string::npos);
  CHECK(r.output.find("loss mse") != std::string::npos);
  auto ours = losses(json);
  REQUIRE(ours.size() == expected.size());
  for (std::size_t i = 0; i < ours.size(); ++i) {
    CHECK(ours[i] == doctest::Approx(expected[i]).epsilon(1e-5));
  }
  auto back = pytorch_oracle("run --model " + exported.string() + " --data " + data + " --out " +
                             (dir / "outputs.pt").string());
  INFO(back.output);
  CHECK(back.exit_code == 0);
  CHECK(back.output.find("\"shape\": [24, 4]") != std::string::npos);

  // The same run with its stages on two nodes, which are sent the model.
  std::vector<std::unique_ptr<background>> nodes;
  std::string addresses;
  for (int i = 0; i < 2; ++i) {
    auto port = free_port();
    nodes.push_back(std::make_unique<background>("node --listen 127.0.0.1:" + std::to_string(port),
                                                 dir / ("node" + std::to_string(i) + ".log")));
    REQUIRE_MESSAGE(nodes.back()->wait_for("listening on", std::chrono::seconds(20)),
                    nodes.back()->output());
    addresses += (i ? "," : "") + std::string("127.0.0.1:") + std::to_string(port);
  }
  auto json_nodes = dir / "nodes.json";
  auto on_nodes =
    run(flags + " --nodes " + addresses + " --connect-timeout 20000 --json " + json_nodes.string());
  INFO(on_nodes.output);
  REQUIRE(on_nodes.exit_code == 0);
  auto remote = losses(json_nodes);
  REQUIRE(remote.size() == ours.size());
  for (std::size_t i = 0; i < ours.size(); ++i) {
    CHECK(remote[i] == doctest::Approx(ours[i]).epsilon(1e-6));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("flags of TorchScript models and tensor files are refused where they do not apply, and "
          "bad files are named") {
  auto dir = temp_file("script-flags");
  auto files = make_oracle_model("mlp", dir);
  auto model = files.model;
  auto data = "tensors:" + files.data;
  // Profiled partitions and the simulator take a scripted model like a built-in one.
  auto plan = run("plan --model " + model + " --data " + data + " --partition time --stages 3");
  INFO(plan.output);
  CHECK(plan.exit_code == 0);
  CHECK(plan.output.find("stage 2") != std::string::npos);
  auto bench = run("bench --model " + model + " --data " + data +
                   " --batch 8 --splits 1,2 --steps 1 --no-progress");
  INFO(bench.output);
  CHECK(bench.exit_code == 0);
  CHECK(bench.output.find(data + " [4, 4] Float") != std::string::npos);
  refused("train --model " + model + " --data " + data + " --epochs 2",
          "--epochs does not apply to --data tensors:PATH");
  refused("train --model " + model + " --data synthetic", "trains on --data tensors:PATH");
  refused("train --model mlp --data fashion-mnist --export x.pt", "--export writes a TorchScript");
  refused("train --model mlp --data synthetic --shuffle", "--shuffle applies to --data tensors");
  refused("train --model mlp --data synthetic --loss mse", "--loss applies to --data tensors");
  refused("train --data " + data, "has no model of its own");
  refused("train --model " + (dir / "data.pt").string() + " --data " + data,
          "is not a TorchScript file");
  refused("train --model " + model + " --data tensors:" + model, "is not a tensor file");
  std::filesystem::remove_all(dir);
}

TEST_CASE("PyTorch is the oracle: SGD with momentum, Nesterov and weight decay from the command "
          "line reaches python3-torch's losses") {
  auto dir = temp_file("nesterov");
  auto [model, data] = make_oracle_model("residual", dir);
  const std::string sgd = " --optimizer sgd --lr 0.05 --momentum 0.9 --weight-decay 0.01";
  auto expected =
    oracle_losses("--model " + model + " --data " + data +
                  " --steps 5 --batch 8 --microbatches 2 --loss mse --nesterov" + sgd);
  const std::string flags = "train --model " + model + " --data tensors:" + data +
                            " --stages 2 --microbatches 2 --batch 8 --steps 5" + sgd;
  auto json = dir / "nesterov.json";
  auto r = run(flags + " --nesterov --json " + json.string());
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  auto ours = losses(json);
  REQUIRE(ours.size() == expected.size());
  for (std::size_t i = 0; i < ours.size(); ++i) {
    CHECK(ours[i] == doctest::Approx(expected[i]).epsilon(1e-5));
  }
  // Without --nesterov the run differs from the second step on: the flag reached the optimizer.
  auto plain_json = dir / "plain.json";
  REQUIRE(run(flags + " --json " + plain_json.string()).exit_code == 0);
  auto plain = losses(plain_json);
  REQUIRE(plain.size() == ours.size());
  CHECK(plain[0] == doctest::Approx(ours[0]).epsilon(1e-6));
  CHECK(std::abs(plain[2] - ours[2]) > 1e-6);
  std::filesystem::remove_all(dir);
}

TEST_CASE("--min-lr is where the cosine schedule ends, and the optimizer flags are refused where "
          "they do not apply") {
  auto metrics = temp_file("min_lr.csv");
  std::filesystem::remove(metrics);
  // 256 samples in batches of 32: 8 steps, 1 of warm-up; the last step's rate is in the metrics.
  auto r = run("train --train-samples 256 --test-samples 64 --batch 32 --epochs 1 --warmup 1 "
               "--lr 0.05 --min-lr 0.01 --no-progress --metrics " +
               metrics.string());
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  std::ifstream in(metrics);
  std::string header, row;
  std::getline(in, header);
  std::getline(in, row);
  REQUIRE(header.rfind("epoch,step,lr,", 0) == 0);
  auto lr = std::stod(row.substr(row.find(',', row.find(',') + 1) + 1));
  const double pi = 3.14159265358979323846;
  CHECK(lr == doctest::Approx(0.01 + 0.5 * 0.04 * (1 + std::cos(pi * 6.0 / 7.0))).epsilon(1e-4));
  std::filesystem::remove(metrics);

  const std::string synthetic = "train --data synthetic --model mlp --steps 1";
  struct refusal {
    std::string flags;
    std::string message;
  };
  for (const auto& [flags, message] : std::vector<refusal>{
         {synthetic + " --min-lr 0.01", "--min-lr does not apply to --data synthetic"},
         {"train --train-samples 64 --lr 0.05 --min-lr 0.1",
          "--min-lr (0.1) must be between 0 and the peak learning rate (0.05)"},
         {synthetic + " --nesterov", "--nesterov needs momentum: give --momentum"},
         {synthetic + " --optimizer adam --nesterov", "--nesterov is SGD's"},
         {synthetic + " --optimizer adam --momentum 0.9", "--momentum is SGD's"},
         {synthetic + " --batch-norm sync", "--batch-norm sync synchronises replicas"},
         {synthetic + " --replicas 2 --batch-norm sync",
          "--model mlp has no batch norm to synchronise"}}) {
    auto bad = run(flags);
    CAPTURE(flags);
    CAPTURE(bad.output);
    CHECK(bad.exit_code == 2);
    CHECK(bad.output.find(message) != std::string::npos);
  }
}

TEST_CASE("a ResNet trains on Fashion-MNIST with a small stem and augmentation, pipelined like "
          "one stage, and --augment is refused elsewhere") {
  // The same augmented batches, in one stage and in two.
  auto out =
    same_losses("--model resnet18 --train-samples 64 --test-samples 32 --batch 16 "
                "--epochs 1 --warmup 1 --no-progress --augment --microbatches 2 --threads 1",
                {"train --stages 1", "train --stages 2"}, 4);
  CHECK(out[1].find("test accuracy: top-1 ") != std::string::npos);
  auto bad = run("train --data synthetic --model resnet18 --image 16 --steps 1 --augment");
  CAPTURE(bad.output);
  CHECK(bad.exit_code == 2);
  CHECK(bad.output.find("--augment") != std::string::npos);
  CHECK(bad.output.find("applies to Fashion-MNIST's images") != std::string::npos);
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

TEST_CASE("--data images:DIR trains on a folder of PNG and JPEG images: pipelined like one stage "
          "with any number of loader workers, evaluated on val/, its waits in the trace") {
  auto dir = temp_file("images");
  std::filesystem::remove_all(dir);
  // 3 classes of 20 images: 16 to train and 4 held out each.
  write_class_folder(dir, 3, 20, true);
  const auto data = "--data images:" + dir.string();
  const auto common = data + " --model cnn --image 16 --batch 12 --epochs 2 --lr 0.05 --warmup 2 "
                             "--threads 1 --no-progress";
  // 48 images, batches of 12: 4 steps an epoch.
  auto out = same_losses(common,
                         {"train --stages 1 --microbatches 1 --workers 0",
                          "train --stages 2 --microbatches 4 --workers 3"},
                         8);
  CHECK(out[1].find("images from " + dir.string() +
                    " (48 train, 12 held out, 3 classes, 3x16x16; 3 "
                    "loader workers)") != std::string::npos);
  CHECK(out[1].find("test accuracy: top-1") != std::string::npos);
  CHECK(out[1].find("data: the training loop waited") != std::string::npos);

  {
    // it learns, and the trace has the loop's wait for each batch.
    auto trace = temp_file("images_trace.json");
    auto r = run("train " + data +
                 " --model cnn --image 16 --batch 12 --epochs 6 --lr 0.1 "
                 "--warmup 2 --stages 2 --no-progress --trace " +
                 trace.string());
    CAPTURE(r.output);
    REQUIRE(r.exit_code == 0);
    auto at = r.output.find("test accuracy: top-1 ");
    REQUIRE(at != std::string::npos);
    CHECK(std::stod(r.output.substr(at + 21)) >= 0.9);
    std::ifstream in(trace);
    const auto events = nlohmann::json::parse(in)["traceEvents"];
    int waits = 0;
    for (const auto& e : events) {
      waits += e["ph"] == "X" && e["name"] == "wait for batch" ? 1 : 0;
    }
    CHECK(waits == 24);
    std::filesystem::remove(trace);
  }
  {
    // the default model is resnet18 with the small stem, grey images too.
    auto r = run("train " + data + " --image 16 --channels 1 --batch 8 --steps 2 --no-progress");
    CAPTURE(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(r.output.find("actorpipe train: resnet18 on images from") != std::string::npos);
    CHECK(r.output.find("1x16x16") != std::string::npos);
  }
  {
    // broken files are named: fail stops, skip warns and trains.
    std::ofstream(dir / "train" / "class1" / "notes.txt") << "not an image";
    auto notes = (dir / "train" / "class1" / "notes.txt").string();
    auto failed = run("train " + data + " --model cnn --image 16 --batch 12 --steps 1");
    CHECK(failed.exit_code != 0);
    CHECK(failed.output.find(notes + ": not an image stb_image can read") != std::string::npos);
    auto skipped =
      run("train " + data +
          " --model cnn --image 16 --batch 12 --steps 1 --bad-images skip --no-progress");
    CAPTURE(skipped.output);
    CHECK(skipped.exit_code == 0);
    CHECK(skipped.output.find("warning: " + notes) != std::string::npos);
    std::filesystem::remove(notes);
  }
  {
    // flags that do not apply are refused, and a missing folder is named.
    auto missing = run("train --data images:/nonexistent/photos --steps 1");
    CHECK(missing.exit_code == 2);
    CHECK(missing.output.find("images:/nonexistent/photos: no such folder") != std::string::npos);
    for (auto [flags, expected] : std::vector<std::pair<std::string, std::string>>{
           {"--workers 2", "--workers applies to --data images:DIR"},
           {"--channels 1", "--channels applies to --data images:DIR"},
           {"--bad-images skip", "--bad-images applies to --data images:DIR"}}) {
      auto r = run("train --steps 1 " + flags);
      CAPTURE(r.output);
      CHECK(r.exit_code == 2);
      CHECK(r.output.find(expected) != std::string::npos);
    }
    for (auto [flags, expected] : std::vector<std::pair<std::string, std::string>>{
           {"--augment", "--augment applies to Fashion-MNIST"},
           {"--classes 5", "--classes sets the synthetic data's classes"},
           {"--channels 2", "--channels (2) must be 1 (grey) or 3 (RGB)"},
           {"--model gpt", "holds images: train gpt on --data text or synthetic"}}) {
      auto r = run("train " + data + " --image 16 --steps 1 " + flags);
      CAPTURE(r.output);
      CHECK(r.exit_code == 2);
      CHECK(r.output.find(expected) != std::string::npos);
    }
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("--devices puts each stage on a device (with --stages auto: at most one each) and "
          "--dp-backend picks the replicas' backend, and what this build or machine cannot do is "
          "refused by name") {
  // Every stage on the CPU, named: the losses of not naming devices.
  auto named = temp_file("devices_named.json");
  auto plain = temp_file("devices_plain.json");
  auto common = " --data synthetic --model mlp --batch 16 --steps 3 --threads 1 --no-progress";
  REQUIRE(run(std::string("train --devices cpu,cpu --json ") + named.string() + common).exit_code ==
          0);
  REQUIRE(run(std::string("train --json ") + plain.string() + common).exit_code == 0);
  CHECK(losses(named) == losses(plain));
  if (!actorpipe::stages::built_with_cuda()) {
    refused("train --data synthetic --model mlp --steps 1 --devices cpu,cuda:0",
            "pipeline: stage 1: device cuda:0: this build of actorpipe has no CUDA");
  }
  refused("train --data synthetic --model mlp --steps 1 --devices cpu,gpu:1",
          "--devices: 'gpu:1' is no device (cpu, cuda or cuda:N)");
  // --stages auto places at most one stage per device given, and each GPU once.
  auto planned = run("train --data synthetic --model mlp --batch 16 --steps 1 --no-progress "
                     "--stages auto --profile-repeats 1 --devices cpu");
  REQUIRE(planned.exit_code == 0);
  CHECK(planned.output.find("1 stage(s)") != std::string::npos);
  refused("train --data synthetic --model mlp --steps 1 --stages auto --devices cuda:0,cuda:0",
          "--stages auto: cuda:0 is listed twice in --devices");
  refused("train --data synthetic --model mlp --steps 1 --stages auto --threads auto --devices "
          "cuda:0",
          "--threads auto tries thread counts on this machine's cores: with stages on GPUs");
  refused("train --data synthetic --model mlp --steps 1 --devices cpu,cpu,cpu",
          "3 devices given for 2 stages");
  refused("train --data synthetic --model mlp --steps 1 --replicas 2 --dp-backend nccl", "NCCL");
}
