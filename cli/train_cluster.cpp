// `actorpipe train` on every process a cluster's launcher started: each rank starts a node and
// announces it in the launcher's store; rank 0 lays the stages over the nodes and drives them
// (its own node among them), then tells the others how the job ended.
#include "cli/train_cluster.hpp"

#include <cstdlib>
#include <exception>
#include <iostream>

#include <unistd.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/training.hpp>

namespace actorpipe::cli {
namespace {

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
int drive(const train_args& given, training::cluster_rank& me) {
  auto a = given;
  a.run.pipeline.placement.nodes = me.gather_nodes(a.run.plan.stages, a.replicas);
  // The replicas' stages meet at a store the driver serves (the launcher's may be its agent's).
  a.master_addr = me.host();
  a.master_port = me.replica_store_port();
  // Below here this process is a driver with --nodes, not one of the launcher's ranks.
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"}) {
    ::unsetenv(name);
  }
  resume_after_restart(a, me.world());
  return run_train(a);
}

} // namespace

std::optional<training::cluster_world> cluster_world_for(const train_args& a) {
  auto world = training::cluster_from_env();
  if (!world || world->size == 1 || !a.given || !a.given("--replicas") ||
      !a.run.pipeline.placement.nodes.empty()) {
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
  ACTORPIPE_CHECK(a.run.plan.stages > 0, "--stages auto plans one machine's cores: under ",
                  world->launcher, " with --replicas give --stages");
  training::check_world_fits(*world, a.run.plan.stages, a.replicas);
  return world;
}

int run_train_in_cluster(const train_args& a, const training::cluster_world& w) {
  training::cluster_rank me(w, training::secret_from(a.secret_file), a.run.pipeline.placement.tls,
                            a.run.pipeline.data_parallel.timeout,
                            "--secret-file FILE, or the variable ACTORPIPE_SECRET");
  if (w.rank != 0) {
    return me.host_until_end();
  }
  try {
    auto code = drive(a, me);
    me.finish(code, "");
    return code;
  } catch (const std::exception& e) {
    me.finish(dynamic_cast<const invalid_argument*>(&e) ? 2 : 1, e.what());
    throw;
  }
}

} // namespace actorpipe::cli
