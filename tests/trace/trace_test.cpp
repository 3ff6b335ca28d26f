// Timelines: Chrome traces and Gantt charts of measured steps, without running a pipeline.
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <actorpipe/errors.hpp>
#include <actorpipe/trace.hpp>

using namespace actorpipe;

namespace {

// GPipe on 2 stages x 2 micro-batches, by hand: stage 0 sends activations, stage 1 gradients.
step_result gpipe_step(uint64_t number) {
  step_result step;
  step.step = number;
  step.wall_ms = 8;
  stage_stats first;
  first.stage = 0;
  first.actions = {{{action_kind::forward, 0}, 0, 1, 64},
                   {{action_kind::forward, 1}, 1, 2, 64},
                   {{action_kind::backward, 1}, 5, 6, 0},
                   {{action_kind::backward, 0}, 6, 7, 0}};
  stage_stats second;
  second.stage = 1;
  second.actions = {{{action_kind::forward, 0}, 1.5, 2.5, 0},
                    {{action_kind::forward, 1}, 2.5, 3.5, 0},
                    {{action_kind::backward, 1}, 3.5, 4.5, 32},
                    {{action_kind::backward, 0}, 4.5, 5.5, 32}};
  step.stages = {first, second};
  return step;
}

std::string read(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

} // namespace

TEST_CASE("a Chrome trace has a track per stage, an event per action, and an arrow per send") {
  auto file = std::filesystem::temp_directory_path() / "actorpipe_trace_test.json";
  write_chrome_trace(file.string(), {gpipe_step(1), gpipe_step(2)});
  auto trace = nlohmann::json::parse(read(file));
  std::map<std::string, std::vector<nlohmann::json>> by_phase;
  for (const auto& e : trace["traceEvents"]) {
    by_phase[e["ph"].get<std::string>()].push_back(e);
  }
  CHECK(by_phase["M"].size() == 2);
  REQUIRE(by_phase["X"].size() == 16);
  // Four sends a step (two activations, two gradients): an arrow from each sender's end to the
  // receiver's start.
  REQUIRE(by_phase["s"].size() == 8);
  REQUIRE(by_phase["f"].size() == 8);
  const auto& first = by_phase["X"].front();
  CHECK(first["name"] == "F0");
  CHECK(first["tid"] == 0);
  CHECK(first["ts"].get<double>() == doctest::Approx(0));
  CHECK(first["dur"].get<double>() == doctest::Approx(1000));
  // The second step follows the first on the time axis.
  const auto& later = by_phase["X"][8];
  CHECK(later["args"]["step"] == 2);
  CHECK(later["ts"].get<double>() == doctest::Approx(8000));
  // F0's activation arrives at stage 1's F0 at 1.5 ms.
  bool found = false;
  for (const auto& f : by_phase["f"]) {
    if (f["name"] == "activation" && f["tid"] == 1 && f["ts"].get<double>() == 1500) {
      found = true;
    }
  }
  CHECK(found);
  std::filesystem::remove(file);
}

TEST_CASE("the training loop's wait for each batch is a track of its own, before each step") {
  auto file = std::filesystem::temp_directory_path() / "actorpipe_trace_data_test.json";
  auto first = gpipe_step(1);
  auto second = gpipe_step(2);
  first.data_wait_ms = 0.5;
  second.data_wait_ms = 3;
  write_chrome_trace(file.string(), {first, second});
  auto trace = nlohmann::json::parse(read(file));
  std::vector<nlohmann::json> waits;
  std::vector<nlohmann::json> actions;
  bool named = false;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["tid"] == 2) {
      named = e["args"]["name"] == "data: wait for batch";
    }
    if (e["ph"] == "X") {
      (e["tid"] == 2 ? waits : actions).push_back(e);
    }
  }
  CHECK(named);
  REQUIRE(waits.size() == 2);
  CHECK(waits[0]["ts"].get<double>() == doctest::Approx(0));
  CHECK(waits[0]["dur"].get<double>() == doctest::Approx(500));
  // Step 1 starts after its wait; step 2's wait follows step 1's 8 ms, and step 2 follows it.
  CHECK(actions.front()["ts"].get<double>() == doctest::Approx(500));
  CHECK(waits[1]["ts"].get<double>() == doctest::Approx(8500));
  CHECK(waits[1]["dur"].get<double>() == doctest::Approx(3000));
  CHECK(actions[8]["ts"].get<double>() == doctest::Approx(11500));
  std::filesystem::remove(file);
}

TEST_CASE("stages on a GPU get a track each for when their actions ran there") {
  auto file = std::filesystem::temp_directory_path() / "actorpipe_trace_device_test.json";
  auto step = gpipe_step(1);
  for (auto& stage : step.stages) {
    for (auto& a : stage.actions) {
      a.device_start_ms = a.start_ms + 0.25; // the GPU runs behind the host
      a.device_end_ms = a.end_ms + 0.5;
    }
  }
  write_chrome_trace(file.string(), {step, gpipe_step(2)});
  auto trace = nlohmann::json::parse(read(file));
  std::map<int, std::string> names;
  std::vector<nlohmann::json> on_device;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M") {
      names[e["tid"].get<int>()] = e["args"]["name"].get<std::string>();
    } else if (e["ph"] == "X" && e["cat"] == "device") {
      on_device.push_back(e);
    }
  }
  // Tracks 0 and 1 are the stages' host tracks, 2 the data track's place, 3 and 4 the GPU's.
  CHECK(names[3] == "stage 0 on its GPU");
  CHECK(names[4] == "stage 1 on its GPU");
  REQUIRE(on_device.size() == 8); // step 2 measured nothing on a device
  CHECK(on_device.front()["name"] == "F0");
  CHECK(on_device.front()["tid"] == 3);
  CHECK(on_device.front()["ts"].get<double>() == doctest::Approx(250));
  CHECK(on_device.front()["dur"].get<double>() == doctest::Approx(1250));
  std::filesystem::remove(file);
}

TEST_CASE("a measured timeline and its Gantt chart show every action") {
  auto rows = timeline_of(gpipe_step(1));
  REQUIRE(rows.size() == 2);
  REQUIRE(rows[0].size() == 4);
  CHECK(rows[1][2].what == action{action_kind::backward, 1});
  CHECK(rows[1][2].start == doctest::Approx(3.5));
  CHECK(rows[1][2].end == doctest::Approx(4.5));
  auto file = std::filesystem::temp_directory_path() / "actorpipe_gantt_test.svg";
  write_gantt_svg(file.string(), rows, "two stages", "ms");
  auto svg = read(file);
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(svg.find("two stages") != std::string::npos);
  CHECK(count(svg, "<title>") == 8);
  CHECK(count(svg, "<title>B1") == 2);
  std::filesystem::remove(file);
}

TEST_CASE("a trace that cannot be written is an io error naming the file") {
  try {
    write_chrome_trace("/nonexistent-folder/trace.json", {gpipe_step(1)});
    FAIL("no error");
  } catch (const pipeline_error& e) {
    CHECK(std::string(e.what()).find("cannot write '/nonexistent-folder/trace.json'") !=
          std::string::npos);
    CHECK(e.kind() == error_kind::io);
  }
}
