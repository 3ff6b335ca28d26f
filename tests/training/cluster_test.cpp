// A cluster's world: the launcher's variables, the layout of stages over ranks, and the ranks'
// rendezvous in a real c10d TCPStore.
#include <future>
#include <map>

#include <doctest/doctest.h>

#include <actorpipe/errors.hpp>

#include "../ports.hpp"
#include "training/cluster.hpp"

using namespace actorpipe;
using namespace actorpipe::training;

namespace {

environment from(std::map<std::string, std::string> vars) {
  auto kept = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [kept](const char* name) -> const char* {
    auto at = kept->find(name);
    return at == kept->end() ? nullptr : at->second.c_str();
  };
}

std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "(no refusal)";
}

} // namespace

TEST_CASE("torchrun's variables make the world, and its agent's store makes every rank a client") {
  CHECK_FALSE(cluster_from(from({})).has_value());
  auto w = cluster_from(from({{"RANK", "3"},
                              {"WORLD_SIZE", "4"},
                              {"LOCAL_RANK", "1"},
                              {"MASTER_ADDR", "10.0.0.1"},
                              {"MASTER_PORT", "29400"},
                              {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                              {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  REQUIRE(w.has_value());
  CHECK(w->launcher == "torchrun");
  CHECK(w->rank == 3);
  CHECK(w->size == 4);
  CHECK(w->local_rank == 1);
  CHECK(w->store_host == "10.0.0.1");
  CHECK(w->store_port == 29400);
  CHECK(w->launcher_store);
  CHECK(w->attempt == 2);
  // torchrun's win over Slurm's (torchrun started by srun, one task per host).
  w = cluster_from(
    from({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "8"}}));
  CHECK(w->launcher == "torchrun");
  CHECK(w->size == 2);
  CHECK_FALSE(w->launcher_store);
  CHECK(w->store_host == "127.0.0.1");
  CHECK(refusal([] {
          cluster_from(from({{"RANK", "4"}, {"WORLD_SIZE", "4"}}));
        }) == "torchrun's rank 4 must be below the world size 4 (WORLD_SIZE)");
  CHECK(refusal([] {
          cluster_from(from({{"RANK", "x"}, {"WORLD_SIZE", "4"}}));
        }) == "environment variable RANK='x' is not a number in [0, 1048576]");
}

TEST_CASE("Slurm's variables as srun sets them: the store on the node list's first host") {
  auto w = cluster_from(from({{"SLURM_PROCID", "5"},
                              {"SLURM_NTASKS", "8"},
                              {"SLURM_LOCALID", "1"},
                              {"SLURM_JOB_NODELIST", "gpu[07-09,12]"},
                              {"SLURM_JOB_ID", "4321987"}}));
  REQUIRE(w.has_value());
  CHECK(w->launcher == "slurm");
  CHECK(w->rank == 5);
  CHECK(w->size == 8);
  CHECK(w->local_rank == 1);
  CHECK(w->store_host == "gpu07");
  CHECK(w->store_port == 15000 + 1987);
  w = cluster_from(from({{"SLURM_PROCID", "0"},
                         {"SLURM_NTASKS", "2"},
                         {"SLURM_JOB_NODELIST", "a1"},
                         {"MASTER_ADDR", "10.1.1.1"},
                         {"MASTER_PORT", "6000"}}));
  CHECK(w->store_host == "10.1.1.1");
  CHECK(w->store_port == 6000);
  CHECK(first_slurm_host("node1,node2") == "node1");
  CHECK(first_slurm_host("rack[3-4]-ib,x") == "rack3-ib");
  CHECK(first_slurm_host("c[001,009]") == "c001");
  CHECK(refusal([] { first_slurm_host("c[001"); }) ==
        "SLURM_JOB_NODELIST 'c[001' has an unclosed '['");
  CHECK(refusal([] {
          cluster_from(from({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}));
        }).find("neither is set") != std::string::npos);
}

TEST_CASE("the world must hold stages x replicas, one stage per process") {
  cluster_world w;
  w.launcher = "torchrun";
  w.size_variable = "WORLD_SIZE";
  w.size = 4;
  CHECK_NOTHROW(check_world_fits(w, 2, 2));
  CHECK(refusal([&] { check_world_fits(w, 2, 3); }) ==
        "the 4 processes torchrun started (WORLD_SIZE=4) cannot hold --stages 2 x --replicas 3 "
        "= 6 stages, one per process: give --replicas 2, or start 6 processes");
  CHECK(refusal([&] { check_world_fits(w, 3, 1); }) ==
        "the 4 processes torchrun started (WORLD_SIZE=4) cannot hold --stages 3 x --replicas 1 "
        "= 3 stages, one per process: start 3 processes");
}

TEST_CASE("the layout keeps a replica's stages on one host, whatever order ranks come in") {
  // Slurm's cyclic distribution: ranks 0, 2 on host a, 1, 3 on host b.
  std::vector<cluster_member> members{
    {3, 1, "b", "b:3"}, {0, 0, "a", "a:0"}, {2, 1, "a", "a:2"}, {1, 0, "b", "b:1"}};
  auto nodes = [](const std::vector<cluster_member>& laid) {
    std::vector<std::string> names;
    for (const auto& m : laid) {
      names.push_back(m.node);
    }
    return names;
  };
  auto laid = lay_out(members, 2);
  CHECK(nodes(laid) == std::vector<std::string>{"a:0", "a:2", "b:1", "b:3"});
  CHECK(describe_layout(laid, 2) == "replica 0 on a (ranks 0, 2), replica 1 on b (ranks 1, 3)");
  // One stage: every rank a replica, in host order.
  CHECK(nodes(lay_out(members, 1)) == std::vector<std::string>{"a:0", "a:2", "b:1", "b:3"});
  // Four stages over both hosts: the replica says so.
  CHECK(describe_layout(lay_out(members, 4), 4) ==
        "replica 0 on a (ranks 0, 2) and b (ranks 1, 3)");
}

TEST_CASE("ranks meet in a TCPStore rank 0 serves, and rank 0 tells them how the job ended") {
  cluster_world w;
  w.launcher = "torchrun";
  w.size = 3;
  w.store_host = "127.0.0.1";
  w.store_port = static_cast<uint16_t>(actorpipe::test::free_port());
  const std::chrono::milliseconds timeout{10000};
  CHECK(address_toward("127.0.0.1", w.store_port) == "127.0.0.1");
  cluster_rendezvous lead(w, timeout);
  lead.announce({0, 0, "127.0.0.1", "127.0.0.1:1000"});
  std::vector<std::future<cluster_rendezvous::outcome>> others;
  for (std::size_t r : {1, 2}) {
    others.push_back(std::async(std::launch::async, [w, r, timeout]() mutable {
      w.rank = r;
      cluster_rendezvous meeting(w, timeout);
      meeting.announce({r, r, "127.0.0.1", "127.0.0.1:" + std::to_string(1000 + r)});
      return meeting.wait_for_end();
    }));
  }
  auto members = lead.gather();
  REQUIRE(members.size() == 3);
  CHECK(members[2].node == "127.0.0.1:1002");
  CHECK(members[1].local_rank == 1);
  lead.finish({3, "the driver failed"});
  for (auto& f : others) {
    auto end = f.get();
    CHECK(end.code == 3);
    CHECK(end.message == "the driver failed");
  }
}

TEST_CASE("a rank that never comes, and a driver that goes, are named within the deadline") {
  cluster_world w;
  w.launcher = "slurm";
  w.size = 2;
  w.store_host = "127.0.0.1";
  w.store_port = static_cast<uint16_t>(actorpipe::test::free_port());
  const std::chrono::milliseconds timeout{1500};
  {
    cluster_rendezvous lead(w, timeout);
    lead.announce({0, 0, "127.0.0.1", "127.0.0.1:1"});
    try {
      lead.gather();
      FAIL("gather returned without rank 1");
    } catch (const pipeline_error& e) {
      CHECK(std::string(e.what()) ==
            "rank 0 of 2 (slurm): rank(s) 1 did not announce a node at the store 127.0.0.1:" +
              std::to_string(w.store_port) +
              " within 1500 ms (under Slurm every task runs it: start it with srun)");
    }
  }
  // A driver that goes mid-run takes its store along: the rank waiting for the end hears so.
  auto lead = std::make_unique<cluster_rendezvous>(w, timeout);
  lead->announce({0, 0, "127.0.0.1", "127.0.0.1:1"});
  auto waiting = std::async(std::launch::async, [w, timeout]() mutable {
    w.rank = 1;
    cluster_rendezvous meeting(w, timeout);
    meeting.announce({1, 0, "127.0.0.1", "127.0.0.1:2"});
    return meeting.wait_for_end();
  });
  CHECK(lead->gather().size() == 2);
  lead.reset();
  try {
    waiting.get();
    FAIL("the end was heard from a driver that is gone");
  } catch (const pipeline_error& e) {
    CHECK(std::string(e.what()).rfind("rank 1 of 2: ", 0) == 0);
    CHECK(std::string(e.what()).find("before rank 0 (the driver) ended the job") !=
          std::string::npos);
  }
}
