// Data parallelism: replicas of a pipeline average gradients per stage over c10d (Gloo): exact
// steps, buffers, clipping, failures and deadlines, the sampler, a barrier.
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
