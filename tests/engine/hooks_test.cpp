// Per-stage hooks: called where documented, able to replace a tensor, and failing cleanly.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <set>
#include <tuple>

#include <unistd.h>

#include "oracle.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

TEST_CASE("hooks see every activation and input gradient sent, and observing changes nothing") {
  engine sys;
  std::mutex m;
  std::multiset<std::tuple<char, std::size_t, int32_t>> calls;
  pipeline_options o;
  o.microbatches = 4;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  o.hooks.after_forward = [&](const hook_context& c, torch::Tensor& t) {
    CHECK(c.train);
    CHECK(t.size(0) == 2);
    std::lock_guard<std::mutex> g{m};
    calls.insert({'F', c.stage, c.microbatch});
  };
  o.hooks.after_backward = [&](const hook_context& c, torch::Tensor&) {
    std::lock_guard<std::mutex> g{m};
    calls.insert({'B', c.stage, c.microbatch});
  };
  auto x = torch::randn({8, 1, 4, 4});
  auto t = torch::randn({8, 3});
  pipeline pipe(sys, tiny_mlp(), partition_uniform(6, 3), o);
  plain_model plain(tiny_mlp(), sgd(0.1));
  pipe.train_step(x, t);
  plain.step(x, t);
  check_close(pipe.named_parameters(), named(plain.layers, false));
  // Forward hooks on the stages that send activations (0, 1), backward hooks on those that send
  // gradients (1, 2); once per micro-batch.
  CHECK(calls.size() == 16);
  for (int32_t mb = 0; mb < 4; ++mb) {
    CHECK(calls.count({'F', 0, mb}) == 1);
    CHECK(calls.count({'F', 1, mb}) == 1);
    CHECK(calls.count({'B', 1, mb}) == 1);
    CHECK(calls.count({'B', 2, mb}) == 1);
  }
}

namespace {

// Two micro-batches, MSE and SGD at 0.1, without hooks yet.
pipeline_options two_microbatches() {
  pipeline_options o;
  o.microbatches = 2;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  return o;
}

} // namespace

TEST_CASE("a hook may replace a tensor, and one that throws or changes the shape fails the step") {
  engine sys;
  auto o = two_microbatches();
  std::atomic<int> mode{0};
  o.hooks.after_forward = [&](const hook_context& c, torch::Tensor& t) {
    if (mode == 1 && c.stage == 1) {
      t = t * 2; // forward-only: the last stage's output
    } else if (mode == 2) {
      throw std::runtime_error("boom");
    } else if (mode == 3) {
      t = t.flatten();
    }
  };
  auto layers = tiny_mlp();
  pipeline pipe(sys, layers, partition_uniform(6, 2), o);
  auto x = torch::randn({4, 1, 4, 4});
  auto plain = run_layers(layers, x).detach();
  mode = 1;
  CHECK(torch::allclose(pipe.forward(x), plain * 2, 1e-5, 1e-6));

  auto before = pipe.named_parameters();
  mode = 2;
  CHECK_THROWS_WITH_AS(
    pipe.train_step(x, torch::randn({4, 3})),
    doctest::Contains("stage 0, microbatch 0: the after_forward hook failed on tensor 0: boom"),
    pipeline_error);
  mode = 3;
  CHECK_THROWS_WITH_AS(pipe.train_step(x, torch::randn({4, 3})),
                       doctest::Contains("the after_forward hook replaced tensor 0 of shape"),
                       pipeline_error);
  check_close(pipe.named_parameters(), before, 0, 0);
}

namespace {

// A TorchScript hook halving its tensor.
std::string halving_hook() {
  return script_module_bytes("def forward(self, x):\n    return x * 0.5\n");
}

} // namespace

TEST_CASE("hooks described by value act as the functions they name: a TorchScript module and "
          "clamp") {
  engine sys;
  auto options = [] {
    pipeline_options o;
    o.microbatches = 4;
    o.loss = mse;
    o.optimizer = sgd(0.1, 0.9);
    return o;
  };
  hook_specs specs;
  specs.after_forward.torchscript = halving_hook();
  specs.after_forward.name = "halve.pt";
  specs.after_backward.builtin = "clamp:0.01";
  auto described = options();
  described.hooks = make_hooks(specs);
  auto by_hand = options();
  by_hand.hooks.after_forward = [](const hook_context&, torch::Tensor& t) { t = t * 0.5; };
  by_hand.hooks.after_backward = [](const hook_context&, torch::Tensor& t) {
    t = t.clamp(-0.01, 0.01);
  };
  auto cut = partition_uniform(6, 3);
  pipeline a(sys, tiny_mlp(), cut, described);
  pipeline b(sys, tiny_mlp(), cut, by_hand);
  plain_model plain(tiny_mlp(), sgd(0.1, 0.9));
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(30 + step);
    auto x = torch::randn({8, 1, 4, 4});
    auto t = torch::randn({8, 3});
    auto la = a.train_step(x, t).loss;
    CHECK(la == doctest::Approx(b.train_step(x, t).loss).epsilon(1e-6));
    // The hooks change training: the plain model's loss differs.
    CHECK(la != doctest::Approx(plain.step(x, t)).epsilon(1e-3));
  }
  check_close(a.named_parameters(), b.named_parameters());
  // The TorchScript hook keeps no autograd graph and runs in eval mode (as in forward-only).
  auto x = torch::randn({4, 1, 4, 4});
  CHECK(torch::allclose(a.forward(x), b.forward(x), 1e-5, 1e-7));
}

TEST_CASE("check_finite fails the step naming stage and micro-batch, and nothing changes") {
  engine sys;
  auto o = two_microbatches();
  hook_specs specs;
  specs.after_forward.builtin = "check_finite";
  o.hooks = make_hooks(specs);
  pipeline pipe(sys, tiny_mlp(), partition_uniform(6, 2), o);
  auto x = torch::randn({4, 1, 4, 4});
  auto t = torch::randn({4, 3});
  pipe.train_step(x, t); // finite: passes
  auto before = pipe.named_parameters();
  x[3][0][0][0] = std::numeric_limits<float>::infinity(); // in micro-batch 1
  CHECK_THROWS_WITH_AS(pipe.train_step(x, t),
                       doctest::Contains("stage 0, microbatch 1: the after_forward hook failed on "
                                         "tensor 0: check_finite: a NaN or an infinity at step"),
                       pipeline_error);
  check_close(pipe.named_parameters(), before, 0, 0);
}

TEST_CASE("hook descriptions that are no hooks are refused, naming the hook and what is wrong") {
  auto refused = [](hook_spec spec, const char* message) {
    CAPTURE(message);
    CHECK_THROWS_WITH_AS(make_hook(spec, "after_forward"), doctest::Contains(message),
                         invalid_argument);
  };
  refused({"clip:1", "", ""}, "unknown after_forward hook 'clip:1' (known: clamp:V (V > 0), "
                              "check_finite, or a TorchScript file)");
  refused({"clamp:0", "", ""}, "after_forward hook 'clamp:0': the bound after clamp: must be a "
                               "number above 0");
  refused({"clamp:x", "", ""}, "the bound after clamp: must be a number above 0");
  refused({"clamp:inf", "", ""}, "the bound after clamp: must be a number above 0");
  refused({"", "not TorchScript", "junk.pt"},
          "the after_forward hook junk.pt is not a TorchScript file");
  refused({"", script_module_bytes("def forward(self, x, y):\n    return x + y\n"), "two.pt"},
          "takes one tensor and returns one");
  refused({"", script_module_bytes("def forward(self, x):\n    return (x, x)\n"), "pair.pt"},
          "takes one tensor and returns one");
  refused({"clamp:1", halving_hook(), "halve.pt"}, "not both");
  CHECK_FALSE(static_cast<bool>(make_hook({}, "after_forward")));

  // From the command line: a built-in by name, else a file.
  CHECK(hook_from_text("clamp:2", "--after-forward").builtin == "clamp:2");
  CHECK_THROWS_WITH_AS(hook_from_text("/no/such/hook.pt", "--after-backward"),
                       doctest::Contains("--after-backward '/no/such/hook.pt' is neither a "
                                         "built-in hook"),
                       invalid_argument);
  auto path = std::filesystem::temp_directory_path() /
              ("actorpipe-hook-" + std::to_string(::getpid()) + ".pt");
  auto bytes = halving_hook();
  {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }
  auto spec = hook_from_text(path.string(), "--after-forward");
  CHECK(spec.torchscript == bytes);
  auto hook = make_hook(spec, "after_forward");
  auto t = torch::ones({2, 3});
  hook(hook_context{}, t);
  CHECK(torch::equal(t, torch::full({2, 3}, 0.5)));
  std::filesystem::remove(path);
}
