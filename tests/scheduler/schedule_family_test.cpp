// The schedules added after the first zero-bubble ones: interleaved zero bubble, V-Min and
// DualPipeV, and the whole backward (a B without a W) that DualPipeV mixes with split ones.
#include <algorithm>
#include <string>

#include <doctest/doctest.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/schedule.hpp>

using namespace actorpipe;

namespace {

// `s` without its W actions.
schedule without_weights(const schedule& s) {
  schedule result(s.size(), s.placement);
  for (std::size_t i = 0; i < s.size(); ++i) {
    std::copy_if(s[i].begin(), s[i].end(), std::back_inserter(result[i]),
                 [](const action& a) { return a.kind != action_kind::weight; });
  }
  return result;
}

double max_peak(const schedule& s) {
  double most = 0;
  for (const auto& program : s) {
    most = std::max(most, peak_stash(program, chunks_of(s)));
  }
  return most;
}

} // namespace

TEST_CASE("interleaved zero bubble: interleaved 1F1B's order with W deferred by the stage index, "
          "valid for any size it takes, and shorter than interleaved 1F1B") {
  CHECK(parse_schedule_kind("interleaved-zb") == schedule_kind::interleaved_zb);
  CHECK(to_string(schedule_kind::interleaved_zb) == "interleaved-zb");
  CHECK(chunks_for(schedule_kind::interleaved_zb, 3) == 3);
  CHECK(splits_backward(schedule_kind::interleaved_zb));
  for (std::size_t p = 1; p <= 6; ++p) {
    for (std::size_t v = 2; v <= 3; ++v) {
      for (std::size_t m = p; m <= 4 * p; m += p) {
        CAPTURE(p);
        CAPTURE(v);
        CAPTURE(m);
        auto zb = make_schedule(schedule_kind::interleaved_zb, p, m, v);
        auto plain = make_schedule(schedule_kind::interleaved, p, m, v);
        REQUIRE_NOTHROW(validate(zb, m, true));
        CHECK(chunks_of(zb) == v);
        CHECK(without_weights(zb) == plain);
        // Stage i holds each micro-batch for at most i more backwards than interleaved 1F1B.
        for (std::size_t i = 0; i < p; ++i) {
          CHECK(peak_stash(zb[i], v) <=
                peak_stash(plain[i], v) + static_cast<double>(i) / static_cast<double>(v) + 1e-9);
        }
        // Equal costs per chunk (F = B = W = 1, a fused backward 2): from 2 stages the split
        // backward fills the cool-down.
        auto fast = simulate(zb, m, {{1, 1, 1}}).makespan;
        auto slow = simulate(plain, m, {{1, 1, 1}}).makespan;
        CHECK(fast <= slow);
        if (p >= 2) {
          CHECK(fast < slow);
        }
      }
    }
  }
  CHECK_THROWS_WITH_AS(make_schedule(schedule_kind::interleaved_zb, 4, 6, 2),
                       doctest::Contains("the interleaved-zb schedule needs microbatches (6) to be "
                                         "a multiple of stages (4)"),
                       actorpipe::invalid_argument);
}

TEST_CASE("V-Min: a valid V for any size, within about a third of 1F1B's activations, trading "
          "time for it") {
  CHECK(parse_schedule_kind("v-min") == schedule_kind::v_min);
  CHECK(chunks_for(schedule_kind::v_min, 1) == 2);
  for (std::size_t p = 1; p <= 12; ++p) {
    for (std::size_t m = 1; m <= 24; ++m) {
      CAPTURE(p);
      CAPTURE(m);
      auto s = make_schedule(schedule_kind::v_min, p, m, 2);
      CHECK(s.placement == chunk_placement::v_shape);
      REQUIRE_NOTHROW(validate(s, m, true));
      // ceil(2p / 3) + 1 chunk activations: a third of 1F1B's p micro-batches, plus one chunk.
      auto cap = static_cast<double>((2 * p + 2) / 3 + 1) / 2;
      CHECK(max_peak(s) <= cap);
      if (p >= 6 && m >= 2 * p) {
        auto half = make_schedule(schedule_kind::v_half, p, m, 2);
        CHECK(max_peak(s) < max_peak(half));
        CHECK(simulate(s, m, {{1, 1, 1}}).makespan >= simulate(half, m, {{1, 1, 1}}).makespan);
      }
    }
  }
}

TEST_CASE("DualPipeV: a valid V with DeepSeek's phases, about 1F1B's activations, and whole "
          "backwards in its main phase") {
  CHECK(parse_schedule_kind("dualpipe-v") == schedule_kind::dualpipe_v);
  CHECK(to_string(schedule_kind::dualpipe_v) == "dualpipe-v");
  CHECK(chunks_for(schedule_kind::dualpipe_v, 1) == 2);
  // Two stages, four micro-batches: stage 0 holds virtual stages 0 and 3, stage 1 holds 1 and 2.
  auto s = make_schedule(schedule_kind::dualpipe_v, 2, 4, 2);
  CHECK(to_string(s[0]) ==
        "F0 F1 F2 F0@1 B0@1 W0@1 F1@1 F3 B1@1 F2@1 B0 B2@1 F3@1 B1 B3@1 B2 W2 B3 W3");
  for (std::size_t p = 1; p <= 8; ++p) {
    for (std::size_t m = 2 * p; m <= 2 * p + 12; ++m) {
      CAPTURE(p);
      CAPTURE(m);
      auto d = make_schedule(schedule_kind::dualpipe_v, p, m, 2);
      CHECK(d.placement == chunk_placement::v_shape);
      REQUIRE_NOTHROW(validate(d, m, true));
      // At most 2p + 1 chunk activations on any stage: 1F1B's p micro-batches and half of one
      // more.
      for (std::size_t i = 0; i < p; ++i) {
        CHECK(peak_stash(d[i], 2) <= static_cast<double>(p) + 0.5);
      }
      // The main phase's backwards are whole (a lone B), the first p - i - 1 and the last
      // rounds split (B ... W).
      for (std::size_t i = 0; i < p; ++i) {
        auto split = split_backwards(d[i]);
        auto splits = static_cast<std::size_t>(std::count(split.begin(), split.end(), true));
        CHECK(splits == 2 * (p - i - 1) + (i + 1));
      }
    }
  }
  CHECK_THROWS_WITH_AS(make_schedule(schedule_kind::dualpipe_v, 3, 5, 2),
                       doctest::Contains("dualpipe-v schedule needs microbatches (5) >= 2 x "
                                         "stages (6)"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(make_schedule(schedule_kind::dualpipe_v, 3, 6, 3),
                       doctest::Contains("dualpipe-v runs two chunks per stage in a V, not 3"),
                       actorpipe::invalid_argument);
}

TEST_CASE("in a schedule that splits backward, a B without a W is a whole backward: valid, "
          "charged as one, and it frees its stash") {
  schedule mixed{{{action_kind::forward, 0, 0},
                  {action_kind::forward, 1, 0},
                  {action_kind::backward, 0, 0},
                  {action_kind::backward, 1, 0},
                  {action_kind::weight, 1, 0}}};
  CHECK(split_backwards(mixed[0]) == std::vector<bool>{false, false, false, true, false});
  REQUIRE_NOTHROW(validate(mixed, 2, true));
  CHECK(splits_backward(mixed));
  // F + F + whole (fused 4) + B (2) + W (3); without a fused cost the whole one is B + W.
  action_costs costs{1, 2, 3, 4};
  CHECK(simulate(mixed, 2, {costs}).makespan == doctest::Approx(1 + 1 + 4 + 2 + 3));
  costs.fused = -1;
  CHECK(simulate(mixed, 2, {costs}).makespan == doctest::Approx(1 + 1 + 5 + 2 + 3));
  CHECK(peak_stash(mixed[0], 1) == doctest::Approx(2));
  // The W of a whole backward is still refused: it comes before its B.
  schedule early{
    {{action_kind::forward, 0, 0}, {action_kind::weight, 0, 0}, {action_kind::backward, 0, 0}}};
  CHECK_THROWS_WITH_AS(validate(early, 1, true),
                       doctest::Contains("weight gradient of micro-batch 0 before its backward"),
                       actorpipe::invalid_argument);
}

TEST_CASE("the built-in schedules' names parse back, and an unknown one lists them all") {
  for (auto kind : {schedule_kind::gpipe, schedule_kind::one_f_one_b, schedule_kind::interleaved,
                    schedule_kind::zb_h1, schedule_kind::zb_h2, schedule_kind::interleaved_zb,
                    schedule_kind::zb_v, schedule_kind::v_half, schedule_kind::v_min,
                    schedule_kind::dualpipe_v}) {
    CHECK(parse_schedule_kind(to_string(kind)) == kind);
    CHECK(known_schedules().find(to_string(kind)) != std::string::npos);
  }
  CHECK_THROWS_WITH_AS(parse_schedule_kind("dualpipe"),
                       doctest::Contains("unknown schedule 'dualpipe' (known: gpipe, 1f1b, "
                                         "interleaved, zb-h1, zb-h2, interleaved-zb, zb-v, v-half, "
                                         "v-min, dualpipe-v)"),
                       actorpipe::invalid_argument);
}

TEST_CASE("a link carries one transfer at a time each way, and the V's turn queues nothing") {
  // Two stages forwarding two micro-batches, each forward 1, each transfer 5: micro-batch 1's
  // activation leaves stage 0 at 2 but waits for the link until micro-batch 0's has arrived (6).
  auto forward_only = make_forward_schedule(2, 2);
  std::vector<action_costs> costs(2);
  for (auto& c : costs) {
    c.forward = 1;
    c.send = 5;
  }
  auto sim = simulate(forward_only, 2, costs);
  REQUIRE(sim.timeline[1].size() == 2);
  CHECK(sim.timeline[1][0].start == doctest::Approx(6));
  CHECK(sim.timeline[1][1].start == doctest::Approx(11));
  CHECK(sim.makespan == doctest::Approx(12));
  // In a V on one stage the turn stays on it: chunk 0's outputs reach chunk 1 without queueing.
  auto v = make_forward_schedule(1, 2, 2, chunk_placement::v_shape);
  costs[0].send = 5;
  auto turn = simulate(v, 2, costs);
  REQUIRE(turn.timeline[0].size() == 4);
  CHECK(turn.timeline[0][2].start == doctest::Approx(6)); // F0@1: F0 ended at 1, + 5
  CHECK(turn.timeline[0][3].start == doctest::Approx(7)); // F1@1: F1 ended at 2, + 5, no queue
}
