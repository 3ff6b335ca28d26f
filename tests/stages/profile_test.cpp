#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <actorpipe/layers.hpp>
#include <actorpipe/memory.hpp>
#include <actorpipe/profile.hpp>

using namespace actorpipe;

namespace {

torch::nn::AnyModule linear(int64_t in, int64_t out) {
  return torch::nn::AnyModule(torch::nn::Linear(in, out));
}

} // namespace

TEST_CASE("a profile times forward, fused and split backward per layer, as stages run them") {
  torch::manual_seed(0);
  layer_list layers;
  layers.emplace_back("fc1", linear(64, 128));
  layers.emplace_back("relu", [](const torch::Tensor& x) { return torch::relu(x); });
  layers.emplace_back("fc2", linear(128, 32));
  auto before = layers[0].module()->parameters()[0].clone();
  profile_options options;
  options.warmup = 1;
  options.repeats = 3;
  options.split_backward = true;
  auto profile = profile_layers(layers, torch::randn({16, 64}), options);
  REQUIRE(profile.size() == 3);
  CHECK(profile[0].name == "fc1");
  CHECK(profile[0].parameters == 64 * 128 + 128);
  CHECK(profile[1].parameters == 0);
  CHECK(profile[0].output_bytes == 16 * 128 * 4);
  CHECK(profile[2].output_bytes == 16 * 32 * 4);
  for (const auto& p : profile) {
    CAPTURE(p.name);
    CHECK(p.forward_ms > 0);
    CHECK(p.backward_ms > 0);
    CHECK(p.forward_spread >= 0);
    CHECK(p.backward_spread >= 0);
  }
  // The model's input takes no gradient (the first stage computes none): fc1's B is empty.
  CHECK(profile[0].input_backward_ms == 0);
  CHECK(profile[2].input_backward_ms > 0);
  CHECK(profile[2].weight_backward_ms > 0);
  CHECK(profile[1].weight_backward_ms == 0); // no weights
  // What B keeps for W: fc2's output gradient (its weight node's), nothing for the ReLU or for
  // fc1 (the model's input: no B); without a split backward, not measured.
  CHECK(profile[2].weight_kept_bytes == 16 * 32 * 4);
  CHECK(profile[1].weight_kept_bytes == 0);
  CHECK(profile[0].weight_kept_bytes == 0);
  options.split_backward = false;
  CHECK(profile_layers(layers, torch::randn({16, 64}), options)[2].weight_kept_bytes == -1);
  // Profiling leaves no gradients and changes no parameter.
  for (const auto& l : layers) {
    if (auto m = l.module()) {
      for (const auto& p : m->parameters()) {
        CHECK_FALSE(p.grad().defined());
      }
    }
  }
  CHECK(torch::equal(before, layers[0].module()->parameters()[0]));
}

TEST_CASE("a profile counts what each layer's forward keeps for its backward, as a stage's stash "
          "does, and what a chain of them frees") {
  memory::warm_memory_scope warm; // the allocator that tallies (stages profile so)
  torch::manual_seed(0);
  layer_list layers;
  layers.emplace_back("fc1", linear(64, 128));
  // tanh keeps its output for its backward, which is also what it returns: one tensor.
  layers.emplace_back("tanh", [](const torch::Tensor& x) { return torch::tanh(x); });
  // x * x saves its input (allocated by the layer before, counted there) and returns a new one.
  layers.emplace_back("square", [](const torch::Tensor& x) { return x * x; });
  profile_options options;
  options.warmup = 1;
  options.repeats = 3;
  auto profile = profile_layers(layers, torch::randn({16, 64}), options);
  REQUIRE(profile.size() == 3);
  const int64_t activation = 16 * 128 * 4;
  for (const auto& p : profile) {
    CAPTURE(p.name);
    CHECK(p.output_bytes == activation);
    CHECK(p.retained_bytes >= p.output_bytes); // at least its output, never less
    CHECK(p.retained_bytes < 4 * activation);
  }
  CHECK(profile[1].retained_bytes == activation);
  // Chained as a stage runs them: tanh saves its result, not its input, so fc1's output is
  // freed once tanh ran; square saves its input (tanh's output), which stays.
  CHECK(profile[0].freed_input_bytes == 0); // the model's input is not the profile's to free
  CHECK(profile[1].freed_input_bytes == activation);
  CHECK(profile[2].freed_input_bytes == 0);
}

TEST_CASE("a profile measures what a layer needs for a moment beyond what it keeps: its "
          "forward's temporaries and its backward's input gradient") {
  memory::warm_memory_scope warm;
  torch::manual_seed(0);
  layer_list layers;
  layers.emplace_back("fc1", linear(64, 128));
  // A scratch tensor of four activations, freed before the forward ends: its sum's graph keeps
  // no tensor of it.
  layers.emplace_back("scratch", [](const torch::Tensor& x) {
    auto scratch = torch::cat({x, x, x, x});
    return torch::tanh(x) + scratch.sum() * 0;
  });
  layers.emplace_back("fc2", linear(128, 32));
  profile_options options;
  options.warmup = 1;
  options.repeats = 3;
  auto profile = profile_layers(layers, torch::randn({16, 64}), options);
  REQUIRE(profile.size() == 3);
  const int64_t activation = 16 * 128 * 4;
  CHECK(profile[1].forward_working_bytes >= 4 * activation);
  // tanh's result (saved) and the sum's: the scratch is not kept.
  CHECK(profile[1].retained_bytes == 2 * activation);
  CHECK(profile[0].forward_working_bytes < activation);
  // Without autograd the scratch is still made, beside the output.
  CHECK(profile[1].no_grad_forward_bytes >= 5 * activation);
  // fc2's backward makes its input's gradient (an activation of 128 columns).
  CHECK(profile[2].backward_working_bytes >= activation);
  for (const auto& p : profile) {
    CAPTURE(p.name);
    CHECK(p.backward_working_bytes >= 0);
    CHECK(p.workspace_bytes == 0); // the CPU keeps none
  }
}

TEST_CASE("a profile of unequal layers gives the same time-balanced cut every time") {
  // Two large layers, then two small ones (an eighth of the work each): the balanced cut is
  // after the first large layer, with a margin far beyond timing noise.
  torch::manual_seed(0);
  layer_list layers;
  layers.emplace_back("big1", linear(512, 512));
  layers.emplace_back("big2", linear(512, 512));
  layers.emplace_back("down", linear(512, 64));
  layers.emplace_back("up", linear(64, 512));
  auto sample = torch::randn({64, 512});
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto profile = profile_layers(layers, sample);
    CHECK(partition_by_time(profile, 2).to_string() == "[0, 1) [1, 4)");
    CHECK(profile_spread(profile) >= 0);
    CHECK(profile_spread(profile) < 10); // a spread of 1000% means something was not timed
  }
}

TEST_CASE("profile options are checked") {
  layer_list layers;
  layers.emplace_back("fc", linear(4, 4));
  profile_options options;
  options.repeats = 0;
  CHECK_THROWS_WITH_AS(profile_layers(layers, torch::randn({2, 4}), options),
                       "profile repeats (0) must be >= 1", std::invalid_argument);
  options.repeats = 1;
  options.warmup = -1;
  CHECK_THROWS_WITH_AS(profile_layers(layers, torch::randn({2, 4}), options),
                       "profile warm-up passes (-1) must be >= 0", std::invalid_argument);
}
