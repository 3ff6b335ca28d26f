// Per-hop overhead of the actor pipeline: a micro-batch through trivial stages (identity on a
// small tensor), so that what is measured is messaging, scheduling and bookkeeping, not compute.
//
//   build/bench/actorpipe_micro_bench --benchmark_counters_tabular=true
#include <optional>

#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

namespace {

actorpipe::layer_list identity_layers(std::size_t n) {
  actorpipe::layer_list layers;
  for (std::size_t i = 0; i < n; ++i) {
    layers.emplace_back("identity" + std::to_string(i), [](const torch::Tensor& x) { return x; });
  }
  return layers;
}

// Forward-only: m micro-batches through p stages; the counter is the time per micro-batch per
// stage (one hop). The third argument is pipeline_options::linger in microseconds (0: every idle
// thread sleeps at once; the default 50 polls first).
void BM_forward_hop(benchmark::State& state) {
  auto p = static_cast<std::size_t>(state.range(0));
  auto m = static_cast<std::size_t>(state.range(1));
  actorpipe::engine sys;
  actorpipe::pipeline_options o;
  o.microbatches = m;
  o.threads_per_stage = 1;
  o.linger = std::chrono::microseconds(state.range(2));
  actorpipe::pipeline pipe(sys, identity_layers(p), actorpipe::partition_uniform(p, p), o);
  auto x = torch::ones({static_cast<int64_t>(m), 16});
  for (auto _ : state) {
    benchmark::DoNotOptimize(pipe.forward_scattered(x));
  }
  // Seconds per hop, printed with an SI prefix (15u = 15 microseconds).
  state.counters["per_hop"] =
    benchmark::Counter(static_cast<double>(m * p),
                       benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_forward_hop)
  ->ArgsProduct({{1, 2, 4, 8}, {1, 8, 64}, {0, 50}})
  ->Unit(benchmark::kMicrosecond)
  ->UseRealTime();

// A whole training step of p tiny stages and one micro-batch: the scheduler's fixed cost per
// step (plans out, reports back, optimizer round trips) and how it grows with the stages; the
// second argument is the linger window in microseconds, as above.
void BM_scheduler_step(benchmark::State& state) {
  auto p = static_cast<std::size_t>(state.range(0));
  actorpipe::engine sys;
  actorpipe::layer_list layers;
  for (std::size_t i = 0; i < p; ++i) {
    layers.emplace_back("fc" + std::to_string(i), torch::nn::AnyModule(torch::nn::Linear(4, 4)));
  }
  actorpipe::pipeline_options o;
  o.threads_per_stage = 1;
  o.loss = [](const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); };
  o.optimizer = actorpipe::sgd(0.01);
  o.microbatches = 1;
  o.linger = std::chrono::microseconds(state.range(1));
  actorpipe::pipeline pipe(sys, layers, actorpipe::partition_uniform(p, p), o);
  auto x = torch::ones({2, 4});
  for (auto _ : state) {
    benchmark::DoNotOptimize(pipe.train_step(x, x));
  }
}
BENCHMARK(BM_scheduler_step)
  ->ArgsProduct({{1, 8, 64}, {0, 50}})
  ->Unit(benchmark::kMicrosecond)
  ->UseRealTime();

// What counting a stage's allocations costs (memory::allocation_tally, open around every training
// forward): one tensor allocated and freed on a warm thread, small (16 floats: libtorch's
// allocator) and large (64K floats: warm memory), without and with a tally.
void BM_allocation(benchmark::State& state) {
  auto elements = state.range(0);
  auto tallied = state.range(1) != 0;
  actorpipe::memory::warm_memory_scope warm;
  std::optional<actorpipe::memory::allocation_tally> tally;
  if (tallied) {
    tally.emplace();
  }
  for (auto _ : state) {
    benchmark::DoNotOptimize(torch::empty({elements}));
  }
}
BENCHMARK(BM_allocation)->ArgsProduct({{16, 65536}, {0, 1}})->Unit(benchmark::kNanosecond);

// Planning one step of p stages x m micro-batches as the scheduler does before it runs one:
// build the programs, validate them (every action, and a deadlock check), simulate them with
// costs. Goal for 64 x 512: <= 100 ms (docs/scaling.md).
void BM_schedule_step(benchmark::State& state) {
  auto p = static_cast<std::size_t>(state.range(0));
  auto m = static_cast<std::size_t>(state.range(1));
  auto kind = static_cast<actorpipe::schedule_kind>(state.range(2));
  std::size_t v =
    kind == actorpipe::schedule_kind::interleaved ? 2 : actorpipe::chunks_for(kind, 1);
  std::vector<actorpipe::action_costs> costs(p * v, actorpipe::action_costs{1, 2, 1});
  for (auto _ : state) {
    auto plan = actorpipe::make_schedule(kind, p, m, v);
    actorpipe::validate(plan, m, /*training=*/true);
    benchmark::DoNotOptimize(actorpipe::simulate(plan, m, costs).makespan);
  }
  state.SetLabel(actorpipe::to_string(kind));
  auto per_microbatch = actorpipe::splits_backward(actorpipe::make_schedule(kind, p, m, v)) ? 3 : 2;
  state.counters["actions"] = static_cast<double>(p * m * v * per_microbatch);
}
BENCHMARK(BM_schedule_step)
  ->ArgsProduct({{8, 16, 64},
                 {64, 512},
                 {static_cast<int64_t>(actorpipe::schedule_kind::one_f_one_b),
                  static_cast<int64_t>(actorpipe::schedule_kind::zb_h1),
                  static_cast<int64_t>(actorpipe::schedule_kind::interleaved),
                  static_cast<int64_t>(actorpipe::schedule_kind::zb_v)}})
  ->Unit(benchmark::kMillisecond)
  ->UseRealTime();

} // namespace

BENCHMARK_MAIN();
