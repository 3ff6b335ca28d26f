// What the tests of stages on nodes share: a tiny model and its options, batches, plain
// libtorch's losses, a client speaking the node protocol, and waits with deadlines for what
// nodes do on their own (copies, rejoins, dropped stages).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include <unistd.h>

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include "../engine/oracle.hpp"
#include "../ports.hpp"
#include "actors/pipeline_errc.hpp"
#include "comm/tensor_hub.hpp"
#include "comm/test_certificates.hpp"
#include "comm/wire.hpp"
#include "nodes/kept_snapshots.hpp"
#include "nodes/option_fields.hpp"
#include "nodes/protocol.hpp"
#include "nodes/remote_stages.hpp"
#include <actorpipe/models.hpp>
#include <actorpipe/node.hpp>
#include <actorpipe/replicas.hpp>
#include <nlohmann/json.hpp>

namespace actorpipe::test {

using namespace std::chrono_literals;

// A two-block GPT of width 8 over 11 tokens, with cross entropy and Adam (lr 1e-2), seed 5.
inline remote_model tiny_gpt() {
  remote_model gpt;
  gpt.name = "gpt";
  gpt.options.vocabulary = 11;
  gpt.options.layers = 2;
  gpt.options.width = 8;
  gpt.options.context = 8;
  gpt.seed = 5;
  gpt.loss = "cross_entropy";
  gpt.optimizer.name = "adam";
  gpt.optimizer.lr = 1e-2;
  return gpt;
}

inline pipeline_options local_options() {
  pipeline_options o;
  o.microbatches = 4;
  o.threads_per_stage = 1;
  o.loss = mse;
  o.optimizer = sgd(0.1, 0.9);
  o.wait_timeout = 5000ms;
  o.step_timeout = 20000ms;
  return o;
}

inline pipeline_options remote_options(const std::vector<std::string>& nodes,
                                       const std::string& secret = "") {
  auto o = local_options();
  o.placement.nodes = nodes;
  o.placement.secret = secret;
  o.placement.connect_timeout = 5000ms;
  return o;
}

inline actorpipe::node_options node_config(const std::string& secret = "") {
  actorpipe::node_options o;
  o.secret = secret;
  return o;
}

inline std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(100 + step);
  return {torch::randn({10, 1, 4, 4}), torch::randn({10, 3})};
}

// The loss of a training step of `p` on batch(step).
template <class Pipe>
inline double loss_at(Pipe& p, int step) {
  auto [x, y] = batch(step);
  return p.train_step(x, y).loss;
}

// Plain libtorch's loss at each of the first `steps` batches (batch(step)), trained in order.
inline std::vector<double> plain_losses(plain_model& plain, int steps) {
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step);
    losses.push_back(plain.step(x, y));
  }
  return losses;
}

inline std::string temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("actorpipe-nodes-test-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

// A client of its own actor system speaking the node protocol to a node directly, as a
// scheduler (or an intruder) would.
struct control_client {
  caf::actor_system_config config;
  std::unique_ptr<caf::actor_system> system;
  caf::actor node;
  std::unique_ptr<caf::scoped_actor> self;

  explicit control_client(const std::string& address) {
    config.load<caf::io::middleman>();
    config.set("logger.verbosity", caf::atom("quiet"));
    actors::add_pipeline_errors(config);
    system = std::make_unique<caf::actor_system>(config);
    auto [host, port] = nodes::parse_host_port(address, "node");
    auto handle = system->middleman().remote_actor(host, port);
    REQUIRE(handle);
    node = *handle;
    self = std::make_unique<caf::scoped_actor>(*system);
  }

  ~control_client() { self.reset(); }

  // A request answered by text; a failed request gives CAF's error, rendered.
  template <class... Ts>
  std::string ask(Ts... xs) {
    std::string reply = "no reply";
    (*self)
      ->request(node, 10s, xs...)
      .receive([&](std::string& r) { reply = r; }, [&](caf::error& e) { reply = render(e); });
    return reply;
  }

  std::string render(const caf::error& e) const { return system->render(e); }

  // The error a request is refused with (none when it was answered with a `Reply`).
  template <class Reply = bool, class... Ts>
  caf::error refusal(Ts... xs) {
    caf::error why;
    (*self)
      ->request(node, 10s, xs...)
      .receive([](Reply&) {}, [&](caf::error& e) { why = std::move(e); });
    return why;
  }

  // Answers the node's challenge with `secret`, as a scheduler does before anything else.
  void authenticate(const std::string& secret = "") {
    auto challenge = ask(nodes::hello_atom::value);
    auto why =
      refusal(nodes::auth_atom::value, nodes::to_hex(comm::handshake_answer(secret, challenge)));
    REQUIRE_MESSAGE(!why, render(why));
  }
};

// Whether the node at `address` holds, within ten seconds, a copy of stage `stage`'s snapshot
// `number`: the copies travel node to node after the driver has the snapshot whole, so a test
// that loses the copy's sender right after must wait for it (else recover() rightly restores the
// driver's snapshot).
inline bool holds_copy(const std::string& address, uint32_t stage, uint64_t number) {
  control_client client(address);
  client.authenticate();
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    auto kept = nodes::kept_by(*client.system, {client.node}, 2s);
    for (const auto& k : kept.front()) {
      if (k.copy && k.stage == stage && k.number == number) {
        return true;
      }
    }
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

// Batches of batch(step), and the node in `victim` goes away when batch `when` is asked for
// the first time: a node lost in the middle of train().
class losing_source : public batch_source {
public:
  losing_source(std::unique_ptr<node>& victim, int64_t when) : victim_(victim), when_(when) {}
  std::string name() const override { return "losing"; }
  int64_t epoch_samples() const override { return 0; }
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t, int64_t index, int64_t, uint64_t, int64_t,
                                                int64_t) const override {
    if (index == when_ && victim_) {
      victim_.reset();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return test::batch(static_cast<int>(index));
  }

private:
  std::unique_ptr<node>& victim_;
  int64_t when_;
};

// train() with lost-node recovery: batches of 10, SGD at 0.1, no progress bar.
inline train_options recovering_options(int64_t steps, uint64_t snapshot_every) {
  train_options to;
  to.batch = 10;
  to.max_steps = steps;
  to.lr = 0.1;
  to.cosine = false;
  to.progress = false;
  to.recover_lost_nodes = true;
  to.snapshot_every = snapshot_every;
  return to;
}

// The report's first `steps` steps are numbered 1, 2, ... with plain libtorch's losses on
// batch(0), batch(1), ... (plain trains them).
inline void check_steps_equal_plain(const train_report& report, plain_model& plain, int steps) {
  REQUIRE(report.steps.size() >= static_cast<std::size_t>(steps));
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step);
    CAPTURE(step);
    CHECK(report.steps[static_cast<std::size_t>(step)].first == static_cast<uint64_t>(step + 1));
    CHECK(report.steps[static_cast<std::size_t>(step)].second ==
          doctest::Approx(plain.step(x, y)).epsilon(1e-6));
  }
}

// Asks rejoin_nodes() for up to 10 s until it takes a node.
inline std::optional<recovery_report> rejoin_within_seconds(pipeline& p) {
  std::optional<recovery_report> r;
  for (int k = 0; k < 500 && !r; ++k) {
    r = p.rejoin_nodes();
    if (!r) {
      std::this_thread::sleep_for(20ms);
    }
  }
  return r;
}

// A node on a port below the ephemeral ones, which a connection could take while the node is
// away: a test stops it and starts another on the same port.
inline std::unique_ptr<node> node_to_restart() {
  std::unique_ptr<node> n;
  std::mt19937 draw(std::random_device{}());
  for (int attempt = 0; attempt < 50 && !n; ++attempt) {
    auto config = node_config();
    config.port = static_cast<uint16_t>(20000 + draw() % 12000);
    try {
      n = std::make_unique<node>(config);
    } catch (const pipeline_error&) {
      // taken: another
    }
  }
  REQUIRE(n);
  return n;
}

// Asks `replicas` between steps, for up to `seconds`, to take back the nodes it lost.
inline std::optional<recovery_report> replicas_rejoin_within(replicated_pipeline& replicas,
                                                             int seconds) {
  for (int k = 0; k < seconds * 20; ++k) {
    if (auto r = replicas.rejoin_nodes()) {
      return r;
    }
    std::this_thread::sleep_for(50ms);
  }
  return std::nullopt;
}

// Waits (up to 5 s) for nodes to drop the stages of a driver that went.
inline void wait_for_no_stages(const std::vector<const node*>& nodes) {
  auto hosting = [&] {
    return std::any_of(nodes.begin(), nodes.end(), [](const node* n) { return n->stages() != 0; });
  };
  for (int wait = 0; wait < 100 && hosting(); ++wait) {
    std::this_thread::sleep_for(50ms);
  }
  CHECK_FALSE(hosting());
}

// Trains `resumed` on from its nodes' snapshot of step 4 (--resume nodes) to step 8: steps 5-8
// with plain libtorch's losses (`expected`), and its parameters.
inline void check_resumed_to_step_8(pipeline& resumed, losing_source& data, train_options to,
                                    const std::vector<double>& expected, plain_model& plain) {
  to.resume = "nodes";
  to.max_steps = 8;
  auto report = train(resumed, data, to);
  REQUIRE(report.steps.size() == 4);
  for (std::size_t k = 0; k < 4; ++k) {
    CAPTURE(k);
    CHECK(report.steps[k].first == k + 5);
    CHECK(report.steps[k].second == doctest::Approx(expected[k + 4]).epsilon(1e-6));
  }
  check_close(resumed.named_parameters(), named(plain.layers, false));
}

} // namespace actorpipe::test
