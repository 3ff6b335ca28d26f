// ZeRO across replicas (data_parallel_options::shard): each replica keeps and steps its part of
// every stage's optimizer state (and, ZeRO-2, of the summed gradients); parameters equal the
// unsharded replicas' and plain libtorch's; checkpoints gather the state whole.
#include <filesystem>
#include <functional>
#include <string>

#include <unistd.h>

#include "oracle.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

namespace {

pipeline_options sharded_options(shard_mode mode, const optimizer_factory& optimizer) {
  pipeline_options o;
  o.microbatches = 2;
  o.loss = mse;
  o.optimizer = optimizer;
  o.data_parallel.timeout = std::chrono::milliseconds(20000);
  o.data_parallel.shard = mode;
  return o;
}

// A 12-sample batch of step `step` (the same for every run).
std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(100 + static_cast<uint64_t>(step));
  return {torch::randn({12, 1, 4, 4}), torch::randn({12, 3})};
}

std::string mode_name(shard_mode mode) {
  return to_string(mode);
}

std::filesystem::path fresh_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("actorpipe_sharding_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

} // namespace

TEST_CASE("ZeRO-1 and ZeRO-2: sharded replicas step like unsharded ones and plain libtorch, "
          "SGD with momentum and Adam over 10 steps") {
  engine sys;
  for (auto optimizer : {std::string("sgd"), std::string("adam")}) {
    auto make = optimizer == "sgd" ? sgd(0.1, 0.9) : adam(0.01);
    for (std::size_t replicas : {2, 3}) {
      auto full = sharded_options(shard_mode::none, make);
      replicated_pipeline reference(
        sys, [] { return tiny_mlp(1); }, partition_uniform(6, 2), full, replicas);
      for (auto mode : {shard_mode::optimizer, shard_mode::gradients}) {
        CAPTURE(optimizer);
        CAPTURE(replicas);
        CAPTURE(mode_name(mode));
        auto o = sharded_options(mode, make);
        replicated_pipeline sharded(
          sys, [] { return tiny_mlp(1); }, partition_uniform(6, 2), o, replicas);
        plain_model plain(tiny_mlp(1), make);
        for (int step = 0; step < 10; ++step) {
          auto [x, t] = batch(step);
          auto r = sharded.train_step(x, t);
          CHECK(r.loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
          if (mode == shard_mode::optimizer) {
            auto expected = reference.train_step(x, t);
            CHECK(r.loss == doctest::Approx(expected.loss).epsilon(1e-6));
            // The optimizer state replica 0 keeps: its part, less than every replica's whole.
            for (std::size_t s = 0; s < r.stages.size() && step > 0; ++s) {
              CHECK(r.stages[s].optimizer_bytes > 0);
              CHECK(r.stages[s].optimizer_bytes < expected.stages[s].optimizer_bytes);
              CHECK(r.stages[s].gradient_bytes == expected.stages[s].gradient_bytes);
            }
          } else {
            // ZeRO-2: each replica keeps the summed gradients of its own parameters only.
            for (const auto& s : r.stages) {
              CHECK(s.gradient_bytes > 0);
            }
          }
        }
        for (std::size_t k = 0; k < replicas; ++k) {
          CAPTURE(k);
          // ZeRO-2's reduce sums in another order than the all-reduce (an ulp), which Adam
          // shows in gradients near 0: up to 4e-8 absolute here.
          check_close(sharded.replica(k).named_parameters(),
                      reference.replica(0).named_parameters(), 1e-6, 1e-7);
          // Adam divides each gradient by its own running size, so rounding noise in a
          // gradient near 0 (the replicas sum in another order than one batch) moves its
          // parameter by up to the learning rate's scale: the unsharded replicas differ from
          // plain libtorch by as much (1.4e-6 on fc2.weight with 3 replicas).
          check_close(sharded.replica(k).named_parameters(), named(plain.layers, false), 1e-4,
                      1e-5);
        }
      }
    }
  }
}

TEST_CASE("ZeRO-2 releases the gradients a replica does not own, and the global norm and clipping "
          "equal the unsharded replicas'") {
  engine sys;
  for (auto mode : {shard_mode::optimizer, shard_mode::gradients}) {
    CAPTURE(mode_name(mode));
    auto full = sharded_options(shard_mode::none, sgd(0.1, 0.9));
    full.max_grad_norm = 0.05;
    auto o = sharded_options(mode, sgd(0.1, 0.9));
    o.max_grad_norm = 0.05;
    replicated_pipeline reference(
      sys, [] { return tiny_mlp(1); }, partition_uniform(6, 3), full, 2);
    replicated_pipeline sharded(
      sys, [] { return tiny_mlp(1); }, partition_uniform(6, 3), o, 2);
    for (int step = 0; step < 4; ++step) {
      auto [x, t] = batch(step);
      t = t * 10;
      auto expected = reference.train_step(x, t);
      auto r = sharded.train_step(x, t);
      CHECK(expected.grad_norm > 0.05); // it clipped
      CHECK(r.grad_norm == doctest::Approx(expected.grad_norm).epsilon(1e-9));
      CHECK(r.loss == doctest::Approx(expected.loss).epsilon(1e-9));
      for (std::size_t s = 0; s < r.stages.size(); ++s) {
        if (mode == shard_mode::gradients) {
          CHECK(r.stages[s].gradient_bytes < expected.stages[s].gradient_bytes);
        }
      }
    }
    // Every gradient lives on exactly one replica under ZeRO-2.
    if (mode == shard_mode::gradients) {
      auto first = sharded.replica(0).named_gradients();
      auto second = sharded.replica(1).named_gradients();
      REQUIRE(first.size() == second.size());
      for (std::size_t i = 0; i < first.size(); ++i) {
        CAPTURE(first[i].first);
        CHECK(first[i].second.defined() != second[i].second.defined());
      }
    }
    check_close(sharded.replica(1).named_parameters(), reference.replica(0).named_parameters(),
                1e-6, 1e-8);
  }
}

TEST_CASE("a sharded checkpoint holds the whole optimizer state and resumes onto another replica "
          "count, sharded or not") {
  engine sys;
  auto dir = fresh_dir("resume");
  auto make = adam(0.01);
  // Uninterrupted: 6 steps of unsharded replicas.
  auto full = sharded_options(shard_mode::none, make);
  replicated_pipeline reference(
    sys, [] { return tiny_mlp(1); }, partition_uniform(6, 2), full, 2);
  {
    auto o = sharded_options(shard_mode::gradients, make);
    replicated_pipeline sharded(
      sys, [] { return tiny_mlp(1); }, partition_uniform(6, 2), o, 2);
    for (int step = 0; step < 3; ++step) {
      auto [x, t] = batch(step);
      sharded.train_step(x, t);
      reference.train_step(x, t);
    }
    // Replica 0 alone holds half the state: its save refuses rather than write part of it.
    CHECK_THROWS_WITH(sharded.replica(0).save_state((dir / "part").string()),
                      doctest::Contains("sharded across 2 replicas"));
    // A second gather with no step between is skipped by every replica alike.
    sharded.end_block();
    sharded.save_state(dir.string());
  }
  // 3 sharded replicas (another split of the state), and 1 plain pipeline, go on from it.
  auto three = sharded_options(shard_mode::optimizer, make);
  replicated_pipeline resumed(
    sys, [] { return tiny_mlp(9); }, partition_uniform(6, 3), three, 3);
  for (std::size_t k = 0; k < 3; ++k) {
    resumed.replica(k).load_state(dir.string());
  }
  auto one = sharded_options(shard_mode::none, make);
  pipeline alone(sys, tiny_mlp(9), partition_uniform(6, 1), one);
  alone.load_state(dir.string());
  for (int step = 3; step < 6; ++step) {
    auto [x, t] = batch(step);
    auto expected = reference.train_step(x, t).loss;
    CHECK(resumed.train_step(x, t).loss == doctest::Approx(expected).epsilon(1e-6));
    CHECK(alone.train_step(x, t).loss == doctest::Approx(expected).epsilon(1e-6));
  }
  // Another replica count sums in another order, which Adam shows in gradients near 0 (see
  // above); without the optimizer state the parameters would differ by the learning rate's scale.
  check_close(resumed.replica(2).named_parameters(), reference.replica(0).named_parameters(), 1e-4,
              1e-5);
  check_close(alone.named_parameters(), reference.replica(0).named_parameters(), 1e-4, 1e-5);
  std::filesystem::remove_all(dir);
}

TEST_CASE("sharding is refused where it cannot apply, by name") {
  engine sys;
  auto refused = [&](const std::function<void(pipeline_options&)>& change, const char* message) {
    auto o = sharded_options(shard_mode::optimizer, sgd(0.1, 0.9));
    o.data_parallel.replicas = 2;
    change(o);
    CAPTURE(message);
    CHECK_THROWS_WITH_AS(pipeline(sys, tiny_mlp(1), partition_uniform(6, 2), o),
                         doctest::Contains(message), invalid_argument);
  };
  refused([](pipeline_options& o) { o.data_parallel.replicas = 1; },
          "data_parallel.shard (optimizer) divides the optimizer's state among replicas");
  refused([](pipeline_options& o) { o.data_parallel.bmuf.block_steps = 2; },
          "cannot be combined with BMUF");
  CHECK(parse_shard_mode("gradients") == shard_mode::gradients);
  CHECK_THROWS_WITH(parse_shard_mode("zero3"),
                    doctest::Contains("unknown shard mode 'zero3' (choose none, optimizer or "
                                      "gradients)"));
}
