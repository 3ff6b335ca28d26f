// `actorpipe plan`, --stages auto, and the schedules chosen from the command line.
#include <cmath>
#include <map>
#include <regex>

#include "../training/image_folders.hpp"
#include "cli/program.hpp"
#include "cli_fixtures.hpp"
#include "stages/device.hpp"

using namespace actorpipe::test;

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
  // A fixed layout under a cap: its stages' predicted peaks are checked as the planner's are.
  auto fixed = run("train --data synthetic --model mlp --batch 16 --stages 2 --steps 1 "
                   "--max-memory 64KB --profile-repeats 1 --no-progress");
  CAPTURE(fixed.output);
  CHECK(fixed.exit_code == 2);
  CHECK(std::regex_search(fixed.output,
                          std::regex(R"(--max-memory 64000 bytes per stage: stage [01] of the )"
                                     R"(layout given \(2 stage\(s\), .*\) needs [0-9]+ bytes at )"
                                     R"(its peak \(parameters [0-9]+, )")));
  CHECK(run("train --data synthetic --model mlp --batch 16 --stages 2 --steps 1 --max-memory 1GB "
            "--max-stash 8 --profile-repeats 1 --no-progress")
          .exit_code == 0);
  auto stashed = run("train --data synthetic --model mlp --batch 16 --stages 2 --steps 1 "
                     "--microbatches 4 --schedule gpipe --max-stash 2 --profile-repeats 1 "
                     "--no-progress");
  CHECK(stashed.exit_code == 2);
  CHECK(stashed.output.find("--max-stash 2 micro-batches: stage 0 of the layout given (2 stage(s), "
                            "gpipe, 4 micro-batch(es)") != std::string::npos);

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
