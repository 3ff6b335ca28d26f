// A model scripted in Python, and on the PyTorch 2.x line the same model exported with
// torch.export, against the same model built in C++, trained through the same pipeline, side by
// side: rounds alternate between them, and the medians and their ratios are printed
// (docs/from-pytorch.md#speed). The models come from tests/oracle/pytorch_script.py.
//
//   build/bench/actorpipe_script_bench --rounds 15
//   build-cuda/bench/actorpipe_script_bench --python .venv-torch/bin/python --rounds 15
//   build-cuda/bench/actorpipe_script_bench --load big.pt2     (the time and peak memory of
//                                                               loading one archive)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

namespace {

using namespace actorpipe;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The same MLP as pytorch_script.py's bench_mlp.
layer_list cpp_mlp() {
  torch::nn::Sequential s(torch::nn::Linear(256, 1024), torch::nn::GELU(),
                          torch::nn::Linear(1024, 1024), torch::nn::GELU(),
                          torch::nn::Linear(1024, 1024), torch::nn::GELU(),
                          torch::nn::Linear(1024, 10));
  return to_layer_list(s);
}

// The built-in gpt at bench_gpt's sizes.
layer_list cpp_gpt() {
  model_options o;
  o.vocabulary = 64;
  o.layers = 4;
  o.heads = 4;
  o.width = 128;
  o.context = 64;
  return make_model("gpt", o);
}

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0; // kilobytes on Linux
}

int time_load(const std::string& path) {
  auto bytes = std::filesystem::file_size(path);
  auto before = peak_rss_mb();
  auto start = std::chrono::steady_clock::now();
  auto layers = load_exported(path);
  auto s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int64_t parameters = 0;
  for (const auto& l : layers) {
    for (const auto& p : l.module()->parameters()) {
      parameters += p.numel();
    }
  }
  std::printf("loaded %s (%.1f MB, %zu segments, %lld parameters) in %.2f s; peak memory %.0f MB "
              "(%.0f MB before)\n",
              path.c_str(), static_cast<double>(bytes) / 1e6, layers.size(),
              static_cast<long long>(parameters), s, peak_rss_mb(), before);
  return 0;
}

struct contender {
  std::string name;
  std::unique_ptr<pipeline> pipe;
};

} // namespace

int main(int argc, char** argv) {
  CLI::App app("actorpipe_script_bench: scripted (TorchScript) against C++ models, side by side");
  int rounds = 15;
  int64_t batch = 64;
  std::size_t stages = 2;
  std::size_t microbatches = 4;
  std::string python = "/usr/bin/python3";
  app.add_option("--rounds", rounds, "Timed steps of each model (after 3 warm-up steps)")
    ->capture_default_str();
  app.add_option("--batch", batch, "Samples per step")->capture_default_str();
  app.add_option("--stages", stages, "Pipeline stages")->capture_default_str();
  app.add_option("--microbatches", microbatches, "Micro-batches per step")->capture_default_str();
  app.add_option("--python", python, "Python with torch, to script the models")
    ->capture_default_str();
  std::string load;
  app.add_option("--load", load, "Only time loading this PT2 archive, and its peak memory");
  CLI11_PARSE(app, argc, argv);
  if (!load.empty()) {
    return time_load(load);
  }

  auto dir = std::filesystem::temp_directory_path() /
             ("actorpipe-script-bench-" + std::to_string(::getpid()));
  std::cout << "model   built in  median s/step  (" << rounds << " rounds, batch " << batch << ", "
            << stages << " stages, " << microbatches << " micro-batches, 1F1B)\n";
  for (std::string model : {"mlp", "gpt"}) {
    auto out = dir / model;
    std::filesystem::create_directories(out);
    auto command = python + " " + ACTORPIPE_SOURCE_DIR + "/tests/oracle/pytorch_script.py make " +
                   "--model bench_" + model + " --samples " + std::to_string(batch) + " --out " +
                   out.string() + (exported_programs_supported() ? " --export" : "") +
                   " > /dev/null 2>&1";
    if (std::system(command.c_str()) != 0) {
      std::cerr << "cannot script the models (needs python3-torch): " << command << '\n';
      return 1;
    }
    auto data = load_tensor_file((out / "data.pt").string());
    engine sys;
    pipeline_options o;
    o.microbatches = microbatches;
    o.loss = builtin_loss("cross_entropy");
    o.optimizer = sgd(1e-3, 0.9);
    std::vector<contender> contenders;
    torch::manual_seed(0);
    auto cpp = model == "mlp" ? cpp_mlp() : cpp_gpt();
    contenders.push_back(
      {"C++", std::make_unique<pipeline>(sys, cpp, partition_uniform(cpp.size(), stages), o)});
    auto scripted = load_torchscript((out / "model.pt").string());
    contenders.push_back(
      {"scripted",
       std::make_unique<pipeline>(sys, scripted, partition_uniform(scripted.size(), stages), o)});
    if (exported_programs_supported()) {
      auto exported = load_exported((out / "model.pt2").string());
      contenders.push_back(
        {"exported",
         std::make_unique<pipeline>(sys, exported, partition_uniform(exported.size(), stages), o)});
    }
    std::vector<std::vector<double>> seconds(contenders.size());
    for (int round = -3; round < rounds; ++round) {
      for (std::size_t c = 0; c < contenders.size(); ++c) {
        auto start = std::chrono::steady_clock::now();
        contenders[c].pipe->train_step(data.images, data.labels);
        auto s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (round >= 0) {
          seconds[c].push_back(s);
        }
      }
    }
    for (std::size_t c = 0; c < contenders.size(); ++c) {
      std::printf("%-7s %-9s %.4f\n", model.c_str(), contenders[c].name.c_str(),
                  median(seconds[c]));
    }
    for (std::size_t c = 1; c < contenders.size(); ++c) {
      std::printf("%-7s %s / C++: %.3fx time\n", model.c_str(), contenders[c].name.c_str(),
                  median(seconds[c]) / median(seconds[0]));
    }
    if (contenders.size() > 2) {
      std::printf("%-7s exported / scripted: %.3fx time\n", model.c_str(),
                  median(seconds[2]) / median(seconds[1]));
    }
  }
  std::filesystem::remove_all(dir);
  return 0;
}
