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
      }
    }
  }
}

TEST_CASE("invalid schedules are rejected naming stage, action and micro-batch") {
  auto F = [](int32_t mb) { return action{action_kind::forward, mb}; };
  auto B = [](int32_t mb) { return action{action_kind::backward, mb}; };
  CHECK_THROWS_WITH_AS(
    validate({{B(0), F(0)}}, 1, true),
    doctest::Contains("stage 0, action 0: backward of micro-batch 0 before its forward"),
    actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(validate({{F(0), F(1), B(1)}}, 2, true),
                       doctest::Contains("stage 0 backs up 1 of 2 micro-batches"),
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
  CHECK_THROWS_WITH_AS(parse_schedule_kind("zb"), doctest::Contains("unknown schedule 'zb'"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(make_schedule(schedule_kind::gpipe, 2, 0),
                       doctest::Contains("microbatches (0) must be >= 1"),
                       actorpipe::invalid_argument);
}
