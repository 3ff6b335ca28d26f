// `actorpipe node` processes hosting the stages of `actorpipe train --nodes`.
#include <sys/stat.h>

#include "comm/test_certificates.hpp"
#include "helpers.hpp"

using namespace actorpipe::test;
using namespace std::chrono_literals;

namespace {

// A node process on a free loopback port, listening.
struct node_process {
  int port;
  std::unique_ptr<background> process;

  explicit node_process(const std::string& extra = "", const std::string& name = "node")
    : port(free_port()) {
    process =
      std::make_unique<background>("node --listen 127.0.0.1:" + std::to_string(port) + " " + extra,
                                   temp_file(name + std::to_string(port) + ".log"));
    REQUIRE_MESSAGE(process->wait_for("listening on", 20s), process->output());
  }

  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

std::filesystem::path secret_file(const std::string& name, const std::string& secret) {
  auto path = temp_file(name);
  std::ofstream(path) << secret << '\n';
  ::chmod(path.c_str(), 0600);
  return path;
}

const std::string synthetic_mlp =
  " --data synthetic --model mlp --batch 16 --microbatches 4 --stages 2 --threads 1 --lr 0.1 "
  "--seed 3";

// Trains `steps` steps on nodes a and b (scheduler flags `flags`) and in process, both with
// `both`: the losses of every step agree.
void check_remote_equals_local(const node_process& a, const node_process& b,
                               const std::string& flags, int steps, const std::string& tag,
                               const std::string& both = "") {
  auto remote_json = temp_file(tag + "-remote.json");
  auto local_json = temp_file(tag + "-local.json");
  auto n = " --steps " + std::to_string(steps) + both;
  auto remote = run("train" + synthetic_mlp + n + " --nodes " + a.address() + "," + b.address() +
                    flags + " --json " + remote_json.string());
  auto local = run("train" + synthetic_mlp + n + " --json " + local_json.string());
  CAPTURE(remote.output);
  REQUIRE(remote.exit_code == 0);
  REQUIRE(local.exit_code == 0);
  auto lr = losses(remote_json);
  auto ll = losses(local_json);
  REQUIRE(lr.size() == static_cast<std::size_t>(steps));
  REQUIRE(ll.size() == static_cast<std::size_t>(steps));
  for (std::size_t i = 0; i < lr.size(); ++i) {
    CHECK(lr[i] == doctest::Approx(ll[i]).epsilon(1e-6));
  }
  std::filesystem::remove(remote_json);
  std::filesystem::remove(local_json);
}

} // namespace

TEST_CASE("a scheduler and two node processes train with the in-process losses") {
  auto secret = secret_file("secret", "correct horse");
  node_process a("--secret-file " + secret.string(), "a");
  node_process b("--secret-file " + secret.string(), "b");
  check_remote_equals_local(a, b, " --secret-file " + secret.string(), 4, "secret");
  // The nodes stay up for the next scheduler, and stop cleanly on SIGTERM.
  auto again = run("train" + synthetic_mlp + " --steps 1 --nodes " + a.address() + "," +
                   b.address() + " --secret-file " + secret.string());
  CHECK(again.exit_code == 0);
  CHECK(a.process->stop(SIGTERM) == 0);
  CHECK(b.process->stop(SIGINT) == 0);
  std::filesystem::remove(secret);
}

TEST_CASE("hooks given on the command line run on the node processes as in process") {
  node_process a("", "hooks-a");
  node_process b("", "hooks-b");
  check_remote_equals_local(a, b, "", 3, "hooks",
                            " --after-forward clamp:0.5 --after-backward check_finite");
  auto refused = run("train" + synthetic_mlp + " --steps 1 --after-backward clip:1 --nodes " +
                     a.address() + "," + b.address());
  CHECK(refused.exit_code == 2);
  CHECK(refused.output.find("--after-backward 'clip:1' is neither a built-in hook") !=
        std::string::npos);
  auto bound = run("train" + synthetic_mlp + " --steps 1 --after-forward clamp:-1");
  CHECK(bound.exit_code == 2);
  CHECK(bound.output.find("after_forward hook 'clamp:-1': the bound after clamp: must be a number "
                          "above 0") != std::string::npos);
  auto missing = run("train" + synthetic_mlp + " --steps 1 --after-forward /no/such.pt");
  CHECK(missing.exit_code == 2);
  CHECK(missing.output.find("--after-forward '/no/such.pt' is neither a built-in hook") !=
        std::string::npos);
}

TEST_CASE("a frozen node (SIGSTOP) is found by its heartbeat within seconds, not at the wait "
          "deadline, and --heartbeat-timeout 0 turns heartbeats off") {
  node_process a("", "freeze-a");
  node_process b("", "freeze-b");
  background train("train --data synthetic --model mlp --batch 256 --microbatches 8 --stages 2 "
                   "--threads 1 --steps 100000 --wait-timeout 60000 --nodes " +
                     a.address() + "," + b.address(),
                   temp_file("freeze-train.log"));
  REQUIRE_MESSAGE(train.wait_for("step 5/", 60s), train.output());
  b.process->signal(SIGSTOP);
  auto start = std::chrono::steady_clock::now();
  auto code = train.stop(0, 30s); // signal 0: just wait
  auto took = std::chrono::steady_clock::now() - start;
  b.process->signal(SIGCONT);
  auto output = train.output();
  CAPTURE(output);
  CHECK(took < 6s);
  CHECK(code == 1);
  CHECK(output.find("node " + b.address() +
                    " hosting stage 1 is lost: it did not answer a heartbeat within 1000 ms") !=
        std::string::npos);
  auto off = run("train --data synthetic --model mlp --steps 1 --heartbeat-timeout 0 --nodes " +
                 a.address() + "," + b.address());
  CHECK_MESSAGE(off.exit_code == 0, off.output);
  auto refused = run("train --data synthetic --model mlp --steps 1 --heartbeat-timeout 500");
  CHECK(refused.exit_code == 2);
  CHECK(refused.output.find("--heartbeat-timeout applies to stages on nodes (--nodes)") !=
        std::string::npos);
}

TEST_CASE("killing a node mid-run ends the run with an error naming it, within the deadline") {
  node_process a("", "kill-a");
  node_process b("", "kill-b");
  background train("train --data synthetic --model mlp --batch 256 --microbatches 8 --stages 2 "
                   "--threads 1 --steps 100000 --wait-timeout 5000 --nodes " +
                     a.address() + "," + b.address(),
                   temp_file("kill-train.log"));
  REQUIRE_MESSAGE(train.wait_for("step 5/", 60s), train.output());
  CHECK(b.process->stop(SIGKILL) == 128 + SIGKILL);
  auto start = std::chrono::steady_clock::now();
  auto code = train.stop(0, 15s); // signal 0: just wait
  auto output = train.output();
  CAPTURE(output);
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  CHECK(code == 1);
  CHECK(output.find("node " + b.address()) != std::string::npos);
  CHECK(output.find("stage 1") != std::string::npos);
  CHECK(output.find("lost") != std::string::npos);
  // The surviving node dropped the stage and serves the next run.
  node_process c("", "kill-c");
  auto next =
    run("train" + synthetic_mlp + " --steps 1 --nodes " + a.address() + "," + c.address());
  CHECK(next.exit_code == 0);
}

TEST_CASE("nodes refuse a wrong secret, and open addresses without one") {
  auto right = secret_file("right", "right");
  auto wrong = secret_file("wrong", "wrong");
  node_process a("--secret-file " + right.string(), "secret-a");
  auto refused = run("train" + synthetic_mlp + " --steps 1 --nodes " + a.address() + "," +
                     a.address() + " --secret-file " + wrong.string());
  CHECK(refused.exit_code == 1);
  CHECK(refused.output.find("node " + a.address() + " refused the secret") != std::string::npos);
  CHECK(a.process->output().find("wrong secret") != std::string::npos);
  auto open = run("node --listen 0.0.0.0:" + std::to_string(free_port()));
  CHECK(open.exit_code == 2);
  CHECK(open.output.find("without a secret") != std::string::npos);
  auto absent =
    run("train" + synthetic_mlp + " --steps 1 --connect-timeout 3000 --nodes " + a.address() +
        ",127.0.0.1:" + std::to_string(free_port()) + " --secret-file " + right.string());
  CHECK(absent.exit_code == 1);
  CHECK(absent.output.find("cannot reach node 127.0.0.1:") != std::string::npos);
  auto count = run("train" + synthetic_mlp + " --steps 1 --nodes " + a.address());
  CHECK(count.exit_code == 2);
  CHECK(count.output.find("--nodes lists 1 nodes for 2 stages") != std::string::npos);
  std::filesystem::remove(right);
  std::filesystem::remove(wrong);
}

TEST_CASE("nodes and a scheduler with certificates of one CA train over TLS") {
  auto dir = temp_file("pki");
  actorpipe::testing::test_ca ca(dir, "cluster");
  auto flags = [&](const std::string& name) {
    auto tls = ca.issue(name);
    return " --tls-cert " + tls.certificate + " --tls-key " + tls.private_key + " --tls-ca " +
           tls.ca_file;
  };
  node_process a(flags("a"), "tls-a");
  node_process b(flags("b"), "tls-b");
  CHECK(a.process->output().find("TLS") != std::string::npos);
  check_remote_equals_local(a, b, flags("scheduler"), 3, "tls");
  // A scheduler without TLS is turned away, naming the node.
  auto plain = run("train" + synthetic_mlp + " --steps 1 --connect-timeout 3000 --nodes " +
                   a.address() + "," + b.address());
  CHECK(plain.exit_code == 1);
  CHECK(plain.output.find("node " + a.address()) != std::string::npos);
  // The three files go together.
  auto tls = ca.issue("half");
  auto half = run("node --listen 127.0.0.1:" + std::to_string(free_port()) + " --tls-cert " +
                  tls.certificate);
  CHECK(half.exit_code == 2);
  CHECK(half.output.find("--tls-cert requires --tls-key") != std::string::npos);
  std::filesystem::remove_all(dir);
}

// --on-node-loss continue (issue 20): the run goes on after a node is lost, and every step's
// loss is the uninterrupted in-process run's.
namespace {

const std::string recovering_mlp =
  " --data synthetic --model mlp --batch 256 --microbatches 8 --threads 1 --lr 0.1 --seed 3 "
  "--steps 40 --snapshot-every 5 --on-node-loss continue";

void check_losses_equal_in_process(const std::filesystem::path& json, int stages, int steps = 40) {
  auto local_json = temp_file("recover-local-" + std::to_string(stages) + ".json");
  auto local = run("train --data synthetic --model mlp --batch 256 --microbatches 8 --threads 1 "
                   "--lr 0.1 --seed 3 --steps " +
                   std::to_string(steps) + " --stages " + std::to_string(stages) + " --json " +
                   local_json.string());
  REQUIRE(local.exit_code == 0);
  auto expected = losses(local_json);
  auto got = losses(json);
  REQUIRE(got.size() == expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == doctest::Approx(expected[i]).epsilon(1e-5));
  }
  std::filesystem::remove(local_json);
}

// Runs `train` with `flags` (and --json `json`), calls `lose` once step 12 is printed, and
// returns the run's output once it exited with 0.
template <class Lose>
std::string run_losing_a_node(const std::string& flags, const std::filesystem::path& json,
                              Lose lose, int steps = 40) {
  auto recovering = recovering_mlp;
  recovering.replace(recovering.find("--steps 40"), 10, "--steps " + std::to_string(steps));
  background train("train" + recovering + flags + " --json " + json.string(),
                   temp_file(json.stem().string() + ".log"));
  REQUIRE_MESSAGE(train.wait_for("step 12/", 60s), train.output());
  lose();
  auto code = train.stop(0, 90s);
  auto output = train.output();
  CHECK_MESSAGE(code == 0, output);
  return output;
}

} // namespace

TEST_CASE("a node killed mid-run is replaced by a spare and the run's losses are the "
          "uninterrupted run's") {
  node_process a("", "spare-a");
  node_process b("", "spare-b");
  node_process spare("", "spare-s");
  auto json = temp_file("recover-spare.json");
  auto output = run_losing_a_node(" --stages 2 --wait-timeout 5000 --nodes " + a.address() + "," +
                                    b.address() + " --spare-nodes " + spare.address(),
                                  json, [&] { CHECK(b.process->stop(SIGKILL) == 128 + SIGKILL); });
  CAPTURE(output);
  CHECK(output.find("(node_lost, node " + b.address() + ")") != std::string::npos);
  CHECK(output.find("recovery 1 of at most 3") != std::string::npos);
  CHECK(output.find("lost " + b.address() + ", spares used " + spare.address()) !=
        std::string::npos);
  CHECK(output.find("now 2 stages on " + a.address() + ", " + spare.address()) !=
        std::string::npos);
  CHECK(output.find("1 lost-node recovery") != std::string::npos);
  check_losses_equal_in_process(json, 2);
  std::filesystem::remove(json);
}

TEST_CASE("a node stopped past the deadline, without a spare: the run goes on over the nodes "
          "left, cut anew") {
  node_process a("", "stop-a");
  node_process b("", "stop-b");
  node_process c("", "stop-c");
  auto json = temp_file("recover-stop.json");
  auto output = run_losing_a_node(" --stages 3 --connect-timeout 2000 --nodes " + a.address() +
                                    "," + b.address() + "," + c.address(),
                                  json, [&] { c.process->signal(SIGSTOP); });
  c.process->signal(SIGCONT);
  CAPTURE(output);
  // Found by its heartbeat (1 s), not at --wait-timeout (60 s).
  CHECK(output.find("(node_lost, node " + c.address() + ")") != std::string::npos);
  CHECK(output.find("did not answer a heartbeat within 1000 ms") != std::string::npos);
  CHECK(output.find("lost " + c.address() + ", spares used none; now 2 stages on " + a.address() +
                    ", " + b.address()) != std::string::npos);
  check_losses_equal_in_process(json, 3);
  std::filesystem::remove(json);
}

TEST_CASE("a driver killed mid-run starts again with --resume nodes from the snapshot its nodes "
          "keep, and the run's losses are the uninterrupted run's") {
  node_process a("", "resume-a");
  node_process b("", "resume-b");
  const auto flags = " --stages 2 --nodes " + a.address() + "," + b.address();
  {
    background killed("train" + recovering_mlp + flags, temp_file("resume-killed.log"));
    REQUIRE_MESSAGE(killed.wait_for("step 12/", 60s), killed.output());
    CHECK(killed.stop(SIGKILL) == 128 + SIGKILL);
  }
  auto json = temp_file("resume-nodes.json");
  auto resumed = run("train" + recovering_mlp + flags + " --resume nodes --json " + json.string());
  CAPTURE(resumed.output);
  REQUIRE(resumed.exit_code == 0);
  // Snapshots every 5 steps: the newest whole one when the driver died is of step 10 at least.
  auto at = resumed.output.find("resumed from the nodes' snapshot ");
  REQUIRE(at != std::string::npos);
  auto step = std::stoi(resumed.output.substr(resumed.output.find(" at step ", at) + 9));
  CHECK(step >= 10);
  CHECK(step % 5 == 0);
  auto local_json = temp_file("resume-nodes-local.json");
  auto local = run("train --data synthetic --model mlp --batch 256 --microbatches 8 --threads 1 "
                   "--lr 0.1 --seed 3 --steps 40 --stages 2 --json " +
                   local_json.string());
  REQUIRE(local.exit_code == 0);
  auto expected = losses(local_json);
  auto got = losses(json);
  REQUIRE(got.size() + static_cast<std::size_t>(step) == expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == doctest::Approx(expected[i + static_cast<std::size_t>(step)]).epsilon(1e-5));
  }
  // Without --nodes there is nothing to resume from.
  auto refused = run("train" + synthetic_mlp + " --steps 2 --resume nodes");
  CHECK(refused.exit_code != 0);
  CHECK(refused.output.find("--resume nodes takes the snapshot that nodes keep") !=
        std::string::npos);
  std::filesystem::remove(json);
  std::filesystem::remove(local_json);
}

TEST_CASE("replicas of pipelines on four node processes train with the in-process replicas' "
          "losses: from one scheduler, interleaved, and from two schedulers of one world") {
  node_process a("", "dp-a"), b("", "dp-b"), c("", "dp-c"), d("", "dp-d");
  const auto four =
    " --nodes " + a.address() + "," + b.address() + "," + c.address() + "," + d.address();
  const std::string steps = " --steps 3";
  auto losses_of = [](const std::string& flags, const std::string& tag) {
    auto json = temp_file(tag + ".json");
    auto r = run("train" + synthetic_mlp + flags + " --json " + json.string());
    CAPTURE(r.output);
    REQUIRE(r.exit_code == 0);
    auto l = losses(json);
    std::filesystem::remove(json);
    return l;
  };
  auto expect_equal = [](const std::vector<double>& got, const std::vector<double>& expected) {
    REQUIRE(got.size() == expected.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      CHECK(got[i] == doctest::Approx(expected[i]).epsilon(1e-6));
    }
  };
  const std::string interleaved = " --replicas 2 --schedule interleaved --chunks 2";
  expect_equal(
    losses_of(steps + interleaved + four + " --master-port " + std::to_string(free_port()),
              "dp-nodes"),
    losses_of(steps + interleaved, "dp-local"));
  // Two schedulers, ranks 0 and 1 of a world of 2, each with its pipeline on two of the nodes.
  auto port = std::to_string(free_port());
  auto json = temp_file("dp-world.json");
  background rank1("train" + synthetic_mlp + steps + " --world-size 2 --rank 1 --master-port " +
                     port + " --nodes " + c.address() + "," + d.address(),
                   temp_file("dp-rank1.log"));
  auto rank0 =
    run("train" + synthetic_mlp + steps + " --world-size 2 --rank 0 --master-port " + port +
        " --nodes " + a.address() + "," + b.address() + " --json " + json.string());
  CAPTURE(rank0.output);
  CHECK(rank0.exit_code == 0);
  auto rank1_code = rank1.stop(0, 30s);
  CAPTURE(rank1.output());
  CHECK(rank1_code == 0);
  expect_equal(losses(json), losses_of(steps + " --replicas 2", "dp-local-1f1b"));
  std::filesystem::remove(json);
  // Refusals: a node count that is not replicas x stages, recovery with replicas.
  auto three = run("train" + synthetic_mlp + steps + " --replicas 2 --nodes " + a.address() + "," +
                   b.address() + "," + c.address());
  CHECK(three.exit_code == 2);
  CHECK(three.output.find("--nodes lists 3 nodes for 2 stages of each of 2 replicas") !=
        std::string::npos);
  auto recovering = run("train" + synthetic_mlp + steps + " --world-size 2 --rank 0 --nodes " +
                        a.address() + "," + b.address() + " --on-node-loss continue");
  CHECK(recovering.exit_code == 2);
  CHECK(recovering.output.find("(--world-size) do not recover a lost node; run them in one "
                               "process with --replicas") != std::string::npos);
}

TEST_CASE("replicas on node processes lose a node mid-run: a spare takes its stages, or without "
          "one the world shrinks, and the losses are the uninterrupted run's") {
  for (bool with_spare : {true, false}) {
    CAPTURE(with_spare);
    auto tag = std::string(with_spare ? "dp-spare" : "dp-shrink");
    node_process a("", tag + "-a"), b("", tag + "-b"), c("", tag + "-c"), d("", tag + "-d");
    std::unique_ptr<node_process> spare;
    auto flags = " --stages 2 --replicas 2 --wait-timeout 5000 --dp-timeout 5000 --master-port " +
                 std::to_string(free_port()) + " --nodes " + a.address() + "," + b.address() + "," +
                 c.address() + "," + d.address();
    if (with_spare) {
      spare = std::make_unique<node_process>("", tag + "-s");
      flags += " --spare-nodes " + spare->address();
    }
    auto json = temp_file(tag + ".json");
    // Replica 1's second stage goes.
    auto output =
      run_losing_a_node(flags, json, [&] { CHECK(d.process->stop(SIGKILL) == 128 + SIGKILL); });
    CAPTURE(output);
    CHECK(output.find("2 replicas (on nodes") != std::string::npos);
    CHECK(output.find("(node_lost, node " + d.address() + ")") != std::string::npos);
    CHECK(output.find("recovery 1 of at most 3") != std::string::npos);
    if (with_spare) {
      CHECK(output.find("lost " + d.address() + ", spares used " + spare->address() +
                        "; now 2 replicas of 2 stages on " + a.address() + ", " + b.address() +
                        ", " + c.address() + ", " + spare->address()) != std::string::npos);
      CHECK(output.find("now 2 replicas of 2 stages, cut") != std::string::npos);
    } else {
      CHECK(output.find("lost " + d.address() +
                        ", spares used none, replicas left (no spare) 1; "
                        "now 1 replica of 2 stages on " +
                        a.address() + ", " + b.address()) != std::string::npos);
      CHECK(output.find("now 1 replica of 2 stages, cut") != std::string::npos);
    }
    auto recoveries = nlohmann::json::parse(std::ifstream(json)).at("recoveries");
    REQUIRE(recoveries.size() == 1);
    CHECK(recoveries[0].at("replicas") == (with_spare ? 2 : 1));
    CHECK(recoveries[0].at("replicas_left") ==
          (with_spare ? nlohmann::json::array() : nlohmann::json::array({1})));
    // Each step is the whole batch's, with two replicas or one, and each has its line (the
    // failed one too where replica 0 completed it: its state is then restored live).
    check_losses_equal_in_process(json, 2);
    for (int step = 1; step <= 40; ++step) {
      CAPTURE(step);
      CHECK(output.find("\nstep " + std::to_string(step) + "/40 ") != std::string::npos);
    }
    std::filesystem::remove(json);
  }
}

TEST_CASE("replicas on nodes: a frozen node (SIGSTOP) ends the other replica's step within "
          "seconds, not at --dp-timeout, and the run goes on with the replica left") {
  node_process a("", "dp-freeze-a"), b("", "dp-freeze-b"), c("", "dp-freeze-c"),
    d("", "dp-freeze-d");
  auto json = temp_file("dp-freeze.json");
  auto flags = " --stages 2 --replicas 2 --dp-timeout 60000 --master-port " +
               std::to_string(free_port()) + " --nodes " + a.address() + "," + b.address() + "," +
               c.address() + "," + d.address();
  background train("train" + recovering_mlp + flags + " --json " + json.string(),
                   temp_file("dp-freeze.log"));
  REQUIRE_MESSAGE(train.wait_for("step 12/", 60s), train.output());
  // Replica 1's second stage freezes: replica 0's second stage waits for it in an all-reduce.
  d.process->signal(SIGSTOP);
  auto start = std::chrono::steady_clock::now();
  auto recovered = train.wait_for("recovery 1 of at most", 60s);
  auto took = std::chrono::steady_clock::now() - start;
  auto code = train.stop(0, 90s);
  d.process->signal(SIGCONT);
  auto output = train.output();
  CAPTURE(output);
  REQUIRE(recovered);
  CHECK(took < 20s); // the heartbeat and the announced failure, not the 60 s deadline
  CHECK(code == 0);
  CHECK(output.find("did not answer a heartbeat") != std::string::npos);
  CHECK(output.find("now 1 replica of 2 stages on " + a.address() + ", " + b.address()) !=
        std::string::npos);
  check_losses_equal_in_process(json, 2);
  std::filesystem::remove(json);
}

TEST_CASE("the flags of lost-node recovery are refused where they do not apply") {
  const std::string two_nodes = " --steps 1 --nodes 127.0.0.1:1,127.0.0.1:2";
  const std::vector<std::pair<std::string, std::string>> refusals{
    {" --steps 1 --on-node-loss continue", "--on-node-loss applies to stages on nodes (--nodes)"},
    {two_nodes + " --spare-nodes 127.0.0.1:3", "--spare-nodes applies to --on-node-loss continue"},
    {two_nodes + " --accept-joins 127.0.0.1:0",
     "--accept-joins applies to --on-node-loss continue"},
    {" --steps 1 --accept-joins 127.0.0.1:0",
     "--accept-joins applies to stages on nodes (--nodes)"},
    {two_nodes + " --on-node-loss continue --snapshot-every 0",
     "--snapshot-every (0) must be >= 1"},
  };
  for (const auto& [flags, message] : refusals) {
    auto refused = run("train" + synthetic_mlp + flags);
    CAPTURE(refused.output);
    CHECK(refused.exit_code == 2);
    CHECK(refused.output.find(message) != std::string::npos);
  }
  auto policy = run("train" + synthetic_mlp + " --steps 1 --on-node-loss retry");
  CHECK(policy.exit_code != 0);
  CHECK(policy.output.find("--on-node-loss") != std::string::npos);
  auto alone = run("node --listen 127.0.0.1:0 --join-timeout 5");
  CHECK(alone.exit_code != 0);
  CHECK(alone.output.find("--join-timeout requires --join") != std::string::npos);
  auto malformed = run("node --listen 127.0.0.1:0 --join nowhere");
  CHECK(malformed.exit_code != 0);
  CHECK(malformed.output.find("--join") != std::string::npos);
}

TEST_CASE("a node started with --join after a node was lost is taken into the run: the model cut "
          "back onto three, the losses the uninterrupted run's, and a wrong secret ends the node") {
  node_process a("", "join-a");
  node_process b("", "join-b");
  node_process c("", "join-c");
  const auto joins = free_port();
  const auto at = "127.0.0.1:" + std::to_string(joins);
  std::unique_ptr<node_process> d;
  auto json = temp_file("join.json");
  auto output = run_losing_a_node(
    " --stages 3 --connect-timeout 2000 --accept-joins " + at + " --nodes " + a.address() + "," +
      b.address() + "," + c.address(),
    json,
    [&] {
      CHECK(c.process->stop(SIGKILL) == 128 + SIGKILL);
      d = std::make_unique<node_process>("--join " + at, "join-d");
    },
    400);
  CAPTURE(output);
  REQUIRE(d);
  CHECK(d->process->wait_for("joined the driver at " + at, 5s));
  CHECK(output.find("nodes may join at " + at) != std::string::npos);
  // Taken as a spare for the lost node, or (found lost first) the model cut back onto it.
  CHECK(output.find("now 3 stages on " + a.address() + ", " + b.address() + ", " + d->address()) !=
        std::string::npos);
  check_losses_equal_in_process(json, 3, 400);
  std::filesystem::remove(json);
  // Two replicas: replica 1 leaves with its lost node, and the node that joins brings it back
  // in that node's place (or, announced before the loss was found, stands by and takes it).
  node_process r0a("", "join-dp-a"), r0b("", "join-dp-b"), r1a("", "join-dp-c"),
    r1b("", "join-dp-d");
  const auto dp_at = "127.0.0.1:" + std::to_string(free_port());
  std::unique_ptr<node_process> joiner;
  auto dp_json = temp_file("join-dp.json");
  output = run_losing_a_node(
    " --stages 2 --replicas 2 --wait-timeout 5000 --dp-timeout 5000 "
    "--master-port " +
      std::to_string(free_port()) + " --accept-joins " + dp_at + " --nodes " + r0a.address() + "," +
      r0b.address() + "," + r1a.address() + "," + r1b.address(),
    dp_json,
    [&] {
      CHECK(r1b.process->stop(SIGKILL) == 128 + SIGKILL);
      joiner = std::make_unique<node_process>("--join " + dp_at, "join-dp-e");
    },
    400);
  CAPTURE(output);
  REQUIRE(joiner);
  CHECK(joiner->process->wait_for("joined the driver at " + dp_at, 5s));
  CHECK(output.find("nodes may join at " + dp_at) != std::string::npos);
  const auto whole =
    r0a.address() + ", " + r0b.address() + ", " + r1a.address() + ", " + joiner->address();
  const bool came_back =
    output.find("now 1 replica of 2 stages on " + r0a.address() + ", " + r0b.address()) !=
      std::string::npos &&
    output.find(joiner->address() + " joined: now 2 replicas, 4 stages on " + whole) !=
      std::string::npos;
  const bool stood_by =
    output.find("spares used " + joiner->address() + "; now 2 replicas of 2 stages on " + whole) !=
    std::string::npos;
  CHECK((came_back || stood_by));
  check_losses_equal_in_process(dp_json, 2, 400);
  std::filesystem::remove(dp_json);
  // Another secret: the driver refuses it and the node ends with the reason.
  auto secret = secret_file("join-secret", "one");
  auto other = secret_file("join-other", "two");
  node_process e("--secret-file " + secret.string(), "join-e");
  auto running = recovering_mlp; // until stopped
  running.replace(running.find("--steps 40"), 10, "--steps 100000");
  background train("train" + running + " --stages 1 --secret-file " + secret.string() +
                     " --nodes " + e.address() + " --accept-joins " + at,
                   temp_file("join-refused.log"));
  REQUIRE_MESSAGE(train.wait_for("nodes may join at", 60s), train.output());
  auto refused = run("node --listen 127.0.0.1:0 --secret-file " + other.string() + " --join " + at);
  CAPTURE(refused.output);
  CHECK(refused.exit_code == 1);
  CHECK(refused.output.find("joining the driver at " + at + ": ") != std::string::npos);
  CHECK(refused.output.find("refused the secret") != std::string::npos);
  train.stop(SIGTERM);
}
