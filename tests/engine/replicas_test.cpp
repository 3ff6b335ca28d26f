// Data parallelism: replicas of a pipeline average gradients per stage over c10d (Gloo).
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <actorpipe/batch_norm.hpp>
#include <actorpipe/data.hpp>

#include "oracle.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

namespace {

pipeline_options mlp_options(std::size_t microbatches) {
  pipeline_options o;
  o.microbatches = microbatches;
  o.loss = mse;
  o.optimizer = sgd(0.1, 0.9);
  o.data_parallel.timeout = std::chrono::milliseconds(20000);
  return o;
}

// A small model with batch norm, for the buffer modes.
layer_list bn_model(uint64_t seed) {
  torch::manual_seed(seed);
  layer_list layers;
  layers.emplace_back("flatten", [](const torch::Tensor& x) { return x.flatten(1); });
  layers.emplace_back("fc1", torch::nn::AnyModule(torch::nn::Linear(16, 6)));
  layers.emplace_back("bn", torch::nn::AnyModule(torch::nn::BatchNorm1d(6)));
  layers.emplace_back("fc2", torch::nn::AnyModule(torch::nn::Linear(6, 3)));
  return layers;
}

torch::Tensor running_mean(const layer_list& layers) {
  for (const auto& l : layers) {
    if (l.name() == "bn") {
      return l.module()->named_buffers()["running_mean"].clone();
    }
  }
  return {};
}

} // namespace

TEST_CASE("2 replicas x 2 stages in one process step exactly like plain libtorch on the whole "
          "batch, for even and uneven batches") {
  engine sys;
  for (int64_t batch : {8, 9}) {
    CAPTURE(batch);
    auto o = mlp_options(2);
    replicated_pipeline replicas(
      sys, [] { return tiny_mlp(1); }, partition_uniform(6, 2), o, 2);
    plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
    for (int step = 0; step < 3; ++step) {
      auto x = torch::randn({batch, 1, 4, 4});
      auto t = torch::randn({batch, 3});
      auto r = replicas.train_step(x, t);
      auto plain_loss = plain.step(x, t);
      CHECK(r.loss == doctest::Approx(plain_loss).epsilon(1e-6));
      for (const auto& s : r.stages) {
        CHECK(s.sync_end_ms >= s.sync_start_ms);
        CHECK(s.sync_bytes > 0);
      }
    }
    check_close(replicas.replica(0).named_parameters(), named(plain.layers, false));
    check_close(replicas.replica(1).named_parameters(), named(plain.layers, false));
    check_close(replicas.replica(1).named_gradients(), named(plain.layers, true));
  }
}

TEST_CASE("replicas start from rank 0's parameters whatever their own seeds") {
  engine sys;
  int built = 0;
  auto o = mlp_options(1);
  replicated_pipeline replicas(
    sys, [&] { return tiny_mlp(static_cast<uint64_t>(++built)); }, partition_uniform(6, 3), o, 3);
  REQUIRE(built == 3);
  auto reference = named(tiny_mlp(1), false);
  for (std::size_t r = 0; r < 3; ++r) {
    CAPTURE(r);
    check_close(replicas.replica(r).named_parameters(), reference, 0, 0);
  }
}

TEST_CASE("buffers: broadcast gives rank 0's running statistics, average their mean") {
  engine sys;
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randn({8, 3});
  auto halves_x = torch::tensor_split(x, 2, 0);
  // What each replica's batch norm records on its half, from the same start.
  std::vector<torch::Tensor> alone;
  for (int r = 0; r < 2; ++r) {
    auto layers = bn_model(3);
    run_layers(layers, halves_x[static_cast<std::size_t>(r)]);
    alone.push_back(running_mean(layers));
  }
  for (auto mode : {buffer_sync::broadcast, buffer_sync::average}) {
    // One micro-batch: each replica's batch norm then sees its half once, as `alone` did.
    auto o = mlp_options(1);
    o.data_parallel.buffers = mode;
    std::vector<layer_list> handles;
    std::mutex m;
    replicated_pipeline replicas(
      sys,
      [&] {
        auto layers = bn_model(3);
        std::lock_guard<std::mutex> g{m};
        handles.push_back(layers);
        return layers;
      },
      partition_uniform(4, 2), o, 2);
    replicas.train_step(x, t);
    auto expected = mode == buffer_sync::broadcast ? alone[0] : (alone[0] + alone[1]) / 2;
    for (const auto& layers : handles) {
      CHECK(torch::allclose(running_mean(layers), expected, 1e-5, 1e-6));
    }
  }
}

TEST_CASE("global gradient-norm clipping matches torch::nn::utils::clip_grad_norm_, with and "
          "without replicas") {
  engine sys;
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randn({8, 3}) * 10;
  auto o = mlp_options(2);
  o.max_grad_norm = 0.05;
  pipeline single(sys, tiny_mlp(1), partition_uniform(6, 3), o);
  replicated_pipeline replicas(
    sys, [] { return tiny_mlp(1); }, partition_uniform(6, 2), o, 2);

  auto layers = tiny_mlp(1);
  std::vector<torch::Tensor> params;
  for (const auto& l : layers) {
    if (auto mod = l.module()) {
      for (auto& p : mod->parameters()) {
        params.push_back(p);
      }
    }
  }
  auto optimizer = sgd(0.1, 0.9)(params);
  auto loss = mse(run_layers(layers, x), t);
  loss.backward();
  auto norm = torch::nn::utils::clip_grad_norm_(params, 0.05);
  optimizer->step();
  REQUIRE(norm > 0.05); // the test clips for real

  auto a = single.train_step(x, t);
  auto b = replicas.train_step(x, t);
  CHECK(a.grad_norm == doctest::Approx(norm).epsilon(1e-5));
  CHECK(b.grad_norm == doctest::Approx(norm).epsilon(1e-5));
  check_close(single.named_parameters(), named(layers, false));
  check_close(replicas.replica(1).named_parameters(), named(layers, false));
}

TEST_CASE("a rank that never arrives fails the others at the rendezvous, naming it") {
  auto o = mlp_options(1);
  o.data_parallel.replicas = 3;
  o.data_parallel.rank = 0;
  o.data_parallel.local = make_local_rendezvous();
  o.data_parallel.timeout = std::chrono::milliseconds(800);
  engine sys;
  auto start = std::chrono::steady_clock::now();
  auto o1 = o;
  o1.data_parallel.rank = 1;
  auto other = std::async(std::launch::async, [&] {
    return std::make_unique<pipeline>(sys, tiny_mlp(), partition_uniform(6, 2), o1);
  });
  std::string message;
  try {
    pipeline p(sys, tiny_mlp(), partition_uniform(6, 2), o);
  } catch (const pipeline_error& e) {
    message = e.what();
  }
  CHECK(message.find("rank 2 of 3 did not arrive") != std::string::npos);
  CHECK_THROWS_AS(other.get(), pipeline_error);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));

  // Over TCP: nobody serves the store.
  auto tcp = mlp_options(1);
  tcp.data_parallel.replicas = 2;
  tcp.data_parallel.rank = 1;
  tcp.data_parallel.master_port = 1; // nobody listens on port 1
  tcp.data_parallel.timeout = std::chrono::milliseconds(800);
  CHECK_THROWS_WITH_AS(pipeline(sys, tiny_mlp(), partition_uniform(6, 2), tcp),
                       doctest::Contains("cannot reach the rendezvous store of rank 0 at "
                                         "127.0.0.1:1"),
                       pipeline_error);
}

namespace {

// Replicas 0 and 1 of tiny_mlp(1) in 2 stages (mlp_options(2)), as pipelines of their own at a
// fresh rendezvous with the collectives' `timeout`, built at once (each waits for the other).
std::pair<std::unique_ptr<pipeline>, std::unique_ptr<pipeline>>
two_replicas(engine& sys, std::chrono::milliseconds timeout) {
  auto o = mlp_options(2);
  o.data_parallel.replicas = 2;
  o.data_parallel.local = make_local_rendezvous();
  o.data_parallel.timeout = timeout;
  std::vector<std::future<std::unique_ptr<pipeline>>> building;
  for (std::size_t r = 0; r < 2; ++r) {
    auto ro = o;
    ro.data_parallel.rank = r;
    auto layers = tiny_mlp(1); // here: the seeded draws of two threads would interleave
    building.push_back(std::async(std::launch::async, [&sys, ro, layers] {
      return std::make_unique<pipeline>(sys, layers, partition_uniform(6, 2), ro);
    }));
  }
  auto p0 = building[0].get();
  return {std::move(p0), building[1].get()};
}

} // namespace

TEST_CASE("a replica that fails its step fails the other within the deadline, and no parameter "
          "changes") {
  engine sys;
  auto [p0, p1] = two_replicas(sys, std::chrono::milliseconds(1500));
  auto before = p0->named_parameters();
  auto start = std::chrono::steady_clock::now();
  auto good = p0->train_step_async(torch::randn({4, 1, 4, 4}), torch::randn({4, 3}));
  // Replica 1's targets have the wrong width: its last stage fails in the loss.
  auto bad = p1->train_step_async(torch::randn({4, 1, 4, 4}), torch::randn({4, 5}));
  CHECK_THROWS_AS(bad.get(), pipeline_error);
  std::string message;
  try {
    good.get();
  } catch (const pipeline_error& e) {
    message = e.what();
  }
  CAPTURE(message);
  CHECK(message.find("data parallel rank 0 of 2") != std::string::npos);
  CHECK(message.find("all-reduce") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(15));
  check_close(p0->named_parameters(), before, 0, 0);
  check_close(p1->named_parameters(), before, 0, 0);
}

TEST_CASE("a replica's failed step ends the other's at once, not at the deadline, their groups "
          "refuse further steps by name, and replicas built again train like plain libtorch") {
  engine sys;
  auto [p0, p1] = two_replicas(sys, std::chrono::milliseconds(30000));
  auto before = p0->named_parameters();
  auto start = std::chrono::steady_clock::now();
  auto good = p0->train_step_async(torch::randn({4, 1, 4, 4}), torch::randn({4, 3}));
  // Replica 1's targets have the wrong width: its last stage fails in the loss, and replica
  // 0's stages wait in their all-reduces for replica 1's, which never come.
  auto bad = p1->train_step_async(torch::randn({4, 1, 4, 4}), torch::randn({4, 5}));
  CHECK_THROWS_AS(bad.get(), pipeline_error);
  try {
    good.get();
    FAIL("replica 0's step succeeded without replica 1's");
  } catch (const pipeline_error& e) {
    std::string message = e.what();
    CAPTURE(message);
    CHECK(e.kind() == error_kind::replica_failure);
    CHECK(message.find("data parallel rank 0 of 2: ") != std::string::npos);
    CHECK(message.find("another replica's step failed (rank 1, step 1: stage 1, microbatch 0: "
                       "the loss function failed") != std::string::npos);
  }
  // At the announcement, not at the 30 s deadline; and nothing changed.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  check_close(p0->named_parameters(), before, 0, 0);
  check_close(p1->named_parameters(), before, 0, 0);
  // Their groups may hold a collective replica 1 never joined: refused by name, at once.
  start = std::chrono::steady_clock::now();
  auto again0 = p0->train_step_async(torch::randn({4, 1, 4, 4}), torch::randn({4, 3}));
  auto again1 = p1->train_step_async(torch::randn({4, 1, 4, 4}), torch::randn({4, 3}));
  for (auto* f : {&again0, &again1}) {
    try {
      f->get();
      FAIL("a step ran on an abandoned replica group");
    } catch (const pipeline_error& e) {
      // At its first collective (or, once abandoned, any): the failure of step 1 named.
      CHECK(std::string(e.what()).find("abandoned") != std::string::npos);
      CHECK(std::string(e.what()).find("another replica's step failed (rank 1, step 1: ") !=
            std::string::npos);
    }
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  // Built again (at a new rendezvous), the replicas step as plain libtorch on their batches
  // together.
  p0.reset();
  p1.reset();
  std::tie(p0, p1) = two_replicas(sys, std::chrono::milliseconds(30000));
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    auto x = torch::randn({8, 1, 4, 4});
    auto t = torch::randn({8, 3});
    auto a = p0->train_step_async(x.slice(0, 0, 4), t.slice(0, 0, 4));
    auto b = p1->train_step_async(x.slice(0, 4, 8), t.slice(0, 4, 8));
    auto loss = a.get().loss;
    b.get();
    CHECK(loss == doctest::Approx(plain.step(x, t)).epsilon(1e-6));
  }
  check_close(p0->named_parameters(), named(plain.layers, false));
  check_close(p1->named_parameters(), named(plain.layers, false));
}

TEST_CASE("the distributed sampler gives every rank an equal share and every sample once") {
  for (int64_t n : {10, 11, 7}) {
    for (int64_t replicas : {1, 2, 3}) {
      CAPTURE(n);
      CAPTURE(replicas);
      std::multiset<int64_t> seen;
      int64_t share = (n + replicas - 1) / replicas;
      for (int64_t r = 0; r < replicas; ++r) {
        auto order = distributed_order(n, 5, 2, r, replicas);
        REQUIRE(order.size(0) == share);
        for (int64_t i = 0; i < share; ++i) {
          seen.insert(order[i].item<int64_t>());
        }
      }
      std::set<int64_t> distinct(seen.begin(), seen.end());
      CHECK(distinct.size() == static_cast<std::size_t>(n));            // every sample
      CHECK(seen.size() == static_cast<std::size_t>(share * replicas)); // plus the padding
      CHECK(static_cast<int64_t>(seen.size()) - n < replicas);
    }
  }
  // Epoch-seeded: the same epoch gives the same order, the next another.
  CHECK(torch::equal(distributed_order(100, 5, 1, 0, 2), distributed_order(100, 5, 1, 0, 2)));
  CHECK_FALSE(torch::equal(distributed_order(100, 5, 1, 0, 2), distributed_order(100, 5, 2, 0, 2)));
  CHECK_THROWS_AS(distributed_order(10, 0, 0, 2, 2), invalid_argument);
}

TEST_CASE("deferred batch norm records the whole batch's running statistics, once per step") {
  // conv -> batch norm -> relu -> pool -> flatten -> linear, with the given batch-norm module.
  auto build = [](torch::nn::AnyModule bn) {
    torch::manual_seed(11);
    layer_list layers;
    layers.emplace_back("conv", torch::nn::AnyModule(
                                  torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1))));
    layers.emplace_back("bn", std::move(bn));
    layers.emplace_back("relu", torch::nn::AnyModule(torch::nn::ReLU()));
    layers.emplace_back("flatten", [](const torch::Tensor& x) { return x.flatten(1); });
    layers.emplace_back("fc", torch::nn::AnyModule(torch::nn::Linear(4 * 4 * 4, 3)));
    return layers;
  };
  auto stats = [](const layer_list& layers) {
    auto buffers = layers[1].module()->named_buffers();
    return std::vector<torch::Tensor>{buffers["running_mean"].clone(),
                                      buffers["running_var"].clone(),
                                      buffers["num_batches_tracked"].clone()};
  };
  auto x = torch::randn({12, 1, 4, 4}) * 3 + 1;
  auto t = torch::randn({12, 3});

  // Plain libtorch: one forward over the whole batch.
  auto plain = build(torch::nn::AnyModule(torch::nn::BatchNorm2d(4)));
  run_layers(plain, x);
  auto expected = stats(plain);

  engine sys;
  for (bool deferred : {true, false}) {
    CAPTURE(deferred);
    DeferredBatchNorm2d bn(4);
    auto layers = build(torch::nn::AnyModule(bn));
    REQUIRE(set_deferred_batch_norm(layers, deferred) == 1);
    auto o = mlp_options(4); // 4 micro-batches of 3
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
    pipe.train_step(x, t);
    auto got = stats(layers);
    bool same = torch::allclose(got[0], expected[0], 1e-5, 1e-6) &&
                torch::allclose(got[1], expected[1], 1e-5, 1e-6) &&
                torch::equal(got[2], expected[2]);
    // Not deferred, each micro-batch updates the statistics: 4 updates of a different kind.
    CHECK(same == deferred);
    if (!deferred) {
      CHECK(got[2].item<int64_t>() == 4);
    }
  }

  // Eval after training uses the running statistics, as BatchNorm2d does.
  DeferredBatchNorm2d a(4);
  torch::nn::BatchNorm2d b(4);
  a->deferred = true;
  a->eval();
  b->eval();
  auto y = torch::randn({2, 4, 3, 3});
  CHECK(torch::allclose(a(y), b(y)));
}

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

TEST_CASE("replicas agree on a value at a barrier, or every rank hears who differs or who is "
          "missing") {
  engine sys;
  auto o = mlp_options(1);
  o.data_parallel.timeout = std::chrono::milliseconds(500);
  replicated_pipeline replicas(
    sys, [] { return tiny_mlp(1); }, partition_uniform(6, 2), o, 2);
  auto both = [&](int64_t v0, int64_t v1, const std::string& what) {
    auto a = std::async(std::launch::async, [&] { replicas.replica(0).replicas_agree(what, v0); });
    auto b = std::async(std::launch::async, [&] { replicas.replica(1).replicas_agree(what, v1); });
    std::vector<std::string> errors;
    for (auto* f : {&a, &b}) {
      try {
        f->get();
      } catch (const pipeline_error& e) {
        CHECK(e.kind() == error_kind::replica_failure);
        errors.emplace_back(e.what());
      }
    }
    return errors;
  };
  CHECK(both(3, 3, "the step to resume from").empty());
  auto differ = both(1, 2, "the end of epoch 1");
  REQUIRE(differ.size() == 2);
  for (const auto& e : differ) {
    INFO(e);
    CHECK(e.find("the ranks disagree on the end of epoch 1 (rank 0: 1, rank 1: 2)") !=
          std::string::npos);
  }
  // Rank 1 never comes: rank 0 names it at the deadline.
  auto start = std::chrono::steady_clock::now();
  try {
    replicas.replica(0).replicas_agree("the end of epoch 2", 2);
    FAIL("the barrier passed without rank 1");
  } catch (const pipeline_error& e) {
    INFO(std::string(e.what()));
    CHECK(std::string(e.what()).find("rank 1 of 2 did not arrive at the end of epoch 2 within "
                                     "500 ms") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  // Without replicas it is a no-op.
  pipeline alone(sys, tiny_mlp(1), partition_uniform(6, 2), mlp_options(1));
  alone.replicas_agree("anything", 1);
}

namespace {

// Caffe2's Parallelize_BMUF written out for R plain libtorch models, as its comments state it:
// each model steps its own SGD; after the warm-up every model takes model 0's parameters; after
// each block, per parameter, v = mu v + lr_b (mean(x) - g), g = g + v (Nesterov: g = g - mu (v -
// v_prev), v_prev = v), and every model's x = g; reset_momentum zeroes the SGD momentum buffers.
struct bmuf_reference {
  std::vector<std::unique_ptr<plain_model>> models;
  bmuf_options o;
  double mu;
  std::vector<torch::Tensor> global, momentum, previous;
  int64_t position = 0;
  bool warm;

  bmuf_reference(std::size_t replicas, const bmuf_options& options)
    : o(options), mu(options.block_momentum < 0 ? 1.0 - 1.0 / static_cast<double>(replicas)
                                                : options.block_momentum),
      warm(options.warmup_steps == 0) {
    for (std::size_t r = 0; r < replicas; ++r) {
      models.push_back(std::make_unique<plain_model>(tiny_mlp(1), sgd(0.1, 0.9)));
    }
    start();
  }
  std::vector<torch::Tensor> params(std::size_t r) const {
    return models[r]->optimizer->param_groups().front().params();
  }
  void start() {
    global.clear();
    momentum.clear();
    previous.clear();
    for (const auto& p : params(0)) {
      global.push_back(p.detach().clone());
      momentum.push_back(torch::zeros_like(p));
      previous.push_back(torch::zeros_like(p));
    }
  }
  // One step of every model on its part of the batch; model 0's loss.
  double step(const torch::Tensor& x, const torch::Tensor& t) {
    auto xs = torch::tensor_split(x, static_cast<int64_t>(models.size()), 0);
    auto ts = torch::tensor_split(t, static_cast<int64_t>(models.size()), 0);
    double first = 0;
    for (std::size_t r = 0; r < models.size(); ++r) {
      auto loss = models[r]->step(xs[r], ts[r]);
      first = r == 0 ? loss : first;
    }
    ++position;
    if (position == (warm ? o.block_steps : o.warmup_steps)) {
      end_block();
    }
    return first;
  }
  void end_block() {
    torch::NoGradGuard no_grad;
    if (!warm) {
      for (std::size_t r = 1; r < models.size(); ++r) {
        for (std::size_t i = 0; i < global.size(); ++i) {
          params(r)[i].copy_(params(0)[i]);
        }
      }
      start();
      warm = true;
    } else if (position > 0) {
      for (std::size_t i = 0; i < global.size(); ++i) {
        auto mean = torch::zeros_like(global[i]);
        for (std::size_t r = 0; r < models.size(); ++r) {
          mean += params(r)[i];
        }
        mean /= static_cast<double>(models.size());
        momentum[i] = mu * momentum[i] + o.block_lr * (mean - global[i]);
        global[i] = global[i] + momentum[i];
        if (o.nesterov) {
          global[i] = global[i] - mu * (momentum[i] - previous[i]);
          previous[i] = momentum[i].clone();
        }
        for (std::size_t r = 0; r < models.size(); ++r) {
          params(r)[i].copy_(global[i]);
        }
      }
    }
    if (o.reset_momentum) {
      for (auto& m : models) {
        for (auto& [key, state] : m->optimizer->state()) {
          static_cast<torch::optim::SGDParamState&>(*state).momentum_buffer().zero_();
        }
      }
    }
    position = 0;
  }
};

} // namespace

TEST_CASE("BMUF: replicas train alone for a block, then average with block momentum, like a "
          "reference implementation of Caffe2's algorithm") {
  struct setting {
    std::size_t replicas;
    bmuf_options bmuf;
  };
  std::vector<setting> settings(3);
  settings[0] = {2, {}};
  settings[0].bmuf.block_steps = 2; // block lr 1, block momentum 1 - 1/2
  settings[1] = {3, {}};
  settings[1].bmuf.block_steps = 3;
  settings[1].bmuf.block_lr = 0.8;
  settings[1].bmuf.block_momentum = 0.6;
  settings[1].bmuf.nesterov = true;
  settings[1].bmuf.reset_momentum = true;
  settings[2] = {2, {}};
  settings[2].bmuf.block_steps = 2;
  settings[2].bmuf.warmup_steps = 2;
  settings[2].bmuf.nesterov = true;
  engine sys;
  for (const auto& [replicas, bmuf] : settings) {
    CAPTURE(replicas);
    CAPTURE(bmuf.block_steps);
    CAPTURE(bmuf.warmup_steps);
    auto o = mlp_options(2);
    o.data_parallel.bmuf = bmuf;
    replicated_pipeline pipes(
      sys, [] { return tiny_mlp(1); }, partition_uniform(6, 2), o, replicas);
    bmuf_reference reference(replicas, bmuf);
    // 7 steps: blocks end inside the run, and end_block ends the last, partial one.
    for (int step = 0; step < 7; ++step) {
      auto x = torch::randn({4 * static_cast<int64_t>(replicas), 1, 4, 4});
      auto t = torch::randn({4 * static_cast<int64_t>(replicas), 3});
      auto r = pipes.train_step(x, t);
      CHECK(r.loss == doctest::Approx(reference.step(x, t)).epsilon(1e-5));
      for (const auto& s : r.stages) {
        CHECK(s.sync_bytes == 0); // no gradient all-reduce
      }
    }
    // Mid-block the replicas differ; a block's end makes them equal.
    REQUIRE(reference.position > 0);
    CHECK_FALSE(torch::allclose(pipes.replica(0).named_parameters()[0].second,
                                pipes.replica(1).named_parameters()[0].second));
    pipes.end_block();
    reference.end_block();
    for (std::size_t r = 0; r < replicas; ++r) {
      check_close(pipes.replica(r).named_parameters(), named(reference.models[r]->layers, false));
    }
    // Nothing to end right after a block's end.
    pipes.end_block();
    check_close(pipes.replica(0).named_parameters(), named(reference.models[0]->layers, false));
  }
}

TEST_CASE("BMUF options are checked, and BMUF refuses synchronised batch norm") {
  engine sys;
  auto refused = [&](const std::function<void(pipeline_options&)>& change, const char* message) {
    auto o = mlp_options(1);
    o.data_parallel.replicas = 2;
    o.data_parallel.bmuf.block_steps = 2;
    change(o);
    CAPTURE(message);
    CHECK_THROWS_WITH_AS(pipeline(sys, tiny_mlp(1), partition_uniform(6, 2), o),
                         doctest::Contains(message), invalid_argument);
  };
  refused([](pipeline_options& o) { o.data_parallel.replicas = 1; }, "BMUF needs replicas");
  refused([](pipeline_options& o) { o.data_parallel.bmuf.block_steps = -1; },
          "bmuf.block_steps (-1) must be >= 1");
  refused([](pipeline_options& o) { o.data_parallel.bmuf.block_momentum = 1; },
          "bmuf.block_momentum (1) must be below 1");
  refused([](pipeline_options& o) { o.data_parallel.bmuf.block_lr = 0; },
          "bmuf.block_lr (0) must be > 0");
  refused([](pipeline_options& o) { o.data_parallel.bmuf.warmup_steps = -2; },
          "bmuf.warmup_steps (-2) must be >= 0");
  refused([](pipeline_options& o) { o.data_parallel.sync_batch_norm = true; },
          "their batch norms cannot synchronise");
}

TEST_CASE("DataParallel's forward: every replica runs its part, outputs gathered or left "
          "scattered, inputs already scattered, and a step on scattered parts of any sizes "
          "equals plain libtorch on their concatenation") {
  engine sys;
  auto o = mlp_options(2);
  // Which stage threads produced how many output rows (the last stage's forward-only hook).
  std::mutex mutex;
  std::map<std::thread::id, int64_t> rows;
  o.hooks.after_forward = [&](const hook_context& where, torch::Tensor& output) {
    if (where.stage == 1 && !where.train) {
      std::lock_guard<std::mutex> lock(mutex);
      rows[std::this_thread::get_id()] += output.size(0);
    }
  };
  replicated_pipeline replicas(
    sys, [] { return tiny_mlp(5); }, partition_uniform(6, 2), o, 3);
  auto plain = tiny_mlp(5);
  auto x = torch::randn({10, 1, 4, 4});
  auto expected = run_layers(plain, x);
  auto sizes_of = [](const std::vector<torch::Tensor>& parts) {
    std::multiset<int64_t> sizes;
    for (const auto& p : parts) {
      sizes.insert(p.size(0));
    }
    return sizes;
  };
  auto thread_rows = [&] {
    std::multiset<int64_t> sizes;
    for (const auto& [id, n] : rows) {
      sizes.insert(n);
    }
    rows.clear();
    return sizes;
  };

  // Gathered: the batch split 4, 3, 3 over the three replicas' own stage threads.
  CHECK(torch::allclose(replicas.forward(x), expected, 1e-5, 1e-6));
  CHECK(thread_rows() == std::multiset<int64_t>{4, 3, 3});
  // Scattered: replica r's outputs for its part, in order.
  auto scattered = replicas.forward_scattered(x);
  REQUIRE(scattered.size() == 3);
  CHECK(torch::allclose(scattered[0], expected.slice(0, 0, 4), 1e-5, 1e-6));
  CHECK(torch::allclose(scattered[2], expected.slice(0, 7, 10), 1e-5, 1e-6));
  CHECK(thread_rows() == std::multiset<int64_t>{4, 3, 3});
  // Fewer samples than replicas: the first two replicas.
  CHECK(sizes_of(replicas.forward_scattered(x.slice(0, 0, 2))) == std::multiset<int64_t>{1, 1});
  CHECK(thread_rows() == std::multiset<int64_t>{1, 1});
  // Inputs already scattered, uneven: 1, 5 and 4 samples.
  std::vector<torch::Tensor> parts{x.slice(0, 0, 1), x.slice(0, 1, 6), x.slice(0, 6, 10)};
  CHECK(torch::allclose(replicas.forward(parts), expected, 1e-5, 1e-6));
  CHECK(thread_rows() == std::multiset<int64_t>{1, 5, 4});
  auto kept = replicas.forward_scattered(parts);
  CHECK(kept[1].size(0) == 5);
  CHECK(torch::allclose(kept[1], expected.slice(0, 1, 6), 1e-5, 1e-6));
  thread_rows();

  // Training on scattered parts of 2, 5 and 3 samples equals one model on all 10.
  plain_model reference(tiny_mlp(5), sgd(0.1, 0.9));
  for (int step = 0; step < 3; ++step) {
    auto xb = torch::randn({10, 1, 4, 4});
    auto tb = torch::randn({10, 3});
    auto r =
      replicas.train_step_scattered({xb.slice(0, 0, 2), xb.slice(0, 2, 7), xb.slice(0, 7, 10)},
                                    {tb.slice(0, 0, 2), tb.slice(0, 2, 7), tb.slice(0, 7, 10)});
    CHECK(r.loss == doctest::Approx(reference.step(xb, tb)).epsilon(1e-6));
  }
  for (std::size_t k = 0; k < 3; ++k) {
    check_close(replicas.replica(k).named_parameters(), named(reference.layers, false));
  }

  // Bad parts are named.
  CHECK_THROWS_WITH_AS(replicas.forward_scattered(std::vector<torch::Tensor>(4, x)),
                       doctest::Contains("4 scattered parts for 3 replicas"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(replicas.forward(std::vector<torch::Tensor>{x, x.slice(0, 0, 0)}),
                       doctest::Contains("part 1 holds no samples"), actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(replicas.train_step_scattered({x, x}, {x, x}),
                       doctest::Contains("2 input and 2 target parts for 3 replicas"),
                       actorpipe::invalid_argument);
  auto t = torch::randn({10, 3});
  CHECK_THROWS_WITH_AS(
    replicas.train_step_scattered({x, x, x.slice(0, 0, 4)}, {t, t, t}),
    doctest::Contains("part 2 needs inputs and targets with the same, non-zero number of samples"),
    actorpipe::invalid_argument);
}
