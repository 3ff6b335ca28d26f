// Stages on CUDA devices (CTest label `gpu`). Every case needs a GPU: without one (or in the CPU
// build) the binary exits with 77, which CTest reports as skipped, never as passed.
//
// Tolerances: a pipeline accumulates its micro-batches' gradients where plain libtorch computes
// the full batch's at once, so sums differ in order: rtol 1e-5, atol 1e-6 in float32 (as on the
// CPU), with cuDNN and cuBLAS deterministic so that a rerun gives the same bits.
#include <cmath>
#include <cstdlib>
#include <filesystem>

#include <torch/cuda.h>

#include <actorpipe/node.hpp>
#include <actorpipe/planner.hpp>
#include <actorpipe/profile.hpp>

#include "../engine/oracle.hpp"
#include "comm/replica_group.hpp"
#include "stages/device.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

namespace {

void require_gpu() {
  if (stages::cuda_device_count() == 0) {
    std::string why = stages::built_with_cuda() ? "skipped: this machine has no CUDA device"
                                                : "skipped: this build of actorpipe has no CUDA";
    MESSAGE(why);
    std::exit(77);
  }
  // cuBLAS reads its workspace setting when it first starts.
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
  at::globalContext().setDeterministicAlgorithms(true, false);
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
}

const c10::Device gpu(c10::kCUDA, 0);
const c10::Device cpu(c10::kCPU);

layer_list on(layer_list layers, c10::Device device) {
  for (auto& l : layers) {
    if (auto m = l.module()) {
      m->to(device);
    }
  }
  return layers;
}

// Named tensors copied to the CPU, for comparisons across devices.
std::vector<std::pair<std::string, torch::Tensor>>
to_cpu(std::vector<std::pair<std::string, torch::Tensor>> all) {
  for (auto& [name, t] : all) {
    t = t.defined() ? t.cpu() : t;
  }
  return all;
}

// A replica group of one rank over NCCL, in process.
data_parallel_options nccl_of_one() {
  data_parallel_options o;
  o.replicas = 1;
  o.backend = dp_backend::nccl;
  o.local = comm::make_local_store();
  o.timeout = std::chrono::milliseconds(30000);
  return o;
}

pipeline_options options_for(schedule_setting s, std::vector<c10::Device> devices) {
  pipeline_options o;
  o.microbatches = 4;
  o.schedule = s.kind;
  o.chunks = s.chunks;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  o.devices = std::move(devices);
  return o;
}

} // namespace

TEST_CASE("gpu: every schedule on one GPU (two stage actors sharing it) equals plain libtorch "
          "on that GPU") {
  require_gpu();
  engine sys;
  auto x = torch::randn({10, 1, 4, 4});
  auto t = torch::randn({10, 3});
  for (auto s : every_schedule()) {
    CAPTURE(to_string(s.kind));
    auto layers = tiny_mlp();
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 2 * s.chunks),
                  options_for(s, {gpu, gpu}));
    plain_model plain(on(tiny_mlp(), gpu), sgd(0.1));
    for (int step = 0; step < 3; ++step) {
      auto result = pipe.train_step(x, t);
      auto plain_loss = plain.step(x.to(gpu), t.to(gpu));
      CHECK(result.loss == doctest::Approx(plain_loss).epsilon(1e-5));
    }
    check_close(to_cpu(pipe.named_parameters()), to_cpu(named(plain.layers, false)), 1e-5, 1e-6);
  }
}

TEST_CASE("gpu: stages on the CPU and on the GPU in one pipeline train like plain libtorch") {
  require_gpu();
  engine sys;
  auto x = torch::randn({12, 1, 4, 4});
  auto t = torch::randn({12, 3});
  for (auto devices : {std::vector<c10::Device>{cpu, gpu}, std::vector<c10::Device>{gpu, cpu}}) {
    CAPTURE(devices.front().str());
    auto layers = tiny_mlp();
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 2),
                  options_for({schedule_kind::one_f_one_b, 1}, devices));
    plain_model plain(tiny_mlp(), sgd(0.1));
    auto result = pipe.train_step(x, t);
    CHECK(result.loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
    check_close(to_cpu(pipe.named_parameters()), named(plain.layers, false), 1e-5, 1e-6);
  }
}

TEST_CASE("gpu: bf16 on a GPU runs under CUDA autocast and stays near float32") {
  require_gpu();
  engine sys;
  auto x = torch::randn({16, 1, 4, 4});
  auto t = torch::randn({16, 3});
  auto layers = tiny_mlp();
  auto o = options_for({schedule_kind::one_f_one_b, 1}, {gpu, gpu});
  o.precision = precision_mode::bf16;
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
  plain_model plain(on(tiny_mlp(), gpu), sgd(0.1));
  auto result = pipe.train_step(x, t);
  auto reference = plain.step(x.to(gpu), t.to(gpu));
  CHECK(std::isfinite(result.loss));
  CHECK(result.loss == doctest::Approx(reference).epsilon(2e-2));
}

TEST_CASE("gpu: recomputation replays the GPU generator: dropout masks equal those kept") {
  require_gpu();
  engine sys;
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randn({8, 3});
  auto train = [&](recompute_mode mode) {
    auto layers = tiny_mlp(9);
    layers.insert(layers.begin() + 3,
                  layer("dropout", torch::nn::AnyModule(torch::nn::Dropout(0.5))));
    auto o = options_for({schedule_kind::one_f_one_b, 1}, {gpu, gpu});
    o.recompute = mode;
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
    torch::cuda::manual_seed_all(5);
    pipe.train_step(x, t);
    return to_cpu(pipe.named_gradients());
  };
  check_close(train(recompute_mode::always), train(recompute_mode::never), 0, 0);
}

TEST_CASE("gpu: a model scripted in Python trains on the GPU as on the CPU") {
  require_gpu();
  engine sys;
  auto dir = std::filesystem::temp_directory_path() / "actorpipe_gpu_torchscript";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  python_oracle("pytorch_script.py", "make --model cnn --out " + dir.string());
  auto data = load_tensor_file((dir / "data.pt").string());
  auto x = data.images.slice(0, 0, 16);
  auto y = data.labels.slice(0, 0, 16);
  auto train = [&](std::vector<c10::Device> devices) {
    auto layers = load_torchscript((dir / "model.pt").string());
    pipeline_options o;
    o.microbatches = 4;
    o.loss = builtin_loss("cross_entropy");
    o.optimizer = sgd(0.05);
    o.devices = std::move(devices);
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
    std::vector<double> losses;
    for (int step = 0; step < 3; ++step) {
      losses.push_back(pipe.train_step(x, y).loss);
    }
    return std::make_pair(losses, to_cpu(pipe.named_parameters()));
  };
  auto [gpu_losses, gpu_parameters] = train({gpu, gpu});
  auto [cpu_losses, cpu_parameters] = train({});
  for (std::size_t i = 0; i < cpu_losses.size(); ++i) {
    CHECK(gpu_losses[i] == doctest::Approx(cpu_losses[i]).epsilon(1e-4));
  }
  check_close(gpu_parameters, cpu_parameters, 1e-4, 1e-5);
  std::filesystem::remove_all(dir);
}

TEST_CASE("gpu: a checkpoint written on the GPU loads onto the CPU and back") {
  require_gpu();
  engine sys;
  auto dir = std::filesystem::temp_directory_path() / "actorpipe_gpu_checkpoint";
  std::filesystem::remove_all(dir);
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randn({8, 3});
  auto o = options_for({schedule_kind::one_f_one_b, 1}, {gpu, gpu});
  auto layers = tiny_mlp(3);
  pipeline trained(sys, layers, partition_uniform(layers.size(), 2), o);
  trained.train_step(x, t);
  trained.save_state(dir.string());
  auto cpu_layers = tiny_mlp(4);
  auto on_cpu = options_for({schedule_kind::one_f_one_b, 1}, {});
  pipeline restored(sys, cpu_layers, partition_uniform(cpu_layers.size(), 3), on_cpu);
  restored.load_state(dir.string());
  check_close(restored.named_parameters(), to_cpu(trained.named_parameters()), 0, 0);
  auto gpu_layers = tiny_mlp(5);
  pipeline back(sys, gpu_layers, partition_uniform(gpu_layers.size(), 2), o);
  back.load_state(dir.string());
  check_close(to_cpu(back.named_parameters()), to_cpu(trained.named_parameters()), 0, 0);
  // Both go on alike from there.
  CHECK(back.train_step(x, t).loss == doctest::Approx(trained.train_step(x, t).loss));
  std::filesystem::remove_all(dir);
}

TEST_CASE("gpu: a stage out of GPU memory fails the step by name and changes nothing") {
  require_gpu();
  engine sys;
  auto layers = tiny_mlp();
  // After the first layer: a layer that asks for 4 TiB on the stage's device.
  layers.insert(layers.begin() + 1, layer("greedy", [](const torch::Tensor& h) {
                  return h + torch::zeros({int64_t{1} << 40}, h.options()).sum();
                }));
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 2),
                options_for({schedule_kind::one_f_one_b, 1}, {gpu, gpu}));
  auto before = to_cpu(pipe.named_parameters());
  try {
    pipe.train_step(torch::randn({8, 1, 4, 4}), torch::randn({8, 3}));
    FAIL("the step should have failed");
  } catch (const pipeline_error& e) {
    CAPTURE(e.what());
    CHECK(e.kind() == error_kind::out_of_memory);
    CHECK(e.stage() == std::optional<std::size_t>(0));
    CHECK(e.microbatch().has_value());
    CHECK(std::string(e.what()).find("greedy") != std::string::npos);
    CHECK(std::string(e.what()).find("cuda:0") != std::string::npos);
  }
  check_close(to_cpu(pipe.named_parameters()), before, 0, 0);
}

TEST_CASE("gpu: stages on a node's GPU train like stages on the GPU in this process") {
  require_gpu();
  engine sys;
  node_options no;
  node n1(no), n2(no);
  auto m = tiny_remote(1);
  auto o = options_for({schedule_kind::one_f_one_b, 1}, {gpu, gpu});
  o.optimizer = sgd(0.1, 0.9);
  auto local = tiny_mlp(1);
  pipeline in_process(sys, local, partition_uniform(local.size(), 2), o);
  o.placement.nodes = {n1.address(), n2.address()};
  pipeline on_nodes(sys, m, partition_uniform(local.size(), 2), o);
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randn({8, 3});
  for (int step = 0; step < 3; ++step) {
    CHECK(on_nodes.train_step(x, t).loss ==
          doctest::Approx(in_process.train_step(x, t).loss).epsilon(1e-5));
  }
  check_close(on_nodes.named_parameters(), to_cpu(in_process.named_parameters()), 1e-5, 1e-6);
}

TEST_CASE("gpu: an NCCL replica group of one rank all-reduces a stage's gradients on the GPU") {
  require_gpu();
  comm::replica_group group(nccl_of_one(), 1, {gpu});
  auto p = torch::ones({4, 3}, torch::TensorOptions().device(gpu)).requires_grad_(true);
  p.mutable_grad() = torch::full({4, 3}, 2.0, p.options());
  auto bytes = group.stage(0)->all_reduce_gradients({p}, 0.5);
  CHECK(bytes == 4 * 3 * 4);
  CHECK(torch::allclose(p.grad().cpu(), torch::ones({4, 3})));
  auto totals = group.stage(0)->sum(8, 4.0);
  CHECK(totals.weight == 8);
  CHECK(totals.weighted_loss == 4.0);
}

TEST_CASE("gpu: ZeRO's collectives (reduce to the owner, broadcast from it, the state gather) run "
          "on NCCL") {
  require_gpu();
  comm::replica_group group(nccl_of_one(), 1, {gpu});
  auto& sync = *group.stage(0);
  auto options = torch::TensorOptions().device(gpu);
  auto a = torch::ones({4, 3}, options).requires_grad_(true);
  auto b = torch::ones({5}, options).requires_grad_(true);
  a.mutable_grad() = torch::full({4, 3}, 2.0, options);
  b.mutable_grad() = torch::full({5}, 4.0, options);
  auto bytes = sync.reduce_gradients({a, b}, {0, 0}, {false, true}, 0.5);
  CHECK(bytes == (12 + 5) * 4);
  CHECK(torch::allclose(a.grad().cpu(), torch::ones({4, 3})));
  CHECK(torch::allclose(b.grad().cpu(), torch::full({5}, 2.0)));
  CHECK(sync.broadcast_from_owners({a, b}, {0, 0}) == (12 + 5) * 4);
  auto gathered = sync.gather_on_first({{"optimizer/x/exp_avg", torch::arange(6.0)}}, "test");
  REQUIRE(gathered.count("optimizer/x/exp_avg") == 1);
  CHECK(torch::equal(gathered.at("optimizer/x/exp_avg"), torch::arange(6.0)));
}

TEST_CASE("gpu: the planner profiles layers on the GPU and leaves them where they were") {
  require_gpu();
  auto layers = tiny_mlp();
  auto before = named(layers, false);
  for (auto& [name, t] : before) {
    t = t.clone();
  }
  profile_options o;
  o.repeats = 2;
  o.device = gpu;
  o.split_backward = true;
  auto profile = profile_layers(layers, torch::randn({8, 1, 4, 4}), o);
  REQUIRE(profile.size() == layers.size());
  for (const auto& p : profile) {
    CAPTURE(p.name);
    CHECK(p.forward_ms > 0);
    CHECK(p.backward_ms >= 0);
  }
  // Back on the CPU, unchanged, without gradients.
  auto after = named(layers, false);
  check_close(after, before, 0, 0);
  for (const auto& [name, t] : after) {
    CAPTURE(name);
    CHECK(t.device().is_cpu());
  }
  CHECK(profile_update(layers, 2, gpu) > 0);
}

TEST_CASE("gpu: a batch already on the GPU trains as one on the host, and every action has its "
          "time on the GPU") {
  require_gpu();
  engine sys;
  auto x = torch::randn({10, 1, 4, 4});
  auto t = torch::randn({10, 3});
  auto from_host = tiny_mlp();
  auto from_gpu = tiny_mlp();
  schedule_setting one_f_one_b{schedule_kind::one_f_one_b, 1};
  pipeline host(sys, from_host, partition_uniform(from_host.size(), 2),
                options_for(one_f_one_b, {gpu, gpu}));
  auto timed = options_for(one_f_one_b, {gpu, gpu});
  timed.device_timing = true;
  pipeline device(sys, from_gpu, partition_uniform(from_gpu.size(), 2), timed);
  for (int step = 0; step < 2; ++step) {
    auto a = host.train_step(x, t);
    auto b = device.train_step(x.to(gpu) * 1.0, t.to(gpu)); // made on the caller's stream
    CHECK(a.loss == b.loss);
    for (const auto& stage : b.stages) {
      REQUIRE(!stage.actions.empty());
      for (const auto& action : stage.actions) {
        CAPTURE(to_string(action.what));
        CHECK(action.device_start_ms >= 0);
        CHECK(action.device_end_ms >= action.device_start_ms);
      }
    }
  }
  check_close(to_cpu(device.named_parameters()), to_cpu(host.named_parameters()), 0, 0);
}

namespace {

// The mlp (flatten, fc1, relu1, fc2, relu2, fc3) in `parts` parts (2, or 4 for two chunks per
// stage) over two stages under `kind`:
// each stage alone on the GPU (the other on the CPU) measures its stash and the caching
// allocator's peak; the planner's prediction from a profile on the GPU must match both, and a
// CPU run must stash the same. Returns the predicted workspaces of the two stages.
std::vector<int64_t> check_device_peak(schedule_kind kind, std::size_t parts) {
  engine sys;
  model_options mo;
  mo.in_channels = 1;
  mo.image_size = 32; // 1,024 inputs, hidden 256 and 128: tensors of kilobytes, not bytes
  mo.num_classes = 3;
  auto model = [&] {
    torch::manual_seed(3);
    return make_model("mlp", mo);
  };
  auto x = torch::randn({64, 1, 32, 32});
  auto t = torch::randn({64, 3});
  const std::size_t m = 4;
  auto cut = partition_uniform(model().size(), parts);
  auto measured = [&](std::vector<c10::Device> devices) {
    // The workspaces earlier pipelines' streams left with cuBLAS are on the device too: given
    // back, the device's peak is this pipeline's alone.
    stages::cuda::release_blas_workspaces(gpu);
    auto layers = model();
    auto o = options_for({kind, parts / 2}, devices);
    o.microbatches = m;
    pipeline pipe(sys, layers, cut, o);
    pipe.train_step(x, t);
    return pipe.train_step(x, t).stages; // the second: cuBLAS started in the first
  };
  auto cpu_run = measured({cpu, cpu});
  auto gpu_first = measured({gpu, cpu});
  auto gpu_last = measured({cpu, gpu});
  auto shared = measured({gpu, gpu});

  profile_options po;
  po.repeats = 2;
  po.device = gpu;
  auto layers = model();
  auto profile = profile_layers(layers, x.slice(0, 0, 64 / m), po);
  auto plan = make_schedule(kind, 2, m, parts / 2);
  std::vector<int64_t> workspaces;
  for (std::size_t s = 0; s < 2; ++s) {
    CAPTURE(s);
    const auto& on_gpu = (s == 0 ? gpu_first : gpu_last).at(s);
    auto predicted = stage_memory(profile, cut, plan, s, 1.0, 0.0);
    workspaces.push_back(predicted.workspace);
    CHECK(on_gpu.peak_stash_bytes > 0);
    CHECK(static_cast<double>(on_gpu.peak_stash_bytes) ==
          doctest::Approx(static_cast<double>(predicted.activations)).epsilon(0.05));
    // The same tensors are kept on the CPU (the allocation tally) as on the GPU.
    CHECK(static_cast<double>(on_gpu.peak_stash_bytes) ==
          doctest::Approx(static_cast<double>(cpu_run.at(s).peak_stash_bytes)).epsilon(0.05));
    // The device's peak holds at least the parameters, their gradients and the stash, and is
    // what the planner predicts in all (with one action's working set and cuBLAS's workspaces,
    // the optimizer's state as measured) within 5%.
    CHECK(on_gpu.device_peak_bytes >=
          predicted.parameters + predicted.gradients + on_gpu.peak_stash_bytes);
    CHECK(predicted.working > 0);
    CHECK(predicted.workspace > 0);
    auto total = predicted.total() - predicted.optimizer + on_gpu.optimizer_bytes;
    CAPTURE(predicted.working);
    CAPTURE(predicted.workspace);
    CAPTURE(on_gpu.device_peak_bytes);
    CHECK(static_cast<double>(on_gpu.device_peak_bytes) ==
          doctest::Approx(static_cast<double>(total)).epsilon(0.05));
    CHECK(on_gpu.peak_working_bytes == -1); // the device's peak counts it there
    CHECK(cpu_run.at(s).peak_working_bytes > 0);
    CHECK(cpu_run.at(s).device_peak_bytes == -1);
    // Sharing the GPU, each stage counts what its own thread allocated; the device's peak is
    // no stage's alone.
    CHECK(static_cast<double>(shared.at(s).peak_stash_bytes) ==
          doctest::Approx(static_cast<double>(on_gpu.peak_stash_bytes)).epsilon(0.01));
    CHECK(shared.at(s).device_peak_bytes == -1);
  }
  return workspaces;
}

} // namespace

TEST_CASE("gpu: a stage alone on a GPU measures its stash and the device's peak from the caching "
          "allocator, as the planner predicts (working set and workspaces too), and stages "
          "sharing a GPU measure their own stash") {
  require_gpu();
  check_device_peak(schedule_kind::one_f_one_b, 2);
}

TEST_CASE("gpu: under DualPipeV each chunk's stream keeps cuBLAS workspaces of its own, and the "
          "device's peak is as the planner predicts") {
  require_gpu();
  // Four parts in a V: stage 0 holds [flatten, fc1] and [fc3], two chunks that multiply
  // matrices, each on its stream; stage 1 holds [relu1, fc2] and [relu2], one.
  auto v = check_device_peak(schedule_kind::dualpipe_v, 4);
  CHECK(v[0] == 2 * v[1]);
}

TEST_CASE("gpu: DualPipeV's chunks on streams of their own train a tied gpt as one stream does, "
          "bit for bit") {
  require_gpu();
  engine sys;
  auto [x, y] = tokens(16, 8, 5);
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> parameters;
  std::vector<double> losses;
  for (bool streams : {true, false}) {
    CAPTURE(streams);
    auto layers = test_gpt(tiny_vocabulary, 4, 32, 8, 9);
    auto o = options_for({schedule_kind::dualpipe_v, 2}, {gpu, gpu});
    o.loss = builtin_loss("cross_entropy");
    o.chunk_streams = streams;
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 4), o);
    for (int step = 0; step < 3; ++step) {
      losses.push_back(pipe.train_step(x, y).loss);
    }
    parameters.push_back(to_cpu(pipe.named_parameters()));
  }
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(losses[i] == losses[i + 3]);
  }
  check_close(parameters[0], parameters[1], 0, 0);
}

TEST_CASE("gpu: CUDA graphs (captured in the third step, replayed after) train every schedule as "
          "eager does on the GPU, a shorter last micro-batch eagerly") {
  require_gpu();
  engine sys;
  torch::manual_seed(4);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> data;
  for (int64_t n : {10, 10, 10, 10, 9, 10}) {
    data.emplace_back(torch::randn({n, 1, 4, 4}), torch::randn({n, 3}));
  }
  for (auto s : every_schedule()) {
    CAPTURE(to_string(s.kind));
    std::vector<std::vector<double>> losses;
    std::vector<std::vector<std::pair<std::string, torch::Tensor>>> parameters;
    for (auto graphs : {cuda_graph_mode::off, cuda_graph_mode::on}) {
      auto layers = tiny_mlp();
      auto o = options_for(s, {gpu, gpu});
      o.microbatches = microbatches_for(s.kind, 2, 4);
      o.cuda_graphs = graphs;
      pipeline pipe(sys, layers, partition_uniform(layers.size(), 2 * s.chunks), o);
      losses.emplace_back();
      for (const auto& [x, t] : data) {
        losses.back().push_back(pipe.train_step(x, t).loss);
      }
      parameters.push_back(to_cpu(pipe.named_parameters()));
    }
    for (std::size_t i = 0; i < data.size(); ++i) {
      CAPTURE(i);
      CHECK(losses[1][i] == doctest::Approx(losses[0][i]).epsilon(1e-6));
    }
    check_close(parameters[1], parameters[0], 1e-6, 1e-7);
  }
}

TEST_CASE("gpu: CUDA graphs draw dropout's masks from the registered generator: a gpt with "
          "dropout, its first stage on the GPU, trains under graphs as eager does") {
  require_gpu();
  engine sys;
  auto [x, y] = random_tokens(32, 8, 6, 5);
  std::vector<double> losses[2];
  for (int g = 0; g < 2; ++g) {
    torch::manual_seed(9);
    stages::default_generator(gpu).set_current_seed(9);
    model_options m;
    m.vocabulary = 32;
    m.layers = 2;
    m.heads = 2;
    m.width = 16;
    m.context = 6;
    m.dropout = 0.1;
    auto layers = make_model("gpt", m);
    pipeline_options o;
    o.microbatches = 2;
    o.loss = builtin_loss("cross_entropy");
    o.optimizer = adam(1e-3);
    o.devices = {gpu, cpu}; // one thread draws from the GPU's generator, as eager's order needs
    o.cuda_graphs = g == 0 ? cuda_graph_mode::off : cuda_graph_mode::on;
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
    for (int step = 0; step < 5; ++step) {
      losses[g].push_back(pipe.train_step(x, y).loss);
    }
  }
  for (std::size_t i = 0; i < losses[0].size(); ++i) {
    CAPTURE(i);
    CHECK(losses[1][i] == doctest::Approx(losses[0][i]).epsilon(1e-5));
  }
}
