// actorpipe_weights_bench: what loading a set of safetensors weights costs (read_pretrained,
// <actorpipe/safetensors.hpp>): it writes --bytes of float32 weights in --tensors tensors, then
// copies them from the mapped file into tensors of a model's own, already allocated and
// touched, as init_exported does: giving each tensor's pages back after its copy, and, for
// comparison, holding them. Prints the seconds and the peak resident memory over the weights'
// size, the model's own tensors included.
//
//     build/bench/actorpipe_weights_bench --bytes 1GiB --dir /tmp
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include <unistd.h>

#include <actorpipe/safetensors.hpp>

namespace {

// Resident and peak resident bytes of this process (/proc/self/status).
std::pair<double, double> resident() {
  std::ifstream in("/proc/self/status");
  std::string key;
  double rss = 0, peak = 0;
  while (in >> key) {
    double kib = 0;
    if (key == "VmRSS:" && in >> kib) {
      rss = kib * 1024;
    } else if (key == "VmHWM:" && in >> kib) {
      peak = kib * 1024;
    }
  }
  return {rss, peak};
}

// The peak from now on (Linux: writing 5 to clear_refs resets VmHWM).
void reset_peak() {
  std::ofstream("/proc/self/clear_refs") << "5";
}

void load(const std::string& path, std::vector<torch::Tensor>& model, bool release,
          double weights) {
  auto [before, _] = resident();
  reset_peak();
  auto start = std::chrono::steady_clock::now();
  {
    auto w = actorpipe::read_pretrained(path);
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < w.tensors.size(); ++i) {
      model[i].copy_(w.tensors[i].second);
      if (release) {
        w.release(w.tensors[i].second);
      }
    }
  }
  auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto [after, peak] = resident();
  std::cout << (release ? "pages given back after each copy" : "pages held until the end    ")
            << ": " << seconds << " s, peak " << peak / weights
            << "x the weights (the model's own included), " << (peak - before) / 1048576.0
            << " MiB over the model before the load\n";
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app("What loading safetensors weights costs: time and peak memory");
  std::string size = "1GiB", dir = "/tmp";
  int tensors = 32;
  app.add_option("--bytes", size, "Weights in all: a count of bytes with B, MiB or GiB");
  app.add_option("--tensors", tensors, "How many tensors they are split into");
  app.add_option("--dir", dir, "Where the file is written (and removed)");
  CLI11_PARSE(app, argc, argv);
  double factor = size.find("GiB") != std::string::npos   ? 1073741824.0
                  : size.find("MiB") != std::string::npos ? 1048576.0
                                                          : 1.0;
  auto bytes = std::stod(size) * factor;
  torch::set_num_threads(1);
  auto path = dir + "/actorpipe-weights-bench-" + std::to_string(::getpid()) + ".safetensors";
  auto each = static_cast<int64_t>(bytes / 4 / tensors);
  {
    actorpipe::named_tensors written;
    for (int i = 0; i < tensors; ++i) {
      written.emplace_back("layers." + std::to_string(i) + ".weight", torch::rand({each}));
    }
    auto start = std::chrono::steady_clock::now();
    actorpipe::write_safetensors(path, written);
    std::cout << "wrote " << bytes / 1073741824.0 << " GiB in " << tensors << " tensors: "
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()
              << " s\n";
  }
  std::vector<torch::Tensor> model;
  for (int i = 0; i < tensors; ++i) {
    model.push_back(torch::zeros({each})); // the model's own, touched
  }
  double weights = static_cast<double>(each) * 4 * tensors;
  std::cout << "resident before loading (the model's own tensors and libtorch): "
            << resident().first / weights << "x the weights\n";
  load(path, model, true, weights);
  load(path, model, false, weights);
  std::filesystem::remove(path);
}
