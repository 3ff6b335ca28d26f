// Synchronised batch norm across replicas: each micro-batch normalised as one BatchNorm2d over
// every replica's part, one update of the running statistics per step.
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <actorpipe/batch_norm.hpp>
#include <actorpipe/data.hpp>

#include "replicas_fixtures.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

namespace {

// conv -> batch norm -> relu -> flatten -> linear, over 1x4x4 inputs.
layer_list conv_bn_model(torch::nn::AnyModule bn, uint64_t seed = 11) {
  torch::manual_seed(seed);
  layer_list layers;
  layers.emplace_back(
    "conv", torch::nn::AnyModule(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1))));
  layers.emplace_back("bn", std::move(bn));
  layers.emplace_back("relu", torch::nn::AnyModule(torch::nn::ReLU()));
  layers.emplace_back("flatten", [](const torch::Tensor& x) { return x.flatten(1); });
  layers.emplace_back("fc", torch::nn::AnyModule(torch::nn::Linear(4 * 4 * 4, 3)));
  return layers;
}

layer_list sync_bn_model() {
  return conv_bn_model(torch::nn::AnyModule(DeferredBatchNorm2d(4)));
}

// What SyncBatchNorm over R replicas of m micro-batches computes, in plain libtorch: micro-batch
// k of every replica together (the batch split as replicated_pipeline and pipeline split it)
// through one torch::nn::BatchNorm2d, the losses weighted by their samples.
struct sync_bn_reference {
  layer_list layers = conv_bn_model(torch::nn::AnyModule(torch::nn::BatchNorm2d(4)));
  plain_model plain{layers, sgd(0.1, 0.9)};

  double step(const torch::Tensor& x, const torch::Tensor& t, int64_t replicas,
              int64_t microbatches) {
    auto xs = torch::tensor_split(x, replicas, 0);
    auto ts = torch::tensor_split(t, replicas, 0);
    std::vector<std::vector<torch::Tensor>> gx(static_cast<std::size_t>(microbatches));
    std::vector<std::vector<torch::Tensor>> gt(gx.size());
    for (int64_t r = 0; r < replicas; ++r) {
      auto mx = torch::tensor_split(xs[static_cast<std::size_t>(r)], microbatches, 0);
      auto mt = torch::tensor_split(ts[static_cast<std::size_t>(r)], microbatches, 0);
      for (std::size_t k = 0; k < gx.size(); ++k) {
        gx[k].push_back(mx[k]);
        gt[k].push_back(mt[k]);
      }
    }
    plain.optimizer->zero_grad();
    auto total = torch::zeros({});
    for (std::size_t k = 0; k < gx.size(); ++k) {
      auto xk = torch::cat(gx[k]);
      auto weight = static_cast<double>(xk.size(0)) / static_cast<double>(x.size(0));
      total = total + mse(run_layers(layers, xk), torch::cat(gt[k])) * weight;
    }
    total.backward();
    plain.optimizer->step();
    return total.item<double>();
  }
};

std::vector<torch::Tensor> bn_buffers(const layer_list& layers) {
  std::vector<torch::Tensor> out;
  for (const auto& b : layers[1].module()->buffers()) {
    out.push_back(b.clone());
  }
  return out;
}

} // namespace

TEST_CASE("synchronised batch norm: R replicas normalise each micro-batch as one BatchNorm2d over "
          "all replicas' micro-batches together, for every schedule, recomputation, 2 and 4 "
          "replicas, even and uneven batches") {
  engine sys;
  struct setting {
    std::size_t replicas;
    std::size_t microbatches;
    schedule_setting schedule;
    recompute_mode recompute;
    int64_t batch;
  };
  std::vector<setting> settings{
    {2, 1, {schedule_kind::one_f_one_b, 1}, recompute_mode::never, 8},
    {2, 2, {schedule_kind::gpipe, 1}, recompute_mode::never, 9},
    {2, 3, {schedule_kind::zb_h1, 1}, recompute_mode::never, 12},
    {2, 2, {schedule_kind::interleaved, 2}, recompute_mode::never, 8},
    {2, 2, {schedule_kind::one_f_one_b, 1}, recompute_mode::always, 10},
    {4, 2, {schedule_kind::one_f_one_b, 1}, recompute_mode::never, 16},
    {4, 1, {schedule_kind::zb_h1, 1}, recompute_mode::except_last, 13},
  };
  for (const auto& c : settings) {
    CAPTURE(c.replicas);
    CAPTURE(c.microbatches);
    CAPTURE(to_string(c.schedule.kind));
    CAPTURE(to_string(c.recompute));
    CAPTURE(c.batch);
    auto o = mlp_options(c.microbatches);
    o.schedule = c.schedule.kind;
    o.chunks = c.schedule.chunks;
    o.recompute = c.recompute;
    o.data_parallel.sync_batch_norm = true;
    o.data_parallel.buffers = buffer_sync::none; // the running statistics must agree by themselves
    std::vector<layer_list> handles(c.replicas);
    std::mutex m;
    std::size_t built = 0;
    replicated_pipeline replicas(
      sys,
      [&] {
        auto layers = sync_bn_model();
        std::lock_guard<std::mutex> g{m};
        handles[built++] = layers;
        return layers;
      },
      partition_uniform(5, 2 * c.schedule.chunks), o, c.replicas);
    sync_bn_reference reference;
    torch::manual_seed(5);
    for (int step = 0; step < 3; ++step) {
      auto x = torch::randn({c.batch, 1, 4, 4}) * 2 + 0.5;
      auto t = torch::randn({c.batch, 3});
      auto r = replicas.train_step(x, t);
      auto expected = reference.step(x, t, static_cast<int64_t>(c.replicas),
                                     static_cast<int64_t>(c.microbatches));
      CHECK(r.loss == doctest::Approx(expected).epsilon(1e-5));
    }
    for (std::size_t rank = 0; rank < c.replicas; ++rank) {
      CAPTURE(rank);
      check_close(replicas.replica(rank).named_parameters(), named(reference.layers, false), 1e-4,
                  1e-6);
      auto got = bn_buffers(handles[rank]);
      auto want = bn_buffers(reference.layers);
      REQUIRE(got.size() == want.size());
      CHECK(torch::allclose(got[0], want[0], 1e-4, 1e-6));
      CHECK(torch::allclose(got[1], want[1], 1e-4, 1e-6));
      CHECK(torch::equal(got[2], want[2]));
    }
    // Eval after training: the running statistics, as BatchNorm2d.
    auto x = torch::randn({5, 1, 4, 4});
    torch::NoGradGuard no_grad;
    for (auto& l : reference.layers) {
      if (auto mod = l.module()) {
        mod->eval();
      }
    }
    CHECK(torch::allclose(replicas.forward(x), run_layers(reference.layers, x), 1e-4, 1e-5));
  }
}

TEST_CASE("synchronised and deferred batch norm: one update of the running statistics per step, "
          "from the whole replicated batch") {
  engine sys;
  auto o = mlp_options(3);
  o.data_parallel.sync_batch_norm = true;
  o.data_parallel.buffers = buffer_sync::none;
  std::vector<layer_list> handles;
  std::mutex m;
  replicated_pipeline replicas(
    sys,
    [&] {
      auto layers = sync_bn_model();
      REQUIRE(set_deferred_batch_norm(layers, true) == 1);
      std::lock_guard<std::mutex> g{m};
      handles.push_back(layers);
      return layers;
    },
    partition_uniform(5, 2), o, 2);
  auto x = torch::randn({12, 1, 4, 4}) * 3 + 1;
  auto t = torch::randn({12, 3});
  replicas.train_step(x, t);
  // Plain libtorch: one forward over the whole batch.
  auto plain = conv_bn_model(torch::nn::AnyModule(torch::nn::BatchNorm2d(4)));
  run_layers(plain, x);
  auto want = bn_buffers(plain);
  for (const auto& layers : handles) {
    auto got = bn_buffers(layers);
    CHECK(torch::allclose(got[0], want[0], 1e-5, 1e-6));
    CHECK(torch::allclose(got[1], want[1], 1e-5, 1e-6));
    CHECK(torch::equal(got[2], want[2]));
  }
}

TEST_CASE("synchronised batch norm refuses a batch norm that cannot synchronise, or a model "
          "without one, naming it") {
  engine sys;
  auto o = mlp_options(1);
  o.data_parallel.sync_batch_norm = true;
  try {
    pipeline pipe(sys, bn_model(1), partition_uniform(4, 2), o);
    FAIL("a torch::nn::BatchNorm1d was accepted");
  } catch (const invalid_argument& e) {
    INFO(std::string(e.what()));
    CHECK(std::string(e.what()).find("'bn' (torch::nn::BatchNorm1d)") != std::string::npos);
    CHECK(std::string(e.what()).find("DeferredBatchNorm2d") != std::string::npos);
  }
  try {
    pipeline pipe(sys, tiny_mlp(1), partition_uniform(6, 2), o);
    FAIL("a model without batch norm was accepted");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("no batch norm") != std::string::npos);
  }
}
