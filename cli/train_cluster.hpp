/// \file
/// `actorpipe train` under a cluster's launcher (torchrun, srun) with `--replicas`: the same
/// command on every process; rank 0 drives, every rank hosts one stage of the world's
/// stages x replicas, met through the launcher's c10d store (training/cluster.hpp).
#pragma once

#include <optional>

#include "cli/train_command.hpp"
#include "training/cluster.hpp"

namespace actorpipe::cli {

/// The world when `a` lays stages over a launcher's ranks: a launcher's world of more than one
/// process, --replicas given and no --nodes. Otherwise nothing (a launcher's ranks without
/// --replicas are whole pipelines each, data parallel, as before).
std::optional<training::cluster_world> cluster_world_for(const train_args& a);

/// Runs this rank's part: rank 0 the driver and a node, the others a node until rank 0 ends
/// the job. Returns the exit code (the driver's, on every rank).
int run_train_in_cluster(const train_args& a, const training::cluster_world& world);

} // namespace actorpipe::cli
