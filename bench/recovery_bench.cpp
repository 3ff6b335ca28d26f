// Lost nodes (docs/distributed.md#when-a-node-is-lost): a run over `actorpipe node` processes on
// loopback whose stage-1 node is killed (SIGKILL) every --kill-every steps and restarted as the
// next spare, trained by train() with recover_lost_nodes. Reports what a loss costs (time from
// the kill to the next completed step, steps replayed), what snapshots cost per step, and, over
// a long run (the soak: --steps 10000 --kill-every 1000), whether every step completed and how
// the memory of the driver and of the node never killed grew.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>
#include <actorpipe/training.hpp>

#include "bench/sweep.hpp"

namespace {

using actorpipe::bench::median;
using clock_type = std::chrono::steady_clock;

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    throw std::runtime_error("no free port");
  }
  ::close(fd);
  return ntohs(sa.sin_port);
}

bool accepts(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0;
  ::close(fd);
  return ok;
}

// Resident memory of a process, in MiB.
double rss_mib(pid_t pid) {
  std::ifstream in("/proc/" + (pid == 0 ? std::string("self") : std::to_string(pid)) + "/statm");
  long pages = 0;
  long resident = 0;
  in >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);
}

// An `actorpipe node` process on a fixed loopback port, restartable.
class node_process {
public:
  explicit node_process(int port) : port_(port) { start(); }
  ~node_process() { kill(); }
  node_process(const node_process&) = delete;
  node_process& operator=(const node_process&) = delete;

  void start() {
    auto log = std::filesystem::temp_directory_path() /
               ("actorpipe-recovery-bench-node-" + std::to_string(port_) + ".log");
    auto command = "exec " + std::string(ACTORPIPE_CLI_PATH) +
                   " node --listen 127.0.0.1:" + std::to_string(port_) + " > " + log.string() +
                   " 2>&1";
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    auto deadline = clock_type::now() + std::chrono::seconds(30);
    while (!accepts(port_)) {
      if (clock_type::now() > deadline) {
        throw std::runtime_error("node on port " + std::to_string(port_) + " did not start");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  void kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }

private:
  int port_;
  pid_t pid_ = -1;
};

// The synthetic batches, and the kills: at batch `kill_offset` of every `kill_every` (the
// first time it is asked for), the node holding stage 1 is killed; once the first step after
// the recovery (which moved stage 1 to the other spare) completed, it is restarted as a spare.
class killing_source : public actorpipe::batch_source {
public:
  killing_source(const actorpipe::batch_source& data, std::vector<node_process*> victims,
                 int64_t kill_every, int64_t kill_offset)
    : data_(data), victims_(std::move(victims)), kill_every_(kill_every),
      kill_offset_(kill_offset) {}

  std::string name() const override { return data_.name(); }
  int64_t epoch_samples() const override { return 0; }

  std::pair<torch::Tensor, torch::Tensor> batch(int64_t epoch, int64_t index, int64_t batch,
                                                uint64_t seed, int64_t rank,
                                                int64_t replicas) const override {
    auto now = clock_type::now();
    if (killed_ && ++calls_since_kill_ == 3) {
      // Call 1 was the failing step's, call 2 the first replayed step's (after the recovery):
      // this one comes when that step completed.
      loss_to_step_.push_back(std::chrono::duration<double>(now - kill_time_).count());
      killed_ = false;
    }
    if (restart_ && !killed_) {
      // Not before the first replayed step completed: a node's start costs a second of CPU.
      restart_->start();
      restart_ = nullptr;
    }
    if (kill_every_ > 0 && index % kill_every_ == kill_offset_ && index > done_) {
      // Memory before each loss: a leak grows it loss after loss, a warm-up only once.
      node_rss_.push_back(rss_mib(watched_));
      driver_rss_.push_back(rss_mib(0));
      auto* victim = victims_[kills_ % victims_.size()];
      victim->kill();
      ++kills_;
      kill_time_ = clock_type::now();
      killed_ = true;
      calls_since_kill_ = 1;
      restart_ = victim;
    }
    done_ = std::max(done_, index);
    return data_.batch(epoch, index, batch, seed, rank, replicas);
  }

  std::size_t kills() const { return kills_; }
  const std::vector<double>& loss_to_step() const { return loss_to_step_; }
  // The resident memory of the node never killed (`watch`) and of this process at each loss.
  void watch(pid_t pid) { watched_ = pid; }
  const std::vector<double>& node_rss() const { return node_rss_; }
  const std::vector<double>& driver_rss() const { return driver_rss_; }

private:
  const actorpipe::batch_source& data_;
  std::vector<node_process*> victims_;
  int64_t kill_every_;
  int64_t kill_offset_;
  mutable int64_t done_ = -1;
  mutable std::size_t kills_ = 0;
  mutable bool killed_ = false;
  mutable int calls_since_kill_ = 0;
  mutable clock_type::time_point kill_time_;
  mutable node_process* restart_ = nullptr;
  mutable std::vector<double> loss_to_step_;
  pid_t watched_ = 0;
  mutable std::vector<double> node_rss_;
  mutable std::vector<double> driver_rss_;
};

// "a -> b MiB (+x%)"
std::string growth(double from, double to) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << from << " -> " << to << " MiB (" << std::showpos
      << 100 * (to - from) / from << "%)";
  return out.str();
}

// The bench's settings (its flags).
struct bench_args {
  std::string model_name = "mlp";
  int64_t batch = 64;
  int64_t image = 28;
  int64_t classes = 10;
  std::size_t microbatches = 4;
  int64_t steps = 10000;
  int64_t snapshot_every = 100;
  int64_t kill_every = 1000;
  int64_t kill_offset = -1;
  int64_t snapshot_repeats = 5;
  int64_t snapshot_steps = 5;
  std::size_t threads = 1;
  std::string json;
};

void add_flags(CLI::App& app, bench_args& a) {
  app.add_option("--model", a.model_name, "Built-in model")->capture_default_str();
  app.add_option("--batch", a.batch, "Samples per step")->capture_default_str();
  app.add_option("--image", a.image, "Synthetic image side")->capture_default_str();
  app.add_option("--classes", a.classes, "Classes")->capture_default_str();
  app.add_option("--microbatches", a.microbatches, "Micro-batches per step")->capture_default_str();
  app.add_option("--steps", a.steps, "Steps to complete")->capture_default_str();
  app.add_option("--snapshot-every", a.snapshot_every, "Steps between snapshots")
    ->capture_default_str();
  app.add_option("--kill-every", a.kill_every, "Steps between kills of the stage-1 node (0: none)")
    ->capture_default_str();
  app
    .add_option(
      "--kill-offset", a.kill_offset,
      "The step within each --kill-every at which the kill comes (-1: half way, plus half of "
      "--snapshot-every)")
    ->capture_default_str();
  app
    .add_option("--snapshot-repeats", a.snapshot_repeats,
                "Rounds of snapshot timing before training (medians)")
    ->capture_default_str();
  app
    .add_option("--snapshot-steps", a.snapshot_steps,
                "Steps timed after each snapshot (and after none) in the snapshot rounds")
    ->capture_default_str();
  app.add_option("--threads", a.threads, "Intra-op threads per stage")->capture_default_str();
  app.add_option("--json", a.json, "Write the figures to this JSON file");
}

// What a snapshot costs the steps, side by side in rounds: --snapshot-steps steps after none,
// after one waited for (pipeline::snapshot), and after one in the background
// (snapshot_in_background, then newest_snapshot: all of it counted, overlapped or not).
struct snapshot_costs {
  std::vector<double> snapshot_ms, plain_ms, waited_ms, background_ms;
};

snapshot_costs time_snapshots(actorpipe::pipeline& pipe, const actorpipe::remote_model& model,
                              const bench_args& a) {
  snapshot_costs c;
  auto x = torch::randn({a.batch, model.options.in_channels, a.image, a.image});
  auto y = torch::randn({a.batch, a.classes});
  auto run_steps = [&] {
    for (int64_t i = 0; i < a.snapshot_steps; ++i) {
      pipe.train_step(x, y);
    }
  };
  auto ms_of = [](auto&& f) {
    auto t0 = clock_type::now();
    f();
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
  };
  run_steps(); // warm
  for (int64_t i = 0; i < a.snapshot_repeats; ++i) {
    c.plain_ms.push_back(ms_of(run_steps));
    c.waited_ms.push_back(ms_of([&] {
      c.snapshot_ms.push_back(ms_of([&] { pipe.snapshot(); }));
      run_steps();
    }));
    c.background_ms.push_back(ms_of([&] {
      pipe.snapshot_in_background();
      run_steps();
      pipe.newest_snapshot();
    }));
  }
  return c;
}

// The run under kills and what it measured.
struct soak_result {
  actorpipe::train_report report;
  double seconds = 0;
  double driver_start = 0, driver_end = 0, node_start = 0, node_end = 0;
};

soak_result soak(actorpipe::pipeline& pipe, killing_source& data,
                 actorpipe::synthetic_source& synthetic, const actorpipe::remote_model& model,
                 const bench_args& a, pid_t watched) {
  actorpipe::train_options to;
  to.batch = a.batch;
  to.max_steps = a.steps;
  to.lr = model.optimizer.lr;
  to.cosine = false;
  to.progress = false;
  to.recover_lost_nodes = true;
  to.snapshot_every = a.snapshot_every;
  to.max_recoveries = static_cast<std::size_t>(a.kill_every > 0 ? a.steps / a.kill_every + 1 : 1);
  // Memory after a warm-up of min(100, steps / 10) steps, and at the end.
  auto warm_options = to;
  warm_options.max_steps = std::max<int64_t>(1, std::min<int64_t>(100, a.steps / 10));
  warm_options.recover_lost_nodes = false;
  killing_source no_kills(synthetic, {}, 0, 0);
  actorpipe::train(pipe, no_kills, warm_options);
  soak_result r;
  r.driver_start = rss_mib(0);
  r.node_start = rss_mib(watched);
  data.watch(watched);
  auto t0 = clock_type::now();
  r.report = actorpipe::train(pipe, data, to);
  r.seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  r.driver_end = rss_mib(0);
  r.node_end = rss_mib(watched);
  return r;
}

std::vector<double> recovery_seconds(const actorpipe::train_report& report) {
  std::vector<double> out;
  for (const auto& r : report.recoveries) {
    out.push_back(r.seconds);
  }
  return out;
}

void print_summary(const bench_args& a, const snapshot_costs& c, const soak_result& r,
                   killing_source& data) {
  const auto& report = r.report;
  auto step_ms = median(report.step_ms);
  auto snap = median(c.snapshot_ms);
  auto plain = median(c.plain_ms);
  auto waited = median(c.waited_ms) - plain;
  auto background = median(c.background_ms) - plain;
  std::cout << std::fixed << std::setprecision(2);
  std::cout << "steps completed " << report.steps.size() << " of " << a.steps << " in " << r.seconds
            << " s (median step " << step_ms << " ms)\n"
            << "kills " << data.kills() << ", recoveries " << report.recoveries.size()
            << ", failed steps " << report.recoveries.size() << ", steps replayed "
            << report.replayed_steps.size() << "\n"
            << "recover() median " << median(recovery_seconds(report))
            << " s; kill to next completed step "
            << "median " << median(data.loss_to_step()) << " s (max "
            << (data.loss_to_step().empty()
                  ? 0.0
                  : *std::max_element(data.loss_to_step().begin(), data.loss_to_step().end()))
            << " s)\n"
            << "snapshot median " << snap
            << " ms = " << snap / static_cast<double>(a.snapshot_every)
            << " ms per step at --snapshot-every " << a.snapshot_every << " ("
            << 100.0 * snap / static_cast<double>(a.snapshot_every) / std::max(1e-9, step_ms)
            << "% of a step)\n"
            << "a snapshot's cost to the " << a.snapshot_steps << " steps after it (median "
            << plain << " ms without): waited for +" << waited << " ms, in the background +"
            << background << " ms (" << 100.0 * background / std::max(1e-9, waited)
            << "% of waiting)\n"
            << "RSS after the warm-up and at the end: driver "
            << growth(r.driver_start, r.driver_end) << ", node never killed "
            << growth(r.node_start, r.node_end) << "\n";
  if (!data.node_rss().empty()) {
    // The first loss comes after the first snapshot's buffers and the first rebuild of stages.
    std::cout << "RSS at the first loss and at the end: driver "
              << growth(data.driver_rss().front(), r.driver_end) << ", node never killed "
              << growth(data.node_rss().front(), r.node_end) << "\nnode RSS at each loss (MiB):";
    for (auto v : data.node_rss()) {
      std::cout << ' ' << std::setprecision(1) << v;
    }
    std::cout << std::setprecision(2) << "\n";
  }
}

void write_json(const bench_args& a, const snapshot_costs& c, const soak_result& r,
                killing_source& data) {
  const auto& report = r.report;
  nlohmann::json j{{"model", a.model_name},
                   {"steps", a.steps},
                   {"completed", report.steps.size()},
                   {"seconds", r.seconds},
                   {"median_step_ms", median(report.step_ms)},
                   {"kills", data.kills()},
                   {"recoveries", report.recoveries.size()},
                   {"replayed_steps", report.replayed_steps.size()},
                   {"recover_s", recovery_seconds(report)},
                   {"kill_to_next_step_s", data.loss_to_step()},
                   {"snapshot_ms", c.snapshot_ms},
                   {"snapshot_every", a.snapshot_every},
                   {"snapshot_steps", a.snapshot_steps},
                   {"steps_plain_ms", c.plain_ms},
                   {"steps_after_waited_snapshot_ms", c.waited_ms},
                   {"steps_after_background_snapshot_ms", c.background_ms},
                   {"rss_driver_mib", {r.driver_start, r.driver_end}},
                   {"rss_node_mib", {r.node_start, r.node_end}},
                   {"rss_node_at_losses_mib", data.node_rss()},
                   {"rss_driver_at_losses_mib", data.driver_rss()}};
  std::ofstream(a.json) << j.dump(2) << "\n";
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"actorpipe_recovery_bench: what a lost node costs a run on loopback node processes"};
  bench_args a;
  add_flags(app, a);
  CLI11_PARSE(app, argc, argv);
  if (a.kill_offset < 0 && a.kill_every > 0) {
    // Between two snapshots, so that a loss costs the steps since the last one.
    a.kill_offset = (a.kill_every / 2 + a.snapshot_every / 2) % a.kill_every;
  }
  // Each recovery logs a warning per node that does not answer: the summary says it.
  actorpipe::set_log_level(actorpipe::log_level::error);

  // As `actorpipe train --nodes` does (the nodes are `actorpipe node`s, which do the same).
  actorpipe::memory::map_large_allocations();
  node_process n0(free_port()), n1(free_port()), n2(free_port());
  actorpipe::remote_model model;
  model.name = a.model_name;
  model.options.image_size = a.image;
  model.options.num_classes = a.classes;
  model.seed = 0;
  model.loss = "mse";
  model.optimizer.lr = 0.01;
  model.optimizer.momentum = 0.9;
  actorpipe::pipeline_options o;
  o.microbatches = a.microbatches;
  o.threads_per_stage = a.threads;
  o.wait_timeout = std::chrono::milliseconds(30000);
  o.placement.nodes = {n0.address(), n1.address()};
  o.placement.spares = {n1.address(), n2.address()};
  o.placement.connect_timeout = std::chrono::milliseconds(5000);
  actorpipe::engine sys;
  auto layers = actorpipe::make_model(a.model_name, model.options);
  actorpipe::pipeline pipe(sys, model, actorpipe::partition_by_params(layers, 2), o);
  std::cout << "model " << a.model_name << " (" << layers.size() << " layers, "
            << actorpipe::parameter_count(layers, 0, layers.size())
            << " parameters), 2 stages on nodes " << n0.address() << ", " << n1.address()
            << ", spare " << n2.address() << "\n";
  auto costs = time_snapshots(pipe, model, a);
  actorpipe::synthetic_source synthetic(model.options.in_channels, a.image, a.classes);
  killing_source data(synthetic, {&n1, &n2}, a.kill_every, a.kill_offset);
  auto result = soak(pipe, data, synthetic, model, a, n0.pid());
  print_summary(a, costs, result, data);
  if (!a.json.empty()) {
    write_json(a, costs, result, data);
  }
  return result.report.steps.size() == static_cast<std::size_t>(a.steps) ? 0 : 1;
}
