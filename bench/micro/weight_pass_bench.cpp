// Zero-bubble's split backward on ResNet-50: a fused backward against B + W, with W walking the
// graph again (as before the weight pass) and with W from what B kept (stages/weight_pass.hpp).
//
//   build/bench/actorpipe_weight_pass_bench --benchmark_counters_tabular=true
//
// One stage thread (one intra-op thread, warm memory), a micro-batch of 6 images at 96 px (the
// reduced bench scenario's batch 48 in 8 micro-batches), the stage holding everything after
// ResNet-50's stem as a middle stage would (it receives an activation and sends a gradient back).
#include <chrono>

#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

#include "stages/stage.hpp"

namespace {

enum variant : int64_t { fused = 0, walk = 1, pass = 2 };

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

void BM_split_backward(benchmark::State& state) {
  auto v = static_cast<variant>(state.range(0));
  at::set_num_threads(1);
  // As on a stage thread: freed buffers are kept for the next micro-batch.
  actorpipe::memory::warm_memory_scope warm;
  torch::manual_seed(0);
  auto model = actorpipe::make_model("resnet50");
  const std::size_t stem = 4; // conv1, bn1, relu, maxpool
  actorpipe::layer_list head(model.begin(), model.begin() + stem);
  actorpipe::layer_list body(model.begin() + stem, model.end());
  torch::Tensor x;
  {
    torch::NoGradGuard no_grad;
    x = actorpipe::run_layers(head, torch::randn({6, 3, 96, 96}));
  }
  actorpipe::stages::stage_config config;
  config.index = 1;
  config.count = 3;
  actorpipe::stages::stage st(config, body);
  st.use_weight_pass(v == pass);
  st.begin_step(true);
  double forward_ms = 0;
  double b_ms = 0;
  double w_ms = 0;
  int32_t m = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    auto y = st.forward(m, x.clone().requires_grad_(true))[0];
    forward_ms += ms_since(t0);
    auto g = torch::ones_like(y);
    auto t1 = std::chrono::steady_clock::now();
    if (v == fused) {
      benchmark::DoNotOptimize(st.backward(m, g));
      b_ms += ms_since(t1);
    } else {
      benchmark::DoNotOptimize(st.backward_input(m, g));
      b_ms += ms_since(t1);
      auto t2 = std::chrono::steady_clock::now();
      st.backward_weight(m);
      w_ms += ms_since(t2);
    }
    ++m;
  }
  auto n = static_cast<double>(state.iterations());
  state.counters["forward_ms"] = forward_ms / n;
  state.counters["B_ms"] = b_ms / n;
  state.counters["W_ms"] = w_ms / n;
  state.counters["backward_ms"] = (b_ms + w_ms) / n;
  state.SetLabel(v == fused  ? "fused backward"
                 : v == walk ? "B + W walking the graph"
                             : "B + W pass");
}
BENCHMARK(BM_split_backward)
  ->Arg(fused)
  ->Arg(walk)
  ->Arg(pass)
  ->Unit(benchmark::kMillisecond)
  ->UseRealTime()
  ->MinTime(3);

} // namespace

BENCHMARK_MAIN();
