// Images from the command line: a ResNet on Fashion-MNIST, a folder of images, stages on devices.
#include <cmath>
#include <map>
#include <regex>

#include "../training/image_folders.hpp"
#include "cli/program.hpp"
#include "cli_fixtures.hpp"
#include "stages/device.hpp"

using namespace actorpipe::test;

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
