// PyTorch itself as the oracle: Debian's python3-torch (the kernels of actorpipe's libtorch)
// trains the built-in gpt from the same initial parameters on the same tokens
// (tests/oracle/pytorch_gpt.py), and the pipelined gpt must reach its losses and parameters.
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <actorpipe/losses.hpp>
#include <actorpipe/models.hpp>

#include "oracle.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

namespace {

constexpr int64_t batch = 8;
constexpr int64_t context = 8;
constexpr int steps = 6;

nlohmann::json pytorch(const std::string& arguments) {
  return python_oracle("pytorch_gpt.py", arguments);
}

// The gpt of the oracle, drawn as it draws it: the same seed, then make_model.
layer_list oracle_gpt() {
  return test_gpt(tiny_vocabulary, 3, 16, context, 5);
}

// Step k's tokens and targets, as the oracle draws them.
std::pair<torch::Tensor, torch::Tensor> oracle_batch(int step) {
  return random_tokens(tiny_vocabulary, batch, context, 100 + static_cast<uint64_t>(step));
}

struct trained_pipeline {
  std::unique_ptr<pipeline> pipe;
  std::vector<double> losses;
};

trained_pipeline train(engine& sys, const schedule_setting& s, std::size_t stages,
                       const optimizer_factory& optimizer) {
  pipeline_options o;
  // Interleaving needs a multiple of the stages; the losses do not depend on the count.
  o.microbatches = microbatches_for(s.kind, stages, 4);
  o.schedule = s.kind;
  o.chunks = s.chunks;
  o.threads_per_stage = 1;
  o.loss = builtin_loss("cross_entropy");
  o.optimizer = optimizer;
  o.wait_timeout = std::chrono::milliseconds(20000);
  auto layers = oracle_gpt();
  trained_pipeline r;
  r.pipe =
    std::make_unique<pipeline>(sys, layers, partition_uniform(layers.size(), stages * s.chunks), o);
  for (int step = 0; step < steps; ++step) {
    auto [x, t] = oracle_batch(step);
    r.losses.push_back(r.pipe->train_step(x, t).loss);
  }
  return r;
}

} // namespace

TEST_CASE("PyTorch is the oracle: the pipelined gpt reaches python3-torch's losses (Adam) and "
          "parameters (SGD) from the same start, every schedule, 1-3 stages") {
  auto adam_run =
    pytorch(actorpipe::detail::concat("--steps ", steps, " --optimizer adam --lr 3e-3"));
  auto oracle_losses = adam_run["losses"].get<std::vector<double>>();
  REQUIRE(oracle_losses.size() == steps);
  // A learnable start: the first loss is about ln 11 = 2.4, and Adam lowers it.
  CHECK(oracle_losses.front() == doctest::Approx(std::log(11.0)).epsilon(0.05));

  auto file = std::filesystem::temp_directory_path() /
              ("actorpipe-oracle-" + std::to_string(::getpid()) + ".pt");
  auto sgd_run = pytorch(actorpipe::detail::concat("--steps ", steps, " --optimizer sgd --lr 0.1 ",
                                                   "--momentum 0.9 --parameters ", file.string()));
  std::ifstream in(file, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(file);
  auto dict = torch::pickle_load(bytes).toGenericDict();
  std::vector<std::pair<std::string, torch::Tensor>> oracle_parameters;
  for (const auto& item : dict) {
    oracle_parameters.emplace_back(item.key().toStringRef(), item.value().toTensor());
  }

  engine sys;
  for (const auto& s : every_schedule()) {
    for (std::size_t stages = 1; stages <= 3; ++stages) {
      CAPTURE(to_string(s.kind));
      CAPTURE(stages);
      auto with_adam = train(sys, s, stages, adam(3e-3));
      for (int step = 0; step < steps; ++step) {
        CAPTURE(step);
        CHECK(with_adam.losses[step] == doctest::Approx(oracle_losses[step]).epsilon(1e-5));
      }
      auto with_sgd = train(sys, s, stages, sgd(0.1, 0.9));
      auto oracle_sgd = sgd_run["losses"].get<std::vector<double>>();
      CHECK(with_sgd.losses.back() == doctest::Approx(oracle_sgd.back()).epsilon(1e-5));
      // Every parameter, the tied head's copy included, where PyTorch's is.
      auto trained = with_sgd.pipe->named_parameters();
      std::map<std::string, torch::Tensor> ours(trained.begin(), trained.end());
      for (const auto& [name, expected] : oracle_parameters) {
        CAPTURE(name);
        REQUIRE(ours.count(name) == 1);
        CHECK(torch::allclose(ours[name], expected, 1e-4, 1e-6));
      }
    }
  }
}
