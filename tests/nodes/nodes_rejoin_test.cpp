// Nodes that come back or join between steps: a lost node answering again, a new node joining,
// for a pipeline and for replicas; recover()'s census; a repartition.
#include "node_fixtures.hpp"

using namespace actorpipe;
using namespace actorpipe::test;
using namespace std::chrono_literals;

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
