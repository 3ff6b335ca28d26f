// `actorpipe train` on every process a cluster's launcher started: each rank starts a node and
// announces it in the launcher's store; rank 0 lays the stages over the nodes and drives them
// (its own node among them), then tells the others how the job ended.
#include "cli/train_cluster.hpp"

#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>

#include <unistd.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/node.hpp>
#include <actorpipe/training.hpp>

#include "cli/launch_command.hpp"
#include "comm/tensor_hub.hpp"

namespace actorpipe::cli {
namespace {

bool loopback(const std::string& host) {
  return host.rfind("127.", 0) == 0 || host == "localhost";
}

// This rank's node: on the address the others reach this host by, any free ports, the secret
// and certificates every rank was given.
node_options node_options_for(const train_args& a, const training::cluster_world& w,
                              const std::string& host) {
  node_options o;
  o.host = host;
  o.secret = secret_from(a.secret_file);
  o.tls = a.pipeline.placement.tls;
  ACTORPIPE_CHECK(loopback(host) || !o.secret.empty() || o.tls.enabled(), "rank ", w.rank,
                  " listens on ", host,
                  " for the other hosts, which needs the same secret on "
                  "every rank (--secret-file FILE, or the variable ACTORPIPE_SECRET) or TLS "
                  "(--tls-cert, --tls-key, --tls-ca)");
  // Gloo (the replicas' collectives) binds to the same address unless told an interface.
  if (!std::getenv("ACTORPIPE_GLOO_IFNAME") && !std::getenv("GLOO_SOCKET_IFNAME")) {
    ::setenv("ACTORPIPE_GLOO_HOST", host.c_str(), 1);
  }
  return o;
}

// A launcher's restart continues from the newest checkpoint in --checkpoint-dir, if any.
void resume_after_restart(train_args& a, const training::cluster_world& w) {
  if (w.attempt == 0 || a.train.checkpoint_dir.empty() || !a.train.resume.empty()) {
    return;
  }
  try {
    auto found = find_checkpoint(a.train.checkpoint_dir);
    a.train.resume = a.train.checkpoint_dir;
    std::cerr << "actorpipe: restart " << w.attempt << " of the group (" << w.launcher
              << "): resuming from " << found << "\n";
  } catch (const invalid_argument&) {
    std::cerr << "actorpipe: restart " << w.attempt << " of the group (" << w.launcher
              << "): no checkpoint in " << a.train.checkpoint_dir << " yet, starting over\n";
  }
}

// Rank 0: the driver, with every rank's node (its own too) as --nodes.
int drive(const train_args& given, const training::cluster_world& w,
          training::cluster_rendezvous& meeting, const std::string& host) {
  auto a = given;
  auto laid = training::lay_out(meeting.gather(), a.plan.stages);
  for (const auto& m : laid) {
    a.pipeline.placement.nodes.push_back(m.node);
  }
  // The replicas' stages meet at a store the driver serves (the launcher's may be its agent's).
  a.master_addr = host;
  a.master_port = free_port(host);
  // Below here this process is a driver with --nodes, not one of the launcher's ranks.
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"}) {
    ::unsetenv(name);
  }
  resume_after_restart(a, w);
  std::cerr << "actorpipe: " << w.size << " ranks (" << w.launcher << "): " << a.plan.stages
            << " stages x " << a.replicas << " replicas, one stage per rank; rank 0 (pid "
            << ::getpid() << ") drives; " << training::describe_layout(laid, a.plan.stages) << "\n";
  return run_train(a);
}

} // namespace

std::string secret_from(const std::string& secret_file) {
  if (!secret_file.empty()) {
    return comm::read_secret_file(secret_file);
  }
  const char* text = std::getenv("ACTORPIPE_SECRET");
  return text ? text : "";
}

std::optional<training::cluster_world> cluster_world_for(const train_args& a) {
  auto world = training::cluster_from_env();
  if (!world || world->size == 1 || !a.given || !a.given("--replicas") ||
      !a.pipeline.placement.nodes.empty()) {
    return std::nullopt;
  }
  for (const char* flag : {"--world-size", "--rank"}) {
    ACTORPIPE_CHECK(!a.given(flag), flag, " does not apply under ", world->launcher,
                    " with --replicas: the launcher's ", world->size_variable,
                    " processes hold the stages, one each");
  }
  if (!a.master_addr.empty()) {
    world->store_host = a.master_addr;
  }
  if (a.master_port > 0) {
    ACTORPIPE_CHECK(a.master_port <= 65535, "--master-port (", a.master_port,
                    ") must be in [1, 65535]");
    world->store_port = static_cast<uint16_t>(a.master_port);
  }
  ACTORPIPE_CHECK(a.plan.stages > 0, "--stages auto plans one machine's cores: under ",
                  world->launcher, " with --replicas give --stages");
  training::check_world_fits(*world, a.plan.stages, a.replicas);
  return world;
}

int run_train_in_cluster(const train_args& a, const training::cluster_world& w) {
  const auto host = training::address_toward(w.store_host, w.store_port);
  auto options = node_options_for(a, w, host);
  training::cluster_rendezvous meeting(w, a.pipeline.data_parallel.timeout);
  node hosted(options);
  meeting.announce({w.rank, w.local_rank, host, hosted.address()});
  if (w.rank == 0) {
    training::cluster_rendezvous::outcome end;
    try {
      end.code = drive(a, w, meeting, host);
    } catch (const std::exception& e) {
      end = {dynamic_cast<const invalid_argument*>(&e) ? 2 : 1, e.what()};
      meeting.finish(end);
      throw;
    }
    meeting.finish(end);
    return end.code;
  }
  std::cerr << "actorpipe: rank " << w.rank << " of " << w.size << " (" << w.launcher << ", pid "
            << ::getpid() << ") hosts a stage at " << hosted.address() << "; rank 0 drives\n";
  auto end = meeting.wait_for_end();
  if (end.code != 0) {
    std::cerr << "actorpipe: rank 0 ended the job with code " << end.code
              << (end.message.empty() ? "" : ": " + end.message) << "\n";
  }
  return end.code;
}

} // namespace actorpipe::cli
