// The snapshots nodes keep (their own stage's and a neighbour's copy): a driver that died
// starts again from them, after a recovery or a rejoin too, and nothing is lost with a node.
#include "node_fixtures.hpp"

using namespace actorpipe;
using namespace actorpipe::test;
using namespace std::chrono_literals;

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
