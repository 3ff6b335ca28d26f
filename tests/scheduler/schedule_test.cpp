#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include <unistd.h>

#include <doctest/doctest.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/schedule.hpp>

using namespace actorpipe;

TEST_CASE("GPipe runs all forwards, then all backwards in reverse") {
  auto s = make_schedule(schedule_kind::gpipe, 2, 3);
  REQUIRE(s.size() == 2);
  CHECK(to_string(s[0]) == "F0 F1 F2 B2 B1 B0");
  CHECK(to_string(s[1]) == "F0 F1 F2 B2 B1 B0");
}

TEST_CASE("1F1B warms up p - i - 1 forwards, alternates, then drains") {
  auto s = make_schedule(schedule_kind::one_f_one_b, 3, 5);
  CHECK(to_string(s[0]) == "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4");
  CHECK(to_string(s[1]) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4");
  CHECK(to_string(s[2]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4");
  auto few = make_schedule(schedule_kind::one_f_one_b, 4, 2);
  CHECK(to_string(few[0]) == "F0 F1 B0 B1");
  CHECK(to_string(few[3]) == "F0 B0 F1 B1");
}

TEST_CASE("built-in schedules are valid and bound their stash") {
  for (std::size_t p = 1; p <= 6; ++p) {
    for (std::size_t m = 1; m <= 9; ++m) {
      CAPTURE(p);
      CAPTURE(m);
      auto gpipe = make_schedule(schedule_kind::gpipe, p, m);
      auto ofob = make_schedule(schedule_kind::one_f_one_b, p, m);
      CHECK_NOTHROW(validate(gpipe, m, true));
      CHECK_NOTHROW(validate(ofob, m, true));
      CHECK_NOTHROW(validate(make_forward_schedule(p, m), m, false));
      for (std::size_t i = 0; i < p; ++i) {
        CHECK(peak_stash(gpipe[i]) == m);
        CHECK(peak_stash(ofob[i]) == std::min(p - i, m));
        auto zb = make_schedule(schedule_kind::zb_h1, p, m);
        CHECK_NOTHROW(validate(zb, m, true));
        CHECK(splits_backward(zb));
        CHECK(peak_stash(zb[i]) <= std::min(p, m));
      }
    }
  }
}

TEST_CASE("invalid schedules are rejected naming stage, action and micro-batch") {
  auto F = [](int32_t mb) { return action{action_kind::forward, mb}; };
  auto B = [](int32_t mb) { return action{action_kind::backward, mb}; };
  CHECK_THROWS_WITH_AS(
    validate({{B(0), F(0)}}, 1, true),
    doctest::Contains("stage 0, action 0 (B0): backward of micro-batch 0 before its forward"),
    actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(validate({{F(0), F(1), B(1)}}, 2, true),
                       doctest::Contains("stage 0 backs up 1 of 2 micro-batch chunks"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(validate({{F(0), F(0)}}, 1, false), doctest::Contains("forwarded twice"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(validate({{F(0), F(3)}}, 2, false),
                       doctest::Contains("micro-batch out of range"), actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(validate({{F(0), B(0)}}, 1, false),
                       doctest::Contains("forward-only schedule has a backward"),
                       actorpipe::invalid_argument);
  // Stage 0 wants B0 before sending F1; stage 1 wants F1 before F0: neither can move.
  CHECK_THROWS_WITH_AS(validate({{F(0), B(0), F(1), B(1)}, {F(1), F(0), B(1), B(0)}}, 2, true),
                       doctest::Contains("schedule deadlocks: stage 0 waits at action 1 (B0) for "
                                         "the gradient of micro-batch 0 from stage 1"),
                       actorpipe::invalid_argument);
}

TEST_CASE("schedule names and sizes are checked") {
  CHECK(parse_schedule_kind("gpipe") == schedule_kind::gpipe);
  CHECK(parse_schedule_kind("1f1b") == schedule_kind::one_f_one_b);
  CHECK(parse_schedule_kind("interleaved") == schedule_kind::interleaved);
  CHECK(parse_schedule_kind("zb-h1") == schedule_kind::zb_h1);
  CHECK_THROWS_WITH_AS(parse_schedule_kind("zb"), doctest::Contains("unknown schedule 'zb'"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(make_schedule(schedule_kind::interleaved, 4, 6, 2),
                       doctest::Contains("microbatches (6) to be a multiple of stages (4)"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(make_schedule(schedule_kind::one_f_one_b, 4, 8, 2),
                       doctest::Contains("runs one chunk per stage"), actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(make_schedule(schedule_kind::gpipe, 2, 0),
                       doctest::Contains("microbatches (0) must be >= 1"),
                       actorpipe::invalid_argument);
}

TEST_CASE("interleaved schedules are valid for 1-4 stages and 2-3 chunks") {
  for (std::size_t p = 1; p <= 4; ++p) {
    for (std::size_t v = 2; v <= 3; ++v) {
      for (std::size_t m = p; m <= 3 * p; m += p) {
        CAPTURE(p);
        CAPTURE(v);
        CAPTURE(m);
        auto s = make_schedule(schedule_kind::interleaved, p, m, v);
        CHECK(chunks_of(s) == v);
        CHECK_NOTHROW(validate(s, m, true));
        CHECK_NOTHROW(validate(make_forward_schedule(p, m, v), m, false));
      }
    }
  }
}

TEST_CASE("the simulator reproduces the textbook bubbles with equal costs") {
  // Forward 1, backward 2 per micro-batch and stage: GPipe and 1F1B take (m + p - 1) * 3, a
  // bubble of (p - 1) / (m + p - 1).
  for (std::size_t p : {2, 4, 8}) {
    for (std::size_t m : {4, 8, 16}) {
      CAPTURE(p);
      CAPTURE(m);
      std::vector<action_costs> costs{action_costs{1, 2, 0}};
      for (auto kind : {schedule_kind::gpipe, schedule_kind::one_f_one_b}) {
        auto r = simulate(make_schedule(kind, p, m), m, costs);
        CHECK(r.makespan == doctest::Approx(3.0 * static_cast<double>(m + p - 1)));
        for (auto b : r.bubble) {
          CHECK(b == doctest::Approx(static_cast<double>(p - 1) / static_cast<double>(m + p - 1)));
        }
      }
      // Interleaved with v chunks of 1/v the cost each: bubble (1/v)(p - 1) over m.
      if (m % p == 0) {
        for (std::size_t v : {2, 4}) {
          CAPTURE(v);
          auto dv = static_cast<double>(v);
          auto r = simulate(make_schedule(schedule_kind::interleaved, p, m, v), m,
                            {action_costs{1 / dv, 2 / dv, 0}});
          auto stretch = static_cast<double>(p - 1) / dv;
          CHECK(r.makespan == doctest::Approx(3.0 * (static_cast<double>(m) + stretch)));
          CHECK(r.mean_bubble() == doctest::Approx(stretch / (static_cast<double>(m) + stretch)));
        }
      }
      // ZB-H1 with F = B = W and m >= p (the paper's setting): a third of 1F1B's bubble, no
      // more memory than 1F1B's peak.
      if (m < p) {
        continue;
      }
      auto zb = simulate(make_schedule(schedule_kind::zb_h1, p, m), m, {action_costs{1, 1, 1}});
      auto ofob =
        simulate(make_schedule(schedule_kind::one_f_one_b, p, m), m, {action_costs{1, 1, 1}});
      auto work = 3.0 * static_cast<double>(m);
      CHECK((zb.makespan - work) == doctest::Approx((ofob.makespan - work) / 3));
      CHECK(*std::max_element(zb.peak_stash.begin(), zb.peak_stash.end()) <=
            *std::max_element(ofob.peak_stash.begin(), ofob.peak_stash.end()));
    }
  }
}

TEST_CASE("the simulator charges per-stage costs and send latency") {
  auto s = make_schedule(schedule_kind::gpipe, 2, 1);
  auto r = simulate(s, 1, {action_costs{1, 1, 0}, action_costs{3, 3, 0}}, 0.5);
  // F on stage 0 [0,1), F on stage 1 [1.5,4.5), B on stage 1 [4.5,7.5), B on stage 0 [8,9).
  CHECK(r.makespan == doctest::Approx(9));
  CHECK(r.timeline[1][0].start == doctest::Approx(1.5));
  CHECK(r.busy[0] == doctest::Approx(2));
  CHECK_THROWS_WITH_AS(simulate(s, 1, {action_costs{}, action_costs{}, action_costs{}}),
                       doctest::Contains("3 costs given for 2 virtual stages"),
                       actorpipe::invalid_argument);
}

TEST_CASE("actions parse as they print, and schedules load from JSON") {
  for (const auto* text : {"F0", "B12", "W3", "F1@1", "B7@3"}) {
    CHECK(to_string(parse_action(text)) == text);
  }
  for (const auto* bad : {"X1", "F", "Fa", "F1@", "F-1", ""}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(parse_action(bad), actorpipe::invalid_argument);
  }
  auto path = std::string("/tmp/actorpipe_schedule_test_") + std::to_string(::getpid()) + ".json";
  {
    std::ofstream out(path);
    out << R"({"programs": [["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]]})";
  }
  auto s = load_schedule(path);
  REQUIRE(s.size() == 2);
  CHECK(to_string(s[0]) == "F0 F1 B0 B1");
  CHECK_NOTHROW(validate(s, 2, true));
  {
    std::ofstream out(path);
    out << R"({"programs": [["F0", "G1"]]})";
  }
  CHECK_THROWS_WITH_AS(load_schedule(path), doctest::Contains("'G1' is not an action"),
                       actorpipe::invalid_argument);
  {
    std::ofstream out(path);
    out << R"({"stages": 2})";
  }
  CHECK_THROWS_WITH_AS(load_schedule(path), doctest::Contains("expected {\"programs\""),
                       actorpipe::invalid_argument);
  std::remove(path.c_str());
}

TEST_CASE("a weight action before its backward is rejected") {
  action f{action_kind::forward, 0, 0};
  action b{action_kind::backward, 0, 0};
  action w{action_kind::weight, 0, 0};
  CHECK_THROWS_WITH_AS(validate({{f, w, b}}, 1, true),
                       doctest::Contains("weight gradient of micro-batch 0 before its backward"),
                       actorpipe::invalid_argument);
  CHECK_NOTHROW(validate({{f, b, w}}, 1, true));
}

TEST_CASE("ZB-H2: valid, more warm-up forwards, and faster than ZB-H1 when the first stage is the "
          "slowest") {
  for (std::size_t p = 1; p <= 6; ++p) {
    for (std::size_t m = 1; m <= 9; ++m) {
      CAPTURE(p);
      CAPTURE(m);
      auto zb = make_schedule(schedule_kind::zb_h2, p, m);
      CHECK_NOTHROW(validate(zb, m, true));
      CHECK(splits_backward(zb));
      for (std::size_t i = 0; i < p; ++i) {
        CAPTURE(i);
        CHECK(peak_stash(zb[i]) <= std::min(2 * p - 1 - i, m));
        // Warm-up: every forward before the first backward.
        std::size_t warmup = 0;
        while (zb[i][warmup].kind == action_kind::forward) {
          ++warmup;
        }
        CHECK(warmup == std::min(2 * (p - 1 - i) + 1, m));
      }
    }
  }
  CHECK(parse_schedule_kind("zb-h2") == schedule_kind::zb_h2);
  CHECK(to_string(schedule_kind::zb_h2) == "zb-h2");
  for (std::size_t p : {2, 3, 4}) {
    for (std::size_t m : {4, 8, 16}) {
      CAPTURE(p);
      CAPTURE(m);
      if (m < 2 * p - 1) {
        continue; // every forward is in stage 0's warm-up: nothing left to fill the drain
      }
      // Stage 0 one and a half times as slow as the others (the bench scenario's shape).
      std::vector<action_costs> costs(p, action_costs{1, 1, 1});
      costs[0] = action_costs{1.5, 1.5, 1.5};
      auto h1 = simulate(make_schedule(schedule_kind::zb_h1, p, m), m, costs);
      auto h2 = simulate(make_schedule(schedule_kind::zb_h2, p, m), m, costs);
      CHECK(h2.makespan < h1.makespan);
      // The slow stage never waits after its warm-up: it is the step.
      CHECK(h2.makespan == doctest::Approx(4.5 * static_cast<double>(m)));
    }
  }
}

TEST_CASE("a V places chunks down the stages and back up: stage 0 holds the first and the last") {
  for (std::size_t p = 1; p <= 5; ++p) {
    for (std::size_t v = 1; v <= 4; ++v) {
      for (auto placement : {chunk_placement::looped, chunk_placement::v_shape}) {
        std::vector<int> seen(p * v, 0);
        for (std::size_t i = 0; i < p; ++i) {
          for (std::size_t c = 0; c < v; ++c) {
            auto k = virtual_stage_of(placement, p, i, c);
            REQUIRE(k < p * v);
            ++seen[k];
            auto back = holder_of(placement, p, k);
            CHECK(back.stage == i);
            CHECK(back.chunk == c);
          }
        }
        CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
      }
    }
    // Two chunks: virtual stage k and 2p - 1 - k on one stage; the turn on the last stage.
    for (std::size_t i = 0; i < p; ++i) {
      CHECK(virtual_stage_of(chunk_placement::v_shape, p, i, 0) == i);
      CHECK(virtual_stage_of(chunk_placement::v_shape, p, i, 1) == 2 * p - 1 - i);
    }
    CHECK(holder_of(chunk_placement::v_shape, p, 2 * p - 1).stage == 0);
    CHECK(holder_of(chunk_placement::v_shape, p, p).stage == p - 1);
  }
}

TEST_CASE("ZB-V and V-Half: valid V schedules for any size, within their memory, and ZB-V faster "
          "than ZB-H1 and 1F1B at 1F1B's memory") {
  for (auto kind : {schedule_kind::zb_v, schedule_kind::v_half}) {
    for (std::size_t p = 1; p <= 8; ++p) {
      for (std::size_t m = 1; m <= 20; ++m) {
        CAPTURE(to_string(kind));
        CAPTURE(p);
        CAPTURE(m);
        auto s = make_schedule(kind, p, m, 2);
        CHECK(s.placement == chunk_placement::v_shape);
        CHECK(chunks_of(s) == 2);
        CHECK(splits_backward(s));
        REQUIRE_NOTHROW(validate(s, m, true));
        // In micro-batches (a chunk's activation counts a half): ZB-V stays within 1F1B's p
        // (stage 0's), V-Half within half of it plus half a micro-batch.
        auto cap =
          kind == schedule_kind::zb_v ? static_cast<double>(p) : (static_cast<double>(p) + 1) / 2;
        for (std::size_t i = 0; i < p; ++i) {
          CHECK(peak_stash(s[i], 2) <= cap);
        }
      }
    }
  }
  CHECK(parse_schedule_kind("zb-v") == schedule_kind::zb_v);
  CHECK(parse_schedule_kind("v-half") == schedule_kind::v_half);
  CHECK(to_string(schedule_kind::v_half) == "v-half");
  CHECK(chunks_for(schedule_kind::zb_v, 1) == 2);
  CHECK(chunks_for(schedule_kind::interleaved, 3) == 3);
  CHECK_THROWS_WITH_AS(make_schedule(schedule_kind::zb_v, 2, 4, 1),
                       doctest::Contains("zb-v runs two chunks per stage in a V, not 1"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(make_schedule(schedule_kind::zb_h1, 2, 4, 2),
                       doctest::Contains("zb-h1 runs one chunk per stage, not 2"),
                       actorpipe::invalid_argument);
  // Equal costs: a V chunk is half a stage, so one F, B or W of it costs 1 where the whole
  // stage's costs 2.
  for (std::size_t p : {2, 4, 8}) {
    for (std::size_t m : {8, 16, 32}) {
      if (m < p) {
        continue;
      }
      CAPTURE(p);
      CAPTURE(m);
      auto work = 6.0 * static_cast<double>(m); // per stage: 2 chunks x m x (F + B + W)
      auto whole = simulate(make_schedule(schedule_kind::zb_h1, p, m), m, {{2, 2, 2}});
      auto ofob = simulate(make_schedule(schedule_kind::one_f_one_b, p, m), m, {{2, 2, 2}});
      auto zbv = simulate(make_schedule(schedule_kind::zb_v, p, m, 2), m, {{1, 1, 1}});
      auto half = simulate(make_schedule(schedule_kind::v_half, p, m, 2), m, {{1, 1, 1}});
      CHECK(whole.makespan == doctest::Approx(work + 2 * static_cast<double>(p - 1)));
      // Up to 4 stages ZB-V's only bubble is the first micro-batch's way down (p - 1 chunk
      // forwards); beyond, the greedy order leaves a little more, never over 3/4 of ZB-H1's.
      if (p <= 4) {
        CHECK(zbv.makespan == doctest::Approx(work + static_cast<double>(p - 1)));
      }
      CHECK(zbv.makespan - work <= 0.75 * (whole.makespan - work));
      // V-Half trades time for memory, and from 4 stages still beats 1F1B.
      CHECK(half.makespan >= zbv.makespan);
      if (p >= 4) {
        CHECK(half.makespan < ofob.makespan);
      }
    }
  }
}

TEST_CASE("V schedules load from JSON with their placement, and the simulator and validation "
          "follow it") {
  char path[] = "/tmp/actorpipe-vschedule-XXXXXX";
  int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  close(fd);
  auto write = [&](const std::string& text) { std::ofstream(path) << text; };
  auto zbv = make_schedule(schedule_kind::zb_v, 2, 3, 2);
  std::string programs = "[";
  for (std::size_t i = 0; i < zbv.size(); ++i) {
    programs += i == 0 ? "[" : ", [";
    for (std::size_t k = 0; k < zbv[i].size(); ++k) {
      programs += (k == 0 ? "\"" : ", \"") + to_string(zbv[i][k]) + "\"";
    }
    programs += "]";
  }
  programs += "]";
  write("{\"placement\": \"v\", \"programs\": " + programs + "}");
  CHECK(load_schedule(path) == zbv);
  // The same programs looped are another schedule, which deadlocks: stage 1 chunk 1 now follows
  // stage 0 chunk 1 in the model, and stage 0 waits for it first.
  write("{\"programs\": " + programs + "}");
  auto looped = load_schedule(path);
  CHECK(looped.placement == chunk_placement::looped);
  CHECK_THROWS_WITH_AS(validate(looped, 3, true), doctest::Contains("schedule deadlocks"),
                       actorpipe::invalid_argument);
  write("{\"placement\": \"w\", \"programs\": " + programs + "}");
  CHECK_THROWS_WITH_AS(load_schedule(path),
                       doctest::Contains("placement 'w' is neither \"looped\" nor \"v\""),
                       actorpipe::invalid_argument);
  std::remove(path);
  // In a V, stage 1 (the last of 2) turns: its chunk 0 waits for stage 0's chunk 0, its chunk 1
  // for itself; a deadlock names the right holder.
  action f0{action_kind::forward, 0, 0};
  action f1{action_kind::forward, 0, 1};
  action b0{action_kind::backward, 0, 0};
  action b1{action_kind::backward, 0, 1};
  schedule bad({{f1, f0, b0, b1}, {f0, f1, b1, b0}}, chunk_placement::v_shape);
  CHECK_THROWS_WITH_AS(validate(bad, 1, true),
                       doctest::Contains("stage 0 waits at action 0 (F0@1) for the activation of "
                                         "micro-batch 0 from stage 1 chunk 1"),
                       actorpipe::invalid_argument);
  schedule good({{f0, f1, b1, b0}, {f0, f1, b1, b0}}, chunk_placement::v_shape);
  CHECK_NOTHROW(validate(good, 1, true));
  auto sim = simulate(good, 1, {{1, 1, 1}});
  // Down (stage 0, 1), back (1, 0), the loss on stage 0, then the backwards the same way back
  // (B + W, 2 units each, unsplit): 4 + 8 in a row.
  CHECK(sim.makespan == doctest::Approx(12.0));
}
