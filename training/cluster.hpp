/// \file
/// A cluster's world: the launcher's variables (torchrun's, else Slurm's) read once into one
/// value, the rule that lays a run's stages and replicas over its ranks, and the rendezvous of
/// those ranks through c10d's TCPStore (the store MASTER_ADDR:MASTER_PORT names; no store of
/// ours). Front ends derive the roles from it: rank 0 drives, every rank hosts a stage.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <actorpipe/tls.hpp>

namespace actorpipe {
class node;
}

namespace actorpipe::training {

/// Where this process stands among the processes a launcher started.
struct cluster_world {
  /// Whose variables these are: "torchrun" (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
  /// MASTER_PORT, TORCHELASTIC_*: torchrun, Kubeflow's torch runtime, JobSet, `actorpipe
  /// launch`) or "slurm" (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST, as srun
  /// sets them).
  std::string launcher;
  std::size_t rank = 0;
  std::size_t size = 1;
  std::size_t local_rank = 0;
  /// The store's address: MASTER_ADDR and MASTER_PORT; under Slurm without them, the first host
  /// of SLURM_JOB_NODELIST and 15000 + the job id's last four digits (Lightning's rule).
  std::string store_host;
  uint16_t store_port = 29500;
  /// The launcher serves the store (torchrun's agent, TORCHELASTIC_USE_AGENT_STORE=True): every
  /// rank is a client of it. Otherwise rank 0 serves it.
  bool launcher_store = false;
  /// How often the launcher has restarted the group (TORCHELASTIC_RESTART_COUNT,
  /// SLURM_RESTART_COUNT): keys are kept apart per attempt, and a restart resumes.
  std::size_t attempt = 0;
  /// The variable that held the world size, for messages ("WORLD_SIZE", "SLURM_NTASKS").
  std::string size_variable;
};

/// A variable's value, or null when unset (std::getenv; tests pass their own).
using environment = std::function<const char*(const char*)>;

/// torchrun's variables when RANK and WORLD_SIZE are set, else Slurm's when SLURM_PROCID and
/// SLURM_NTASKS are, else nothing. A malformed value throws invalid_argument naming the variable.
std::optional<cluster_world> cluster_from(const environment& env);
std::optional<cluster_world> cluster_from_env();

/// The first host of a Slurm node list ("gpu[07-09,12],cpu1" -> "gpu07").
std::string first_slurm_host(const std::string& nodelist);

/// One rank as it announced itself at the rendezvous.
struct cluster_member {
  std::size_t rank = 0;
  std::size_t local_rank = 0;
  /// The address other hosts reach this rank by (its host's identity in the layout).
  std::string host;
  /// "host:port" of the node this rank runs (its control listener).
  std::string node;
};

/// Refuses (invalid_argument, naming both numbers and the variable) a world of `world.size`
/// processes that cannot hold `stages` x `replicas` stages, one per process.
void check_world_fits(const cluster_world& world, std::size_t stages, std::size_t replicas);

/// The members in the order of `stages` x `replicas` stage actors, replica after replica
/// (node_placement's order): hosts in the order of their lowest rank, each host's ranks by local
/// rank; slot i is stage i % stages of replica i / stages. A replica's stages so share a host
/// whenever each host runs a multiple of `stages` processes.
std::vector<cluster_member> lay_out(std::vector<cluster_member> members, std::size_t stages);

/// "replica 0 on HOST (ranks 0, 1), replica 1 on ..." for a layout.
std::string describe_layout(const std::vector<cluster_member>& laid, std::size_t stages);

/// The address of this host's interface that routes to `host` (where the store is), as the
/// other ranks reach this one; ACTORPIPE_HOST overrides it. Loopback for a loopback `host`.
std::string address_toward(const std::string& host, uint16_t port);

/// The ranks' meeting place in the launcher's store, under `actorpipe/attempt_<n>/`. Rank 0
/// gathers every member and, at the end, says how the job ended; the others wait for that
/// while they host their stages. Every wait has a deadline and names who is missing.
class cluster_rendezvous {
public:
  /// Connects to (or, as rank 0 without a launcher's store, serves) the store; `timeout` bounds
  /// the connection, the gathering, and the silence of a driver that stopped beating.
  cluster_rendezvous(const cluster_world& world, std::chrono::milliseconds timeout);
  ~cluster_rendezvous();
  cluster_rendezvous(const cluster_rendezvous&) = delete;
  cluster_rendezvous& operator=(const cluster_rendezvous&) = delete;

  void announce(const cluster_member& me);
  /// Rank 0: every rank's member, by rank, once all have announced.
  std::vector<cluster_member> gather();

  /// How the job ended, as rank 0 tells it.
  struct outcome {
    int code = 0;
    std::string message;
  };
  /// Rank 0: tells every rank the job ended, then waits (within the timeout) until each has
  /// read it, since the store may be this process's and go with it.
  void finish(const outcome& end);
  /// Every other rank: waits until rank 0 finishes, asking about every 200 ms. Throws
  /// pipeline_error when the store goes away or rank 0 stops beating for the timeout.
  outcome wait_for_end();

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

/// A port nobody listens on now at `addr` (the kernel's pick for an ephemeral bind; any address
/// when `addr` is no IPv4 address), or 0 when none can be had.
uint16_t free_port(const std::string& addr);

/// The nodes' shared secret: the file's (`secret_file`, mode 600), else the text of the variable
/// ACTORPIPE_SECRET (a secret a cluster hands out as a variable), else none.
std::string secret_from(const std::string& secret_file);

/// This process as one rank of a cluster run: its node (on the address the other hosts reach it
/// by, any free ports, the secret or certificates every rank was given), announced at the
/// rendezvous. Front ends derive the roles: rank 0 drives (gather_nodes, finish), the others
/// host their stage until it ends the job (host_until_end).
class cluster_rank {
public:
  /// Refuses (invalid_argument) to listen beyond loopback with neither a secret nor TLS;
  /// `secret_ways` says where a secret comes from, for that message.
  cluster_rank(const cluster_world& world, const std::string& secret, const tls_options& tls,
               std::chrono::milliseconds timeout, const std::string& secret_ways);
  ~cluster_rank();

  const cluster_world& world() const { return world_; }
  /// The address the other hosts reach this one by.
  const std::string& host() const { return host_; }
  /// A free port at host() (free_port) for the store rank 0 serves its replicas.
  uint16_t replica_store_port() const;
  /// Rank 0: every rank's node, laid out for `stages` x `replicas` (lay_out), the layout said.
  std::vector<std::string> gather_nodes(std::size_t stages, std::size_t replicas);
  /// Rank 0: tells every rank the job ended (once; later calls do nothing).
  void finish(int code, const std::string& message);
  /// Every other rank: hosts its stage until rank 0 ends the job; rank 0's code.
  int host_until_end();

private:
  cluster_world world_;
  std::string host_;
  std::unique_ptr<node> hosted_;
  std::unique_ptr<cluster_rendezvous> meeting_;
  bool finished_ = false;
};

} // namespace actorpipe::training
