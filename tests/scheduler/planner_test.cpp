#include <algorithm>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <actorpipe/planner.hpp>
#include <actorpipe/schedule.hpp>

using namespace actorpipe;

namespace {

layer_list four_layers() {
  layer_list layers;
  for (int i = 0; i < 4; ++i) {
    layers.emplace_back("fc" + std::to_string(i), torch::nn::AnyModule(torch::nn::Linear(8, 8)));
  }
  return layers;
}

// Costs that grow linearly with the samples: per sample, forward f and backward b ms per layer,
// and `bytes` of output per sample.
measured_costs linear_costs(std::size_t threads, int64_t samples, double f, double b,
                            int64_t bytes = 100, std::size_t layers = 4) {
  measured_costs c{threads, samples, {}};
  for (std::size_t i = 0; i < layers; ++i) {
    layer_profile p;
    p.name = "fc" + std::to_string(i);
    p.forward_ms = f * static_cast<double>(samples);
    p.backward_ms = b * static_cast<double>(samples);
    p.output_bytes = bytes * samples;
    p.parameters = 72;
    c.layers.push_back(p);
  }
  return c;
}

// Costs at every size the space needs, one thread: (f1, b1), two threads: (f2, b2).
std::vector<measured_costs> costs_for(const layer_list& layers, const layout_space& space,
                                      double f1, double b1, double f2, double b2) {
  std::vector<measured_costs> costs;
  for (auto [threads, samples] : costs_needed(layers, space)) {
    costs.push_back(threads == 1 ? linear_costs(1, samples, f1, b1)
                                 : linear_costs(threads, samples, f2, b2));
  }
  return costs;
}

layout_space small_space() {
  layout_space space;
  space.batch = 8;
  space.stage_counts = {1, 2};
  space.cores = 2;
  space.microbatch_counts = {1, 2, 4, 8};
  space.partitions = {"uniform", "time"};
  space.hop_ms = 0;
  space.step_ms = 0;
  return space;
}

const layout* find(const std::vector<layout>& ranking, std::size_t stages, std::size_t m,
                   schedule_kind kind, const std::string& partition = "uniform") {
  for (const auto& l : ranking) {
    // Specs that gave the same cut share a layout: "uniform,time".
    auto specs = "," + l.partition_spec + ",";
    if (l.stages == stages && l.microbatches == m && l.schedule == kind &&
        specs.find("," + partition + ",") != std::string::npos) {
      return &l;
    }
  }
  return nullptr;
}

} // namespace

TEST_CASE("the planner needs costs at each stage count's threads and every micro-batch size") {
  auto layers = four_layers();
  auto space = small_space();
  auto needed = costs_needed(layers, space);
  // One stage takes both cores, two stages one each; sizes 8, 4, 2, 1 for 1, 2, 4, 8 parts.
  std::vector<std::pair<std::size_t, int64_t>> expected{{1, 8}, {1, 4}, {1, 2}, {1, 1},
                                                        {2, 8}, {2, 4}, {2, 2}, {2, 1}};
  CHECK(needed == expected);
  space.thread_counts = {1, 2};
  space.stage_counts = {1};
  space.microbatch_counts = {3};
  // tensor_split(8, 3) gives 3, 3, 2: the largest part is profiled.
  expected = {{1, 3}, {2, 3}};
  CHECK(costs_needed(layers, space) == expected);
}

TEST_CASE("one stage with every core ranks first when a second thread halves the time") {
  auto layers = four_layers();
  auto space = small_space();
  auto ranking = rank_layouts(layers, costs_for(layers, space, 1, 2, 0.5, 1), space);
  const auto& best = ranking.front();
  CHECK(best.stages == 1);
  CHECK(best.threads == 2);
  CHECK(best.microbatches == 1); // every count ties at 48 ms: the fewest wins
  CHECK(best.step_ms == doctest::Approx(4 * 8 * 1.5));
  CHECK(best.fits);
  // Two one-thread stages of two layers, 8 micro-batches of 1 sample, 1F1B: (m + p - 1) x
  // (F + B) = 9 x (2 + 4) ms.
  auto two = find(ranking, 2, 8, schedule_kind::one_f_one_b);
  REQUIRE(two != nullptr);
  CHECK(two->threads == 1);
  CHECK(two->step_ms == doctest::Approx(54));
  CHECK(two->cut.to_string() == "[0, 2) [2, 4)");
  CHECK(two->stash == doctest::Approx(2)); // stage 0 holds p - 0 micro-batches
  for (std::size_t i = 1; i < ranking.size(); ++i) {
    CHECK(ranking[i - 1].step_ms <= ranking[i].step_ms);
  }
}

TEST_CASE("two stages rank first when a second thread barely helps, at the most micro-batches") {
  auto layers = four_layers();
  auto space = small_space();
  auto ranking = rank_layouts(layers, costs_for(layers, space, 1, 2, 0.9, 1.8), space);
  const auto& best = ranking.front();
  CAPTURE(best.to_string());
  CHECK(best.stages == 2);
  CHECK(best.threads == 1);
  CHECK(best.microbatches == 8);
  CHECK(best.step_ms <= 54 + 1e-9);
  auto one = find(ranking, 1, 1, schedule_kind::one_f_one_b);
  REQUIRE(one != nullptr);
  CHECK(one->step_ms == doctest::Approx(4 * 8 * 2.7));
  CHECK(best.step_ms < one->step_ms);
  // The engine's own costs count: a hop and a fixed cost per step.
  space.hop_ms = 1;
  space.step_ms = 5;
  auto with_overheads = rank_layouts(layers, costs_for(layers, space, 1, 2, 0.9, 1.8), space);
  auto one_again = find(with_overheads, 1, 1, schedule_kind::one_f_one_b);
  REQUIRE(one_again != nullptr);
  CHECK(one_again->step_ms == doctest::Approx(4 * 8 * 2.7 + 5)); // no hops in one stage
  auto two = find(with_overheads, 2, 8, schedule_kind::one_f_one_b);
  auto two_before = find(ranking, 2, 8, schedule_kind::one_f_one_b);
  REQUIRE(two != nullptr);
  REQUIRE(two_before != nullptr);
  CHECK(two->step_ms > two_before->step_ms + 5);
}

TEST_CASE("layouts over a memory cap rank after every layout that fits") {
  auto layers = four_layers();
  auto space = small_space();
  space.max_stash = 1;
  auto ranking = rank_layouts(layers, costs_for(layers, space, 1, 2, 0.9, 1.8), space);
  CHECK(ranking.front().fits);
  CHECK(ranking.front().stash <= 1);
  bool over = false;
  for (const auto& l : ranking) {
    CAPTURE(l.to_string());
    CHECK(l.fits == (l.stash <= 1));
    CHECK((!over || !l.fits)); // once over the cap, only layouts over it follow
    over = over || !l.fits;
  }
  CHECK(over);
  // In bytes: 100 bytes of output per sample and layer. One stage of 4 layers keeps
  // 4 x 100 x samples per micro-batch, 3,200 bytes for the whole batch at once.
  space.max_stash = 0;
  space.max_stash_bytes = 1000;
  auto by_bytes = rank_layouts(layers, costs_for(layers, space, 1, 2, 0.5, 1), space);
  auto whole = find(by_bytes, 1, 1, schedule_kind::one_f_one_b);
  REQUIRE(whole != nullptr);
  CHECK(whole->stash_bytes == 3200);
  CHECK_FALSE(whole->fits);
  CHECK(by_bytes.front().fits);
  CHECK(by_bytes.front().stash_bytes <= 1000);
  CHECK(by_bytes.front().stages == 1);
  CHECK(by_bytes.front().microbatches >= 4);
}

TEST_CASE("the memory model: parameters, gradients, the optimizer's state (sharded or not) and "
          "the stash, and a cap on it per stage") {
  // 1,000 parameters: 4,000 bytes each for the values and the gradients; Adam keeps 2 tensors.
  auto adam = estimate_memory(1000, 2, 500);
  CHECK(adam.parameters == 4000);
  CHECK(adam.gradients == 4000);
  CHECK(adam.optimizer == 8000);
  CHECK(adam.activations == 500);
  CHECK(adam.total() == 16500);
  CHECK(estimate_memory(1000, 1, 0).optimizer == 4000);                   // SGD with momentum
  CHECK(estimate_memory(1000, 2, 0, /*shard_ways=*/4).optimizer == 2000); // ZeRO over 4
  CHECK_THROWS_AS(estimate_memory(-1, 0, 0), invalid_argument);
  // What a stage keeps per micro-batch: its input, each layer's retained bytes, less what its
  // layers after the first free of their inputs (a ReLU after a batch norm frees its output).
  auto chain = linear_costs(1, 1, 1, 2).layers; // 100 bytes of output each
  chain[2].freed_input_bytes = 100;
  CHECK(kept_bytes(chain, 1, 4) == doctest::Approx(100 + 300 - 100));
  CHECK(kept_bytes(chain, 2, 4) == doctest::Approx(100 + 200)); // its input is the stage's own
  // A view of its input (a flatten) keeps nothing; a layer not measured counts its output.
  chain[1].retained_bytes = 0;
  CHECK(kept_bytes(chain, 1, 4) == doctest::Approx(100 + 0 + 200 - 100));
  chain[1].retained_bytes = -1;
  CHECK(kept_bytes(chain, 1, 4) == doctest::Approx(100 + 300 - 100));

  // Four layers of 72 parameters, 100 bytes of output per sample; SGD with momentum.
  auto layers = four_layers();
  auto space = small_space();
  space.optimizer_state = 1;
  auto ranking = rank_layouts(layers, costs_for(layers, space, 1, 2, 0.5, 1), space);
  auto whole = find(ranking, 1, 1, schedule_kind::one_f_one_b);
  auto halves = find(ranking, 2, 8, schedule_kind::one_f_one_b);
  REQUIRE(whole != nullptr);
  REQUIRE(halves != nullptr);
  // One stage: 288 parameters x 12 bytes, and the whole batch's 3,200 bytes of activations.
  CHECK(whole->memory_bytes == 288 * 12 + 3200);
  // Two stages of 144 parameters; the fuller (the first: 1F1B stashes 2 of 8 micro-batches of
  // one sample there, 200 bytes each).
  CHECK(halves->memory_bytes == 144 * 12 + halves->stash_bytes);
  // A cap per stage leaves out every layout over it, and ranks them last.
  space.max_memory_bytes = 2500;
  auto capped = rank_layouts(layers, costs_for(layers, space, 1, 2, 0.5, 1), space);
  CHECK(capped.front().fits);
  for (const auto& l : capped) {
    CAPTURE(l.to_string());
    CHECK(l.fits == (l.memory_bytes <= 2500));
  }
  CHECK(capped.front().stages == 2);
}

TEST_CASE("the memory model counts how far a stage's peak rises above its stash while one "
          "micro-batch's layer runs, and a GPU's workspaces where a layer multiplies matrices") {
  auto profile = linear_costs(1, 1, 1, 2).layers; // each keeps its 100 bytes of output
  CHECK(working_bytes(profile, 0, 4) == 0);       // not measured: nothing counted
  profile[1].forward_working_bytes = 250;         // a forward's temporaries
  profile[2].backward_working_bytes = 120;        // a backward's, with its input gradient
  profile[3].backward_working_bytes = 10;
  // The micro-batch holds what its layers up to the running one keep (the stage's input, 100,
  // and 100 a layer), a backward also its output's gradient (100) and, but in the stage's last
  // layer, the gradient the stage received (100); less what it keeps whole. Layers 0-3 keep
  // 400: fc1's forward reaches 200 + 250, fc2's backward 300 + 220 + 100.
  CHECK(working_bytes(profile, 0, 4) == doctest::Approx(300 + 220 + 100 - 400));
  CHECK(working_bytes(profile, 0, 2) == doctest::Approx(200 + 250 - 200));
  CHECK(working_bytes(profile, 2, 4) == doctest::Approx(200 + 220 + 100 - 300));
  CHECK(working_bytes(profile, 3, 4) == doctest::Approx(10 + 100));
  CHECK(working_bytes(profile, 2, 2) == 0);
  CHECK_THROWS_AS(working_bytes(profile, 3, 5), invalid_argument);
  // fc3 frees fc2's output in the forward (a ReLU after a batch norm): the stage keeps 200, and
  // fc2's backward runs beside fc2's input alone (100) with its 320.
  profile[3].freed_input_bytes = 100;
  CHECK(working_bytes(profile, 2, 4) == doctest::Approx(100 + 320 - 200));
  profile[3].freed_input_bytes = 0;
  // Recomputing, the last stage's first forward runs without autograd beside a stash of inputs
  // alone: fc3's peak then (300) with its input (100), against the 300 - 100 a rebuilt
  // micro-batch adds to its input.
  profile[3].no_grad_forward_bytes = 300;
  CHECK(working_bytes(profile, 3, 4, recompute_mode::always) == doctest::Approx(300 - 100));
  profile[3].no_grad_forward_bytes = 400;
  CHECK(working_bytes(profile, 2, 4, recompute_mode::always) == doctest::Approx(100 + 400 - 200));
  CHECK(working_bytes(profile, 2, 4, recompute_mode::never) == doctest::Approx(220));
  profile[1].no_grad_forward_bytes = 900; // not the last stage: its forward builds the graph
  CHECK(working_bytes(profile, 0, 2, recompute_mode::always) == doctest::Approx(250));
  profile[3].no_grad_forward_bytes = -1;
  profile[1].no_grad_forward_bytes = -1;
  profile[2].workspace_bytes = 4096; // cuBLAS's workspaces, made by fc2 on a GPU
  auto cut = partition_uniform(4, 2);
  auto plan = make_schedule(schedule_kind::gpipe, 2, 8);
  // Micro-batches of two samples: the working set scales with them; the workspace does not.
  auto memory = stage_memory(profile, cut, plan, 1, 2, 0);
  CHECK(memory.working == 2 * 220);
  CHECK(memory.workspace == 4096);
  CHECK(memory.activations == 8 * 2 * 300);
  CHECK(memory.total() == 144 * 8 + 8 * 2 * 300 + 2 * 220 + 4096);
  auto first = stage_memory(profile, cut, plan, 0, 2, 0);
  CHECK(first.working == 2 * 250);
  CHECK(first.workspace == 0); // its layers multiply no matrices on the GPU
  // In a V each stage holds two chunks, each on a CUDA stream with its own workspaces: stage 0
  // holds fc0 and fc3 (chunks 0 and 3 of four), fc3's workspace only; stage 1 holds fc1 and fc2.
  profile[3].workspace_bytes = 1024;
  auto v = make_schedule(schedule_kind::dualpipe_v, 2, 8, 2);
  auto quarters = partition_uniform(4, 4);
  CHECK(stage_memory(profile, quarters, v, 0, 1, 0).workspace == 1024);
  profile[1].workspace_bytes = 2048;
  CHECK(stage_memory(profile, quarters, v, 1, 1, 0).workspace == 2048 + 4096);
  // One chunk per stage keeps one stream: the largest of its layers'.
  CHECK(stage_memory(profile, cut, plan, 1, 2, 0).workspace == 4096);
}

TEST_CASE("the memory model adds each action's working set to what the stage holds during that "
          "action: a split B's, before it has kept what its W reads") {
  // Two stages of two layers of 100 bytes of output per sample; stage 1 keeps 300 per
  // micro-batch (its input and two outputs). fc2's backward needs 120 above its input gradient,
  // fc3's 10; their B keep 50 and 70 for W.
  auto profile = linear_costs(1, 1, 1, 2).layers;
  auto cut = partition_uniform(4, 2);
  profile[2].backward_working_bytes = 120;
  profile[3].backward_working_bytes = 10;
  profile[2].weight_kept_bytes = 50;
  profile[3].weight_kept_bytes = 70;
  // While fc2's backward runs the micro-batch holds fc2's input and output (200), both
  // gradients (200) and its 120, and fc3 has kept its 70 for W, fc2 not yet its 50: 170 above
  // the 420 it holds once B ends. fc3's B (110 above the whole entry) comes before anything is
  // kept for W: -10.
  CHECK(working_bytes(profile, 2, 4) == doctest::Approx(200 + 320 - 300));
  // ZB-H1, stage 1: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3. Its stash peaks after B1 (two entries
  // and what their B kept: 840); B1's working set rises 170 above that, not fc2's 220.
  auto zb = make_schedule(schedule_kind::zb_h1, 2, 4);
  auto split = stage_memory(profile, cut, zb, 1, 1, 0);
  CHECK(split.activations == 2 * (300 + 120));
  CHECK(split.working == 170);
  // Two samples a micro-batch: both scale.
  auto doubled = stage_memory(profile, cut, zb, 1, 2, 0);
  CHECK(doubled.activations == 2 * 2 * 420);
  CHECK(doubled.working == 2 * 170);
  // A B that keeps more for W than its working set needs: the stash's peak is the stage's.
  profile[2].weight_kept_bytes = 400;
  CHECK(stage_memory(profile, cut, zb, 1, 1, 0).working == 0);
  profile[2].weight_kept_bytes = 50;
  // A whole backward keeps nothing for W: 1F1B holds one entry, and fc2's 220 above it.
  auto fused = stage_memory(profile, cut, make_schedule(schedule_kind::one_f_one_b, 2, 4), 1, 1, 0);
  CHECK(fused.activations == 300);
  CHECK(fused.working == 220);
  // A forward's working set counts beside what is stashed as it runs: stage 0 of 1F1B stashes
  // two micro-batches (200 each) when F1 runs, and fc1's forward needs 250 beyond what it keeps.
  profile[1].forward_working_bytes = 250;
  auto first = stage_memory(profile, cut, make_schedule(schedule_kind::one_f_one_b, 2, 4), 0, 1, 0);
  CHECK(first.activations == 2 * 200);
  CHECK(first.working == 250);
}

TEST_CASE("recomputation in the memory model: inputs stashed, one micro-batch rebuilt, each "
          "recomputed backward charged its forward, and chosen when only it fits") {
  // Four layers of 100 bytes of output per sample, two stages of two layers, GPipe over 8
  // micro-batches of one sample: each stage stashes all 8.
  auto profile = linear_costs(1, 1, 1, 2).layers;
  auto cut = partition_uniform(4, 2);
  auto plan = make_schedule(schedule_kind::gpipe, 2, 8);
  // The second stage keeps its input (100) and its layers' outputs (200) per micro-batch.
  CHECK(stashed_bytes(profile, cut, plan, 1, 1) == doctest::Approx(8 * 300));
  // Recomputed: 7 inputs and one micro-batch rebuilt whole; except_last keeps its last whole,
  // which GPipe backs up first (B7 .. B0): it is gone before the first is rebuilt.
  CHECK(stashed_bytes(profile, cut, plan, 1, 1, recompute_mode::always, 8) ==
        doctest::Approx(7 * 100 + 300));
  CHECK(stashed_bytes(profile, cut, plan, 1, 1, recompute_mode::except_last, 8) ==
        doctest::Approx(7 * 100 + 300));
  // 1F1B backs the last micro-batch up last: B6 rebuilds its entry beside F7's whole one.
  CHECK(stashed_bytes(profile, cut, make_schedule(schedule_kind::one_f_one_b, 2, 8), 0, 1,
                      recompute_mode::except_last, 8) == doctest::Approx(2 * 200));
  // except_last of one micro-batch recomputes nothing; the first stage stashes no input.
  CHECK(stashed_bytes(profile, cut, make_schedule(schedule_kind::gpipe, 2, 1), 1, 1,
                      recompute_mode::except_last, 1) == doctest::Approx(300));
  CHECK(stashed_bytes(profile, cut, plan, 0, 1, recompute_mode::always, 8) == doctest::Approx(200));
  // A split backward: between its B and its W a micro-batch also holds the gradients the weight
  // pass kept for W. ZB-H1 over 4 micro-batches, stage 1: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3,
  // at most two entries, both past their B after B1.
  auto zb = make_schedule(schedule_kind::zb_h1, 2, 4);
  CHECK(stashed_bytes(profile, cut, zb, 1, 1) == doctest::Approx(2 * 300));
  profile[2].weight_kept_bytes = 50;
  profile[3].weight_kept_bytes = 70;
  profile[0].weight_kept_bytes = 1000; // the model's first part: its B computes nothing
  CHECK(stashed_bytes(profile, cut, zb, 1, 1) == doctest::Approx(2 * (300 + 120)));
  CHECK(stashed_bytes(profile, cut, zb, 0, 1) == doctest::Approx(2 * 200));
  // A whole backward keeps nothing for W: 1F1B's stash is as before.
  auto one = make_schedule(schedule_kind::one_f_one_b, 2, 4);
  CHECK(stashed_bytes(profile, cut, one, 1, 1) == doctest::Approx(300));
  // Recomputed and split: B rebuilds the entry, which W frees with what B kept; after B1 both
  // entries are rebuilt, as without recomputation; before it, F1's input beside B0's entry.
  CHECK(stashed_bytes(profile, cut, zb, 1, 1, recompute_mode::always, 4) ==
        doctest::Approx(2 * (300 + 120)));
  auto gpipe4 = make_schedule(schedule_kind::gpipe, 2, 4); // F0..F3 then B3..B0: 3 inputs, 1 whole
  CHECK(stashed_bytes(profile, cut, gpipe4, 1, 1, recompute_mode::always, 4) ==
        doctest::Approx(3 * 100 + 300));
  for (auto& l : profile) {
    l.weight_kept_bytes = -1;
  }
  auto memory = stage_memory(profile, cut, plan, 1, 1, 1, recompute_mode::always, 8);
  CHECK(memory.parameters == 144 * 4);
  CHECK(memory.working == 0); // not measured
  CHECK(memory.total() == 144 * 12 + 1000);

  std::vector<action_costs> costs{{1, 2, 3, 5, 0}, {2, 1, 1, -1, 0}};
  auto always = costs;
  charge_recomputation(always, recompute_mode::always, 4);
  CHECK(always[0].backward == doctest::Approx(3));
  CHECK(always[0].fused == doctest::Approx(6));
  CHECK(always[1].fused == doctest::Approx(-1)); // not given stays not given
  auto except_last = costs;
  charge_recomputation(except_last, recompute_mode::except_last, 4);
  CHECK(except_last[1].backward == doctest::Approx(1 + 0.75 * 2));
  auto never = costs;
  charge_recomputation(never, recompute_mode::never, 4);
  CHECK(never[0].backward == doctest::Approx(2));

  // 1F1B, SGD with momentum: 2 stages x 8 micro-batches hold 1,728 bytes of state each and
  // stage 0 stashes 2 micro-batches of 200 bytes (2,128 in all); recomputed, 200 (1,928), and
  // stage 1 then holds the most: 2,028. Under a cap of 2,100 only recomputation fits.
  auto layers = four_layers();
  auto space = small_space();
  space.schedules = {schedule_kind::one_f_one_b};
  space.optimizer_state = 1;
  space.max_memory_bytes = 2100;
  space.recompute = {recompute_mode::never, recompute_mode::except_last, recompute_mode::always};
  auto ranking = rank_layouts(layers, costs_for(layers, space, 1, 2, 0.5, 1), space);
  const auto& best = ranking.front();
  CAPTURE(best.to_string());
  CHECK(best.fits);
  CHECK(best.recompute == recompute_mode::always);
  CHECK(best.stages == 2);
  CHECK(best.microbatches == 8);
  CHECK(best.memory_bytes == 2028);
  CHECK(best.to_string().find("recompute always") != std::string::npos);
  auto kept = std::find_if(ranking.begin(), ranking.end(), [&](const layout& l) {
    return l.recompute == recompute_mode::never && l.stages == 2 && l.microbatches == 8;
  });
  REQUIRE(kept != ranking.end());
  CHECK_FALSE(kept->fits);
  CHECK(kept->memory_bytes == 2128);
  CHECK(kept->step_ms < best.step_ms); // recomputing costs a forward per backward
  // Without a cap the fastest never recomputes.
  space.max_memory_bytes = 0;
  auto free = rank_layouts(layers, costs_for(layers, space, 1, 2, 0.5, 1), space);
  CHECK(free.front().recompute == recompute_mode::never);
  space.recompute.clear();
  CHECK_THROWS_AS(rank_layouts(layers, costs_for(layers, space, 1, 2, 0.5, 1), space),
                  invalid_argument);
}

TEST_CASE("costs measured at another size are scaled, and missing thread counts are named") {
  auto layers = four_layers();
  auto space = small_space();
  space.stage_counts = {1};
  // Only 4-sample micro-batches were measured: a whole batch of 8 costs twice as much.
  auto ranking = rank_layouts(layers, {linear_costs(2, 4, 0.5, 1)}, space);
  auto whole = find(ranking, 1, 1, schedule_kind::one_f_one_b);
  REQUIRE(whole != nullptr);
  CHECK(whole->step_ms == doctest::Approx(4 * 8 * 1.5));
  CHECK_THROWS_WITH_AS(rank_layouts(layers, {linear_costs(1, 4, 1, 2)}, space),
                       "rank_layouts: no costs measured at 2 thread(s) per stage",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(rank_layouts(layers, {linear_costs(2, 4, 1, 2, 100, 3)}, space),
                       "rank_layouts: costs at 2 thread(s), 4 samples cover 3 of the 4 layers",
                       std::invalid_argument);
}

TEST_CASE("more stages than cores run one thread each and pay for sharing the cores") {
  auto layers = four_layers();
  auto space = small_space();
  space.stage_counts = {4};
  space.microbatch_counts = {8};
  auto ranking = rank_layouts(layers, costs_for(layers, space, 1, 2, 0.5, 1), space);
  auto four = find(ranking, 4, 8, schedule_kind::one_f_one_b);
  REQUIRE(four != nullptr);
  CHECK(four->threads == 1);
  // Four threads on two cores: each action takes twice as long, (8 + 3) x (2 + 4) ms.
  CHECK(four->step_ms == doctest::Approx(66));
  // Interleaving needs two chunks per stage: 8 parts of 4 layers cannot be cut.
  for (const auto& l : ranking) {
    CHECK(l.schedule != schedule_kind::interleaved);
  }
}

TEST_CASE("split backward costs: B is the part's input gradient, W walks the inner layers again") {
  std::vector<layer_profile> profile(3);
  for (std::size_t i = 0; i < 3; ++i) {
    profile[i].forward_ms = 1;
    profile[i].backward_ms = 2;
    profile[i].input_backward_ms = i == 0 ? 0 : 1.25;
    profile[i].weight_backward_ms = 1;
  }
  auto costs = costs_of(profile, partition_at(3, {1}));
  REQUIRE(costs.size() == 2);
  // The model's first part: no input gradient; its W is the whole fused backward.
  CHECK(costs[0].backward == 0);
  CHECK(costs[0].weight == doctest::Approx(2));
  CHECK(costs[0].fused == doctest::Approx(2));
  // Layers 1 and 2: B = 1.25 + 1.25; W = 1 + 1 + the inner layer's input gradient again.
  CHECK(costs[1].backward == doctest::Approx(2.5));
  CHECK(costs[1].weight == doctest::Approx(3.25));
  CHECK(costs[1].fused == doctest::Approx(4));
  // A fused schedule pays the fused backward, a split one B + W.
  auto fused = simulate(make_schedule(schedule_kind::one_f_one_b, 2, 1), 1, costs);
  auto split = simulate(make_schedule(schedule_kind::zb_h1, 2, 1), 1, costs);
  CHECK(fused.makespan == doctest::Approx(1 + 2 + 4 + 2));
  // Stage 1's W (3.25) outlasts stage 0's (2), which starts when stage 1's B is done.
  CHECK(split.makespan == doctest::Approx(1 + 2 + 2.5 + 3.25));
  // Without a split profile, B and W take half of the fused backward each.
  for (auto& p : profile) {
    p.input_backward_ms = 0;
    p.weight_backward_ms = 0;
  }
  auto halves = costs_of(profile, partition_at(3, {1}));
  CHECK(halves[1].backward == doctest::Approx(2));
  CHECK(halves[1].weight == doctest::Approx(2));
}

TEST_CASE("specs that give the same cut are one layout, named by both") {
  auto layers = four_layers();
  auto space = small_space();
  space.stage_counts = {2};
  space.microbatch_counts = {2};
  space.schedules = {schedule_kind::one_f_one_b};
  space.partitions = {"uniform", "params", "time"};
  auto ranking = rank_layouts(layers, costs_for(layers, space, 1, 2, 0.5, 1), space);
  REQUIRE(ranking.size() == 1); // equal layers: every spec cuts [0, 2) [2, 4)
  CHECK(ranking[0].partition_spec == "uniform,params,time");
}

TEST_CASE("projections charge the link for activations and the all-reduce for replicas") {
  auto layers = four_layers();
  layout_space space;
  space.batch = 8;
  space.devices = 4;
  space.stage_counts = {1, 2, 4};
  space.replica_counts = {1, 2, 4};
  space.microbatch_counts = {2};
  space.schedules = {schedule_kind::gpipe, schedule_kind::one_f_one_b};
  space.partitions = {"uniform"};
  space.hop_ms = 0;
  space.step_ms = 0;
  space.link_gbps = 1; // 1e6 bytes per ms
  space.link_latency_ms = 0.5;
  auto costs = std::vector<measured_costs>{linear_costs(1, 4, 1, 2, 250000)};
  auto ranking = rank_layouts(layers, costs, space);
  // stages x replicas == 4 devices: 1 x 4 (one stage: 1F1B only), 2 x 2 and 4 x 1 (both
  // schedules); micro-batches of 1, 2 and 4 samples.
  REQUIRE(ranking.size() == 5);
  for (const auto& l : ranking) {
    CAPTURE(l.to_string());
    CHECK(l.stages * l.replicas == 4);
    if (l.stages == 4 && l.schedule == schedule_kind::gpipe) {
      // 4 samples per micro-batch x 250,000 bytes = 1 ms on the link, plus 0.5 ms latency.
      CHECK(l.send_ms == doctest::Approx(1.5));
      CHECK(l.allreduce_ms == 0);
      // GPipe over 4 one-layer stages, 2 micro-batches of F = 4, B = 8 ms, each hop 1.5 ms:
      // forwards end at 3 x (4 + 1.5) + 2 x 4 = 24.5, backwards take (2 + 3) x 8 + 3 x 1.5.
      CHECK(l.step_ms == doctest::Approx(24.5 + 40 + 4.5));
    }
    if (l.replicas == 4) {
      // One stage: 4 layers x 72 parameters x 4 bytes, ring all-reduce 2 (r - 1) / r of it,
      // 2 (r - 1) latencies.
      CHECK(l.send_ms == 0);
      CHECK(l.allreduce_ms == doctest::Approx(6 * 0.5 + 4.0 * 288 * 2 * 3 / 4 / 1e6));
    }
  }
}
