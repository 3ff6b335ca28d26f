// Tensors between processes: how fast a 64 MB activation crosses loopback in actorpipe's frames
// (comm::tensor_hub), plain and over TLS, against a plain TCP socket pair moving the same bytes,
// in the same run, interleaved; the latency of a small frame; and what a micro-batch costs when its
// stages live on nodes instead of in the process.
//
//   build/bench/actorpipe_wire_bench [--rounds 7] [--mb 64] [--json FILE]
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <actorpipe/actorpipe.hpp>

#include "bench/sweep.hpp"
#include "comm/tensor_hub.hpp"
#include "comm/test_certificates.hpp"
#include <actorpipe/node.hpp>

using namespace actorpipe;
using clock_type = std::chrono::steady_clock;

namespace {

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// A connected loopback TCP pair (client, server side).
std::pair<int, int> socket_pair() {
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  ::bind(listener, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&sa), &len);
  ::listen(listener, 1);
  int client = ::socket(AF_INET, SOCK_STREAM, 0);
  ::connect(client, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  int server = ::accept(listener, nullptr, nullptr);
  ::close(listener);
  int one = 1;
  ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return {client, server};
}

void write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    auto r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r <= 0) {
      throw std::runtime_error("raw socket write failed");
    }
    p += r;
    n -= static_cast<std::size_t>(r);
  }
}

void read_all(int fd, char* p, std::size_t n) {
  while (n > 0) {
    auto r = ::recv(fd, p, n, 0);
    if (r <= 0) {
      throw std::runtime_error("raw socket read failed");
    }
    p += r;
    n -= static_cast<std::size_t>(r);
  }
}

// GB/s of `count` transfers of `bytes` over a plain socket pair (the reader reuses one buffer).
double raw_throughput(std::size_t bytes, int count) {
  auto [client, server] = socket_pair();
  std::vector<char> out(bytes, 1), in(bytes);
  auto start = clock_type::now();
  std::thread reader([&, server = server] {
    for (int i = 0; i < count; ++i) {
      read_all(server, in.data(), bytes);
    }
  });
  for (int i = 0; i < count; ++i) {
    write_all(client, out.data(), bytes);
  }
  reader.join();
  auto s = seconds_since(start);
  ::close(client);
  ::close(server);
  return static_cast<double>(bytes) * count / s / 1e9;
}

// Waits for frames arriving at a hub.
struct counter {
  std::mutex mutex;
  std::condition_variable cv;
  int frames = 0;

  comm::tensor_hub::sink sink() {
    return [this](comm::frame&&) {
      std::lock_guard<std::mutex> lock(mutex);
      ++frames;
      cv.notify_all();
    };
  }
  void wait(int n) {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return frames >= n; });
  }
};

// GB/s of `count` frames of a `bytes` float tensor from one hub to another (the receiver
// allocates a tensor per frame, as a stage does).
double hub_throughput(comm::tensor_hub& from, comm::tensor_hub& to, counter& arrived,
                      std::size_t bytes, int count) {
  auto t = torch::ones({static_cast<int64_t>(bytes / 4)});
  int base = arrived.frames;
  auto start = clock_type::now();
  for (int i = 0; i < count; ++i) {
    from.send(to.host(), to.port(), comm::describe(comm::frame_kind::activation, 0, 1, i, 0, t), t);
  }
  arrived.wait(base + count);
  return static_cast<double>(bytes) * count / seconds_since(start) / 1e9;
}

// Microseconds of a one-way small frame: half a ping-pong between two hubs.
double hub_latency_us(int count) {
  std::unique_ptr<comm::tensor_hub> a, b;
  counter back;
  auto t = torch::ones({16});
  b = std::make_unique<comm::tensor_hub>(comm::hub_options{}, [&](comm::frame&& f) {
    b->send(a->host(), a->port(), f.header, f.tensor);
  });
  a = std::make_unique<comm::tensor_hub>(comm::hub_options{}, back.sink());
  auto header = comm::describe(comm::frame_kind::activation, 0, 1, 0, 0, t);
  a->send(b->host(), b->port(), header, t); // connect both ways first
  back.wait(1);
  auto start = clock_type::now();
  for (int i = 0; i < count; ++i) {
    a->send(b->host(), b->port(), header, t);
    back.wait(i + 2);
  }
  auto us = seconds_since(start) * 1e6 / count / 2;
  b.reset();
  return us;
}

double raw_latency_us(int count) {
  auto [client, server] = socket_pair();
  char buf[64 + 40] = {};
  std::thread echo([&, server = server] {
    for (int i = 0; i < count; ++i) {
      read_all(server, buf, sizeof buf);
      write_all(server, buf, sizeof buf);
    }
  });
  char mine[sizeof buf] = {};
  auto start = clock_type::now();
  for (int i = 0; i < count; ++i) {
    write_all(client, mine, sizeof mine);
    read_all(client, mine, sizeof mine);
  }
  auto us = seconds_since(start) * 1e6 / count / 2;
  echo.join();
  ::close(client);
  ::close(server);
  return us;
}

// Milliseconds per forward-only step of m micro-batches of a tiny MLP, 2 stages.
double step_ms(pipeline& pipe, const torch::Tensor& x, int steps) {
  pipe.forward(x);
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) {
    auto start = clock_type::now();
    pipe.forward(x);
    times.push_back(seconds_since(start) * 1e3);
  }
  return bench::median(times);
}

// A micro-batch through stages on two nodes against the same stages in process: `rounds`
// medians of 50 forward-only steps each, interleaved.
std::pair<std::vector<double>, std::vector<double>> steps_in_process_and_on_nodes(int rounds) {
  node n1(node_options{}), n2(node_options{});
  engine sys;
  remote_model model;
  model.name = "mlp";
  model.options.in_channels = 1;
  model.options.image_size = 4;
  model.options.num_classes = 3;
  pipeline_options o;
  o.microbatches = 8;
  o.threads_per_stage = 1;
  auto cut = partition_uniform(6, 2);
  torch::manual_seed(0);
  pipeline local(sys, make_model("mlp", model.options), cut, o);
  o.placement.nodes = {n1.address(), n2.address()};
  pipeline remote(sys, model, cut, o);
  auto x = torch::randn({8, 1, 4, 4});
  std::vector<double> local_ms, remote_ms;
  for (int r = 0; r < rounds; ++r) {
    local_ms.push_back(step_ms(local, x, 50));
    remote_ms.push_back(step_ms(remote, x, 50));
  }
  return {local_ms, remote_ms};
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"actorpipe wire bench: tensor frames over loopback against a plain socket"};
  int rounds = 7;
  int megabytes = 64;
  std::string json_file;
  app.add_option("--rounds", rounds, "Interleaved rounds (medians reported)")
    ->capture_default_str();
  app.add_option("--mb", megabytes, "Tensor size in MB")->capture_default_str();
  app.add_option("--json", json_file, "Write the results as JSON");
  CLI11_PARSE(app, argc, argv);
  set_log_level(log_level::off);
  auto bytes = static_cast<std::size_t>(megabytes) << 20;
  const int per_round = 5;

  counter arrived;
  comm::tensor_hub to(comm::hub_options{}, arrived.sink());
  comm::tensor_hub from(comm::hub_options{}, [](comm::frame&&) {});
  hub_throughput(from, to, arrived, bytes, 1); // connect, warm up
  // The same over TLS, with a throw-away CA.
  auto pki_dir =
    std::filesystem::temp_directory_path() / ("actorpipe-wire-bench-" + std::to_string(::getpid()));
  actorpipe::testing::test_ca ca(pki_dir, "bench");
  comm::hub_options tls_to_options, tls_from_options;
  tls_to_options.tls = ca.issue("to");
  tls_from_options.tls = ca.issue("from");
  counter tls_arrived;
  comm::tensor_hub tls_to(tls_to_options, tls_arrived.sink());
  comm::tensor_hub tls_from(tls_from_options, [](comm::frame&&) {});
  hub_throughput(tls_from, tls_to, tls_arrived, bytes, 1);
  std::filesystem::remove_all(pki_dir);
  std::vector<double> raw, hub, tls;
  for (int r = 0; r < rounds; ++r) {
    raw.push_back(raw_throughput(bytes, per_round));
    hub.push_back(hub_throughput(from, to, arrived, bytes, per_round));
    tls.push_back(hub_throughput(tls_from, tls_to, tls_arrived, bytes, per_round));
    std::cerr << "round " << r + 1 << "/" << rounds << ": raw " << raw.back() << " GB/s, frames "
              << hub.back() << " GB/s, TLS frames " << tls.back() << " GB/s\n";
  }
  auto raw_gbs = bench::median(raw);
  auto hub_gbs = bench::median(hub);
  auto tls_gbs = bench::median(tls);

  std::vector<double> raw_lat, hub_lat;
  for (int r = 0; r < rounds; ++r) {
    raw_lat.push_back(raw_latency_us(2000));
    hub_lat.push_back(hub_latency_us(2000));
  }

  auto [local_ms, remote_ms] = steps_in_process_and_on_nodes(rounds);
  auto local_step = bench::median(local_ms);
  auto remote_step = bench::median(remote_ms);
  // Forward-only over 2 stages: m micro-batches cross 2 hops each (scheduler -> node 1 -> node 2)
  // plus the outputs back.
  auto per_microbatch_us = (remote_step - local_step) * 1e3 / 8;

  std::cout << std::fixed << std::setprecision(2) << "\n"
            << megabytes << " MB tensors over loopback, medians of " << rounds << " rounds of "
            << per_round << " transfers, interleaved:\n"
            << "  plain socket pair      " << raw_gbs << " GB/s\n"
            << "  actorpipe frames       " << hub_gbs << " GB/s  (" << std::setprecision(0)
            << 100 * hub_gbs / raw_gbs << "% of the plain socket)\n"
            << "  actorpipe frames, TLS  " << std::setprecision(2) << tls_gbs << " GB/s  ("
            << std::setprecision(0) << 100 * tls_gbs / raw_gbs << "% of the plain socket)\n"
            << std::setprecision(1) << "one-way latency of a small frame (ping-pong / 2):\n"
            << "  plain socket pair      " << bench::median(raw_lat) << " us\n"
            << "  actorpipe frames       " << bench::median(hub_lat) << " us\n"
            << "forward-only step, tiny MLP, 2 stages, 8 micro-batches (median of " << rounds
            << " x 50):\n"
            << "  in process             " << std::setprecision(3) << local_step << " ms\n"
            << "  on 2 nodes (loopback)  " << remote_step << " ms\n"
            << "  overhead per micro-batch " << std::setprecision(0) << per_microbatch_us
            << " us\n";
  if (!json_file.empty()) {
    nlohmann::json j = {{"megabytes", megabytes},
                        {"rounds", rounds},
                        {"raw_gbs", raw},
                        {"frames_gbs", hub},
                        {"tls_frames_gbs", tls},
                        {"raw_latency_us", raw_lat},
                        {"frames_latency_us", hub_lat},
                        {"local_step_ms", local_ms},
                        {"remote_step_ms", remote_ms},
                        {"median",
                         {{"raw_gbs", raw_gbs},
                          {"frames_gbs", hub_gbs},
                          {"ratio", hub_gbs / raw_gbs},
                          {"tls_frames_gbs", tls_gbs},
                          {"raw_latency_us", bench::median(raw_lat)},
                          {"frames_latency_us", bench::median(hub_lat)},
                          {"per_microbatch_overhead_us", per_microbatch_us}}}};
    std::ofstream(json_file) << j.dump(2) << '\n';
  }
  return 0;
}
