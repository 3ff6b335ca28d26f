// One training loop for every kind of data and model: flags that do not apply, recomputation,
// a gpt on text, bf16, TorchScript models, PyTorch as the oracle, the optimizer's flags.
#include <atomic>
#include <cmath>
#include <map>
#include <regex>
#include <thread>

#include "../training/image_folders.hpp"
#include "cli/program.hpp"
#include "cli_fixtures.hpp"
#include "stages/device.hpp"

using namespace actorpipe::test;

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
  refused("train --model " + model + " --data " + data + " --warmup 5",
          "--warmup does not apply to --data tensors:PATH read as a stream");
  refused("train --model mlp --data fashion-mnist --holdout 0.1",
          "--holdout applies to --data tensors:PATH");
  refused("train --model " + model + " --data " + data + " --holdout 1.5", "--holdout");
  refused("train --model " + model + " --data synthetic", "trains on --data tensors:PATH");
  refused("train --model mlp --data fashion-mnist --export x.pt",
          "--export writes a model file back");
  refused("train --model mlp --data fashion-mnist --segments nodes",
          "--segments cuts a PT2 archive");
  refused("train --model " + model + " --data " + data + " --segments nodes",
          "a TorchScript model's layers are its Sequential's children");
  refused("train --model mlp --data synthetic --shuffle", "--shuffle applies to --data tensors");
  refused("train --model mlp --data synthetic --loss mse", "--loss applies to --data tensors");
  refused("train --data " + data, "has no model of its own");
  refused("train --model " + (dir / "data.pt").string() + " --data " + data,
          "is not a TorchScript file");
  refused("train --model " + model + " --data tensors:" + model, "is not a tensor file");
  std::filesystem::remove_all(dir);
}

TEST_CASE("the main job says nothing but its progress while something else loads the cores") {
  // Two threads spinning beside the run, as a compile on a shared machine would: in-process
  // stages slow down with it, and no straggler warning (for stages on other machines) comes.
  std::atomic<bool> stop{false};
  std::vector<std::thread> load;
  for (int i = 0; i < 2; ++i) {
    load.emplace_back([&stop] {
      volatile uint64_t n = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        n = n + 1;
      }
    });
  }
  auto r = run("train --train-samples 3072 --test-samples 256");
  stop = true;
  for (auto& t : load) {
    t.join();
  }
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(r.output.find("test accuracy: top-1 ") != std::string::npos);
  CHECK(r.output.find("slower") == std::string::npos);
  CHECK(r.output.find("warn") == std::string::npos);
  CHECK(r.output.find("actorpipe: ") == std::string::npos);
}

TEST_CASE("a tensor file is a data set with --epochs and --holdout: epochs in file order or "
          "shuffled, a held-out part evaluated after each, as a stream when neither is given") {
  auto dir = temp_file("tensor-epochs");
  auto files = make_oracle_model("mlp", dir); // 24 samples, 5 classes
  const std::string flags =
    "train --model " + files.model + " --data tensors:" + files.data + " --no-progress";
  auto losses_of = [&](const std::string& more, const std::string& name) {
    auto json = dir / (name + ".json");
    auto r = run(flags + more + " --json " + json.string());
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    return std::make_pair(losses(json), r.output);
  };
  // One epoch in file order at a constant rate visits the batches a stream of 3 steps does.
  auto [stream, stream_out] = losses_of(" --batch 8 --steps 3", "stream");
  auto [epoch, epoch_out] = losses_of(" --batch 8 --epochs 1", "epoch");
  REQUIRE(epoch.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(epoch[i] == stream[i]);
  }
  CHECK(epoch_out.find("24 samples to train on, 0 held out") != std::string::npos);
  CHECK(epoch_out.find("1 epochs in file order") != std::string::npos);
  auto [shuffled, shuffled_out] = losses_of(" --batch 8 --epochs 1 --shuffle", "shuffled");
  CHECK(shuffled[0] != epoch[0]);
  // A quarter held out: 18 samples in 3 batches of 6 per epoch, the 6 others scored after each.
  auto json = dir / "held.json";
  auto held =
    run(flags + " --batch 6 --epochs 2 --holdout 0.25 --stages 2 --json " + json.string());
  INFO(held.output);
  REQUIRE(held.exit_code == 0);
  CHECK(held.output.find("18 samples to train on, 6 held out") != std::string::npos);
  CHECK(held.output.find("epoch 2/2  train loss ") != std::string::npos);
  CHECK(held.output.find("top-1 ") != std::string::npos);
  CHECK(held.output.find("held out: loss ") != std::string::npos);
  CHECK(losses(json).size() == 6);
  auto report = nlohmann::json::parse(std::ifstream(json));
  REQUIRE(report["epochs"].size() == 2);
  for (const auto& e : report["epochs"]) {
    CHECK(e["test_loss"].get<double>() > 0);
    CHECK(e["top1"].get<double>() >= 0);
    CHECK(e["top1"].get<double>() <= 1);
  }
  // Float targets are scored by the run's loss (MSE) alone.
  auto regression = make_oracle_model("residual", dir / "residual");
  auto mse = run("train --model " + regression.model + " --data tensors:" + regression.data +
                 " --batch 6 --epochs 1 --holdout 0.25 --no-progress");
  INFO(mse.output);
  REQUIRE(mse.exit_code == 0);
  CHECK(mse.output.find("held out: loss ") != std::string::npos);
  CHECK(mse.output.find("top-1") == std::string::npos);
  // Too much held out leaves no batch.
  refused(flags + " --batch 8 --epochs 1 --holdout 0.9", "smaller than one batch");
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
