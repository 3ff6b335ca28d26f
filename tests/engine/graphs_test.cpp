// CUDA graphs' bookkeeping, through the whole pipeline, on the CPU: a device that "captures" a
// body by keeping it and "replays" it by running it again on the same static buffers (what a
// CUDA graph does on a GPU), and records every call. The pipeline then trains with graphs as a
// GPU would (warm-up, capture in program order, replays, eager fallbacks), and every loss and
// parameter must equal eager training's bit for bit. The GPU's own graphs: tests/gpu.
#include <mutex>

#include "oracle.hpp"
#include "stages/device.hpp"

using namespace actorpipe;
using namespace actorpipe::test;

namespace {

struct call_log {
  std::mutex mutex;
  std::vector<std::string> calls; // "pool 3", "capture 3", "replay 3"
  unsigned long long pools = 0;

  void add(const std::string& call) {
    std::lock_guard<std::mutex> lock{mutex};
    calls.push_back(call);
  }
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> lock{mutex};
    std::vector<std::string> taken;
    taken.swap(calls);
    return taken;
  }
};

std::size_t count(const std::vector<std::string>& calls, const std::string& prefix) {
  return static_cast<std::size_t>(std::count_if(
    calls.begin(), calls.end(), [&](const auto& c) { return c.rfind(prefix, 0) == 0; }));
}

class recorded_graph final : public stages::device_graph {
public:
  recorded_graph(std::shared_ptr<call_log> log, unsigned long long pool, std::function<void()> body)
    : log_(std::move(log)), pool_(pool), body_(std::move(body)) {}
  void replay() override {
    log_->add("replay " + std::to_string(pool_));
    body_();
  }

private:
  std::shared_ptr<call_log> log_;
  unsigned long long pool_;
  std::function<void()> body_;
};

class recording_device final : public stages::device_context {
public:
  explicit recording_device(std::shared_ptr<call_log> log)
    : device_context(c10::Device(c10::kCPU)), log_(std::move(log)) {}
  bool captures_graphs() const override { return true; }
  stages::graph_pool new_graph_pool() override {
    unsigned long long id = 0;
    {
      std::lock_guard<std::mutex> lock{log_->mutex};
      id = ++log_->pools;
    }
    log_->add("pool " + std::to_string(id));
    return {id, 0};
  }
  std::unique_ptr<stages::device_graph> capture(stages::graph_pool pool,
                                                const std::function<void()>& body) override {
    log_->add("capture " + std::to_string(pool.first));
    return std::make_unique<recorded_graph>(log_, pool.first, body);
  }

private:
  std::shared_ptr<call_log> log_;
};

struct run_result {
  std::vector<double> losses;
  std::vector<std::pair<std::string, torch::Tensor>> parameters;
  // The device's calls, step by step.
  std::vector<std::vector<std::string>> calls;
};

// Trains `batches` (inputs and targets) with `o`, CUDA graphs `mode` on the recording device.
run_result train(pipeline_options o, std::size_t stages, cuda_graph_mode mode,
                 const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) {
  auto log = std::make_shared<call_log>();
  stages::device_override recording(
    [log](c10::Device) { return std::make_shared<recording_device>(log); });
  engine sys;
  auto layers = tiny_mlp(3);
  o.loss = mse;
  o.optimizer = sgd(0.1, 0.9);
  o.cuda_graphs = mode;
  pipeline pipe(sys, layers, partition_uniform(layers.size(), stages * o.chunks), o);
  run_result r;
  for (const auto& [x, t] : batches) {
    r.losses.push_back(pipe.train_step(x, t).loss);
    r.calls.push_back(log->take());
  }
  r.parameters = pipe.named_parameters();
  return r;
}

std::vector<std::pair<torch::Tensor, torch::Tensor>> batches(std::vector<int64_t> sizes) {
  torch::manual_seed(7);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> b;
  for (auto n : sizes) {
    b.emplace_back(torch::randn({n, 1, 4, 4}), torch::randn({n, 3}));
  }
  return b;
}

void check_equal(const run_result& graphed, const run_result& eager) {
  REQUIRE(graphed.losses.size() == eager.losses.size());
  for (std::size_t i = 0; i < eager.losses.size(); ++i) {
    CAPTURE(i);
    CHECK(graphed.losses[i] == eager.losses[i]);
  }
  REQUIRE(graphed.parameters.size() == eager.parameters.size());
  for (std::size_t i = 0; i < eager.parameters.size(); ++i) {
    CAPTURE(eager.parameters[i].first);
    CHECK(torch::equal(graphed.parameters[i].second, eager.parameters[i].second));
  }
}

} // namespace

TEST_CASE("CUDA graphs on a recording device: two eager steps, a capture step in program order, "
          "then replays, and losses and parameters equal eager training's bit for bit") {
  for (auto setting :
       {schedule_setting{schedule_kind::gpipe, 1}, schedule_setting{schedule_kind::one_f_one_b, 1},
        schedule_setting{schedule_kind::interleaved, 2}}) {
    for (std::size_t m : {2, 4}) {
      CAPTURE(to_string(setting.kind));
      CAPTURE(m);
      pipeline_options o;
      o.schedule = setting.kind;
      o.chunks = setting.chunks;
      o.microbatches = m;
      auto data = batches({8, 8, 8, 8, 8});
      auto eager = train(o, 2, cuda_graph_mode::off, data);
      auto graphed = train(o, 2, cuda_graph_mode::on, data);
      check_equal(graphed, eager);
      std::size_t virtual_stages = 2 * setting.chunks;
      for (const auto& step : eager.calls) {
        CHECK(step.empty()); // off: the device is never asked
      }
      CHECK(graphed.calls[0].empty()); // warm-up
      CHECK(graphed.calls[1].empty());
      const auto& capture = graphed.calls[2];
      CHECK(count(capture, "pool ") == virtual_stages); // a pool for each stage (chunk)
      CHECK(count(capture, "capture ") == 2 * m * virtual_stages);
      CHECK(count(capture, "replay ") == 2 * m * virtual_stages);
      // Each capture is replayed at once, by its own pool, before that pool captures again.
      std::map<std::string, std::string> last;
      for (const auto& c : capture) {
        auto pool = c.substr(c.find(' ') + 1);
        if (c.rfind("capture ", 0) == 0) {
          CHECK(last[pool] != "capture");
          last[pool] = "capture";
        } else if (c.rfind("replay ", 0) == 0) {
          CHECK(last[pool] == "capture");
          last[pool] = "replay";
        }
      }
      for (std::size_t step = 3; step < graphed.calls.size(); ++step) {
        CAPTURE(step);
        CHECK(count(graphed.calls[step], "capture ") == 0);
        CHECK(count(graphed.calls[step], "pool ") == 0);
        CHECK(count(graphed.calls[step], "replay ") == 2 * m * virtual_stages);
      }
    }
  }
}

TEST_CASE("CUDA graphs: a micro-batch of another shape runs eagerly with its backward, the others "
          "replay, and the losses still equal eager's") {
  pipeline_options o;
  o.schedule = schedule_kind::one_f_one_b;
  o.microbatches = 4;
  // 8 samples: four of 2; 7: the last of 1 (a step of another program: stages_test's book).
  auto data = batches({8, 8, 8, 7, 8});
  auto eager = train(o, 2, cuda_graph_mode::off, data);
  auto graphed = train(o, 2, cuda_graph_mode::on, data);
  check_equal(graphed, eager);
  CHECK(count(graphed.calls[2], "capture ") == 2 * 4 * 2);
  CHECK(count(graphed.calls[3], "replay ") == 2 * 3 * 2); // the short micro-batch: eager
  CHECK(count(graphed.calls[4], "replay ") == 2 * 4 * 2);
}

TEST_CASE("CUDA graphs: recomputation and the zero-bubble schedules' split backward run eagerly, "
          "as eager training does") {
  pipeline_options recomputing;
  recomputing.microbatches = 2;
  recomputing.recompute = recompute_mode::always;
  pipeline_options split;
  split.schedule = schedule_kind::zb_h1;
  split.microbatches = 4;
  for (const auto& o : {recomputing, split}) {
    auto data = batches({8, 8, 8, 8});
    auto eager = train(o, 2, cuda_graph_mode::off, data);
    auto graphed = train(o, 2, cuda_graph_mode::on, data);
    check_equal(graphed, eager);
    for (const auto& step : graphed.calls) {
      CHECK(count(step, "capture ") == 0);
      CHECK(count(step, "replay ") == 0);
    }
  }
}

TEST_CASE("CUDA graphs: auto captures a stage whose eager actions are short on the host") {
  pipeline_options o;
  o.microbatches = 2;
  auto data = batches({8, 8, 8, 8});
  // The tiny MLP's actions take microseconds here: launch-bound by auto's rule.
  auto graphed = train(o, 2, cuda_graph_mode::automatic, data);
  check_equal(graphed, train(o, 2, cuda_graph_mode::off, data));
  CHECK(count(graphed.calls[2], "capture ") == 2 * 2 * 2);
  CHECK(count(graphed.calls[3], "replay ") == 2 * 2 * 2);
}

TEST_CASE("CUDA graphs on the CPU's own device: nothing is captured, training is as eager") {
  engine sys;
  auto layers = tiny_mlp(3);
  pipeline_options o;
  o.loss = mse;
  o.optimizer = sgd(0.1);
  o.cuda_graphs = cuda_graph_mode::on;
  pipeline pipe(sys, layers, partition_uniform(layers.size(), 2), o);
  plain_model plain(tiny_mlp(3), sgd(0.1));
  for (const auto& [x, t] : batches({8, 8, 8, 8})) {
    CHECK(pipe.train_step(x, t).loss == doctest::Approx(plain.step(x, t)).epsilon(1e-5));
  }
}
