// Stages on nodes (in this process, each node its own actor system and listeners, talking over
// loopback TCP exactly as separate processes do).
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <limits>
#include <map>
#include <random>
#include <thread>

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
#include <actorpipe/models.hpp>
#include <actorpipe/node.hpp>
#include <actorpipe/replicas.hpp>
#include <nlohmann/json.hpp>

using namespace actorpipe;
using namespace actorpipe::test;
using namespace std::chrono_literals;

namespace {

// A two-block GPT of width 8 over 11 tokens, with cross entropy and Adam (lr 1e-2), seed 5.
remote_model tiny_gpt() {
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

pipeline_options local_options() {
  pipeline_options o;
  o.microbatches = 4;
  o.threads_per_stage = 1;
  o.loss = mse;
  o.optimizer = sgd(0.1, 0.9);
  o.wait_timeout = 5000ms;
  o.step_timeout = 20000ms;
  return o;
}

pipeline_options remote_options(const std::vector<std::string>& nodes,
                                const std::string& secret = "") {
  auto o = local_options();
  o.placement.nodes = nodes;
  o.placement.secret = secret;
  o.placement.connect_timeout = 5000ms;
  return o;
}

actorpipe::node_options node_config(const std::string& secret = "") {
  actorpipe::node_options o;
  o.secret = secret;
  return o;
}

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(100 + step);
  return {torch::randn({10, 1, 4, 4}), torch::randn({10, 3})};
}

// The loss of a training step of `p` on batch(step).
template <class Pipe>
double loss_at(Pipe& p, int step) {
  auto [x, y] = batch(step);
  return p.train_step(x, y).loss;
}

// Plain libtorch's loss at each of the first `steps` batches (batch(step)), trained in order.
std::vector<double> plain_losses(plain_model& plain, int steps) {
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step);
    losses.push_back(plain.step(x, y));
  }
  return losses;
}

std::string temp_dir(const std::string& name) {
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

  // Answers the node's challenge with `secret`, as a scheduler does before anything else.
  void authenticate(const std::string& secret = "") {
    auto challenge = ask(nodes::hello_atom::value);
    REQUIRE(
      ask(nodes::auth_atom::value, nodes::to_hex(comm::handshake_answer(secret, challenge))) == "");
  }
};

} // namespace

TEST_CASE("stages on two nodes train like the in-process pipeline and plain libtorch") {
  node n1(node_config("pw")), n2(node_config("pw"));
  engine sys;
  auto cut = partition_uniform(6, 2);
  pipeline remote(sys, tiny_remote(), cut, remote_options({n1.address(), n2.address()}, "pw"));
  pipeline local(sys, tiny_mlp(1), cut, local_options());
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  CHECK(n1.stages() == 1);
  CHECK(n2.stages() == 1);
  CHECK(remote.stage_parameter_counts() == local.stage_parameter_counts());
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    auto r = remote.train_step(x, y);
    auto l = local.train_step(x, y);
    auto p = plain.step(x, y);
    CAPTURE(step);
    CHECK(r.loss == doctest::Approx(l.loss).epsilon(1e-6));
    CHECK(r.loss == doctest::Approx(p).epsilon(1e-6));
    REQUIRE(r.stages.size() == 2);
    CHECK(r.stages[0].actions.size() == 8); // 4 forwards, 4 backwards
  }
  check_close(remote.named_parameters(), local.named_parameters());
  check_close(remote.named_parameters(), named(plain.layers, false));
  CHECK_THROWS_WITH(remote.named_gradients(), doctest::Contains("stay on the nodes"));
  // Forward-only outputs come back from the last node.
  auto [x, y] = batch(9);
  CHECK(torch::allclose(remote.forward(x), local.forward(x), 1e-5, 1e-7));
  auto parts = remote.forward_scattered(x);
  CHECK(parts.size() == 4);
}

TEST_CASE("recomputation reaches the stages on nodes and trains as in process") {
  node n1(node_config()), n2(node_config());
  engine sys;
  auto cut = partition_uniform(6, 2);
  auto options = remote_options({n1.address(), n2.address()});
  options.recompute = recompute_mode::always;
  pipeline remote(sys, tiny_remote(), cut, options);
  pipeline local(sys, tiny_mlp(1), cut, local_options());
  for (int step = 0; step < 2; ++step) {
    auto [x, y] = batch(step);
    auto r = remote.train_step(x, y);
    CHECK(r.loss == doctest::Approx(local.train_step(x, y).loss).epsilon(1e-6));
    // Every forward on both nodes kept only its input.
    REQUIRE(r.stages.size() == 2);
    CHECK(r.stages[0].recomputed == 4);
    CHECK(r.stages[1].recomputed == 4);
  }
  check_close(remote.named_parameters(), local.named_parameters());
  // The spec a node builds from says so (a node of an older build would refuse the field's
  // absence, not ignore it).
  nodes::stage_spec spec;
  spec.model = tiny_remote();
  spec.bounds = cut.bounds;
  spec.settings.count = 2;
  spec.settings.recompute = recompute_mode::except_last;
  CHECK(nodes::stage_spec_from_json(nodes::to_json(spec)).settings.recompute ==
        recompute_mode::except_last);
}

TEST_CASE("hooks run on the nodes, a TorchScript module and a built-in, as in process") {
  node n1(node_config()), n2(node_config()), n3(node_config());
  engine sys;
  auto cut = partition_uniform(6, 3);
  auto model = tiny_remote();
  model.hooks.after_forward.torchscript =
    script_module_bytes("def forward(self, x):\n    return x * 0.5\n");
  model.hooks.after_forward.name = "halve.pt";
  model.hooks.after_backward.builtin = "clamp:0.01";
  pipeline remote(sys, model, cut, remote_options({n1.address(), n2.address(), n3.address()}));
  auto o = local_options();
  o.hooks.after_forward = [](const hook_context&, torch::Tensor& t) { t = t * 0.5; };
  o.hooks.after_backward = [](const hook_context&, torch::Tensor& t) { t = t.clamp(-0.01, 0.01); };
  pipeline local(sys, tiny_mlp(1), cut, o);
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    auto r = remote.train_step(x, y).loss;
    CAPTURE(step);
    CHECK(r == doctest::Approx(local.train_step(x, y).loss).epsilon(1e-6));
    CHECK(r != doctest::Approx(plain.step(x, y)).epsilon(1e-3)); // the hooks ran
  }
  check_close(remote.named_parameters(), local.named_parameters());
  // A hook that fails on a node fails the step naming the stage; nothing changes.
  auto failing = tiny_remote();
  failing.hooks.after_backward.builtin = "check_finite";
  pipeline checked(sys, failing, cut, remote_options({n1.address(), n2.address(), n3.address()}));
  auto [x, y] = batch(7);
  y[9][0] = std::numeric_limits<float>::quiet_NaN(); // micro-batch 3's loss and gradients
  auto before = checked.named_parameters();
  CHECK_THROWS_WITH_AS(checked.train_step(x, y),
                       doctest::Contains("stage 2, microbatch 3: the after_backward hook failed "
                                         "on tensor 0: check_finite"),
                       pipeline_error);
  check_close(checked.named_parameters(), before, 0, 0);
  // Refused before any node is reached (nobody listens at the address given).
  auto unknown = tiny_remote();
  unknown.hooks.after_forward.builtin = "clip:1";
  auto nowhere = "127.0.0.1:" + std::to_string(free_port());
  CHECK_THROWS_WITH_AS(pipeline(sys, unknown, partition_uniform(6, 1), remote_options({nowhere})),
                       doctest::Contains("unknown after_forward hook 'clip:1'"), invalid_argument);
}

TEST_CASE("bf16 reaches the stages on nodes and trains as in process, recomputing") {
  node n1(node_config()), n2(node_config());
  engine sys;
  auto cut = partition_uniform(6, 2);
  auto options = remote_options({n1.address(), n2.address()});
  options.precision = precision_mode::bf16;
  options.recompute = recompute_mode::always;
  pipeline remote(sys, tiny_remote(), cut, options);
  auto local_o = local_options();
  local_o.precision = precision_mode::bf16;
  local_o.recompute = recompute_mode::always;
  pipeline local(sys, tiny_mlp(1), cut, local_o);
  pipeline fp32(sys, tiny_mlp(1), cut, local_options());
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    auto r = remote.train_step(x, y);
    auto l = local.train_step(x, y);
    auto f = fp32.train_step(x, y);
    CAPTURE(step);
    // The same bf16 arithmetic on the nodes as in process (bit for bit: same kernels, threads).
    CHECK(r.loss == doctest::Approx(l.loss).epsilon(1e-6));
    CHECK(r.loss != f.loss);
    CHECK(r.loss == doctest::Approx(f.loss).epsilon(0.02));
    // Stash sizes come back from the nodes: the first stage keeps 4 inputs of 1x4x4 floats.
    REQUIRE(r.stages.size() == 2);
    CHECK(r.stages[0].peak_stash_bytes == l.stages[0].peak_stash_bytes);
    CHECK(r.stages[0].peak_stash_bytes > 0);
  }
  check_close(remote.named_parameters(), local.named_parameters(), 1e-5, 1e-6);
  nodes::stage_spec spec;
  spec.model = tiny_remote();
  spec.bounds = cut.bounds;
  spec.settings.count = 2;
  spec.settings.precision = precision_mode::bf16;
  CHECK(nodes::stage_spec_from_json(nodes::to_json(spec)).settings.precision ==
        precision_mode::bf16);
}

TEST_CASE("a node can host several stages, and three stages span two nodes") {
  node n1(node_config()), n2(node_config());
  engine sys;
  auto cut = partition_uniform(6, 3);
  pipeline remote(sys, tiny_remote(), cut,
                  remote_options({n1.address(), n2.address(), n1.address()}));
  pipeline local(sys, tiny_mlp(1), cut, local_options());
  CHECK(n1.stages() == 2);
  for (int step = 0; step < 2; ++step) {
    auto [x, y] = batch(step);
    CHECK(remote.train_step(x, y).loss ==
          doctest::Approx(local.train_step(x, y).loss).epsilon(1e-6));
  }
  check_close(remote.named_parameters(), local.named_parameters());
}

TEST_CASE("a checkpoint of stages on nodes resumes on re-attached nodes") {
  auto dir = temp_dir("resume");
  auto cut = partition_uniform(6, 2);
  engine sys;
  pipeline local(sys, tiny_mlp(1), cut, local_options());
  node n1(node_config());
  std::string second_address;
  {
    node n2(node_config());
    second_address = n2.address();
    pipeline remote(sys, tiny_remote(), cut, remote_options({n1.address(), n2.address()}));
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = batch(step);
      remote.train_step(x, y);
      local.train_step(x, y);
    }
    remote.save_state(dir);
    CHECK(std::filesystem::exists(dir + "/stage-0.pt"));
    CHECK(std::filesystem::exists(dir + "/stage-1.pt"));
  }
  // Node 2 went away with its pipeline; a new node 2 comes up, a new pipeline loads.
  node n2(node_config());
  pipeline resumed(sys, tiny_remote(), cut, remote_options({n1.address(), n2.address()}));
  resumed.load_state(dir);
  check_close(resumed.named_parameters(), local.named_parameters());
  // Momentum buffers came back too: the next step matches.
  auto [x, y] = batch(2);
  CHECK(resumed.train_step(x, y).loss ==
        doctest::Approx(local.train_step(x, y).loss).epsilon(1e-6));
  check_close(resumed.named_parameters(), local.named_parameters());
  std::filesystem::remove_all(dir);
}

TEST_CASE("a wrong secret and an absent node are refused with their names") {
  node n1(node_config("right"));
  engine sys;
  auto cut = partition_uniform(6, 2);
  CHECK_THROWS_WITH_AS(
    pipeline(sys, tiny_remote(), cut, remote_options({n1.address(), n1.address()}, "wrong")),
    doctest::Contains(("node " + n1.address() + " refused the secret").c_str()), pipeline_error);
  CHECK(n1.stages() == 0);
  CHECK(n1.rejected() >= 1);
  // A port nobody listens on (the node's data port speaks another protocol; use a closed one).
  std::string absent;
  {
    node gone(node_config());
    absent = gone.address();
  }
  CHECK_THROWS_WITH_AS(
    pipeline(sys, tiny_remote(), cut, remote_options({n1.address(), absent}, "right")),
    doctest::Contains(("cannot reach node " + absent).c_str()), pipeline_error);
  // The stage node 1 built for the failed pipeline was released.
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (n1.stages() != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  CHECK(n1.stages() == 0);
  CHECK_THROWS_WITH_AS(pipeline(sys, tiny_remote(), cut, remote_options({"nonsense", "x:1"})),
                       doctest::Contains("'nonsense' is not HOST:PORT"), invalid_argument);
  CHECK_THROWS_WITH_AS(pipeline(sys, tiny_remote(), cut, remote_options({n1.address()})),
                       doctest::Contains("1 nodes given for 2 stages"), invalid_argument);
}

TEST_CASE("a node refuses a non-loopback address without a secret") {
  actorpipe::node_options o;
  o.host = "0.0.0.0";
  CHECK_THROWS_WITH_AS(node{o}, doctest::Contains("without a secret"), invalid_argument);
}

TEST_CASE("unauthenticated and unknown control messages are refused, and the node keeps serving") {
  node n(node_config("pw"));
  control_client intruder(n.address());
  CHECK(intruder.ask(nodes::build_atom::value, std::string("{}")).find("authenticate first") !=
        std::string::npos);
  // A wrong answer to the challenge.
  intruder.ask(nodes::hello_atom::value);
  CHECK(intruder.ask(nodes::auth_atom::value, std::string("00")).find("refused the secret") !=
        std::string::npos);
  // Messages the protocol does not know are dropped.
  bool failed = false;
  (*intruder.self)
    ->request(intruder.node, 5s, std::string("hello?"), 42)
    .receive([&](caf::message&) {}, [&](caf::error&) { failed = true; });
  CHECK(failed);
  CHECK(n.rejected() >= 3);
  // The node still serves a scheduler that knows the secret.
  node n2(node_config("pw"));
  engine sys;
  pipeline remote(sys, tiny_remote(), partition_uniform(6, 2),
                  remote_options({n.address(), n2.address()}, "pw"));
  auto [x, y] = batch(0);
  CHECK(std::isfinite(remote.train_step(x, y).loss));
}

TEST_CASE("a node whose stage is busy past its deadline answers an abort and an update with an "
          "error naming the stage, the node and the deadline") {
  // The test speaks the node protocol itself: it builds a one-stage ResNet-18 with a 100 ms wait
  // deadline, gives it a forward-only program long enough to keep its thread busy for seconds,
  // then asks the node to abort and to step the optimizer while the stage cannot answer.
  node n(node_config());
  control_client scheduler(n.address());
  scheduler.authenticate();
  nodes::stage_spec spec;
  spec.model.name = "resnet18";
  spec.model.options.num_classes = 10;
  spec.model.options.image_size = 224;
  spec.bounds = {0, make_model("resnet18", spec.model.options).size()};
  spec.settings.wait_timeout = 100ms;
  auto built = nlohmann::json::parse(scheduler.ask(nodes::build_atom::value, nodes::to_json(spec)));
  REQUIRE_MESSAGE(!built.contains("error"), built.dump());
  comm::hub_options hub_options;
  hub_options.host = "127.0.0.1";
  comm::tensor_hub hub(hub_options, [](comm::frame&&) {});
  nodes::peer_table peers;
  peers.stages.push_back(
    {built.at("data_host").get<std::string>(), built.at("data_port").get<uint16_t>(), n.address()});
  peers.scheduler = {hub.host(), hub.port(), "scheduler"};
  auto& self = *scheduler.self;
  REQUIRE(scheduler.ask(nodes::wire_atom::value, uint32_t{0}, nodes::to_json(peers),
                        caf::actor_cast<caf::actor>(self)) == "");
  // Three forward passes of 16 images at 224x224 (about 90 GFLOP on one thread), their inputs
  // there before the plan: the stage runs them in one go, for a second or more.
  actors::step_plan plan;
  plan.step = 1;
  plan.train = false;
  for (int32_t mb = 0; mb < 3; ++mb) {
    plan.program.push_back({action_kind::forward, mb});
    auto x = torch::randn({16, 3, 224, 224});
    hub.send(peers.stages[0].host, peers.stages[0].port,
             comm::describe(comm::frame_kind::activation, 0, 1, mb, 0, x), x);
  }
  std::this_thread::sleep_for(200ms);
  self->send(scheduler.node, nodes::rplan_atom::value, uint32_t{0}, nodes::to_json(plan, 0));
  std::this_thread::sleep_for(100ms);
  auto start = std::chrono::steady_clock::now();
  std::string abort_error;
  self->request(scheduler.node, 10s, nodes::rabort_atom::value, uint32_t{0}, uint64_t{1})
    .receive([&](bool) { abort_error = "the busy stage confirmed the abort"; },
             [&](caf::error& e) { abort_error = scheduler.render(e); });
  CHECK_MESSAGE(abort_error.find("stage 0 on node " + n.address() + ", asked to abort") !=
                  std::string::npos,
                abort_error);
  CHECK_MESSAGE(abort_error.find("100 ms") != std::string::npos, abort_error);
  std::string update_error;
  caf::error refusal;
  self->request(scheduler.node, 10s, nodes::rupdate_atom::value, uint32_t{0}, uint64_t{1}, 0.1, 1.0)
    .receive([&](double) { update_error = "the busy stage stepped its optimizer"; },
             [&](caf::error& e) {
               refusal = e;
               update_error = scheduler.render(e);
             });
  // A refusal of the node's, as CAF error data: its kind, and the sentence as CAF renders it.
  CHECK(actors::is_pipeline_error(refusal));
  CHECK(actors::kind_of_pipeline_error(refusal) == error_kind::timeout);
  CHECK_MESSAGE(
    update_error.find("stage 0 on node " + n.address() + ", asked to step its optimizer") == 0,
    update_error);
  CHECK_MESSAGE(update_error.find("100 ms") != std::string::npos, update_error);
  // Both answers came at the node's deadline, not when the stage got free (or never).
  CHECK(std::chrono::steady_clock::now() - start < 2s);
  self->send(scheduler.node, nodes::release_atom::value, uint32_t{0});
}

TEST_CASE("a node that goes away fails the next step, naming it, within the deadline") {
  auto n1 = std::make_unique<node>(node_config());
  node n2(node_config());
  auto address = n1->address();
  engine sys;
  pipeline remote(sys, tiny_remote(), partition_uniform(6, 2),
                  remote_options({address, n2.address()}));
  auto [x, y] = batch(0);
  remote.train_step(x, y);
  n1.reset();
  std::this_thread::sleep_for(200ms);
  auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(remote.train_step(x, y), doctest::Contains(("node " + address).c_str()),
                       pipeline_error);
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  // The same as fields, for an application that re-plans: which node, which stage.
  try {
    remote.train_step(x, y);
    FAIL("a step on a lost node succeeded");
  } catch (const pipeline_error& e) {
    CAPTURE(e.what());
    CHECK(e.kind() == error_kind::node_lost);
    CHECK(e.node() == address);
    CHECK(e.stage() == std::optional<std::size_t>(0));
  }
}

namespace {

// A CA for the cluster and one for strangers, in a folder of this test process.
struct cluster_pki : actorpipe::testing::test_pki {
  cluster_pki() : test_pki(temp_dir("pki")) {}

  actorpipe::node_options node(const std::string& name) const {
    actorpipe::node_options o;
    o.tls = ca.issue(name);
    return o;
  }
};

} // namespace

TEST_CASE("over TLS, stages on two nodes train like the in-process pipeline") {
  cluster_pki pki;
  node n1(pki.node("node1")), n2(pki.node("node2"));
  engine sys;
  auto cut = partition_uniform(6, 2);
  auto o = remote_options({n1.address(), n2.address()});
  o.placement.tls = pki.ca.issue("scheduler");
  pipeline remote(sys, tiny_remote(), cut, o);
  pipeline local(sys, tiny_mlp(1), cut, local_options());
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step);
    CAPTURE(step);
    CHECK(remote.train_step(x, y).loss ==
          doctest::Approx(local.train_step(x, y).loss).epsilon(1e-6));
  }
  check_close(remote.named_parameters(), local.named_parameters());
  auto [x, y] = batch(9);
  CHECK(torch::allclose(remote.forward(x), local.forward(x), 1e-5, 1e-7));
  // With certificates a node may listen beyond loopback without a shared secret.
  auto open = pki.node("open");
  open.host = "0.0.0.0";
  CHECK_NOTHROW(node{open});
}

TEST_CASE("a TLS node refuses plain schedulers and other CAs' certificates, and keeps serving") {
  cluster_pki pki;
  node n1(pki.node("node1")), n2(pki.node("node2"));
  auto cut = partition_uniform(6, 2);
  auto o = remote_options({n1.address(), n2.address()});
  o.placement.connect_timeout = 2000ms;
  {
    // No TLS: the node's TLS layer drops the plain handshake.
    engine plain;
    auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH_AS(pipeline(plain, tiny_remote(), cut, o),
                         doctest::Contains(("node " + n1.address()).c_str()), pipeline_error);
    CHECK(std::chrono::steady_clock::now() - start < 5s);
  }
  {
    engine stranger;
    auto s = o;
    s.placement.tls = pki.stranger.issue("intruder");
    CHECK_THROWS_WITH_AS(pipeline(stranger, tiny_remote(), cut, s),
                         doctest::Contains(("cannot reach node " + n1.address()).c_str()),
                         pipeline_error);
  }
  CHECK(n1.stages() == 0);
  engine sys;
  auto good = o;
  good.placement.tls = pki.ca.issue("scheduler");
  pipeline remote(sys, tiny_remote(), cut, good);
  auto [x, y] = batch(0);
  CHECK(std::isfinite(remote.train_step(x, y).loss));
  // An engine keeps the identity its first TLS pipeline gave it.
  auto other = good;
  other.placement.tls = pki.ca.issue("scheduler2");
  CHECK_THROWS_WITH_AS(pipeline(sys, tiny_remote(), cut, other),
                       doctest::Contains("one identity per engine"), invalid_argument);
  auto broken = good;
  broken.placement.tls.private_key = pki.ca.issue("x").private_key;
  engine fresh;
  CHECK_THROWS_WITH_AS(pipeline(fresh, tiny_remote(), cut, broken),
                       doctest::Contains("does not belong to the certificate"), invalid_argument);
}

TEST_CASE("a gpt on one node trains as in process, and so does a gpt cut across nodes, its tied "
          "embedding and head summing their gradients node to node") {
  auto gpt = tiny_gpt();
  auto options = [] {
    auto o = local_options();
    o.loss = builtin_loss("cross_entropy");
    o.optimizer = adam(1e-2);
    return o;
  };
  node n1(node_config()), n2(node_config());
  engine sys;
  auto remote_o = options();
  remote_o.placement.nodes = {n1.address()};
  remote_o.placement.connect_timeout = 5000ms;
  pipeline remote(sys, gpt, partition_uniform(5, 1), remote_o);
  torch::manual_seed(5);
  pipeline local(sys, make_model("gpt", gpt.options), partition_uniform(5, 1), options());
  for (int64_t length : {8, 6}) {
    torch::manual_seed(60 + length);
    // Token ids and targets cross to the node as int64 tensors.
    auto x = torch::randint(11, {4, length});
    auto t = torch::randint(11, {4, length});
    CHECK(remote.train_step(x, t).loss ==
          doctest::Approx(local.train_step(x, t).loss).epsilon(1e-6));
  }
  check_close(remote.named_parameters(), local.named_parameters());

  // Embedding and head on different nodes (2 stages), and on one node with a stage between
  // them on the other (3 stages: the node sends its tied gradients to itself).
  for (const auto& placement : std::vector<std::vector<std::string>>{
         {n1.address(), n2.address()}, {n1.address(), n2.address(), n1.address()}}) {
    CAPTURE(placement.size());
    auto split_o = options();
    split_o.placement.nodes = placement;
    split_o.placement.connect_timeout = 5000ms;
    auto cut = partition_uniform(5, placement.size());
    pipeline split(sys, gpt, cut, split_o);
    torch::manual_seed(5);
    pipeline in_process(sys, make_model("gpt", gpt.options), cut, options());
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(70 + step);
      auto x = torch::randint(11, {4, 8});
      auto t = torch::randint(11, {4, 8});
      CHECK(split.train_step(x, t).loss ==
            doctest::Approx(in_process.train_step(x, t).loss).epsilon(1e-6));
    }
    auto trained = split.named_parameters();
    check_close(trained, in_process.named_parameters());
    // The head's copy on the last node stayed the embedding, bit for bit.
    std::map<std::string, torch::Tensor> by_name(trained.begin(), trained.end());
    REQUIRE(by_name.count("head.weight") == 1);
    CHECK(torch::equal(by_name.at("head.weight"), by_name.at("embed.token.weight")));
  }
}

TEST_CASE("interleaved, zero-bubble and V schedules run on nodes and train like plain libtorch") {
  node n1(node_config()), n2(node_config());
  engine sys;
  auto settings = every_schedule();
  settings.push_back({schedule_kind::interleaved, 3});
  for (auto [schedule, chunks] : settings) {
    CAPTURE(to_string(schedule));
    CAPTURE(chunks);
    auto o = remote_options({n1.address(), n2.address()});
    o.schedule = schedule;
    o.chunks = chunks;
    pipeline remote(sys, tiny_remote(), partition_uniform(6, 2 * chunks), o);
    CHECK(remote.stages() == 2);
    CHECK(n1.stages() == 1);
    plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = batch(step);
      auto r = remote.train_step(x, y);
      CAPTURE(step);
      CHECK(r.loss == doctest::Approx(plain.step(x, y)).epsilon(1e-6));
      REQUIRE(r.stages.size() == 2);
      // Every action of stage 0's program ran there: every chunk's forward and backward of 4
      // micro-batches, and the W of each split backward.
      CHECK(r.stages[0].actions.size() == make_schedule(schedule, 2, 4, chunks)[0].size());
      CHECK(r.stages[0].actions.size() >= 8 * chunks);
    }
    check_close(remote.named_parameters(), named(plain.layers, false));
    auto [x, y] = batch(9);
    torch::NoGradGuard no_grad;
    CHECK(torch::allclose(remote.forward(x), run_layers(plain.layers, x), 1e-5, 1e-7));
  }
}

TEST_CASE("a gpt interleaved over two nodes ties its embedding and head across chunks, and a lost "
          "node's chunks shrink onto the node left") {
  auto gpt = tiny_gpt();
  auto options = [] {
    auto o = local_options();
    o.loss = builtin_loss("cross_entropy");
    o.optimizer = adam(1e-2);
    o.schedule = schedule_kind::interleaved;
    o.chunks = 2;
    return o;
  };
  node n1(node_config());
  auto n2 = std::make_unique<node>(node_config());
  engine sys;
  auto remote_o = options();
  remote_o.placement.nodes = {n1.address(), n2->address()};
  remote_o.placement.connect_timeout = 2000ms;
  // Virtual stages 0 (embedding) and 2 on the first node, 1 and 3 (head) on the second.
  auto cut = partition_uniform(5, 4);
  pipeline remote(sys, gpt, cut, remote_o);
  torch::manual_seed(5);
  pipeline local(sys, make_model("gpt", gpt.options), cut, options());
  auto tokens = [](int step) {
    torch::manual_seed(80 + step);
    return std::make_pair(torch::randint(11, {4, 8}), torch::randint(11, {4, 8}));
  };
  for (int step = 0; step < 2; ++step) {
    auto [x, t] = tokens(step);
    CHECK(remote.train_step(x, t).loss ==
          doctest::Approx(local.train_step(x, t).loss).epsilon(1e-6));
  }
  auto trained = remote.named_parameters();
  check_close(trained, local.named_parameters());
  std::map<std::string, torch::Tensor> by_name(trained.begin(), trained.end());
  CHECK(torch::equal(by_name.at("head.weight"), by_name.at("embed.token.weight")));

  // The second node goes: its two chunks' layers move to the first, which then holds the
  // embedding and the head in one actor (2 parts of one stage actor).
  remote.snapshot();
  n2.reset();
  std::this_thread::sleep_for(200ms);
  {
    auto [x, t] = tokens(2);
    CHECK_THROWS_AS(remote.train_step(x, t), pipeline_error);
  }
  std::vector<std::size_t> asked;
  auto r = remote.recover([&](std::size_t parts) {
    asked.push_back(parts);
    return partition_uniform(5, parts);
  });
  CHECK(asked == std::vector<std::size_t>{2});
  CHECK(r.nodes == std::vector<std::string>{n1.address()});
  CHECK(remote.stages() == 1);
  CHECK(n1.stages() == 1);
  auto one_o = options();
  auto dir = temp_dir("gpt-interleaved");
  local.save_state(dir); // the state of the snapshot
  pipeline reference(sys, make_model("gpt", gpt.options), partition_uniform(5, 2), one_o);
  reference.load_state(dir);
  std::filesystem::remove_all(dir);
  for (int step = 2; step < 4; ++step) {
    auto [x, t] = tokens(step);
    CHECK(remote.train_step(x, t).loss ==
          doctest::Approx(reference.train_step(x, t).loss).epsilon(1e-6));
  }
  check_close(remote.named_parameters(), reference.named_parameters());
}

TEST_CASE("2 replicas x 2 stages on four nodes step like plain libtorch on the whole batch, "
          "their stages averaging gradients node to node") {
  node n1(node_config()), n2(node_config()), n3(node_config()), n4(node_config());
  engine sys;
  auto settings =
    std::vector<schedule_setting>{{schedule_kind::one_f_one_b, 1}, {schedule_kind::interleaved, 2}};
  for (auto [schedule, chunks] : settings) {
    CAPTURE(to_string(schedule));
    auto o = remote_options({n1.address(), n2.address(), n3.address(), n4.address()});
    o.schedule = schedule;
    o.chunks = chunks;
    o.data_parallel.master_port = static_cast<uint16_t>(free_port());
    o.data_parallel.timeout = 10000ms;
    replicated_pipeline replicas(sys, tiny_remote(), partition_uniform(6, 2 * chunks), o, 2);
    CHECK(n1.stages() == 1);
    CHECK(n4.stages() == 1);
    plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      torch::manual_seed(200 + step);
      // 9 samples: replica 0 takes 5, replica 1 takes 4, and the mean counts them so.
      auto x = torch::randn({9, 1, 4, 4});
      auto t = torch::randn({9, 3});
      auto r = replicas.train_step(x, t);
      CHECK(r.loss == doctest::Approx(plain.step(x, t)).epsilon(1e-6));
    }
    check_close(replicas.replica(0).named_parameters(), named(plain.layers, false));
    check_close(replicas.replica(1).named_parameters(), named(plain.layers, false));
    CHECK_THROWS_WITH_AS(replicas.replica(1).recover(),
                         doctest::Contains("replicated_pipeline::recover()"), invalid_argument);
  }
}

TEST_CASE("replicas of stages on nodes refuse an in-process rendezvous, BMUF, recover() and a "
          "node count that is not replicas x stages") {
  node n1(node_config()), n2(node_config());
  engine sys;
  auto o = remote_options({n1.address(), n2.address()});
  o.data_parallel.replicas = 2;
  o.data_parallel.local = make_local_rendezvous();
  CHECK_THROWS_WITH_AS(pipeline(sys, tiny_remote(), partition_uniform(6, 2), o),
                       doctest::Contains("in-process rendezvous"), invalid_argument);
  o.data_parallel.local = nullptr;
  o.data_parallel.bmuf.block_steps = 2;
  CHECK_THROWS_WITH_AS(pipeline(sys, tiny_remote(), partition_uniform(6, 2), o),
                       doctest::Contains("BMUF"), invalid_argument);
  auto three = remote_options({n1.address(), n2.address(), n1.address()});
  CHECK_THROWS_WITH_AS(replicated_pipeline(sys, tiny_remote(), partition_uniform(6, 2), three, 2),
                       doctest::Contains("3 nodes given for 2 replicas of 2 stages"),
                       invalid_argument);
  // A replica whose partner never arrives fails at the rendezvous, naming the missing rank.
  auto lonely = remote_options({n1.address(), n2.address()});
  lonely.data_parallel.replicas = 2;
  lonely.data_parallel.master_port = static_cast<uint16_t>(free_port());
  lonely.data_parallel.timeout = 1500ms;
  CHECK_THROWS_WITH_AS(pipeline(sys, tiny_remote(), partition_uniform(6, 2), lonely),
                       doctest::Contains("rank 1 of 2 did not arrive"), pipeline_error);
}

// Losing a node (issue 20): recover() moves the stages and restores the newest snapshot, and
// the steps replayed from there give what the uninterrupted run gives.

TEST_CASE("a lost node's stages move to a spare and the replayed steps equal plain libtorch") {
  auto n1 = std::make_unique<node>(node_config());
  auto n2 = std::make_unique<node>(node_config());
  node spare(node_config());
  auto lost = n2->address();
  engine sys;
  auto cut = partition_uniform(6, 2);
  auto o = remote_options({n1->address(), n2->address()});
  o.placement.spares = {"127.0.0.1:1", spare.address()}; // the first answers nothing
  o.placement.connect_timeout = 2000ms;
  pipeline remote(sys, tiny_remote(), cut, o);
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto expected = plain_losses(plain, 4);
  for (int step = 0; step < 2; ++step) {
    auto [x, y] = batch(step);
    CHECK(remote.train_step(x, y).loss == doctest::Approx(expected[step]).epsilon(1e-6));
  }
  CHECK(remote.snapshot() == 1);
  {
    auto [x, y] = batch(2);
    remote.train_step(x, y); // done, then lost with the node: replayed
  }
  n2.reset();
  std::this_thread::sleep_for(200ms);
  try {
    auto [x, y] = batch(3);
    remote.train_step(x, y);
    FAIL("a step on a lost node succeeded");
  } catch (const pipeline_error& e) {
    CHECK(e.kind() == error_kind::node_lost);
    CHECK(e.node() == lost);
  }
  auto r = remote.recover();
  CHECK(r.lost == std::vector<std::string>{lost});
  CHECK(r.spares_used == std::vector<std::string>{spare.address()});
  CHECK(r.nodes == std::vector<std::string>{n1->address(), spare.address()});
  CHECK(r.bounds == cut.bounds);
  CHECK(r.snapshot == 1);
  // Not from the driver: n1 loaded the part it keeps, the spare the copy of n2's that n1 kept.
  CHECK(r.from_nodes);
  CHECK(r.seconds > 0);
  CHECK(spare.stages() == 1);
  CHECK(n1->stages() == 1);
  for (int step = 2; step < 4; ++step) {
    auto [x, y] = batch(step);
    auto result = remote.train_step(x, y);
    CAPTURE(step);
    CHECK(result.loss == doctest::Approx(expected[step]).epsilon(1e-6));
    CHECK(result.step > 4); // numbered after the failed step
  }
  check_close(remote.named_parameters(), named(plain.layers, false));
}

TEST_CASE("replicas on nodes recover a lost node: a spare takes its stages, or its replica leaves "
          "and the world shrinks, the state comes from a replica that kept its nodes (nothing "
          "replayed) or else the snapshot, and the steps equal plain libtorch") {
  // 0: replica 1's second node goes and a spare takes it; 1: the same without a spare (in both,
  // replica 0 kept its nodes: its live state is taken, and the failed step is the next); 2: both
  // of replica 0's nodes and replica 1's second go, and the one spare goes to replica 1, which it
  // makes whole (not to replica 0, which it would not): no replica kept its nodes, so the
  // snapshot is restored and the steps since it are replayed.
  for (int scenario : {0, 1, 2}) {
    CAPTURE(scenario);
    std::vector<std::unique_ptr<node>> n;
    for (int k = 0; k < 4; ++k) {
      n.push_back(std::make_unique<node>(node_config()));
    }
    node spare(node_config());
    std::vector<std::string> address;
    for (const auto& k : n) {
      address.push_back(k->address());
    }
    engine sys;
    auto o = remote_options(address);
    o.data_parallel.master_port = static_cast<uint16_t>(free_port());
    o.data_parallel.timeout = 5000ms;
    o.placement.connect_timeout = 2000ms;
    if (scenario != 1) {
      o.placement.spares = {spare.address()};
    }
    replicated_pipeline replicas(sys, tiny_remote(), partition_uniform(6, 2), o, 2);
    plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
    auto expected = plain_losses(plain, 5);
    auto train = [&](int step) { return loss_at(replicas, step); };
    CHECK(train(0) == doctest::Approx(expected[0]).epsilon(1e-6));
    CHECK(replicas.snapshot() == 1);
    CHECK(train(1) == doctest::Approx(expected[1]).epsilon(1e-6)); // replayed in scenario 2
    // Replica 1's second stage goes: its step fails at once, replica 0's at the announcement of
    // replica 1's failure (its stages' all-reduce ends).
    auto lost = scenario == 2 ? std::vector<std::string>{address[0], address[1], address[3]}
                              : std::vector<std::string>{address[3]};
    n[3].reset();
    if (scenario == 2) {
      n[0].reset();
      n[1].reset();
    }
    std::this_thread::sleep_for(200ms);
    try {
      train(2);
      FAIL("a step of a replica on a lost node succeeded");
    } catch (const pipeline_error& e) {
      // Of the replicas' errors, one that names a lost node.
      CHECK(e.kind() == error_kind::node_lost);
      CHECK(std::find(lost.begin(), lost.end(), e.node()) != lost.end());
    }
    auto r = replicas.recover();
    CHECK(r.lost == lost);
    const bool live = scenario != 2;
    CHECK(r.from_replica == (live ? 0 : -1));
    CHECK(r.snapshot == (live ? 2U : 1U)); // the live state is made the newest snapshot
    CHECK(replicas.newest_snapshot() == r.snapshot);
    CHECK(r.bounds == partition_uniform(6, 2).bounds);
    if (scenario == 0) {
      CHECK(r.spares_used == std::vector<std::string>{spare.address()});
      CHECK(r.replicas_left.empty());
      CHECK(r.replicas == 2);
      CHECK(r.nodes ==
            std::vector<std::string>{address[0], address[1], address[2], spare.address()});
      CHECK(spare.stages() == 1);
    } else if (scenario == 1) {
      CHECK(r.spares_used.empty());
      CHECK(r.replicas_left == std::vector<std::size_t>{1});
      CHECK(r.replicas == 1);
      CHECK(r.nodes == std::vector<std::string>{address[0], address[1]});
    } else {
      CHECK(r.spares_used == std::vector<std::string>{spare.address()});
      CHECK(r.replicas_left == std::vector<std::size_t>{0});
      CHECK(r.replicas == 1);
      CHECK(r.nodes == std::vector<std::string>{address[2], spare.address()});
    }
    CHECK(replicas.replicas() == r.replicas);
    // From the failed step (live) or replayed from the snapshot taken after step 0; each step
    // still the whole batch's.
    for (int step = live ? 2 : 1; step < 5; ++step) {
      CAPTURE(step);
      CHECK(train(step) == doctest::Approx(expected[step]).epsilon(1e-6));
    }
    for (std::size_t k = 0; k < replicas.replicas(); ++k) {
      check_close(replicas.replica(k).named_parameters(), named(plain.layers, false));
    }
    if (scenario == 1) {
      CHECK(n[2]->stages() == 0); // the replica that left holds nothing on its node left
    }
  }
}

TEST_CASE("a snapshot taken in the background holds the state between its steps, while the next "
          "steps run, and recover() restores it") {
  auto n1 = std::make_unique<node>(node_config());
  auto n2 = std::make_unique<node>(node_config());
  node spare(node_config());
  engine sys;
  auto cut = partition_uniform(6, 2);
  auto o = remote_options({n1->address(), n2->address()});
  o.placement.spares = {spare.address()};
  pipeline remote(sys, tiny_remote(), cut, o);
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto expected = plain_losses(plain, 5);
  auto train = [&](int step) { return loss_at(remote, step); };
  train(0);
  CHECK(remote.snapshot_in_background() == 1);
  // The steps after it change every parameter and momentum while the copies travel.
  CHECK(train(1) == doctest::Approx(expected[1]).epsilon(1e-6));
  CHECK(train(2) == doctest::Approx(expected[2]).epsilon(1e-6));
  CHECK(remote.newest_snapshot() == 1);
  n2.reset();
  std::this_thread::sleep_for(200ms);
  CHECK_THROWS_AS(train(3), pipeline_error);
  auto r = remote.recover();
  CHECK(r.snapshot == 1);
  CHECK(r.spares_used == std::vector<std::string>{spare.address()});
  CHECK(r.from_nodes);
  // Replayed from snapshot 1, taken after step 0 (not after the steps that ran beside it).
  for (int step = 1; step < 5; ++step) {
    CAPTURE(step);
    CHECK(train(step) == doctest::Approx(expected[step]).epsilon(1e-6));
  }
  check_close(remote.named_parameters(), named(plain.layers, false));
}

TEST_CASE("nodes that keep no snapshot: recover() restores the driver's, with the same losses") {
  auto keeps_none = node_config();
  keeps_none.keep_snapshots = 0s;
  auto n1 = std::make_unique<node>(keeps_none);
  auto n2 = std::make_unique<node>(keeps_none);
  node spare(keeps_none);
  engine sys;
  auto o = remote_options({n1->address(), n2->address()});
  o.placement.spares = {spare.address()};
  pipeline remote(sys, tiny_remote(), partition_uniform(6, 2), o);
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto expected = plain_losses(plain, 4);
  auto train = [&](int step) { return loss_at(remote, step); };
  train(0);
  CHECK(remote.snapshot() == 1);
  train(1);
  n2.reset();
  std::this_thread::sleep_for(200ms);
  CHECK_THROWS_AS(train(2), pipeline_error);
  auto r = remote.recover();
  CHECK(r.snapshot == 1);
  CHECK_FALSE(r.from_nodes);
  for (int step = 1; step < 4; ++step) {
    CAPTURE(step);
    CHECK(train(step) == doctest::Approx(expected[step]).epsilon(1e-6));
  }
}

TEST_CASE("without a spare the pipeline shrinks onto the nodes left and equals a run resumed "
          "there from the same snapshot") {
  node n1(node_config()), n3(node_config());
  auto n2 = std::make_unique<node>(node_config());
  auto dir = temp_dir("shrink");
  engine sys;
  pipeline remote(sys, tiny_remote(), partition_uniform(6, 3),
                  remote_options({n1.address(), n2->address(), n3.address()}));
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto expected = plain_losses(plain, 5);
  for (int step = 0; step < 2; ++step) {
    auto [x, y] = batch(step);
    remote.train_step(x, y);
  }
  remote.snapshot();
  remote.save_state(dir); // the same state on disk, for the run resumed from it
  n2.reset();
  std::this_thread::sleep_for(200ms);
  auto [x2, y2] = batch(2);
  CHECK_THROWS_AS(remote.train_step(x2, y2), pipeline_error);
  std::vector<std::size_t> asked;
  auto r = remote.recover([&](std::size_t stages) {
    asked.push_back(stages);
    return partition_at(6, {4});
  });
  CHECK(asked == std::vector<std::size_t>{2});
  CHECK(r.lost.size() == 1);
  CHECK(r.spares_used.empty());
  CHECK(r.nodes == std::vector<std::string>{n1.address(), n3.address()});
  CHECK(r.bounds == std::vector<std::size_t>{0, 4, 6});
  CHECK_FALSE(r.from_nodes); // cut anew: the kept parts are of the old cut
  CHECK(remote.stages() == 2);
  CHECK(remote.cut().bounds == r.bounds);
  std::vector<double> recovered;
  for (int step = 2; step < 5; ++step) {
    auto [x, y] = batch(step);
    recovered.push_back(remote.train_step(x, y).loss);
    CHECK(recovered.back() == doctest::Approx(expected[step]).epsilon(1e-6));
  }
  auto parameters = remote.named_parameters();
  check_close(parameters, named(plain.layers, false));
  // The uninterrupted run: the same new layout (on other nodes), resumed from the snapshot.
  node m1(node_config()), m3(node_config());
  pipeline resumed(sys, tiny_remote(), partition_at(6, {4}),
                   remote_options({m1.address(), m3.address()}));
  resumed.load_state(dir);
  for (int step = 2; step < 5; ++step) {
    auto [x, y] = batch(step);
    CHECK(resumed.train_step(x, y).loss == recovered[static_cast<std::size_t>(step - 2)]);
  }
  check_close(resumed.named_parameters(), parameters, 0, 0);
  std::filesystem::remove_all(dir);
}

TEST_CASE("recover() refuses stages in process, a repartition of another stage count, and an "
          "empty placement") {
  engine sys;
  pipeline local(sys, tiny_mlp(1), partition_uniform(6, 2), local_options());
  CHECK_THROWS_WITH_AS(local.recover(), doctest::Contains("in this process"), invalid_argument);
  replicated_pipeline in_process(
    sys, [] { return tiny_mlp(1); }, partition_uniform(6, 2), local_options(), 2);
  CHECK_THROWS_WITH_AS(in_process.recover(), doctest::Contains("in this process"),
                       invalid_argument);
  auto n1 = std::make_unique<node>(node_config());
  auto n2 = std::make_unique<node>(node_config());
  auto o = remote_options({n1->address(), n2->address()});
  o.placement.connect_timeout = 2000ms;
  pipeline remote(sys, tiny_remote(), partition_uniform(6, 2), o);
  auto [x, y] = batch(0);
  remote.train_step(x, y);
  n2.reset();
  std::this_thread::sleep_for(200ms);
  CHECK_THROWS_AS(remote.train_step(x, y), pipeline_error);
  CHECK_THROWS_WITH_AS(remote.recover([](std::size_t) { return partition_uniform(6, 3); }),
                       doctest::Contains("gave 3 stages for the 1 nodes left"), invalid_argument);
  // The pipeline has no stages now: a step says so and points at recover().
  CHECK_THROWS_WITH_AS(remote.train_step(x, y), doctest::Contains("call recover() again"),
                       pipeline_error);
  n1.reset();
  std::this_thread::sleep_for(200ms);
  try {
    remote.recover();
    FAIL("recovered without nodes");
  } catch (const pipeline_error& e) {
    CHECK(e.kind() == error_kind::node_lost);
    CHECK(std::string(e.what()).find("no node is left (2 lost") != std::string::npos);
  }
}

namespace {

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
    return ::batch(static_cast<int>(index));
  }

private:
  std::unique_ptr<node>& victim_;
  int64_t when_;
};

// train() with lost-node recovery: batches of 10, SGD at 0.1, no progress bar.
train_options recovering_options(int64_t steps, uint64_t snapshot_every) {
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
void check_steps_equal_plain(const train_report& report, plain_model& plain, int steps) {
  REQUIRE(report.steps.size() >= static_cast<std::size_t>(steps));
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step);
    CAPTURE(step);
    CHECK(report.steps[static_cast<std::size_t>(step)].first == static_cast<uint64_t>(step + 1));
    CHECK(report.steps[static_cast<std::size_t>(step)].second ==
          doctest::Approx(plain.step(x, y)).epsilon(1e-6));
  }
}

} // namespace

TEST_CASE("train() recovers from a node lost mid-run and replays from its newest snapshot") {
  node n1(node_config()), spare(node_config());
  auto n2 = std::make_unique<node>(node_config());
  engine sys;
  auto o = remote_options({n1.address(), n2->address()});
  o.placement.spares = {spare.address()};
  pipeline remote(sys, tiny_remote(), partition_uniform(6, 2), o);
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto to = recovering_options(8, 3);
  // At step 8's batch: snapshots hold the start (1), steps 3 (2) and 6 (3); step 7 is replayed.
  losing_source data(n2, 7);
  auto report = train(remote, data, to);
  REQUIRE(report.steps.size() == 8);
  check_steps_equal_plain(report, plain, 8);
  REQUIRE(report.recoveries.size() == 1);
  CHECK(report.recoveries[0].snapshot == 3);
  CHECK(report.recoveries[0].spares_used == std::vector<std::string>{spare.address()});
  CHECK(report.replayed_steps == std::vector<uint64_t>{7});
  check_close(remote.named_parameters(), named(plain.layers, false));
  // Without recovery the same loss ends the run.
  node m1(node_config());
  auto m2 = std::make_unique<node>(node_config());
  pipeline failing(sys, tiny_remote(), partition_uniform(6, 2),
                   remote_options({m1.address(), m2->address()}));
  losing_source again(m2, 2);
  to.recover_lost_nodes = false;
  CHECK_THROWS_AS(train(failing, again, to), pipeline_error);
}

// Asks rejoin_nodes() for up to 10 s until it takes a node.
std::optional<recovery_report> rejoin_within_seconds(pipeline& p) {
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
std::unique_ptr<node> node_to_restart() {
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
std::optional<recovery_report> replicas_rejoin_within(replicated_pipeline& replicas, int seconds) {
  for (int k = 0; k < seconds * 20; ++k) {
    if (auto r = replicas.rejoin_nodes()) {
      return r;
    }
    std::this_thread::sleep_for(50ms);
  }
  return std::nullopt;
}

TEST_CASE(
  "a lost node of a replica that answers again brings its replica back (the replicas meet "
  "again from the state then, nothing replayed) or stands by as a spare, and the steps equal "
  "plain libtorch") {
  // 0: no spare, replica 1 left; its node restarted brings it back. 1: a spare took the node's
  // stages; the node restarted stands by for the next loss.
  for (int scenario : {0, 1}) {
    CAPTURE(scenario);
    std::vector<std::unique_ptr<node>> n;
    for (int k = 0; k < 3; ++k) {
      n.push_back(std::make_unique<node>(node_config()));
    }
    n.push_back(node_to_restart());
    node spare(node_config());
    std::vector<std::string> address;
    for (const auto& k : n) {
      address.push_back(k->address());
    }
    const auto port = n[3]->port();
    engine sys;
    auto o = remote_options(address);
    o.data_parallel.master_port = static_cast<uint16_t>(free_port());
    o.data_parallel.timeout = 5000ms;
    o.placement.connect_timeout = 2000ms;
    if (scenario == 1) {
      o.placement.spares = {spare.address()};
    }
    replicated_pipeline replicas(sys, tiny_remote(), partition_uniform(6, 2), o, 2);
    plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
    auto expected = plain_losses(plain, 6);
    auto train = [&](int step) { return loss_at(replicas, step); };
    CHECK(train(0) == doctest::Approx(expected[0]).epsilon(1e-6));
    CHECK(train(1) == doctest::Approx(expected[1]).epsilon(1e-6));
    n[3].reset();
    std::this_thread::sleep_for(200ms);
    CHECK_THROWS_AS(train(2), pipeline_error);
    auto r = replicas.recover();
    CHECK(r.replicas == (scenario == 0 ? 1U : 2U));
    CHECK_FALSE(replicas.rejoin_nodes()); // asked beside the steps; gone still
    CHECK(train(2) == doctest::Approx(expected[2]).epsilon(1e-6));
    auto config = node_config();
    config.port = port;
    n[3] = std::make_unique<node>(config);
    auto back = replicas_rejoin_within(replicas, 10);
    REQUIRE(back);
    CHECK(back->rejoined == std::vector<std::string>{address[3]});
    CHECK(back->replicas == 2);
    CHECK(replicas.replicas() == 2);
    if (scenario == 0) {
      CHECK(back->nodes == address);
      CHECK(back->spares_used.empty());
      CHECK(n[3]->stages() == 1);
    } else {
      CHECK(back->nodes ==
            std::vector<std::string>{address[0], address[1], address[2], spare.address()});
      CHECK(back->spares_used == std::vector<std::string>{address[3]});
      CHECK(n[3]->stages() == 0);
    }
    CHECK(n[2]->stages() == 1);
    for (int step = 3; step < 6; ++step) {
      CAPTURE(step);
      CHECK(train(step) == doctest::Approx(expected[step]).epsilon(1e-6));
    }
    for (std::size_t k = 0; k < replicas.replicas(); ++k) {
      check_close(replicas.replica(k).named_parameters(), named(plain.layers, false));
    }
  }
}

TEST_CASE("a lost node that answers again is taken back between steps: the model is cut back onto "
          "it from the state then, nothing replayed, and the losses are plain libtorch's") {
  node n1(node_config()), n2(node_config());
  auto n3 = node_to_restart();
  const auto third = n3->address();
  const auto port = n3->port();
  engine sys;
  auto o = remote_options({n1.address(), n2.address(), third});
  o.placement.connect_timeout = 2000ms;
  pipeline remote(sys, tiny_remote(), partition_uniform(6, 3), o);
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto expected = plain_losses(plain, 6);
  auto train = [&](int step) { return loss_at(remote, step); };
  CHECK(train(0) == doctest::Approx(expected[0]).epsilon(1e-6));
  remote.snapshot();
  CHECK_FALSE(remote.rejoin_nodes()); // nothing lost: nothing asked
  n3.reset();
  std::this_thread::sleep_for(200ms);
  CHECK_THROWS_AS(train(1), pipeline_error);
  auto lost = remote.recover();
  CHECK(lost.nodes == std::vector<std::string>{n1.address(), n2.address()});
  CHECK(train(1) == doctest::Approx(expected[1]).epsilon(1e-6));
  // Asked beside the steps: nobody answers at its address yet.
  for (int k = 0; k < 20; ++k) {
    CHECK_FALSE(remote.rejoin_nodes());
    std::this_thread::sleep_for(20ms);
  }
  CHECK(train(2) == doctest::Approx(expected[2]).epsilon(1e-6));
  auto again = node_config();
  again.port = port;
  node back(again);
  auto r = rejoin_within_seconds(remote);
  REQUIRE(r);
  CHECK(r->rejoined == std::vector<std::string>{third});
  CHECK(r->lost.empty());
  CHECK(r->nodes == std::vector<std::string>{n1.address(), n2.address(), third});
  CHECK(r->bounds == partition_uniform(6, 3).bounds);
  CHECK(remote.cut().bounds == partition_uniform(6, 3).bounds);
  CHECK(back.stages() == 1);
  CHECK(remote.newest_snapshot() == r->snapshot);
  // From the state after step 2: nothing replayed.
  for (int step = 3; step < 6; ++step) {
    CAPTURE(step);
    CHECK(train(step) == doctest::Approx(expected[step]).epsilon(1e-6));
  }
  check_close(remote.named_parameters(), named(plain.layers, false));
  CHECK_FALSE(remote.rejoin_nodes()); // none lost any more
}

// Waits (up to 10 s) until `n` stopped trying to join.
node::join_state joined_or_not(const node& n) {
  for (int k = 0; k < 500 && n.joining() == node::join_state::trying; ++k) {
    std::this_thread::sleep_for(20ms);
  }
  return n.joining();
}

TEST_CASE(
  "a new node that joins (node_options::join) is taken between steps: the model cut back "
  "onto it after a loss, else it stands by, and a wrong secret or an absent driver refused") {
  const std::string secret = "join-secret";
  node n1(node_config(secret));
  auto n2 = std::make_unique<node>(node_config(secret));
  engine sys;
  auto o = remote_options({n1.address(), n2->address()}, secret);
  o.placement.connect_timeout = 2000ms;
  o.placement.accept_joins = "127.0.0.1:0";
  pipeline remote(sys, tiny_remote(), partition_uniform(6, 2), o);
  const auto at = remote.join_address();
  REQUIRE(at.rfind("127.0.0.1:", 0) == 0);
  CHECK(at != "127.0.0.1:0");
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto expected = plain_losses(plain, 6);
  auto train = [&](int step) { return loss_at(remote, step); };
  CHECK(train(0) == doctest::Approx(expected[0]).epsilon(1e-6));
  remote.snapshot();
  n2.reset();
  std::this_thread::sleep_for(200ms);
  CHECK_THROWS_AS(train(1), pipeline_error);
  CHECK(remote.recover().nodes == std::vector<std::string>{n1.address()});
  CHECK(train(1) == doctest::Approx(expected[1]).epsilon(1e-6));
  // A new node (another address than the lost one's) joins: cut back onto two.
  auto joining = node_config(secret);
  joining.join = at;
  node n3(joining);
  auto r = rejoin_within_seconds(remote);
  REQUIRE(r);
  CHECK(n3.joining() == node::join_state::joined);
  CHECK(r->joined == std::vector<std::string>{n3.address()});
  CHECK(r->rejoined.empty());
  CHECK(r->nodes == std::vector<std::string>{n1.address(), n3.address()});
  CHECK(remote.cut().bounds == partition_uniform(6, 2).bounds);
  CHECK(n3.stages() == 1);
  for (int step = 2; step < 4; ++step) {
    CAPTURE(step);
    CHECK(train(step) == doctest::Approx(expected[step]).epsilon(1e-6));
  }
  // The pipeline whole again: the next one to join stands by.
  node n4(joining);
  r = rejoin_within_seconds(remote);
  REQUIRE(r);
  CHECK(r->joined == std::vector<std::string>{n4.address()});
  CHECK(r->nodes == std::vector<std::string>{n1.address(), n3.address()});
  CHECK(r->spares_used == std::vector<std::string>{n4.address()});
  CHECK(remote.spares() == std::vector<std::string>{n4.address()});
  CHECK(n4.stages() == 0);
  for (int step = 4; step < 6; ++step) {
    CAPTURE(step);
    CHECK(train(step) == doctest::Approx(expected[step]).epsilon(1e-6));
  }
  check_close(remote.named_parameters(), named(plain.layers, false));
  // Another secret: refused at once, and nothing taken.
  auto wrong = node_config("another");
  wrong.join = at;
  node n5(wrong);
  CHECK(joined_or_not(n5) == node::join_state::failed);
  CHECK(n5.join_error().find("joining the driver at " + at + ": ") != std::string::npos);
  CHECK(n5.join_error().find("refused the secret") != std::string::npos);
  CHECK_FALSE(remote.rejoin_nodes().has_value());
  // Nobody listening: it gives up at its deadline.
  bound_socket closed;
  auto nobody = node_config();
  nobody.join = "127.0.0.1:" + std::to_string(closed.port);
  nobody.join_timeout = 1500ms;
  node n6(nobody);
  CHECK(joined_or_not(n6) == node::join_state::failed);
  CHECK(n6.join_error().find("nobody took the announcement within 1.5 s") != std::string::npos);
  CHECK(node(node_config()).joining() == node::join_state::none);
}

TEST_CASE("replicas take nodes that join (accept_joins): one takes a lost node's place in the "
          "replica that left, which comes back, the next stands by and serves the next loss, and "
          "the steps equal plain libtorch") {
  std::vector<std::unique_ptr<node>> n;
  std::vector<std::string> address;
  for (int k = 0; k < 4; ++k) {
    n.push_back(std::make_unique<node>(node_config()));
    address.push_back(n.back()->address());
  }
  engine sys;
  auto o = remote_options(address);
  o.data_parallel.master_port = static_cast<uint16_t>(free_port());
  o.data_parallel.timeout = 5000ms;
  o.placement.connect_timeout = 2000ms;
  o.placement.accept_joins = "127.0.0.1:0";
  replicated_pipeline replicas(sys, tiny_remote(), partition_uniform(6, 2), o, 2);
  const auto at = replicas.join_address();
  REQUIRE(at.rfind("127.0.0.1:", 0) == 0);
  CHECK(at != "127.0.0.1:0");
  CHECK(replicas.replica(0).join_address().empty()); // one listener, the replicas'
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto expected = plain_losses(plain, 8);
  auto train = [&](int step) { return loss_at(replicas, step); };
  CHECK(train(0) == doctest::Approx(expected[0]).epsilon(1e-6));
  CHECK(train(1) == doctest::Approx(expected[1]).epsilon(1e-6));
  // Replica 1's second node goes, no spare: replica 1 leaves.
  n[3].reset();
  std::this_thread::sleep_for(200ms);
  CHECK_THROWS_AS(train(2), pipeline_error);
  CHECK(replicas.recover().replicas == 1);
  CHECK(train(2) == doctest::Approx(expected[2]).epsilon(1e-6));
  // A new node joins: it takes the lost node's place, and replica 1 comes back.
  auto joining = node_config();
  joining.join = at;
  node j1(joining);
  auto r = replicas_rejoin_within(replicas, 10);
  REQUIRE(r);
  CHECK(j1.joining() == node::join_state::joined);
  CHECK(r->joined == std::vector<std::string>{j1.address()});
  CHECK(r->rejoined.empty());
  CHECK(r->replicas == 2);
  CHECK(r->nodes == std::vector<std::string>{address[0], address[1], address[2], j1.address()});
  CHECK(r->spares_used.empty());
  CHECK(j1.stages() == 1);
  CHECK(n[2]->stages() == 1);
  for (int step = 3; step < 5; ++step) {
    CAPTURE(step);
    CHECK(train(step) == doctest::Approx(expected[step]).epsilon(1e-6));
  }
  // The replicas whole: the next one to join stands by, and takes the next lost node's stages.
  node j2(joining);
  r = replicas_rejoin_within(replicas, 10);
  REQUIRE(r);
  CHECK(r->joined == std::vector<std::string>{j2.address()});
  CHECK(r->replicas == 2);
  CHECK(r->spares_used == std::vector<std::string>{j2.address()});
  CHECK(replicas.replica(0).spares() == std::vector<std::string>{j2.address()});
  CHECK(j2.stages() == 0);
  CHECK(train(5) == doctest::Approx(expected[5]).epsilon(1e-6));
  replicas.snapshot(); // after step 5: what a recovery without a live source restores
  n[1].reset();        // replica 0's second node
  std::this_thread::sleep_for(200ms);
  CHECK_THROWS_AS(train(6), pipeline_error);
  auto lost = replicas.recover();
  CHECK(lost.spares_used == std::vector<std::string>{j2.address()});
  CHECK(lost.replicas == 2);
  CHECK(lost.nodes == std::vector<std::string>{address[0], j2.address(), address[2], j1.address()});
  for (int step = lost.failed_step ? 7 : 6; step < 8; ++step) {
    CAPTURE(step);
    CHECK(train(step) == doctest::Approx(expected[step]).epsilon(1e-6));
  }
  for (std::size_t k = 0; k < replicas.replicas(); ++k) {
    check_close(replicas.replica(k).named_parameters(), named(plain.layers, false));
  }
}

TEST_CASE("recover() counts a node the failed step found lost without asking it again, and "
          "rejoin_nodes() takes it back once it answers") {
  node n1(node_config()), n2(node_config());
  engine sys;
  auto o = remote_options({n1.address(), n2.address()});
  o.placement.connect_timeout = 2000ms;
  pipeline remote(sys, tiny_remote(), partition_uniform(6, 2), o);
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto expected = plain_losses(plain, 4);
  auto train = [&](int step) { return loss_at(remote, step); };
  CHECK(train(0) == doctest::Approx(expected[0]).epsilon(1e-6));
  remote.snapshot();
  // n2 answers, but a step found it lost (a heartbeat it left unanswered): not asked again.
  auto r = remote.recover({}, {n2.address()});
  CHECK(r.lost == std::vector<std::string>{n2.address()});
  CHECK(r.nodes == std::vector<std::string>{n1.address()});
  CHECK(train(1) == doctest::Approx(expected[1]).epsilon(1e-6));
  auto back = rejoin_within_seconds(remote);
  REQUIRE(back);
  CHECK(back->rejoined == std::vector<std::string>{n2.address()});
  CHECK(back->nodes == std::vector<std::string>{n1.address(), n2.address()});
  for (int step = 2; step < 4; ++step) {
    CAPTURE(step);
    CHECK(train(step) == doctest::Approx(expected[step]).epsilon(1e-6));
  }
  check_close(remote.named_parameters(), named(plain.layers, false));
}

TEST_CASE("repartition places the stages on their nodes again with another cut, from the state "
          "then, and the losses stay plain libtorch's, refused in process and for another stage "
          "count") {
  node n1(node_config()), n2(node_config());
  engine sys;
  pipeline remote(sys, tiny_remote(), partition_uniform(6, 2),
                  remote_options({n1.address(), n2.address()}));
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto expected = plain_losses(plain, 5);
  auto train = [&](int step) { return loss_at(remote, step); };
  CHECK(train(0) == doctest::Approx(expected[0]).epsilon(1e-6));
  CHECK(train(1) == doctest::Approx(expected[1]).epsilon(1e-6));
  auto number = remote.repartition(partition_at(6, {4}));
  CHECK(number == remote.newest_snapshot());
  CHECK(remote.cut().bounds == partition_at(6, {4}).bounds);
  CHECK(remote.nodes() == std::vector<std::string>{n1.address(), n2.address()});
  for (int step = 2; step < 5; ++step) {
    CAPTURE(step);
    CHECK(train(step) == doctest::Approx(expected[step]).epsilon(1e-6));
  }
  check_close(remote.named_parameters(), named(plain.layers, false));
  CHECK_THROWS_WITH_AS(remote.repartition(partition_uniform(6, 3)),
                       doctest::Contains("is not a cut of the 6 layers into 2 stages"),
                       invalid_argument);
  pipeline local(sys, tiny_mlp(1), partition_uniform(6, 2), local_options());
  CHECK(local.nodes().empty());
  CHECK_THROWS_WITH_AS(local.repartition(partition_at(6, {4})),
                       doctest::Contains("in this process"), invalid_argument);
}

// Waits (up to 5 s) for nodes to drop the stages of a driver that went.
void wait_for_no_stages(const std::vector<const node*>& nodes) {
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
void check_resumed_to_step_8(pipeline& resumed, losing_source& data, train_options to,
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

TEST_CASE("a driver that died starts again from the snapshot its nodes keep (resume nodes), with "
          "the losses of the uninterrupted run") {
  node n1(node_config()), n2(node_config());
  engine sys;
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  std::vector<double> expected;
  for (int step = 0; step < 8; ++step) {
    auto [x, y] = batch(step);
    expected.push_back(plain.step(x, y));
  }
  std::unique_ptr<node> nobody;
  losing_source data(nobody, -1);
  auto to = recovering_options(5, 2);
  {
    // Snapshots: the start (1), after steps 2 (2) and 4 (3); then the driver goes (its stages
    // with it) as a killed one would, and the nodes keep snapshot 3.
    pipeline first(sys, tiny_remote(), partition_uniform(6, 2),
                   remote_options({n1.address(), n2.address()}));
    CHECK(train(first, data, to).steps.size() == 5);
  }
  for (int wait = 0; wait < 100 && (n1.stages() != 0 || n2.stages() != 0); ++wait) {
    std::this_thread::sleep_for(50ms); // the nodes drop the stages of a driver that went
  }
  CHECK(n1.stages() == 0);
  uint64_t newest = 0;
  {
    pipeline second(sys, tiny_remote(), partition_uniform(6, 2),
                    remote_options({n1.address(), n2.address()}));
    auto kept = second.kept_on_nodes();
    CHECK(kept.number == 3);
    CHECK(kept.note.find("\"step\":4") != std::string::npos);
    check_resumed_to_step_8(second, data, to, expected, plain);
    newest = second.newest_snapshot();
  }
  // The first node keeps its own stage and a copy of its neighbour's: whole on it alone.
  wait_for_no_stages({&n1, &n2});
  node fresh(node_config()), other_fresh(node_config());
  {
    pipeline one(sys, tiny_remote(), partition_uniform(6, 2),
                 remote_options({n1.address(), fresh.address()}));
    auto kept = one.kept_on_nodes();
    CHECK(kept.number == newest);
    CHECK(kept.nodes == std::vector<std::string>{n1.address(), n1.address()});
  }
  // Nodes that keep nothing: refused, naming what each node keeps.
  pipeline other(sys, tiny_remote(), partition_uniform(6, 2),
                 remote_options({fresh.address(), other_fresh.address()}));
  CHECK_THROWS_WITH_AS(
    other.kept_on_nodes(),
    doctest::Contains(("do not keep one snapshot of every stage whole (" + fresh.address() +
                       ": none; " + other_fresh.address() + ": none)")
                        .c_str()),
    pipeline_error);
  pipeline local(sys, tiny_mlp(1), partition_uniform(6, 2), local_options());
  CHECK_THROWS_WITH_AS(local.kept_on_nodes(), doctest::Contains("in this process"),
                       invalid_argument);
}

TEST_CASE("a node keeps a neighbour's copy once its bytes and the driver's note are both there, "
          "the newest only") {
  auto bytes_of = [](float value) {
    auto packed = stages::pack_tensors({{"w", torch::full({3}, value)}});
    auto t = torch::empty({static_cast<int64_t>(packed.size())}, torch::kUInt8);
    std::memcpy(t.data_ptr(), packed.data(), packed.size());
    return t;
  };
  auto value_of = [](const stages::tensor_map& m) { return m.at("w")[0].item<float>(); };
  nodes::kept_snapshots kept;
  CHECK_FALSE(kept.copy_coming(1, 4));
  kept.copy_arrived(1, 4, bytes_of(4));
  CHECK(kept.inventory() == "[]"); // the driver has not said it is whole yet
  CHECK(kept.empty());
  CHECK(kept.copy_coming(1, 4)); // a restore of it waits
  CHECK_FALSE(kept.copy_coming(1, 5));
  kept.copy_held(1, 4, "tag 4");
  CHECK_FALSE(kept.copy_coming(1, 4)); // here: a restore loads it at once
  CHECK(kept.inventory() == R"([{"copy":true,"note":"tag 4","number":4,"stage":1}])");
  CHECK(value_of(kept.take(1, 4, "n")) == 4);
  // The next one, its note first: the copy before stays until its bytes come.
  kept.copy_held(1, 6, "tag 6");
  CHECK(kept.copy_coming(1, 6));
  CHECK(value_of(kept.take(1, 4, "n")) == 4);
  kept.copy_arrived(1, 6, bytes_of(6));
  CHECK(value_of(kept.take(1, 6, "n")) == 6);
  CHECK_THROWS_WITH_AS(kept.take(1, 4, "127.0.0.1:1"),
                       "node 127.0.0.1:1 keeps no snapshot of stage 1 (a copy of snapshot 6), not "
                       "snapshot 4",
                       pipeline_error);
  // Bytes and a note of different snapshots (a new driver numbers anew) are not a copy.
  kept.copy_arrived(1, 2, bytes_of(2));
  kept.copy_held(1, 3, "tag 3");
  CHECK(value_of(kept.take(1, 6, "n")) == 6);
  CHECK_THROWS_AS(kept.take(1, 3, "n"), pipeline_error);
  kept.clear();
  CHECK(kept.empty());
}

TEST_CASE("a node's restore of a copy on its way waits for its bytes, and is refused when its "
          "stage goes") {
  node n1(node_config());
  engine sys;
  auto remote = std::make_unique<pipeline>(sys, tiny_remote(), partition_uniform(6, 1),
                                           remote_options({n1.address()}));
  control_client client(n1.address());
  client.authenticate();
  auto& self = *client.self;
  auto restore = [&](std::chrono::milliseconds timeout) {
    std::string outcome = "no reply";
    self->request(client.node, timeout, nodes::rrestore_atom::value, uint32_t{0}, uint64_t{7})
      .receive([&](bool) { outcome = "loaded"; },
               [&](caf::error& e) { outcome = client.render(e); });
    return outcome;
  };
  // Nothing kept, nothing coming: refused at once.
  CHECK(restore(5s).find("keeps no snapshot of stage 0") != std::string::npos);
  bool held = false;
  self
    ->request(client.node, 5s, nodes::hold_atom::value, uint32_t{0}, uint64_t{7},
              std::string("note"))
    .receive([&](bool ok) { held = ok; }, [](caf::error&) {});
  REQUIRE(held);
  // Its note here, its bytes not: the restore waits (here past the asker's deadline).
  CHECK(restore(300ms).find("request_timeout") != std::string::npos);
  // The stage goes while a restore waits: refused, naming it.
  auto waiting = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(300ms);
    remote.reset();
  });
  auto refused = restore(10s);
  waiting.get();
  CHECK(refused.find("hosts no stage 0") != std::string::npos);
}

TEST_CASE("a node lost with its driver loses nothing: its neighbour keeps a copy of its stage's "
          "snapshot, and the driver started again resumes from it, then spreads over the nodes") {
  node n1(node_config()), n3(node_config());
  auto n2 = node_to_restart();
  const auto second_address = n2->address();
  const auto port = n2->port();
  engine sys;
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto expected = plain_losses(plain, 8);
  std::unique_ptr<node> nobody;
  losing_source data(nobody, -1);
  auto to = recovering_options(5, 2);
  const std::vector<std::string> given{n1.address(), second_address, n3.address()};
  {
    // Snapshot 3 after step 4: each node keeps its stage's, and its neighbour (the next node,
    // round) a copy.
    pipeline first(sys, tiny_remote(), partition_uniform(6, 3), remote_options(given));
    CHECK(train(first, data, to).steps.size() == 5);
  }
  wait_for_no_stages({&n1, n2.get(), &n3});
  // The second node's host went down with the driver; the same command starts it again, empty.
  n2.reset();
  auto config = node_config();
  config.port = port;
  n2 = std::make_unique<node>(config);
  pipeline second(sys, tiny_remote(), partition_uniform(6, 3), remote_options(given));
  auto kept = second.kept_on_nodes();
  CHECK(kept.number == 3);
  // Stage 1's part is the third node's copy: it takes stages 1 and 2 to load them.
  CHECK(kept.nodes == std::vector<std::string>{n1.address(), n3.address(), n3.address()});
  check_resumed_to_step_8(second, data, to, expected, plain);
  // Spread over the given nodes again: the restarted one took the stage the copy served.
  CHECK(second.nodes() == std::vector<std::string>{n1.address(), n3.address(), second_address});
}

TEST_CASE("a driver that died after a recovery, and again after a rejoin, resumes from its nodes "
          "placed as they kept the snapshot, with the losses of plain libtorch") {
  node n1(node_config()), n3(node_config());
  auto n2 = node_to_restart();
  const auto second = n2->address();
  const auto port = n2->port();
  const std::vector<std::string> given{n1.address(), second, n3.address()};
  engine sys;
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto expected = plain_losses(plain, 6);
  auto o = remote_options(given);
  o.placement.connect_timeout = 2000ms;
  uint64_t number = 0;
  {
    // The middle node lost: the model cut onto the other two, a snapshot there; the driver goes.
    pipeline first(sys, tiny_remote(), partition_uniform(6, 3), o);
    CHECK(loss_at(first, 0) == doctest::Approx(expected[0]).epsilon(1e-6));
    first.snapshot(); // what recover() restores
    n2.reset();
    std::this_thread::sleep_for(200ms);
    CHECK_THROWS_AS(loss_at(first, 1), pipeline_error);
    first.recover();
    CHECK(loss_at(first, 1) == doctest::Approx(expected[1]).epsilon(1e-6));
    number = first.snapshot("two steps");
  }
  auto again = node_config();
  again.port = port;
  node back(again);
  wait_for_no_stages({&n1, &n3});
  const auto two = partition_by_params(tiny_mlp(1), 2).bounds;
  {
    // Started again with the given nodes: the nodes keep the two-stage cut on the first and the
    // third; the returned node is taken back between steps, cut back onto the given three.
    pipeline resumed(sys, tiny_remote(), partition_uniform(6, 3), o);
    auto kept = resumed.kept_on_nodes();
    CHECK(kept.number == number);
    CHECK(kept.note == "two steps");
    CHECK(kept.nodes == std::vector<std::string>{n1.address(), n3.address()});
    CHECK(kept.bounds == two);
    resumed.restore_from_nodes(kept);
    CHECK(resumed.nodes() == kept.nodes);
    CHECK(resumed.cut().bounds == two);
    CHECK(loss_at(resumed, 2) == doctest::Approx(expected[2]).epsilon(1e-6));
    auto r = rejoin_within_seconds(resumed);
    REQUIRE(r);
    CHECK(r->rejoined == std::vector<std::string>{second});
    CHECK(r->nodes == std::vector<std::string>{n1.address(), n3.address(), second});
    CHECK(loss_at(resumed, 3) == doctest::Approx(expected[3]).epsilon(1e-6));
    number = resumed.snapshot("four steps");
  }
  wait_for_no_stages({&n1, &back, &n3});
  // Again with the given order: each stage goes to the node keeping its part, the returned one
  // last, as the rejoin placed them.
  pipeline third(sys, tiny_remote(), partition_uniform(6, 3), o);
  auto kept = third.kept_on_nodes();
  CHECK(kept.number == number);
  CHECK(kept.nodes == std::vector<std::string>{n1.address(), n3.address(), second});
  CHECK(kept.bounds == partition_uniform(6, 3).bounds);
  third.restore_from_nodes(kept);
  CHECK(third.nodes() == kept.nodes);
  for (int step = 4; step < 6; ++step) {
    CAPTURE(step);
    CHECK(loss_at(third, step) == doctest::Approx(expected[step]).epsilon(1e-6));
  }
  check_close(third.named_parameters(), named(plain.layers, false));
  CHECK_FALSE(third.rejoin_nodes()); // none lost
}

TEST_CASE("train() over replicas on nodes takes a lost node's state from the replica that kept "
          "its nodes: no step replayed, every loss that of plain libtorch") {
  std::vector<std::unique_ptr<node>> n;
  std::vector<std::string> address;
  for (int k = 0; k < 4; ++k) {
    n.push_back(std::make_unique<node>(node_config()));
    address.push_back(n.back()->address());
  }
  node spare(node_config());
  engine sys;
  auto o = remote_options(address);
  o.data_parallel.master_port = static_cast<uint16_t>(free_port());
  o.data_parallel.timeout = 5000ms;
  o.placement.connect_timeout = 2000ms;
  o.placement.spares = {spare.address()};
  replicated_pipeline replicas(sys, tiny_remote(), partition_uniform(6, 2), o, 2);
  plain_model plain(tiny_mlp(1), sgd(0.1, 0.9));
  auto to = recovering_options(8, 3);
  // Replica 1's second node goes at step 8's batch: snapshots 1 (start), 2 (step 3), 3 (step 6);
  // replica 0's state after step 7 becomes snapshot 4 and step 8 is taken again.
  losing_source data(n[3], 7);
  auto report = train(replicas, data, to);
  REQUIRE(report.steps.size() == 8);
  check_steps_equal_plain(report, plain, 8);
  REQUIRE(report.recoveries.size() == 1);
  CHECK(report.recoveries[0].from_replica == 0);
  CHECK(report.recoveries[0].snapshot == 4);
  CHECK(report.recoveries[0].spares_used == std::vector<std::string>{spare.address()});
  CHECK(report.replayed_steps.empty());
  for (std::size_t k = 0; k < replicas.replicas(); ++k) {
    check_close(replicas.replica(k).named_parameters(), named(plain.layers, false));
  }
}

namespace {

// Stage settings with every field away from its default.
stage_settings unusual_settings() {
  stage_settings s;
  s.index = 1;
  s.count = 3;
  s.chunks = 2;
  s.placement = chunk_placement::v_shape;
  s.device = c10::Device(c10::kCUDA, 1);
  s.threads = 3;
  s.warm_memory = false;
  s.wait_timeout = 1234ms;
  s.linger = 0us;
  s.reduction = loss_reduction::sum;
  s.report_gradient_norm = true;
  s.device_timing = true;
  s.chunk_streams = false;
  s.recompute = recompute_mode::always;
  s.precision = precision_mode::bf16;
  s.buffers = buffer_sync::average;
  s.sync_batch_norm = true;
  s.shard = shard_mode::gradients;
  s.bmuf = {7, 0.5, 0.25, true, true, 2};
  return s;
}

// Each field's JSON, by name.
std::map<std::string, std::string> fields_of(const stage_settings& s) {
  auto j = nlohmann::json::parse(nodes::to_json(s));
  std::map<std::string, std::string> out;
  visit_fields(s, [&](const char* name, const auto&) { out[name] = j.at(name).dump(); });
  return out;
}

} // namespace

TEST_CASE("a stage's report crosses from a node whole: every figure of stage_stats") {
  // A figure added to stage_stats needs its line in visit_scalars (results.hpp: the node report,
  // train --json and Python's stats are made from that list); then update this size and count.
  static_assert(sizeof(stage_stats) == 152, "stage_stats changed: list the new field in "
                                            "visit_scalars (results.hpp), then update");
  actors::stage_report sent;
  sent.step = 7;
  auto& st = sent.stats;
  int n = 0;
  visit_scalars(st, [&](const char*, auto& value) {
    ++n;
    using T = std::decay_t<decltype(value)>;
    if constexpr (std::is_same_v<T, bool>) {
      value = true;
    } else {
      value = static_cast<T>(n * 3 + 1); // every field away from its default, each its own
    }
  });
  CHECK(n == 17);
  st.actions.push_back({{action_kind::forward, 2, 1}, 1.5, 2.5, 64, 1.75, 2.25});
  std::size_t outputs = 0;
  auto back = nodes::stage_report_from_json(nodes::to_json(sent), outputs);
  CHECK(back.step == 7);
  std::map<std::string, std::string> a, b;
  visit_scalars(st, [&](const char* name, const auto& value) { a[name] = std::to_string(value); });
  visit_scalars(back.stats,
                [&](const char* name, const auto& value) { b[name] = std::to_string(value); });
  CHECK(a == b);
  REQUIRE(back.stats.actions.size() == 1);
  CHECK(back.stats.actions[0].device_end_ms == 2.25);
}

TEST_CASE("stage settings cross to a node whole: every field, with a version, checked") {
  // A field added to stage_settings needs its line in visit_fields (the serializer, the parser
  // and this test walk that list); then update this size.
  static_assert(sizeof(stage_settings) == 136, "stage_settings changed: list the new field in "
                                               "visit_fields (stage_settings.hpp), then update");
  auto sent = unusual_settings();
  auto defaults = fields_of(stage_settings{});
  auto unusual = fields_of(sent);
  REQUIRE(unusual.size() == 24);
  for (const auto& [name, value] : unusual) {
    CAPTURE(name);
    CHECK(value != defaults.at(name));
  }
  CHECK(fields_of(nodes::stage_settings_from_json(nodes::to_json(sent))) == unusual);
  // Another version, a missing field and a malformed one are refused by name.
  auto j = nlohmann::json::parse(nodes::to_json(sent));
  auto refused = [](const nlohmann::json& text) {
    try {
      nodes::stage_settings_from_json(text.dump());
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  auto other = j;
  other["version"] = 99;
  CHECK(refused(other).find("settings of version 99") != std::string::npos);
  CHECK(j.at("version") == stage_settings::version);
  auto missing = j;
  missing.erase("linger");
  CHECK(refused(missing).find("field 'linger' is missing") != std::string::npos);
  auto malformed = j;
  malformed["device"] = "gpu:7";
  CHECK(refused(malformed).find("field 'device' is malformed") != std::string::npos);
}

namespace {

// Every field `visit` lists of `v`, set away from its default (each its own value), or read as
// text by name.
template <class T, class Visit>
int make_unusual(T& v, Visit visit, int n) {
  visit(v, [&](const char*, auto& value) {
    using V = std::decay_t<decltype(value)>;
    ++n;
    if constexpr (std::is_same_v<V, std::string>) {
      value = "text " + std::to_string(n);
    } else if constexpr (std::is_same_v<V, bool>) {
      value = !value;
    } else {
      value = static_cast<V>(n * 3 + 1) + static_cast<V>(std::is_floating_point_v<V> ? 0.25 : 0);
    }
  });
  return n;
}

template <class T, class Visit>
std::map<std::string, std::string> text_of(const T& v, Visit visit) {
  std::map<std::string, std::string> out;
  visit(v, [&](const char* name, const auto& value) {
    if constexpr (std::is_same_v<std::decay_t<decltype(value)>, std::string>) {
      out[name] = value;
    } else {
      out[name] = std::to_string(value);
    }
  });
  return out;
}

} // namespace

TEST_CASE("a model's options, optimizer and hooks cross to a node whole: every field, checked") {
  // A field added to one of these structs needs its line in nodes/option_fields.hpp (the
  // serializer, the parser and this test walk those lists); then update these sizes.
  static_assert(sizeof(model_options) == 80, "model_options changed: list the new field in "
                                             "visit_model_options (nodes/option_fields.hpp)");
  static_assert(sizeof(optimizer_spec) == 64, "optimizer_spec changed: list the new field in "
                                              "visit_optimizer_spec (nodes/option_fields.hpp)");
  static_assert(sizeof(hook_spec) == 96, "hook_spec changed: list the new field in "
                                         "visit_hook_spec (nodes/option_fields.hpp)");
  auto options = [](auto& o, auto&& f) { nodes::visit_model_options(o, f); };
  auto optimizer = [](auto& o, auto&& f) { nodes::visit_optimizer_spec(o, f); };
  auto hook = [](auto& h, auto&& f) { nodes::visit_hook_spec(h, f); };
  nodes::stage_spec spec;
  spec.bounds = {0, 4};
  auto& m = spec.model;
  m.name = "a model";
  m.seed = 17;
  m.loss = "cross_entropy";
  m.torchscript = "bytes";
  CHECK(make_unusual(m.options, options, 0) == 12);
  CHECK(make_unusual(m.optimizer, optimizer, 0) == 5);
  CHECK(make_unusual(m.hooks.after_forward, hook, 0) == 3);
  CHECK(make_unusual(m.hooks.after_backward, hook, 10) == 13);
  for (const auto& [name, value] : text_of(m.options, options)) {
    CAPTURE(name);
    CHECK(value != text_of(model_options{}, options).at(name));
  }
  auto back = nodes::stage_spec_from_json(nodes::to_json(spec)).model;
  CHECK(back.name == m.name);
  CHECK(back.seed == m.seed);
  CHECK(back.loss == m.loss);
  CHECK(back.torchscript == m.torchscript);
  CHECK(text_of(back.options, options) == text_of(m.options, options));
  CHECK(text_of(back.optimizer, optimizer) == text_of(m.optimizer, optimizer));
  CHECK(text_of(back.hooks.after_forward, hook) == text_of(m.hooks.after_forward, hook));
  CHECK(text_of(back.hooks.after_backward, hook) == text_of(m.hooks.after_backward, hook));
  // A missing or malformed field is refused by name.
  auto j = nlohmann::json::parse(nodes::to_json(spec));
  auto refused = [](const nlohmann::json& text) {
    try {
      nodes::stage_spec_from_json(text.dump());
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  auto malformed = j;
  malformed["model"]["width"] = "wide";
  CHECK(refused(malformed).find("field 'width' is malformed") != std::string::npos);
  auto missing = j;
  missing["model"]["optimizer"].erase("nesterov");
  CHECK(refused(missing).find("field 'nesterov' is missing") != std::string::npos);
}

TEST_CASE("a step plan crosses to a node whole: every field it carries beside its tensors") {
  // A field added to step_plan is sent in plan_fields (nodes/protocol.cpp) or said there to stay
  // in the process; then update this size.
  static_assert(sizeof(actors::step_plan) == 168, "step_plan changed: list the new field in "
                                                  "plan_fields (nodes/protocol.cpp)");
  actors::step_plan sent;
  sent.step = 7;
  sent.train = false;
  sent.program = {{action_kind::forward, 3, 1}, {action_kind::weight, 2, 0}};
  sent.loss_scales = {0.5, 0.25};
  sent.samples = 9;
  sent.learning_rate = 0.125;
  sent.optimistic = true;
  std::size_t targets = 0;
  auto back = nodes::step_plan_from_json(nodes::to_json(sent, 2), targets);
  CHECK(targets == 2);
  CHECK(back.step == 7);
  CHECK_FALSE(back.train);
  CHECK((back.program == sent.program));
  CHECK(back.loss_scales == sent.loss_scales);
  CHECK(back.samples == 9);
  CHECK(back.learning_rate == 0.125);
  CHECK(back.optimistic);
  auto j = nlohmann::json::parse(nodes::to_json(sent, 2));
  j["loss_scales"] = "half";
  try {
    nodes::step_plan_from_json(j.dump(), targets);
    FAIL("a malformed plan was accepted");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("field 'loss_scales' is malformed") != std::string::npos);
  }
}

TEST_CASE("a node builds its stage with the settings sent, cold memory and linger included") {
  node n(node_config());
  control_client scheduler(n.address());
  scheduler.authenticate();
  nodes::stage_spec spec;
  spec.model = tiny_remote();
  spec.bounds = {0, 3, 6};
  spec.settings.index = 1;
  spec.settings.count = 2;
  spec.settings.threads = 1;
  spec.settings.warm_memory = false;
  spec.settings.linger = 0us;
  spec.settings.wait_timeout = 4321ms;
  spec.settings.recompute = recompute_mode::always;
  spec.settings.reduction = loss_reduction::sum;
  auto built = nlohmann::json::parse(scheduler.ask(nodes::build_atom::value, nodes::to_json(spec)));
  REQUIRE_MESSAGE(!built.contains("error"), built.dump());
  // What the stage actor was given, as the node reports it.
  CHECK(built.at("settings") == nlohmann::json::parse(nodes::to_json(spec.settings)));
  // A device this node does not have is refused by name.
  spec.settings.device = c10::Device(c10::kCUDA, 5);
  auto refused =
    nlohmann::json::parse(scheduler.ask(nodes::build_atom::value, nodes::to_json(spec)));
  REQUIRE(refused.contains("error"));
  CHECK(refused["error"].get<std::string>().find("cuda:5") != std::string::npos);
}

TEST_CASE("a pipeline with a device its node does not have fails to build, naming node, stage "
          "and device") {
  node n1(node_config()), n2(node_config());
  engine sys;
  auto o = remote_options({n1.address(), n2.address()});
  o.devices = {c10::Device(c10::kCPU), c10::Device(c10::kCUDA, 3)};
  try {
    pipeline remote(sys, tiny_remote(), partition_uniform(6, 2), o);
    FAIL("the node should have refused cuda:3");
  } catch (const std::exception& e) {
    std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("stage 1") != std::string::npos);
    CHECK(what.find(n2.address()) != std::string::npos);
    CHECK(what.find("device cuda:3") != std::string::npos);
  }
}
