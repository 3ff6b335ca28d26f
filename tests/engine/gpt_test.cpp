// The built-in GPT through the pipeline: tied embedding and head on different stages, every
// schedule and stage count, replicas, clipping, checkpoints and failures, against plain libtorch
// training the same model in one process.
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>
#include <thread>

#include <unistd.h>

#include <actorpipe/losses.hpp>
#include <actorpipe/models.hpp>

#include "oracle.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

namespace {

// embed, block0 .. block<blocks-1>, ln_f, head.
layer_list tiny_gpt(int64_t blocks = 2, uint64_t seed = 5) {
  return test_gpt(tiny_vocabulary, blocks, 8, 8, seed);
}

// Plain libtorch: one process, the tied tensor held by both layers (and stepped once).
struct plain_lm {
  layer_list layers;
  std::vector<torch::Tensor> parameters;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  loss_function loss = builtin_loss("cross_entropy");

  plain_lm(layer_list l, const optimizer_factory& make)
    : layers(std::move(l)), parameters(unique_parameters(layers)) {
    optimizer = make(parameters);
  }

  double step(const torch::Tensor& x, const torch::Tensor& t, double max_norm = 0) {
    optimizer->zero_grad();
    auto l = loss(run_layers(layers, x), t);
    l.backward();
    if (max_norm > 0) {
      torch::nn::utils::clip_grad_norm_(parameters, max_norm, 2.0);
    }
    optimizer->step();
    return l.item<double>();
  }
};

// SGD with momentum where parameters are compared with plain libtorch's: Adam divides every
// gradient by its own running size, so a gradient that is rounding noise (the attention's key
// bias: softmax does not change when a row of scores shifts) moves its parameter by the learning
// rate in the noise's direction. Losses agree under Adam too (the key bias does not change them).
const optimizer_factory& gpt_optimizer() {
  static const optimizer_factory make = sgd(0.1, 0.9);
  return make;
}

pipeline_options gpt_options(std::size_t microbatches) {
  pipeline_options o;
  o.microbatches = microbatches;
  o.loss = builtin_loss("cross_entropy");
  o.optimizer = gpt_optimizer();
  o.wait_timeout = std::chrono::milliseconds(20000);
  o.data_parallel.timeout = std::chrono::milliseconds(20000);
  return o;
}

const torch::Tensor& find(const std::vector<std::pair<std::string, torch::Tensor>>& all,
                          const std::string& name) {
  for (const auto& [n, t] : all) {
    if (n == name) {
      return t;
    }
  }
  FAIL("no tensor " << name);
  static torch::Tensor none;
  return none;
}

std::string temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("actorpipe-gpt-test-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

} // namespace

TEST_CASE("a pipelined gpt trains exactly like plain libtorch: every schedule, 1-4 stages, head "
          "and embedding on different stages, uneven micro-batches, sequence length changing") {
  engine sys;
  for (auto [kind, chunks] : every_schedule()) {
    for (std::size_t stages = 1; stages <= 4; ++stages) {
      CAPTURE(to_string(kind));
      CAPTURE(stages);
      auto o = gpt_options(microbatches_for(kind, stages, 3));
      o.schedule = kind;
      o.chunks = chunks;
      auto layers = tiny_gpt(6);
      pipeline pipe(sys, layers, partition_uniform(layers.size(), stages * chunks), o);
      plain_lm plain(tiny_gpt(6), gpt_optimizer());
      int step = 0;
      for (int64_t length : {8, 5, 8}) {
        auto [x, t] = tokens(o.microbatches + 1, length, 10 + step++);
        auto r = pipe.train_step(x, t);
        CHECK(r.loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
      }
      auto trained = pipe.named_parameters();
      check_close(trained, named(plain.layers, false), 1e-4, 1e-6);
      // The copies on the head's stage stayed bit for bit the embedding.
      CHECK(torch::equal(find(trained, "head.weight"), find(trained, "embed.token.weight")));
      auto [x, t] = tokens(3, 7, 99);
      CHECK(torch::allclose(pipe.forward(x), run_layers(plain.layers, x), 1e-4, 1e-5));
    }
  }
}

TEST_CASE("under Adam the losses of a 3-stage gpt are plain libtorch's") {
  engine sys;
  auto o = gpt_options(3);
  o.optimizer = adam(1e-2);
  auto layers = tiny_gpt();
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 3), o);
  plain_lm plain(tiny_gpt(), adam(1e-2));
  for (int step = 0; step < 4; ++step) {
    auto [x, t] = tokens(5, 8, 70 + step);
    CHECK(pipe.train_step(x, t).loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
  }
  auto trained = pipe.named_parameters();
  CHECK(torch::equal(find(trained, "head.weight"), find(trained, "embed.token.weight")));
  check_close({{"embed.token.weight", find(trained, "embed.token.weight")}},
              {{"embed.token.weight", find(named(plain.layers, false), "embed.token.weight")}},
              1e-4, 1e-6);
}

TEST_CASE("recomputation gives a gpt with dropout the gradients of keeping every activation") {
  engine sys;
  auto make = [] {
    torch::manual_seed(5);
    model_options o;
    o.vocabulary = tiny_vocabulary;
    o.layers = 2;
    o.width = 8;
    o.context = 8;
    o.dropout = 0.2;
    return make_model("gpt", o);
  };
  auto [x, t] = tokens(6, 8, 3);
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> results;
  std::vector<double> losses;
  for (auto mode : {recompute_mode::never, recompute_mode::always}) {
    auto o = gpt_options(3);
    o.recompute = mode;
    auto layers = make();
    // One stage actor: stages share the CPU generator, so with several the order in which
    // they draw depends on timing, and two runs draw different masks either way.
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 1), o);
    torch::manual_seed(42);
    losses.push_back(pipe.train_step(x, t).loss);
    results.push_back(pipe.named_gradients());
  }
  CHECK(losses[0] == doctest::Approx(losses[1]).epsilon(1e-6));
  check_close(results[0], results[1], 1e-6, 1e-7);
}

TEST_CASE("tied copies count once in the global gradient norm") {
  engine sys;
  auto o = gpt_options(2);
  o.max_grad_norm = 0.05;
  auto layers = tiny_gpt();
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 3), o);
  plain_lm plain(tiny_gpt(), gpt_optimizer());
  for (int step = 0; step < 2; ++step) {
    auto [x, t] = tokens(4, 6, 20 + step);
    auto r = pipe.train_step(x, t);
    CHECK(r.loss == doctest::Approx(plain.step(x, t, 0.05)).epsilon(1e-5));
    CHECK(r.grad_norm > 0.05); // it clipped
  }
  check_close(pipe.named_parameters(), named(plain.layers, false), 1e-4, 1e-6);
}

TEST_CASE("2 replicas of a 3-stage gpt step like plain libtorch on the whole batch") {
  engine sys;
  auto o = gpt_options(2);
  replicated_pipeline replicas(
    sys, [] { return tiny_gpt(); }, partition_uniform(5, 3), o, 2);
  plain_lm plain(tiny_gpt(), gpt_optimizer());
  for (int step = 0; step < 3; ++step) {
    auto [x, t] = tokens(8, 6, 30 + step);
    CHECK(replicas.train_step(x, t).loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
  }
  check_close(replicas.replica(0).named_parameters(), named(plain.layers, false), 1e-4, 1e-6);
  check_close(replicas.replica(1).named_parameters(), named(plain.layers, false), 1e-4, 1e-6);
}

TEST_CASE("sharded replicas of a 3-stage gpt (embedding and head tied across stages) step like "
          "unsharded ones, clipped, under ZeRO-1 and ZeRO-2") {
  engine sys;
  auto o = gpt_options(2);
  o.max_grad_norm = 0.5;
  replicated_pipeline reference(
    sys, [] { return tiny_gpt(); }, partition_uniform(5, 3), o, 2);
  std::vector<std::unique_ptr<replicated_pipeline>> sharded;
  for (auto mode : {shard_mode::optimizer, shard_mode::gradients}) {
    auto s = o;
    s.data_parallel.shard = mode;
    sharded.push_back(std::make_unique<replicated_pipeline>(
      sys, [] { return tiny_gpt(); }, partition_uniform(5, 3), s, 2));
  }
  for (int step = 0; step < 4; ++step) {
    auto [x, t] = tokens(8, 6, 60 + step);
    auto expected = reference.train_step(x, t);
    for (auto& p : sharded) {
      auto r = p->train_step(x, t);
      CHECK(r.loss == doctest::Approx(expected.loss).epsilon(1e-6));
      CHECK(r.grad_norm == doctest::Approx(expected.grad_norm).epsilon(1e-6));
    }
  }
  for (auto& p : sharded) {
    for (std::size_t k = 0; k < 2; ++k) {
      CAPTURE(k);
      check_close(p->replica(k).named_parameters(), reference.replica(0).named_parameters(), 1e-6,
                  1e-7);
    }
  }
}

TEST_CASE("a checkpoint stores a tied parameter once and resumes with another stage count") {
  engine sys;
  auto dir = temp_dir("resume");
  auto o = gpt_options(2);
  o.optimizer = adam(1e-2); // its state is checkpointed with the tied parameter
  std::vector<std::pair<std::string, torch::Tensor>> saved;
  {
    auto layers = tiny_gpt();
    pipeline pipe(sys, layers, partition_uniform(layers.size(), 3), o);
    for (int step = 0; step < 2; ++step) {
      auto [x, t] = tokens(4, 6, 40 + step);
      pipe.train_step(x, t);
    }
    pipe.save_state(dir);
    saved = pipe.named_parameters();
  }
  // Once: under its first holder's name, by the embedding's stage.
  std::set<std::string> keys;
  for (const auto& file : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(file.path(), std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (const auto& item : torch::pickle_load(bytes).toGenericDict()) {
      CHECK(keys.insert(item.key().toStringRef()).second);
    }
  }
  CHECK(keys.count("embed.token.weight") == 1);
  CHECK(keys.count("optimizer/embed.token.weight/exp_avg") == 1);
  CHECK(keys.count("head.weight") == 0);
  // Resumed with 2 stages and with 1 (the tie then inside one stage): the same parameters and
  // the same next step.
  std::vector<double> next;
  for (std::size_t stages : {2, 1}) {
    CAPTURE(stages);
    auto layers = tiny_gpt(2, 77); // other initial values, overwritten by the checkpoint
    pipeline pipe(sys, layers, partition_uniform(layers.size(), stages), o);
    pipe.load_state(dir);
    check_close(pipe.named_parameters(), saved, 0, 0);
    auto [x, t] = tokens(4, 6, 42);
    next.push_back(pipe.train_step(x, t).loss);
    CHECK(torch::equal(find(pipe.named_parameters(), "head.weight"),
                       find(pipe.named_parameters(), "embed.token.weight")));
  }
  CHECK(next[0] == doctest::Approx(next[1]).epsilon(1e-6));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a step that fails while a tied holder waits for the others fails at once, changes "
          "nothing, and the next step trains") {
  engine sys;
  auto o = gpt_options(3);
  o.wait_timeout = std::chrono::milliseconds(30000);
  bool fail = true;
  // Stage 1's last backward: stage 2 (the head) has finished and waits in the tie sum.
  o.hooks.after_backward = [&](const hook_context& c, torch::Tensor&) {
    if (fail && c.stage == 1 && c.microbatch == 2) {
      throw std::runtime_error("injected failure");
    }
  };
  auto layers = tiny_gpt();
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 3), o);
  plain_lm plain(tiny_gpt(), gpt_optimizer());
  auto before = pipe.named_parameters();
  auto [x, t] = tokens(6, 6, 50);
  auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(pipe.train_step(x, t), doctest::Contains("injected failure"),
                       pipeline_error);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  check_close(pipe.named_parameters(), before, 0, 0);
  fail = false;
  CHECK(pipe.train_step(x, t).loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
  check_close(pipe.named_parameters(), named(plain.layers, false), 1e-4, 1e-6);
}

TEST_CASE("optimizer post-validation: stages step before the update and keep or redo the step, "
          "bit for bit the parameters of waiting for it, clipped or not, every schedule") {
  engine sys;
  for (auto [kind, chunks] : every_schedule()) {
    // Off; clipping every step (each early step is undone and redone); never clipping.
    for (double clip : {0.0, 0.05, 1e9}) {
      CAPTURE(to_string(kind));
      CAPTURE(clip);
      std::vector<std::vector<std::pair<std::string, torch::Tensor>>> trained;
      std::vector<std::vector<double>> losses;
      for (bool optimistic : {true, false}) {
        CAPTURE(optimistic);
        auto o = gpt_options(microbatches_for(kind, 3, 3));
        o.schedule = kind;
        o.chunks = chunks;
        o.max_grad_norm = clip;
        o.optimistic_update = optimistic;
        o.optimizer = adam(1e-2); // its state appears at the first step: undone, it must go
        auto layers = tiny_gpt(6);
        pipeline pipe(sys, layers, partition_uniform(layers.size(), 3 * chunks), o);
        losses.emplace_back();
        for (int step = 0; step < 3; ++step) {
          auto [x, t] = tokens(static_cast<int64_t>(o.microbatches) + 1, 6, 40 + step);
          auto r = pipe.train_step(x, t);
          losses.back().push_back(r.loss);
          if (clip == 0.05) {
            CHECK(r.grad_norm > clip);
          }
          // Every stage but the one that reported last the step before steps early (all at
          // the first step), unless the step before was clipped.
          std::size_t early = 0;
          for (const auto& st : r.stages) {
            early += st.early_update ? 1 : 0;
          }
          CHECK(early == (!optimistic ? 0 : step == 0 ? 3 : clip == 0.05 ? 0 : 2));
        }
        auto named = pipe.named_parameters();
        for (auto& [name, t] : named) {
          t = t.clone();
        }
        trained.push_back(std::move(named));
      }
      CHECK(losses[0] == losses[1]);
      REQUIRE(trained[0].size() == trained[1].size());
      for (std::size_t i = 0; i < trained[0].size(); ++i) {
        CAPTURE(trained[0][i].first);
        CHECK(torch::equal(trained[0][i].second, trained[1][i].second));
      }
    }
  }
}

TEST_CASE("a NaN or infinite gradient norm fails the step naming it, and no parameter or optimizer "
          "state changes: the stages' early optimizer steps are undone") {
  engine sys;
  std::atomic<bool> poison{false};
  auto options = [&] {
    auto o = gpt_options(3);
    o.max_grad_norm = 1e9; // the norm is checked, never clips (a clipped step is not stepped early)
    o.optimizer = sgd(0.1, 0.9);
    o.optimistic_update = true; // the failed step's early optimizer steps must be undone
    // Stage 0's output scaled by infinity: the loss and every gradient are no longer finite.
    o.hooks.after_forward = [&](const hook_context& c, torch::Tensor& t) {
      if (poison && c.stage == 0) {
        t = t * std::numeric_limits<float>::infinity();
      }
    };
    return o;
  };
  auto layers = tiny_gpt();
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 3), options());
  auto reference_layers = tiny_gpt();
  pipeline reference(sys, reference_layers, partition_uniform(reference_layers.size(), 3),
                     options());
  // Momentum buffers exist from here on.
  auto [x, t] = tokens(4, 6, 60);
  auto first = pipe.train_step(x, t);
  CHECK(first.loss == reference.train_step(x, t).loss);
  CHECK(first.stages[0].early_update); // and two stages step early in the failing step
  auto before = pipe.named_parameters();
  for (auto& [name, p] : before) {
    p = p.clone();
  }
  poison = true;
  auto [bad_x, bad_t] = tokens(4, 6, 61);
  CHECK_THROWS_WITH_AS(pipe.train_step(bad_x, bad_t),
                       doctest::Contains("step 2: the global gradient norm is "), pipeline_error);
  poison = false;
  auto after = pipe.named_parameters();
  REQUIRE(after.size() == before.size());
  for (std::size_t i = 0; i < after.size(); ++i) {
    CAPTURE(after[i].first);
    CHECK(torch::equal(after[i].second, before[i].second));
  }
  // The momentum too: the next steps are those of a pipeline that never saw the bad batch.
  for (int step = 0; step < 2; ++step) {
    auto [nx, nt] = tokens(4, 6, 62 + step);
    CHECK(pipe.train_step(nx, nt).loss == reference.train_step(nx, nt).loss);
  }
  auto trained = pipe.named_parameters();
  auto expected = reference.named_parameters();
  for (std::size_t i = 0; i < trained.size(); ++i) {
    CAPTURE(trained[i].first);
    CHECK(torch::equal(trained[i].second, expected[i].second));
  }
}

namespace {

// Copies of a pipeline's parameters (named_parameters shares nothing, but clones keep them).
std::vector<std::pair<std::string, torch::Tensor>> parameters_now(const pipeline& pipe) {
  auto all = pipe.named_parameters();
  for (auto& [name, t] : all) {
    t = t.clone();
  }
  return all;
}

void check_equal(const std::vector<std::pair<std::string, torch::Tensor>>& a,
                 const std::vector<std::pair<std::string, torch::Tensor>>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CAPTURE(a[i].first);
    CHECK(torch::equal(a[i].second, b[i].second));
  }
}

} // namespace

TEST_CASE("overlapping steps: submitted together, each stage starts a step when it is done with "
          "the one before, and parameters are those of steps one after the other bit for bit, "
          "every schedule on 3 stages and 1F1B on one, clipped or not") {
  engine sys;
  for (auto [kind, chunks] : every_schedule()) {
    for (std::size_t stages : {std::size_t{1}, std::size_t{3}}) {
      if (stages == 1 && kind != schedule_kind::one_f_one_b) {
        continue; // one stage runs every schedule alike (and costs the sanitizer runs time)
      }
      // Off; clipping every step (a stage waits for the update first); never clipping.
      for (double clip : {0.0, 0.05, 1e9}) {
        CAPTURE(to_string(kind));
        CAPTURE(stages);
        CAPTURE(clip);
        std::vector<std::vector<std::pair<std::string, torch::Tensor>>> trained;
        std::vector<std::vector<double>> losses;
        for (bool overlap : {true, false}) {
          CAPTURE(overlap);
          auto o = gpt_options(microbatches_for(kind, 3, 3));
          o.schedule = kind;
          o.chunks = chunks;
          o.max_grad_norm = clip;
          o.overlap_steps = overlap;
          auto layers = tiny_gpt(6);
          pipeline pipe(sys, layers, partition_uniform(layers.size(), stages * chunks), o);
          std::vector<std::future<step_result>> futures;
          for (int step = 0; step < 4; ++step) {
            auto [x, t] = tokens(static_cast<int64_t>(o.microbatches) + 1, 6, 70 + step);
            futures.push_back(pipe.train_step_async(x, t));
          }
          losses.emplace_back();
          std::size_t overlapped = 0;
          for (std::size_t step = 0; step < futures.size(); ++step) {
            auto r = futures[step].get();
            CHECK(r.step == step + 1);
            losses.back().push_back(r.loss);
            for (const auto& st : r.stages) {
              overlapped += st.overlapped ? 1 : 0;
              // Without overlap no stage steps early; with it every stage does at the first
              // step, and none after a clipped step (the second was sent before the first was
              // clipped).
              if (!overlap) {
                CHECK(!st.early_update);
              } else if (step == 0) {
                CHECK(st.early_update);
              } else if (clip == 0.05 && step >= 2) {
                CHECK(!st.early_update);
              }
            }
          }
          // Without clipping, the stage that finishes a step last goes on to the next before the
          // scheduler confirmed it (one stage alone does so every other step: it finishes the
          // next step before the confirmation comes, and steps that one when it comes); with
          // clipping, every stage waits for the update.
          if (overlap && clip == 0) {
            CHECK(overlapped >= 2);
          } else {
            CHECK(overlapped == 0);
          }
          trained.push_back(parameters_now(pipe));
        }
        CHECK(losses[0] == losses[1]);
        check_equal(trained[0], trained[1]);
      }
    }
  }
}

TEST_CASE("overlapping steps: a step that fails behind a running one fails alone, a step that "
          "fails while the next one runs fails it too, and both leave the parameters as before") {
  engine sys;
  // Which step's hook throws, on which stage, in which direction.
  std::atomic<uint64_t> failing_step{0};
  std::atomic<std::size_t> failing_stage{0};
  std::atomic<int32_t> failing_microbatch{0};
  std::atomic<bool> forward{false};
  // Closed while the test submits steps that must reach the scheduler together: every hook
  // waits for it, so no step gets far (or fails) before the others are queued, whatever the
  // test thread's scheduling.
  std::atomic<bool> gate_open{true};
  auto options = [&](bool hooked) {
    auto o = gpt_options(3);
    o.schedule = schedule_kind::zb_h1;
    o.optimizer = sgd(0.1, 0.9); // momentum: an undone step must take its momentum along
    o.overlap_steps = hooked;
    if (hooked) {
      auto hook = [&](bool in_forward) {
        return [&, in_forward](const hook_context& c, torch::Tensor&) {
          auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
          while (!gate_open && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          if (in_forward == forward && c.step == failing_step && c.stage == failing_stage &&
              c.microbatch == failing_microbatch) {
            throw std::runtime_error("the test's hook fails");
          }
        };
      };
      o.hooks.after_forward = hook(true);
      o.hooks.after_backward = hook(false);
    }
    return o;
  };
  auto batch = [](int step) { return tokens(4, 6, 80 + step); };
  // The pipeline with the hooks, `count` steps submitted to it together (after the first has
  // run, when `first_alone`), and a pipeline without them that takes its steps one at a time.
  struct trial {
    std::unique_ptr<pipeline> pipe;
    std::unique_ptr<pipeline> reference;
    std::vector<std::future<step_result>> futures;
  };
  auto submit = [&](int count, bool first_alone) {
    trial t;
    auto layers = tiny_gpt();
    t.pipe =
      std::make_unique<pipeline>(sys, layers, partition_uniform(layers.size(), 3), options(true));
    auto reference_layers = tiny_gpt();
    t.reference = std::make_unique<pipeline>(
      sys, reference_layers, partition_uniform(reference_layers.size(), 3), options(false));
    for (int step = 0; step < count; ++step) {
      auto [x, y] = batch(step);
      if (step == (first_alone ? 1 : 0)) {
        gate_open = false;
      }
      t.futures.push_back(t.pipe->train_step_async(x, y));
      if (step == 0 && first_alone) {
        t.futures.back().wait();
      }
    }
    gate_open = true;
    return t;
  };
  auto reference_loss = [&](trial& t, int step) {
    auto [x, y] = batch(step);
    return t.reference->train_step(x, y).loss;
  };
  SUBCASE("the step behind fails") {
    // Step 2 fails at its first forward on stage 0, which stage 0 runs right after its part of
    // step 1, before its confirmation of step 1: step 1 and step 3 are as without it.
    failing_step = 2;
    failing_stage = 0;
    failing_microbatch = 0;
    forward = true;
    auto t = submit(3, false);
    CHECK(t.futures[0].get().loss == reference_loss(t, 0));
    CHECK_THROWS_WITH_AS(t.futures[1].get(), doctest::Contains("the test's hook fails"),
                         pipeline_error);
    auto third = t.futures[2].get();
    CHECK(third.step == 3);
    CHECK(third.loss == reference_loss(t, 2));
    check_equal(parameters_now(*t.pipe), parameters_now(*t.reference));
  }
  SUBCASE("the step before fails") {
    // Step 2 fails on stage 1 while step 3 is behind it (step 2 started alone: it cannot fail
    // while step 1 runs, and fail alone); stage 2 may have finished its part of step 2 and
    // started step 3, whose start and early optimizer step of step 2 are undone: steps 2 and 3
    // fail, step 4 runs as step 2 of a pipeline that never saw them.
    failing_step = 2;
    failing_stage = 1;
    failing_microbatch = 2;
    forward = false;
    auto t = submit(4, true);
    CHECK(t.futures[0].get().loss == reference_loss(t, 0));
    CHECK_THROWS_WITH_AS(t.futures[1].get(), doctest::Contains("the test's hook fails"),
                         pipeline_error);
    try {
      t.futures[2].get();
      FAIL("step 3 ran on the parameters of a failed step");
    } catch (const pipeline_error& e) {
      CHECK(std::string(e.what()).find("step 3 did not run: it overlapped step 2, which failed") !=
            std::string::npos);
      CHECK(e.details().step == 3u);
    }
    auto fourth = t.futures[3].get();
    CHECK(fourth.step == 4);
    CHECK(fourth.loss == reference_loss(t, 3));
    check_equal(parameters_now(*t.pipe), parameters_now(*t.reference));
  }
}

TEST_CASE("overlapping steps are refused for stages on nodes") {
  engine sys;
  auto o = gpt_options(2);
  o.overlap_steps = true;
  o.placement.nodes = {"127.0.0.1:1", "127.0.0.1:2"};
  remote_model model;
  model.name = "gpt";
  CHECK_THROWS_WITH_AS(pipeline(sys, model, partition_uniform(4, 2), o),
                       doctest::Contains("overlap_steps runs stages in this process"),
                       std::invalid_argument);
}
