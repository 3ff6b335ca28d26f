// The door to a pipeline for its recovery: where its stages are, its state, and to stop, be
// placed and restore. A single pipeline's recovery (pipeline_recovery.cpp) and a set of
// replicas' (replicas_recovery.cpp) reach pipeline::impl through it alone; engine/
// pipeline_snapshots.cpp answers it. Private to engine/.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

#include <actorpipe/options.hpp>
#include <actorpipe/pipeline.hpp>

#include "engine/recovery/membership.hpp"
#include "nodes/protocol.hpp"
#include "stages/checkpoint.hpp"

namespace actorpipe::recovery {

// The key to pipeline::placed(): a type complete only inside engine/, so only it makes one.
class access {};

// One replica's pipeline as its recovery drives it.
class placed_stages {
public:
  explicit placed_stages(pipeline::impl& p) : p_(&p) {}

  // Where it is: whether its stages are on nodes, its options (the placement's nodes are its
  // stage actors', in stage order), the nodes it reached and its cut's bounds.
  bool on_nodes() const;
  // Whether it is one of a set of replicas (which recover together).
  bool replicated() const;
  const pipeline_options& options() const;
  const std::map<std::string, caf::actor>& reached() const;
  const std::vector<std::size_t>& bounds() const;
  const partition& cut() const;
  // The model as given (a cut anew by parameters counts them).
  const layer_list& layers() const;
  caf::actor_system& system() const;
  // The node of each stage actor, in stage order, and where each takes frames.
  std::vector<caf::actor> stage_nodes() const;
  const std::vector<nodes::endpoint>& stage_data() const;
  // The nodes beyond those its stages are on now.
  membership& members();

  // The snapshots it keeps (replica 0's are the replicas'), after the one still arriving came
  // or failed.
  recovery::snapshots& settled_snapshots();
  // The same, as they are (a snapshot still arriving is left to arrive).
  recovery::snapshots& kept_snapshots();
  // Every stage's state now (`what` names the caller in errors).
  std::shared_ptr<const stages::tensor_map> fetch(const char* what);

  // Its stage actors and scheduler go (their nodes drop the stages); it stays out of its
  // replicas' process groups too when `leave_replicas`.
  void stop(bool leave_replicas = false);
  // Placed as replica `rank` of `world` on `nodes` (one per stage actor), to be started.
  void move_to(std::vector<std::string> nodes, std::size_t rank, std::size_t world);
  // Meets the other replicas, places its stages and restores `state` (snapshot `number`).
  void start(const std::shared_ptr<const stages::tensor_map>& state, uint64_t number);
  // Stopped, its stages placed on `nodes` (one per stage actor) cut by `cut`, to be restored.
  void place(std::vector<std::string> nodes, partition cut);
  // Every stage takes its tensors from `state` (snapshot `number`; null: nothing to restore).
  void restore(const std::shared_ptr<const stages::tensor_map>& state, uint64_t number,
               const char* what);
  // The spares the next recovery's census asks; one more at their end (unless among them).
  void set_spares(std::vector<std::string> spares);
  void add_spare(const std::string& node);
  // The nodes that joined since it last asked, taken into its membership.
  void take_joined();

private:
  pipeline::impl* p_;
};

inline placed_stages placed(pipeline& p) {
  return p.placed(access{});
}

} // namespace actorpipe::recovery
