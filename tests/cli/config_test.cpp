// A run as a file: --config reads TOML, --print-config writes it, the command line overrides the
// file, checkpoints keep it and a resume says what differs (docs/config.md).
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "helpers.hpp"

using namespace actorpipe::test;

namespace {

const std::string mlp = " --data synthetic --model mlp --batch 16 --threads 1 --no-progress";

void write(const std::filesystem::path& file, const std::string& text) {
  std::ofstream(file) << text;
}

std::string read(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

} // namespace

TEST_CASE("--print-config writes every flag as TOML and --config runs it again: the same losses, "
          "the command line overriding the file") {
  auto printed = run("train" + mlp + " --steps 3 --lr 0.1 --microbatches 2 --print-config");
  REQUIRE(printed.exit_code == 0);
  CHECK(has(printed.output, "train.lr=0.1\n"));
  CHECK(has(printed.output, "train.microbatches=2\n"));
  CHECK(has(printed.output, "train.schedule=\"1f1b\"\n")); // a default
  CHECK_FALSE(has(printed.output, "print-config"));
  auto file = temp_file("config_run.toml");
  write(file, printed.output);
  // Read back, it prints itself.
  CHECK(run("train --config " + file.string() + " --print-config").output == printed.output);
  auto from_flags = temp_file("config_flags.json");
  auto from_file = temp_file("config_file.json");
  REQUIRE(run("train" + mlp + " --steps 3 --lr 0.1 --microbatches 2 --json " + from_flags.string())
            .exit_code == 0);
  REQUIRE(run("train --config " + file.string() + " --json " + from_file.string()).exit_code == 0);
  CHECK(losses(from_file) == losses(from_flags));
  auto shorter = temp_file("config_shorter.json");
  REQUIRE(
    run("train --config " + file.string() + " --steps 1 --json " + shorter.string()).exit_code ==
    0);
  REQUIRE(losses(shorter).size() == 1);
  CHECK(losses(shorter).front() == losses(from_flags).front());
}

TEST_CASE("a config file's key that is no flag is refused, naming it, and so is a missing file") {
  auto file = temp_file("config_bad.toml");
  write(file, "[train]\nstepz = 3\n");
  auto bad = run("train --config " + file.string() + mlp);
  CHECK(bad.exit_code == 2);
  CHECK(has(bad.output, "stepz"));
  auto missing = run("train --config /nonexistent/run.toml" + mlp);
  CHECK(missing.exit_code == 2);
  CHECK(has(missing.output, "/nonexistent/run.toml"));
}

TEST_CASE("a config file's mistake names the file, the line and the key, where the key goes and "
          "what its value must be") {
  auto file = temp_file("config_mistakes.toml");
  // A key of the run outside its section: the program's own keys are the only top-level ones.
  write(file, "# a run\ndata = \"synthetic\"\n[train]\nmodel = \"mlp\"\n");
  auto top = run("train --config " + file.string() + " --batch 16 --threads 1 --no-progress");
  CHECK(top.exit_code == 2);
  CHECK(has(top.output, file.string() + ":2: 'data' is a flag of `actorpipe train`"));
  CHECK(has(top.output, "put it under [train], or write it as train.data"));
  CHECK_FALSE(has(top.output, "INI"));
  // A misspelt key, with the flag it was meant to be.
  write(file, "[train]\nmodel = \"mlp\"\nstepz = 3\n");
  auto typo = run("train --config " + file.string() + mlp);
  CHECK(typo.exit_code == 2);
  CHECK(has(typo.output, file.string() + ":3: 'stepz' is no flag of actorpipe train (did you mean "
                                         "'steps'?)"));
  // A value of the wrong type: the flag and what it takes.
  write(file, "train.lr = 0.1\ntrain.steps = \"two\"\n");
  auto type = run("train --config " + file.string() + mlp);
  CHECK(type.exit_code == 2);
  CHECK(
    has(type.output, file.string() + ":2: train.steps = \"two\": --steps takes a whole number"));
  // The same mistake on the command line is the command line's, not the file's.
  write(file, "train.steps = 3\n");
  auto flag = run("train --config " + file.string() + mlp + " --steps two");
  CHECK(flag.exit_code == 2);
  CHECK_FALSE(has(flag.output, file.string() + ":"));
  CHECK(has(flag.output, "--steps"));
}

TEST_CASE("checkpoints keep the run's settings, and a resume with other settings says what "
          "differs") {
  auto dir = temp_file("config_checkpoints");
  std::filesystem::remove_all(dir);
  REQUIRE(run("train" + mlp + " --steps 2 --checkpoint-dir " + dir.string()).exit_code == 0);
  auto recorded = read(dir / "step-2" / "run.toml");
  CHECK(has(recorded, "train.lr=0.05\n"));
  // A longer run of the same settings resumes quietly.
  auto same = run("train" + mlp + " --steps 3 --resume " + dir.string());
  CHECK(same.exit_code == 0);
  CHECK_FALSE(has(same.output, "other settings"));
  auto other = run("train" + mlp + " --steps 3 --lr 0.2 --resume " + dir.string());
  CHECK(other.exit_code == 0);
  CHECK(has(other.output, "other settings"));
  CHECK(has(other.output, "train.lr: 0.05 -> 0.2"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("the example configs run: each seed scenario, one short step") {
  auto configs = std::string(ACTORPIPE_SOURCE_DIR) + "/examples/configs/";
  auto r = run("train --config " + configs + "rpc_tutorial.toml" +
               " --steps 1 --batch 8 --image 32 --model resnet18 --no-progress");
  CHECK_MESSAGE(r.exit_code == 0, r.output);
  if (std::filesystem::exists("/usr/share/datasets/fashion-mnist")) {
    r = run("train --config " + configs + "fashion_mnist.toml --steps 2 --no-progress");
    CHECK_MESSAGE(r.exit_code == 0, r.output);
  } else {
    MESSAGE("fashion_mnist.toml not run: no /usr/share/datasets/fashion-mnist");
  }
  if (std::filesystem::exists("/usr/share/games/fortunes")) {
    r = run("train --config " + configs + "gpt_text.toml --steps 2 --sample 0 --no-progress");
    CHECK_MESSAGE(r.exit_code == 0, r.output);
  } else {
    MESSAGE("gpt_text.toml not run: no /usr/share/games/fortunes");
  }
}

TEST_CASE("The flags that fill the library's option structs refuse a value out of range or an "
          "unknown name, naming the flag") {
  const std::pair<const char*, const char*> refused[] = {
    {"--wait-timeout 0", "--wait-timeout: must be >= 1 (got 0)"},
    {"--dp-timeout 0", "--dp-timeout: must be >= 1 (got 0)"},
    {"--connect-timeout 0", "--connect-timeout: must be >= 1 (got 0)"},
    {"--heartbeat-timeout -1", "--heartbeat-timeout: must be >= 0 (got -1)"},
    {"--wait-timeout soon", "--wait-timeout: 'soon' is not a number"},
    {"--lr -0.1", "--lr: must be >= 0 (got -0.1)"},
    {"--momentum -1", "--momentum: must be >= 0 (got -1)"},
    {"--weight-decay -0.5", "--weight-decay: must be >= 0 (got -0.5)"},
    {"--max-grad-norm -2", "--max-grad-norm: must be >= 0 (got -2)"},
    {"--precision fp16", "--precision: unknown precision 'fp16' (choose fp32 or bf16)"},
    {"--buffers all", "--buffers: unknown buffer sync 'all' (choose broadcast, average or none)"},
    {"--dp-backend mpi", "--dp-backend: unknown backend 'mpi' (choose auto, gloo or nccl)"},
    {"--step-timeout 0", "--step-timeout: must be >= 1 (got 0)"},
    {"--microbatches 2.5", "--microbatches: '2.5' is not a whole number"},
  };
  for (const auto& [flag, message] : refused) {
    CAPTURE(flag);
    auto r = run("train" + mlp + " --steps 1 " + flag);
    CHECK(r.exit_code != 0);
    CHECK(has(r.output, message));
  }
  // Given, they are printed as set; the defaults stay the library's (options.hpp).
  auto printed = run("train" + mlp +
                     " --wait-timeout 500 --dp-timeout 700 --momentum 0.5 "
                     "--max-grad-norm 2 --precision bf16 --print-config");
  REQUIRE(printed.exit_code == 0);
  for (const char* line :
       {"train.wait-timeout=500\n", "train.dp-timeout=700\n", "train.momentum=0.5\n",
        "train.max-grad-norm=2\n", "train.precision=\"bf16\"\n", "# train.buffers=\"broadcast\"\n",
        "# train.connect-timeout=10000\n", "# train.heartbeat-timeout=1000\n"}) {
    CHECK(has(printed.output, line));
  }
}
