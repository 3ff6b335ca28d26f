// Stages on nodes (in this process, each node its own actor system and listeners, talking over
// loopback TCP exactly as separate processes do): training as in process, secrets and TLS,
// refusals, a gpt and every schedule.
#include "node_fixtures.hpp"

using namespace actorpipe;
using namespace actorpipe::test;
using namespace std::chrono_literals;

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
  // Refused as an actorpipe error naming the node, not as text in the reply.
  auto unauthenticated = intruder.refusal<std::string>(nodes::build_atom::value, std::string("{}"));
  REQUIRE(actors::is_pipeline_error(unauthenticated));
  CHECK(intruder.render(unauthenticated).find("authenticate first") != std::string::npos);
  CHECK(actors::details_of_pipeline_error(unauthenticated).node == n.address());
  // A wrong answer to the challenge.
  intruder.ask(nodes::hello_atom::value);
  auto wrong = intruder.refusal(nodes::auth_atom::value, std::string("00"));
  REQUIRE(actors::is_pipeline_error(wrong));
  CHECK(intruder.render(wrong).find("refused the secret") != std::string::npos);
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
  auto unwired = scheduler.refusal(nodes::wire_atom::value, uint32_t{0}, nodes::to_json(peers),
                                   caf::actor_cast<caf::actor>(self));
  REQUIRE_MESSAGE(!unwired, scheduler.render(unwired));
  // Three forward passes of 16 images at 224x224 (about 90 GFLOP on one thread), their inputs
  // there before the plan: the stage runs them in one go, for a second or more.
  actors::step_plan plan;
  plan.step = 1;
  plan.train = false;
  plan.microbatches = 3;
  for (int32_t mb = 0; mb < 3; ++mb) {
    plan.program.push_back({action_kind::forward, mb});
    auto x = torch::randn({16, 3, 224, 224});
    hub.send(peers.stages[0].host, peers.stages[0].port,
             comm::describe(comm::frame_kind::activation, 0, 1, mb, 0, x), x);
  }
  std::this_thread::sleep_for(200ms);
  self->send(scheduler.node, actors::plan_atom::value, uint32_t{0}, nodes::to_json(plan, 0));
  std::this_thread::sleep_for(100ms);
  auto start = std::chrono::steady_clock::now();
  std::string abort_error;
  self->request(scheduler.node, 10s, actors::abort_atom::value, uint32_t{0}, uint64_t{1})
    .receive([&](bool) { abort_error = "the busy stage confirmed the abort"; },
             [&](caf::error& e) { abort_error = scheduler.render(e); });
  CHECK_MESSAGE(abort_error.find("stage 0 on node " + n.address() + ", asked to abort") !=
                  std::string::npos,
                abort_error);
  CHECK_MESSAGE(abort_error.find("100 ms") != std::string::npos, abort_error);
  std::string update_error;
  caf::error refusal;
  self->request(scheduler.node, 10s, actors::update_atom::value, uint32_t{0}, uint64_t{1}, 0.1, 1.0)
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
