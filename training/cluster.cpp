// A cluster's world from the launcher's variables, the layout of stages over its ranks, and the
// ranks' rendezvous in c10d's store.
#include "training/cluster.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/node.hpp>

#include "comm/tensor_hub.hpp"
#include "logging/log.hpp"

namespace actorpipe::training {
namespace {

using clock_type = std::chrono::steady_clock;

// `name`'s value as a number in [min, max], or nothing when unset.
std::optional<uint64_t> number(const environment& env, const char* name, uint64_t min,
                               uint64_t max) {
  const char* text = env(name);
  if (text == nullptr || *text == '\0') {
    return std::nullopt;
  }
  char* end = nullptr;
  errno = 0;
  auto value = std::strtoull(text, &end, 10);
  ACTORPIPE_CHECK(errno == 0 && *end == '\0' && text[0] != '-' && value >= min && value <= max,
                  "environment variable ", name, "='", text, "' is not a number in [", min, ", ",
                  max, "]");
  return value;
}

std::string text(const environment& env, const char* name) {
  const char* value = env(name);
  return value ? value : "";
}

cluster_world torchrun_world(const environment& env) {
  cluster_world w;
  w.launcher = "torchrun";
  w.size_variable = "WORLD_SIZE";
  w.size = *number(env, "WORLD_SIZE", 1, 1u << 20);
  w.rank = *number(env, "RANK", 0, 1u << 20);
  w.local_rank = number(env, "LOCAL_RANK", 0, 1u << 20).value_or(0);
  w.store_host = text(env, "MASTER_ADDR");
  w.store_host = w.store_host.empty() ? "127.0.0.1" : w.store_host;
  w.store_port = static_cast<uint16_t>(number(env, "MASTER_PORT", 1, 65535).value_or(29500));
  w.launcher_store = text(env, "TORCHELASTIC_USE_AGENT_STORE") == "True";
  w.attempt = number(env, "TORCHELASTIC_RESTART_COUNT", 0, 1u << 20).value_or(0);
  return w;
}

cluster_world slurm_world(const environment& env) {
  cluster_world w;
  w.launcher = "slurm";
  w.size_variable = "SLURM_NTASKS";
  w.size = *number(env, "SLURM_NTASKS", 1, 1u << 20);
  w.rank = *number(env, "SLURM_PROCID", 0, 1u << 20);
  w.local_rank = number(env, "SLURM_LOCALID", 0, 1u << 20).value_or(0);
  w.attempt = number(env, "SLURM_RESTART_COUNT", 0, 1u << 20).value_or(0);
  w.store_host = text(env, "MASTER_ADDR");
  if (w.store_host.empty()) {
    auto nodes = text(env, "SLURM_JOB_NODELIST");
    nodes = nodes.empty() ? text(env, "SLURM_NODELIST") : nodes;
    ACTORPIPE_CHECK(!nodes.empty(), "under Slurm (SLURM_PROCID is set) the store's host is "
                                    "MASTER_ADDR or the first of SLURM_JOB_NODELIST: neither "
                                    "is set");
    w.store_host = first_slurm_host(nodes);
  }
  if (auto port = number(env, "MASTER_PORT", 1, 65535)) {
    w.store_port = static_cast<uint16_t>(*port);
  } else {
    auto job = number(env, "SLURM_JOB_ID", 0, UINT64_MAX);
    ACTORPIPE_CHECK(job.has_value(), "under Slurm the store's port is MASTER_PORT, or follows "
                                     "from SLURM_JOB_ID: neither is set");
    w.store_port = static_cast<uint16_t>(15000 + *job % 10000);
  }
  return w;
}

} // namespace

std::optional<cluster_world> cluster_from(const environment& env) {
  std::optional<cluster_world> w;
  if (env("RANK") && env("WORLD_SIZE")) {
    w = torchrun_world(env);
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    w = slurm_world(env);
  } else {
    return std::nullopt;
  }
  ACTORPIPE_CHECK(w->rank < w->size, w->launcher, "'s rank ", w->rank,
                  " must be below the world size ", w->size, " (", w->size_variable, ")");
  return w;
}

std::optional<cluster_world> cluster_from_env() {
  return cluster_from([](const char* name) { return std::getenv(name); });
}

std::string first_slurm_host(const std::string& nodelist) {
  auto end = nodelist.find_first_of(",[");
  if (end == std::string::npos || nodelist[end] == ',') {
    return nodelist.substr(0, end);
  }
  // "prefix[07-09,12]suffix": the range's first number, its zeros kept.
  auto close = nodelist.find(']', end);
  ACTORPIPE_CHECK(close != std::string::npos, "SLURM_JOB_NODELIST '", nodelist,
                  "' has an unclosed '['");
  auto first = nodelist.substr(end + 1, nodelist.find_first_of("-,]", end + 1) - end - 1);
  auto suffix = nodelist.substr(close + 1, nodelist.find(',', close) - close - 1);
  return nodelist.substr(0, end) + first + suffix;
}

void check_world_fits(const cluster_world& world, std::size_t stages, std::size_t replicas) {
  ACTORPIPE_CHECK(stages >= 1 && replicas >= 1, "--stages and --replicas must be >= 1");
  if (stages * replicas == world.size) {
    return;
  }
  std::string fix = world.size % stages == 0
                      ? detail::concat("give --replicas ", world.size / stages, ", or ")
                      : std::string{};
  ACTORPIPE_CHECK(false, "the ", world.size, " processes ", world.launcher, " started (",
                  world.size_variable, "=", world.size, ") cannot hold --stages ", stages,
                  " x --replicas ", replicas, " = ", stages * replicas,
                  " stages, one per process: ", fix, "start ", stages * replicas, " processes");
}

std::vector<cluster_member> lay_out(std::vector<cluster_member> members, std::size_t stages) {
  std::map<std::string, std::size_t> first_rank;
  for (const auto& m : members) {
    auto [at, fresh] = first_rank.emplace(m.host, m.rank);
    at->second = fresh ? m.rank : std::min(at->second, m.rank);
  }
  std::sort(members.begin(), members.end(), [&](const auto& a, const auto& b) {
    return std::tie(first_rank[a.host], a.local_rank, a.rank) <
           std::tie(first_rank[b.host], b.local_rank, b.rank);
  });
  for (std::size_t i = 1; i < members.size(); ++i) {
    if (i % stages != 0 && members[i].host != members[i - 1].host) {
      log::get()->warn("cluster: replica {} spans hosts {} and {}: its {} stages do not fit in "
                       "the processes left on one host",
                       i / stages, members[i - 1].host, members[i].host, stages);
    }
  }
  return members;
}

std::string describe_layout(const std::vector<cluster_member>& laid, std::size_t stages) {
  std::string text;
  for (std::size_t begin = 0; begin < laid.size(); begin += stages) {
    text += detail::concat(begin == 0 ? "" : ", ", "replica ", begin / stages, " on ");
    const auto end = std::min(begin + stages, laid.size());
    // Runs of one host: "HOST (rank 3)", "HOST (ranks 0, 2) and HOST (rank 1)".
    for (auto i = begin; i < end;) {
      auto j = i;
      std::string ranks;
      for (; j < end && laid[j].host == laid[i].host; ++j) {
        ranks += detail::concat(j == i ? "" : ", ", laid[j].rank);
      }
      text += detail::concat(i == begin ? "" : " and ", laid[i].host, " (rank",
                             j - i > 1 ? "s " : " ", ranks, ")");
      i = j;
    }
  }
  return text;
}

std::string address_toward(const std::string& host, uint16_t port) {
  if (const char* given = std::getenv("ACTORPIPE_HOST"); given && *given) {
    return given;
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  ACTORPIPE_CHECK(rc == 0 && found, "cannot resolve the store's host '", host,
                  "' (MASTER_ADDR): ", ::gai_strerror(rc));
  // Connecting a datagram socket sends nothing: it only picks the route, and so our address.
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in mine{};
  socklen_t length = sizeof mine;
  bool ok = fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &length) == 0;
  ::freeaddrinfo(found);
  if (fd >= 0) {
    ::close(fd);
  }
  ACTORPIPE_CHECK(ok, "no route to the store's host '", host,
                  "' (MASTER_ADDR): set ACTORPIPE_HOST to this host's address");
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &mine.sin_addr, text, sizeof text);
  return text;
}

namespace {

// A first request, within `timeout`: a server that speaks another protocol closes the connection
// or never answers (libtorch 1.x's client before torch 2.x's, which validates clients first).
void probe(const c10::intrusive_ptr<c10d::TCPStore>& store, const std::string& key,
           std::chrono::milliseconds timeout) {
  auto answer = std::make_shared<std::promise<void>>();
  auto answered = answer->get_future();
  std::thread([store, key, answer] {
    try {
      store->check({key});
      answer->set_value();
    } catch (...) {
      answer->set_exception(std::current_exception());
    }
  }).detach();
  if (answered.wait_for(timeout) != std::future_status::ready) {
    throw std::runtime_error("the store does not answer");
  }
  answered.get();
}

} // namespace

struct cluster_rendezvous::impl {
  cluster_world world;
  std::chrono::milliseconds timeout;
  std::string prefix;
  c10::intrusive_ptr<c10d::TCPStore> store;
  // One request at a time on the store's connection (the beat runs beside the others).
  std::mutex mutex;
  std::atomic<bool> stop{false};
  std::thread beat;

  std::string key(const std::string& name) const { return prefix + name; }

  template <class F>
  auto locked(F&& f) {
    std::lock_guard<std::mutex> lock(mutex);
    return f(*store);
  }

  // Rank 0 says it is alive twice a second until it finishes.
  void start_beating() {
    beat = std::thread([this] {
      while (!stop.load()) {
        try {
          locked([&](c10d::Store& s) { return s.add(key("beat"), 1); });
        } catch (const std::exception&) {
          return; // the store is gone: the others notice it themselves
        }
        for (int i = 0; i < 5 && !stop.load(); ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
      }
    });
  }

  std::string where() const { return detail::concat(world.store_host, ":", world.store_port); }
};

cluster_rendezvous::cluster_rendezvous(const cluster_world& world,
                                       std::chrono::milliseconds timeout)
  : impl_(std::make_unique<impl>()) {
  impl_->world = world;
  impl_->timeout = timeout;
  impl_->prefix = detail::concat("actorpipe/cluster/attempt_", world.attempt, "/");
  const bool serve = world.rank == 0 && !world.launcher_store;
  c10d::TCPStoreOptions so;
  so.port = world.store_port;
  so.isServer = serve;
  so.waitWorkers = false;
  so.timeout = timeout;
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(world.store_host, so);
    probe(impl_->store, impl_->key("member/0"), timeout);
  } catch (const std::exception& e) {
    std::string what = e.what();
    // libtorch 1.x's client cannot speak to torch 2.x's store (it validates clients first).
    std::string hint;
    if (world.launcher_store && TORCH_VERSION_MAJOR < 2) {
      hint =
        detail::concat("; this build's libtorch ", TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR,
                       " cannot speak to a newer torchrun's store: set "
                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (rank 0 then "
                       "serves the store)");
    }
    throw pipeline_error(detail::concat(
      "rank ", world.rank, " of ", world.size, " (", world.launcher,
      "): ", serve ? "cannot serve the store on port " : "cannot reach the store at ",
      impl_->where(), " (MASTER_ADDR:MASTER_PORT) within ", timeout.count(),
      " ms: ", what.substr(0, what.find('\n')), hint));
  }
  if (world.rank == 0) {
    impl_->start_beating();
  }
}

cluster_rendezvous::~cluster_rendezvous() {
  impl_->stop = true;
  if (impl_->beat.joinable()) {
    impl_->beat.join();
  }
}

void cluster_rendezvous::announce(const cluster_member& me) {
  nlohmann::json j{
    {"rank", me.rank}, {"local_rank", me.local_rank}, {"host", me.host}, {"node", me.node}};
  auto text = j.dump();
  impl_->locked([&](c10d::Store& s) {
    s.set(impl_->key(detail::concat("member/", me.rank)),
          std::vector<uint8_t>(text.begin(), text.end()));
    return 0;
  });
}

std::vector<cluster_member> cluster_rendezvous::gather() {
  const auto& w = impl_->world;
  auto deadline = clock_type::now() + impl_->timeout;
  std::vector<std::optional<cluster_member>> members(w.size);
  for (;;) {
    std::string missing;
    for (std::size_t r = 0; r < w.size; ++r) {
      auto key = impl_->key(detail::concat("member/", r));
      if (!members[r] && impl_->locked([&](c10d::Store& s) { return s.check({key}); })) {
        auto bytes = impl_->locked([&](c10d::Store& s) { return s.get(key); });
        auto j = nlohmann::json::parse(std::string(bytes.begin(), bytes.end()));
        members[r] = cluster_member{j.at("rank"), j.at("local_rank"), j.at("host"), j.at("node")};
      }
      if (!members[r]) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    if (missing.empty()) {
      break;
    }
    if (clock_type::now() > deadline) {
      throw pipeline_error(detail::concat(
        "rank 0 of ", w.size, " (", w.launcher, "): rank(s) ", missing,
        " did not announce a node at the store ", impl_->where(), " within ",
        impl_->timeout.count(), " ms",
        w.launcher == "slurm" ? " (under Slurm every task runs it: start it with srun)" : ""));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::vector<cluster_member> all;
  for (auto& m : members) {
    all.push_back(*m);
  }
  return all;
}

void cluster_rendezvous::finish(const outcome& end) {
  nlohmann::json j{{"code", end.code}, {"message", end.message}};
  auto text = j.dump();
  impl_->locked([&](c10d::Store& s) {
    s.set(impl_->key("end"), std::vector<uint8_t>(text.begin(), text.end()));
    return 0;
  });
  // The others count themselves out; rank 0's store must outlive their reading.
  auto deadline = clock_type::now() + impl_->timeout;
  auto left = [&] {
    return impl_->locked([&](c10d::Store& s) { return s.add(impl_->key("left"), 0); });
  };
  while (left() < static_cast<int64_t>(impl_->world.size) - 1 && clock_type::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

cluster_rendezvous::outcome cluster_rendezvous::wait_for_end() {
  const auto& w = impl_->world;
  int64_t last_beat = -1;
  auto heard = clock_type::now();
  for (;;) {
    try {
      auto end_key = impl_->key("end");
      if (impl_->locked([&](c10d::Store& s) { return s.check({end_key}); })) {
        auto bytes = impl_->locked([&](c10d::Store& s) { return s.get(end_key); });
        auto j = nlohmann::json::parse(std::string(bytes.begin(), bytes.end()));
        impl_->locked([&](c10d::Store& s) { return s.add(impl_->key("left"), 1); });
        return {j.at("code").get<int>(), j.at("message").get<std::string>()};
      }
      auto beat = impl_->locked([&](c10d::Store& s) { return s.add(impl_->key("beat"), 0); });
      if (beat != last_beat) {
        last_beat = beat;
        heard = clock_type::now();
      }
    } catch (const std::exception& e) {
      std::string what = e.what();
      throw pipeline_error(detail::concat(
        "rank ", w.rank, " of ", w.size, ": the store at ", impl_->where(),
        " went away before rank 0 (the driver) ended the job: ", what.substr(0, what.find('\n'))));
    }
    if (clock_type::now() - heard > impl_->timeout) {
      throw pipeline_error(detail::concat("rank ", w.rank, " of ", w.size,
                                          ": rank 0 (the driver) has not been heard at the store ",
                                          impl_->where(), " for ", impl_->timeout.count(), " ms"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

uint16_t free_port(const std::string& addr) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (::inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) {
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
  }
  socklen_t length = sizeof sa;
  bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &length) == 0;
  if (fd >= 0) {
    ::close(fd);
  }
  return ok ? ntohs(sa.sin_port) : 0;
}

std::string secret_from(const std::string& secret_file) {
  if (!secret_file.empty()) {
    return comm::read_secret_file(secret_file);
  }
  const char* text = std::getenv("ACTORPIPE_SECRET");
  return text ? text : "";
}

namespace {

bool loopback(const std::string& host) {
  return host.rfind("127.", 0) == 0 || host == "localhost";
}

} // namespace

cluster_rank::cluster_rank(const cluster_world& world, const std::string& secret,
                           const tls_options& tls, std::chrono::milliseconds timeout,
                           const std::string& secret_ways)
  : world_(world), host_(address_toward(world.store_host, world.store_port)) {
  node_options o;
  o.host = host_;
  o.secret = secret;
  o.tls = tls;
  ACTORPIPE_CHECK(loopback(host_) || !o.secret.empty() || o.tls.enabled(), "rank ", world.rank,
                  " listens on ", host_, " for the other hosts, which needs the same secret on ",
                  "every rank (", secret_ways, ") or TLS");
  // Gloo (the replicas' collectives) binds to the same address unless told an interface.
  if (!std::getenv("ACTORPIPE_GLOO_IFNAME") && !std::getenv("GLOO_SOCKET_IFNAME")) {
    ::setenv("ACTORPIPE_GLOO_HOST", host_.c_str(), 1);
  }
  meeting_ = std::make_unique<cluster_rendezvous>(world, timeout);
  hosted_ = std::make_unique<node>(o);
  meeting_->announce({world.rank, world.local_rank, host_, hosted_->address()});
}

cluster_rank::~cluster_rank() = default;

std::vector<std::string> cluster_rank::gather_nodes(std::size_t stages, std::size_t replicas) {
  auto laid = lay_out(meeting_->gather(), stages);
  std::vector<std::string> nodes;
  for (const auto& m : laid) {
    nodes.push_back(m.node);
  }
  std::cerr << "actorpipe: " << world_.size << " ranks (" << world_.launcher << "): " << stages
            << " stages x " << replicas << " replicas, one stage per rank; rank 0 (pid "
            << ::getpid() << ") drives; " << describe_layout(laid, stages) << std::endl;
  return nodes;
}

uint16_t cluster_rank::replica_store_port() const {
  auto port = free_port(host_);
  ACTORPIPE_CHECK(port != 0, "rank 0 finds no free port on ", host_, " for its replicas' store");
  return port;
}

void cluster_rank::finish(int code, const std::string& message) {
  if (!std::exchange(finished_, true)) {
    meeting_->finish({code, message});
  }
}

int cluster_rank::host_until_end() {
  std::cerr << "actorpipe: rank " << world_.rank << " of " << world_.size << " (" << world_.launcher
            << ", pid " << ::getpid() << ") hosts a stage at " << hosted_->address()
            << "; rank 0 drives" << std::endl;
  auto end = meeting_->wait_for_end();
  if (end.code != 0) {
    std::cerr << "actorpipe: rank 0 ended the job with code " << end.code
              << (end.message.empty() ? "" : ": " + end.message) << std::endl;
  }
  return end.code;
}

} // namespace actorpipe::training
