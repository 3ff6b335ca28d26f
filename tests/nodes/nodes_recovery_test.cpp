// Stages on nodes that lose a node: replicas of stages on nodes, recover() onto a spare or the
// nodes left, snapshots in the background, and train() recovering mid-run.
#include "node_fixtures.hpp"

using namespace actorpipe;
using namespace actorpipe::test;
using namespace std::chrono_literals;

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
  // n1 keeps a copy of n2's part, on its way from n2 now; then n2 goes.
  REQUIRE(holds_copy(n1->address(), 1, 1));
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
