// Tied-gradient sums (comm::tie_group) between members in other processes: each member's
// group sends its part through a sender and takes the others' through deliver().
#include <chrono>
#include <future>
#include <thread>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <actorpipe/errors.hpp>

#include "comm/tie_group.hpp"

using namespace actorpipe;
using namespace std::chrono_literals;

namespace {

using part = std::map<std::string, torch::Tensor>;

// Two members' groups, each sending to the other as a transport between processes would.
struct linked_pair {
  std::shared_ptr<comm::tie_group> first;
  std::shared_ptr<comm::tie_group> second;

  linked_pair() {
    first = std::make_shared<comm::tie_group>(
      std::set<std::size_t>{0, 2},
      [this](std::size_t to, uint64_t step, std::size_t from, const part& p) {
        REQUIRE(to == 2);
        second->deliver(step, from, clone(p));
      });
    second = std::make_shared<comm::tie_group>(
      std::set<std::size_t>{0, 2},
      [this](std::size_t to, uint64_t step, std::size_t from, const part& p) {
        REQUIRE(to == 0);
        first->deliver(step, from, clone(p));
      });
  }

  static part clone(const part& p) {
    part out;
    for (const auto& [name, t] : p) {
      out[name] = t.clone();
    }
    return out;
  }
};

} // namespace

TEST_CASE("tie groups in two processes sum in member order, a part that comes before its step "
          "included") {
  linked_pair groups;
  torch::manual_seed(1);
  auto g0 = torch::randn({5, 3});
  auto g2 = torch::randn({5, 3});
  for (uint64_t step = 1; step <= 3; ++step) {
    part a{{"embed.token.weight", g0.clone()}};
    part b{{"embed.token.weight", g2.clone()}};
    // Member 0 sums first: its part reaches member 2's group before member 2 starts the step.
    auto first = std::async(std::launch::async, [&] { groups.first->sum(step, 0, a, 5000ms); });
    std::this_thread::sleep_for(20ms);
    groups.second->sum(step, 2, b, 5000ms);
    first.get();
    // The same bits on both sides: g0 + g2, added in member order.
    CHECK(torch::equal(a.at("embed.token.weight"), g0 + g2));
    CHECK(torch::equal(b.at("embed.token.weight"), a.at("embed.token.weight")));
  }
}

TEST_CASE("a tie group drops parts of old steps, fails when its sender fails, and a cancelled step "
          "stops the wait at once") {
  torch::manual_seed(2);
  part mine{{"w", torch::ones({2})}};
  SUBCASE("an old step's part changes nothing; a missing member times out, named") {
    comm::tie_group group({0, 1}, [](std::size_t, uint64_t, std::size_t, const part&) {});
    group.deliver(5, 1, {{"w", torch::ones({2})}});
    group.deliver(3, 1, {{"w", torch::full({2}, 100.0)}}); // dropped when step 5 starts
    auto p = mine;
    group.sum(5, 0, p, 2000ms);
    CHECK(torch::equal(p.at("w"), torch::full({2}, 2.0)));
    group.deliver(4, 1, {{"w", torch::full({2}, 100.0)}}); // now older than the current step
    auto q = mine;
    CHECK_THROWS_WITH(group.sum(6, 0, q, 200ms),
                      doctest::Contains("stage 1 did not arrive within 200 ms"));
  }
  SUBCASE("a sender that fails fails the sum, naming where it sent") {
    comm::tie_group group({0, 1}, [](std::size_t, uint64_t, std::size_t, const part&) {
      throw std::runtime_error("connection refused");
    });
    auto p = mine;
    CHECK_THROWS_WITH(group.sum(1, 0, p, 2000ms),
                      doctest::Contains("sending tied gradients of step 1 to stage 1: connection "
                                        "refused"));
  }
  SUBCASE("a cancel (an abort relayed by the node) wakes the waiting member") {
    comm::tie_group group({0, 1}, [](std::size_t, uint64_t, std::size_t, const part&) {});
    auto start = std::chrono::steady_clock::now();
    auto waiting = std::async(std::launch::async, [&] {
      auto p = mine;
      group.sum(7, 0, p, 30000ms);
    });
    std::this_thread::sleep_for(50ms);
    group.cancel(7, 1);
    CHECK_THROWS_WITH(waiting.get(), doctest::Contains("stage 1 failed the step"));
    CHECK(std::chrono::steady_clock::now() - start < 10s);
  }
}

TEST_CASE("a member that fails the next step while another still takes this step's sum does not "
          "abandon it: the cancellation waits for its own round (overlapping steps)") {
  comm::tie_group group({0, 2});
  torch::manual_seed(2);
  auto g0 = torch::randn({4});
  auto g2 = torch::randn({4});
  part a{{"w", g0.clone()}};
  part b{{"w", g2.clone()}};
  // Member 2 arrives first and waits; member 0 completes the round, takes its sum and fails
  // step 2 before member 2 has woken to take its own.
  std::promise<void> waiting;
  auto second = std::async(std::launch::async, [&] {
    waiting.set_value();
    group.sum(1, 2, b, 5s);
  });
  waiting.get_future().wait();
  std::this_thread::sleep_for(20ms);
  group.sum(1, 0, a, 5s);
  group.cancel(2, 0);
  REQUIRE_NOTHROW(second.get());
  CHECK(torch::equal(b.at("w"), g0 + g2));
  CHECK(torch::equal(a.at("w"), g0 + g2));
  // Step 2's round, when member 2 reaches it, is the cancelled one.
  part c{{"w", g2.clone()}};
  CHECK_THROWS_WITH_AS(group.sum(2, 2, c, 1s), doctest::Contains("stage 0 failed the step"),
                       pipeline_error);
}
