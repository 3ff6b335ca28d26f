// Pipelines on a GPU against plain libtorch on the same GPU, in one process (docs/gpu.md):
//   1. the seed scenario: ResNet-50, batch 120 of 3x128x128 random images, MSE against one-hot
//      targets, SGD; plain libtorch, then two stages sharing the device for each split count;
//   2. the per-hop cost: forward-only passes through near-empty stages on the device, per hop
//      (as actorpipe_micro_bench on the CPU);
//   3. the gpt's tokens per second in fp32 and bf16 (two stages on the device, 4 micro-batches),
//      width 1024 and 512 tokens, at 16 and 64 sequences a batch: the smaller leaves a GPU
//      waiting for the host's kernel launches, the larger is decided by its matrix products;
//   with CUDA graphs off and on (--cuda-graphs off,on; docs/gpu.md#cuda-graphs) for the pipeline
//   rows of 1-3, beside plain libtorch accumulating the same micro-batches (the seed scenario) and
//   a training hop (4 near-empty stages, 64 micro-batches, a forward and a backward hop each);
//   4. schedules on the gpt (fp32, 32 sequences, 8 micro-batches, two stages): 1F1B, ZB-V, and
//      DualPipeV with each chunk on a stream of its own (pipeline_options::chunk_streams) and
//      with one stream per stage, side by side.
// The batch and targets start on the device for plain libtorch and the pipeline alike (the
// pipeline's hand-off of a host batch is what `--host-batch` adds). Medians over the timed steps,
// after a warm-up step; one JSON object on stdout or --json.
//
//   build-cuda/bench/actorpipe_gpu_bench --json gpu.json              # on a GPU
//   build/bench/actorpipe_gpu_bench --device cpu --batch 8 --image 32 --splits 1,2 --steps 2
//                                                                     # a smoke run on the CPU
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>
#include <actorpipe/torch_compat.hpp>

#include "bench/sweep.hpp"
#include "stages/device.hpp"

namespace {

using namespace actorpipe;
using clock_type = std::chrono::steady_clock;

struct settings {
  std::string device = "cuda:0";
  int64_t batch = 120;
  int64_t image = 128;
  std::vector<std::size_t> splits{1, 2, 4, 8};
  int steps = 5;
  int64_t gpt_width = 1024;
  int64_t gpt_layers = 8;
  int64_t gpt_context = 512;
  std::vector<int64_t> gpt_batches{16, 64};
  int64_t schedules_batch = 32;
  bool host_batch = false;
  std::vector<std::string> graphs{"off", "on"};
};

double ms_since(clock_type::time_point start) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - start).count();
}

// Median step time of `step` (which returns once the step's work is done) after `warmup` steps.
template <class Step>
double median_step_ms(int steps, Step&& step, int warmup = 1) {
  for (int i = 0; i < warmup; ++i) {
    step();
  }
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) {
    auto start = clock_type::now();
    step();
    times.push_back(ms_since(start));
  }
  return bench::median(times);
}

layer_list resnet50() {
  torch::manual_seed(1);
  model_options o;
  o.in_channels = 3;
  o.num_classes = 1000;
  o.block_layers = true;
  return make_model("resnet50", o);
}

// Moves every layer of `layers` to `device`; their parameters, for plain libtorch's optimizer.
std::vector<torch::Tensor> parameters_on(layer_list& layers, c10::Device device) {
  std::vector<torch::Tensor> parameters;
  for (auto& l : layers) {
    if (auto m = l.module()) {
      m->to(device);
      for (auto& p : m->parameters()) {
        parameters.push_back(p);
      }
    }
  }
  return parameters;
}

double plain_ms(layer_list layers, c10::Device device, const torch::Tensor& x,
                const torch::Tensor& y, int steps,
                precision_mode precision = precision_mode::fp32) {
  torch::optim::SGD optimizer(parameters_on(layers, device), torch::optim::SGDOptions(0.05));
  auto xd = x.to(device);
  auto yd = y.to(device);
  auto loss = builtin_loss(y.is_floating_point() ? "mse" : "cross_entropy");
  return median_step_ms(steps, [&] {
    optimizer.zero_grad();
    torch::Tensor out;
    if (precision == precision_mode::bf16 && device.is_cuda()) {
      compat::set_autocast_enabled(c10::DeviceType::CUDA, true);
      compat::set_autocast_dtype(c10::DeviceType::CUDA, at::kBFloat16);
      out = run_layers(layers, xd);
      compat::set_autocast_enabled(c10::DeviceType::CUDA, false);
      at::autocast::clear_cache();
      out = out.to(torch::kFloat);
    } else {
      out = run_layers(layers, xd);
    }
    auto l = loss(out, yd);
    l.backward();
    optimizer.step();
    l.item<double>(); // waits for the device
  });
}

// Plain libtorch's step accumulating `m` micro-batches' gradients before one optimizer step:
// the same kernels a pipeline of the same micro-batches runs, with no engine around them.
double plain_accumulating_ms(layer_list layers, c10::Device device, const torch::Tensor& x,
                             const torch::Tensor& y, std::size_t m, int steps) {
  torch::optim::SGD optimizer(parameters_on(layers, device), torch::optim::SGDOptions(0.05));
  auto xs = torch::tensor_split(x.to(device), static_cast<int64_t>(m), 0);
  auto ys = torch::tensor_split(y.to(device), static_cast<int64_t>(m), 0);
  auto loss = builtin_loss("mse");
  return median_step_ms(steps, [&] {
    optimizer.zero_grad();
    torch::Tensor last;
    for (std::size_t i = 0; i < m; ++i) {
      last = loss(run_layers(layers, xs[i]), ys[i]) / static_cast<double>(m);
      last.backward();
    }
    optimizer.step();
    last.item<double>(); // waits for the device
  });
}

// Warm-up steps before timing: CUDA graphs capture in the third training step.
int warmup_for(cuda_graph_mode graphs) {
  return graphs == cuda_graph_mode::off ? 1 : 3;
}

// The pipeline's step on x and y as given (on the device, or on the host with --host-batch).
double pipeline_ms(engine& sys, const layer_list& layers, std::size_t stages, std::size_t splits,
                   c10::Device device, const torch::Tensor& x, const torch::Tensor& y, int steps,
                   precision_mode precision = precision_mode::fp32,
                   cuda_graph_mode graphs = cuda_graph_mode::off) {
  pipeline_options o;
  o.cuda_graphs = graphs;
  o.microbatches = splits;
  o.schedule = schedule_kind::one_f_one_b;
  o.loss = builtin_loss(y.is_floating_point() ? "mse" : "cross_entropy");
  o.optimizer = sgd(0.05);
  o.devices.assign(stages, device);
  o.precision = precision;
  pipeline pipe(sys, layers, partition_uniform(layers.size(), stages), o);
  return median_step_ms(
    steps, [&] { pipe.train_step(x, y); }, warmup_for(graphs));
}

std::vector<cuda_graph_mode> graph_modes(const settings& s) {
  std::vector<cuda_graph_mode> modes;
  for (const auto& g : s.graphs) {
    modes.push_back(parse_cuda_graph_mode(g));
  }
  return modes;
}

// Where the pipeline's batch starts: the device, as plain libtorch's (or the host: --host-batch).
torch::Tensor batch_for(const settings& s, const torch::Tensor& t, c10::Device device) {
  return s.host_batch ? t : t.to(device);
}

nlohmann::json seed_scenario(engine& sys, const settings& s, c10::Device device) {
  auto x = torch::randn({s.batch, 3, s.image, s.image});
  auto y = torch::nn::functional::one_hot(torch::randint(1000, {s.batch}), 1000).to(torch::kFloat);
  auto px = batch_for(s, x, device);
  auto py = batch_for(s, y, device);
  nlohmann::json rows = nlohmann::json::array();
  double plain = plain_ms(resnet50(), device, x, y, s.steps);
  std::fprintf(stderr, "seed scenario: plain libtorch %.1f ms\n", plain);
  for (auto m : s.splits) {
    double accumulating = plain_accumulating_ms(resnet50(), device, x, y, m, s.steps);
    for (auto graphs : graph_modes(s)) {
      double ms =
        pipeline_ms(sys, resnet50(), 2, m, device, px, py, s.steps, precision_mode::fp32, graphs);
      std::fprintf(stderr,
                   "seed scenario: 2 stages, %zu splits, graphs %s: %.1f ms (%.3fx plain, %.3fx "
                   "plain accumulating %zu micro-batches)\n",
                   m, to_string(graphs), ms, plain / ms, accumulating / ms, m);
      rows.push_back({{"splits", m},
                      {"cuda_graphs", to_string(graphs)},
                      {"ms", ms},
                      {"plain_over_pipeline", plain / ms},
                      {"plain_accumulating_ms", accumulating},
                      {"accumulating_over_pipeline", accumulating / ms}});
    }
  }
  return {{"plain_ms", plain}, {"two_stages_one_device", rows}};
}

// Per hop, as actorpipe_micro_bench measures it on the CPU (BENCHMARKS.md): forward-only
// passes through 4 stages of one 16-wide linear layer each on the device, [m, 16] floats, per
// hop = the pass's time / (stages x micro-batches); m = 64 (hops overlap, as in a pipeline's
// steady state) and m = 1 (one micro-batch: every hop and the step's fixed cost in series).
nlohmann::json hop_cost(engine& sys, const settings& s, c10::Device device) {
  torch::manual_seed(2);
  const std::size_t stages = 4;
  layer_list layers;
  for (std::size_t i = 0; i < stages; ++i) {
    layers.emplace_back("fc" + std::to_string(i), torch::nn::AnyModule(torch::nn::Linear(16, 16)));
  }
  nlohmann::json out;
  for (std::size_t m : {std::size_t{64}, std::size_t{1}}) {
    pipeline_options o;
    o.microbatches = m;
    o.optimizer = sgd(0.05);
    o.loss = builtin_loss("mse");
    o.devices.assign(stages, device);
    pipeline pipe(sys, layers, partition_uniform(layers.size(), stages), o);
    auto x = batch_for(s, torch::randn({static_cast<int64_t>(m), 16}), device);
    double ms = median_step_ms(s.steps * 20, [&] { pipe.forward(x); });
    double per_hop_us = ms * 1000.0 / static_cast<double>(stages * m);
    std::fprintf(stderr,
                 "per hop: %zu stages, %zu micro-batches: %.3f ms a pass, %.1f us per hop\n",
                 stages, m, ms, per_hop_us);
    out[m == 1 ? "one_microbatch" : "steady"] = {
      {"stages", stages}, {"microbatches", m}, {"pass_ms", ms}, {"per_hop_us", per_hop_us}};
  }
  // Training: a forward and a backward hop per stage and micro-batch, with graphs off and on.
  for (auto graphs : graph_modes(s)) {
    const std::size_t m = 64;
    pipeline_options o;
    o.microbatches = m;
    o.optimizer = sgd(0.05);
    o.loss = builtin_loss("mse");
    o.devices.assign(stages, device);
    o.cuda_graphs = graphs;
    pipeline pipe(sys, layers, partition_uniform(layers.size(), stages), o);
    auto x = batch_for(s, torch::randn({static_cast<int64_t>(m), 16}), device);
    auto y = batch_for(s, torch::randn({static_cast<int64_t>(m), 16}), device);
    double ms = median_step_ms(
      s.steps * 4, [&] { pipe.train_step(x, y); }, warmup_for(graphs));
    double per_hop_us = ms * 1000.0 / static_cast<double>(2 * stages * m);
    std::fprintf(stderr, "per training hop, graphs %s: %.3f ms a step, %.1f us per hop\n",
                 to_string(graphs), ms, per_hop_us);
    out[std::string("train_graphs_") + to_string(graphs)] = {
      {"stages", stages}, {"microbatches", m}, {"step_ms", ms}, {"per_hop_us", per_hop_us}};
  }
  return out;
}

// The bench's gpt (vocabulary 256, 8 heads), its parameters drawn after seed 3.
layer_list bench_gpt(const settings& s) {
  torch::manual_seed(3);
  model_options o;
  o.vocabulary = 256;
  o.layers = s.gpt_layers;
  o.heads = 8;
  o.width = s.gpt_width;
  o.context = s.gpt_context;
  return make_model("gpt", o);
}

nlohmann::json gpt_tokens(engine& sys, const settings& s, int64_t batch, c10::Device device) {
  auto gpt = [&] { return bench_gpt(s); };
  auto x = torch::randint(256, {batch, s.gpt_context});
  auto y = torch::randint(256, {batch, s.gpt_context});
  auto px = batch_for(s, x, device);
  auto py = batch_for(s, y, device);
  auto tokens = static_cast<double>(batch * s.gpt_context);
  nlohmann::json out{{"batch", batch}, {"tokens_per_step", batch * s.gpt_context}};
  for (auto precision : {precision_mode::fp32, precision_mode::bf16}) {
    auto name = precision == precision_mode::bf16 ? "bf16" : "fp32";
    double plain = plain_ms(gpt(), device, x, y, s.steps, precision);
    out[name] = {{"plain_ms", plain}, {"plain_tokens_per_s", tokens / plain * 1000.0}};
    for (auto graphs : graph_modes(s)) {
      double ms = pipeline_ms(sys, gpt(), 2, 4, device, px, py, s.steps, precision, graphs);
      auto key = graphs == cuda_graph_mode::off
                   ? std::string("pipeline")
                   : std::string("pipeline_graphs_") + to_string(graphs);
      out[name][key + "_ms"] = ms;
      out[name][key + "_tokens_per_s"] = tokens / ms * 1000.0;
      std::fprintf(stderr,
                   "gpt, batch %lld, %s, graphs %s: pipeline %.0f tokens/s, plain %.0f "
                   "tokens/s\n",
                   static_cast<long long>(batch), name, to_string(graphs), tokens / ms * 1000.0,
                   tokens / plain * 1000.0);
    }
  }
  if (out["fp32"].contains("pipeline_ms") && out["bf16"].contains("pipeline_ms")) {
    out["bf16_over_fp32"] =
      out["fp32"]["pipeline_ms"].get<double>() / out["bf16"]["pipeline_ms"].get<double>();
  }
  return out;
}

// Step times of the schedules on the gpt: two stages sharing the device, 8 micro-batches.
nlohmann::json schedules(engine& sys, const settings& s, c10::Device device) {
  auto gpt = [&] { return bench_gpt(s); };
  auto x = batch_for(s, torch::randint(256, {s.schedules_batch, s.gpt_context}), device);
  auto y = batch_for(s, torch::randint(256, {s.schedules_batch, s.gpt_context}), device);
  struct contender {
    const char* name;
    schedule_kind kind;
    std::size_t chunks;
    bool chunk_streams;
  };
  const contender contenders[] = {{"1f1b", schedule_kind::one_f_one_b, 1, true},
                                  {"zb-v", schedule_kind::zb_v, 2, true},
                                  {"dualpipe-v", schedule_kind::dualpipe_v, 2, true},
                                  {"dualpipe-v, one stream", schedule_kind::dualpipe_v, 2, false}};
  nlohmann::json out{{"batch", s.schedules_batch}, {"microbatches", 8}};
  double base = 0;
  for (const auto& c : contenders) {
    auto layers = gpt();
    pipeline_options o;
    o.microbatches = 8;
    o.schedule = c.kind;
    o.chunks = c.chunks;
    o.chunk_streams = c.chunk_streams;
    o.loss = builtin_loss("cross_entropy");
    o.optimizer = sgd(0.05);
    o.devices.assign(2, device);
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 2 * c.chunks), o);
    double ms = median_step_ms(s.steps, [&] { pipe.train_step(x, y); });
    base = base > 0 ? base : ms;
    out[c.name] = {{"step_ms", ms}, {"over_1f1b", base / ms}};
    std::fprintf(stderr, "gpt schedules, batch %lld: %s %.1f ms (%.3fx 1f1b)\n",
                 static_cast<long long>(s.schedules_batch), c.name, ms, base / ms);
  }
  return out;
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app("actorpipe_gpu_bench: pipelines on a GPU against plain libtorch on it");
  settings s;
  std::string json_path;
  app.add_option("--device", s.device, "cuda:N, or cpu for a smoke run")->capture_default_str();
  app.add_option("--batch", s.batch, "seed scenario: images per batch")->capture_default_str();
  app.add_option("--image", s.image, "seed scenario: image side")->capture_default_str();
  app.add_option("--splits", s.splits, "seed scenario: micro-batch counts")->delimiter(',');
  app.add_option("--steps", s.steps, "timed steps per configuration")->capture_default_str();
  app.add_option("--gpt-width", s.gpt_width, "gpt: width")->capture_default_str();
  app.add_option("--gpt-layers", s.gpt_layers, "gpt: blocks")->capture_default_str();
  app.add_option("--gpt-context", s.gpt_context, "gpt: tokens per sequence")->capture_default_str();
  app.add_option("--gpt-batch", s.gpt_batches, "gpt: sequences per batch (each size measured)")
    ->delimiter(',');
  app
    .add_option("--schedules-batch", s.schedules_batch,
                "schedules on the gpt: sequences per batch (0: not measured)")
    ->capture_default_str();
  app.add_flag("--host-batch", s.host_batch,
               "the pipeline's batch starts on the host (pinned and copied every step)");
  app.add_option("--cuda-graphs", s.graphs, "pipelines with CUDA graphs off, on or auto")
    ->delimiter(',');
  app.add_option("--json", json_path, "write the results here (default: stdout)");
  CLI11_PARSE(app, argc, argv);
  try {
    c10::Device device(s.device);
    stages::check_device(device, "actorpipe_gpu_bench --device");
    if (device.is_cuda()) {
      ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
    }
    engine sys;
    nlohmann::json result{{"device", s.device}, {"steps", s.steps}, {"host_batch", s.host_batch}};
    result["seed_scenario"] = seed_scenario(sys, s, device);
    result["hop"] = hop_cost(sys, s, device);
    result["gpt"] = nlohmann::json::array();
    for (auto batch : s.gpt_batches) {
      result["gpt"].push_back(gpt_tokens(sys, s, batch, device));
    }
    if (s.schedules_batch > 0) {
      result["schedules"] = schedules(sys, s, device);
    }
    if (json_path.empty()) {
      std::cout << result.dump(2) << "\n";
    } else {
      std::ofstream(json_path) << result.dump(2) << "\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "actorpipe_gpu_bench: %s\n",
                 actorpipe::detail::first_line(e.what()).c_str());
    return 1;
  }
  return 0;
}
