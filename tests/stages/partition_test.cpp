#include <doctest/doctest.h>

#include <torch/torch.h>

#include <actorpipe/models.hpp>
#include <actorpipe/partition.hpp>

using namespace actorpipe;

TEST_CASE("uniform partition spreads layers evenly, earlier stages take the remainder") {
  CHECK(partition_uniform(11, 2).bounds == std::vector<std::size_t>{0, 6, 11});
  CHECK(partition_uniform(10, 3).bounds == std::vector<std::size_t>{0, 4, 7, 10});
  CHECK(partition_uniform(4, 4).bounds == std::vector<std::size_t>{0, 1, 2, 3, 4});
  CHECK(partition_uniform(5, 1).bounds == std::vector<std::size_t>{0, 5});
}

TEST_CASE("the uniform 2-stage cut of a ResNet is the RPC tutorial's: conv1..layer2 | layer3..fc") {
  auto layers = make_model("resnet50");
  auto p = partition_uniform(layers.size(), 2);
  CHECK(layers[p.end(0) - 1].name() == "layer2");
  CHECK(layers[p.begin(1)].name() == "layer3");
}

TEST_CASE("partition by parameters minimises the largest stage") {
  auto layers = make_model("resnet50");
  auto p = partition_by_params(layers, 2);
  auto counts = stage_parameter_counts(layers, p);
  REQUIRE(counts.size() == 2);
  CHECK(counts[0] + counts[1] == 25557032);
  // Exhaustive check: no other single cut has a smaller maximum.
  int64_t best = INT64_MAX;
  for (std::size_t c = 1; c < layers.size(); ++c) {
    auto q = partition_at(layers.size(), {c});
    auto qc = stage_parameter_counts(layers, q);
    best = std::min(best, std::max(qc[0], qc[1]));
  }
  CHECK(std::max(counts[0], counts[1]) == best);
  auto three = partition_by_params(layers, 3);
  CHECK(three.stages() == 3);
  for (std::size_t s = 0; s < 3; ++s) {
    CHECK(three.begin(s) < three.end(s));
  }
}

TEST_CASE("explicit cut points make the stages they name") {
  auto p = partition_at(10, {3, 7});
  CHECK(p.bounds == std::vector<std::size_t>{0, 3, 7, 10});
  CHECK(p.to_string() == "[0, 3) [3, 7) [7, 10)");
  auto layers = make_model("mlp");
  CHECK(parse_partition("cut:2,4", layers, 3).bounds == std::vector<std::size_t>{0, 2, 4, 6});
  CHECK(parse_partition("cut:2,4", layers, 0).stages() == 3);
}

TEST_CASE("bad partitions are rejected with the reason") {
  auto layers = make_model("mlp"); // 6 layers
  CHECK_THROWS_WITH_AS(partition_uniform(6, 7), doctest::Contains("must not exceed the model's 6"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(partition_uniform(6, 0), doctest::Contains("stages (0) must be >= 1"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(partition_at(6, {6}), doctest::Contains("cut point 6 is out of range"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(partition_at(6, {0}), doctest::Contains("cut point 0 is out of range"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(partition_at(6, {3, 2}), doctest::Contains("strictly increasing"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(parse_partition("cut:2", layers, 3), doctest::Contains("makes 2 stages"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(parse_partition("cut:a", layers, 0), doctest::Contains("not a layer index"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(parse_partition("time", layers, 2), doctest::Contains("unknown partition"),
                       actorpipe::invalid_argument);
  CHECK_THROWS_WITH_AS(partition_by_params(layers, 7), doctest::Contains("must not exceed"),
                       actorpipe::invalid_argument);
}
