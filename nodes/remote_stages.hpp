/// \file
/// The scheduler side of distributed nodes: reaching and authenticating nodes, having each build
/// its stages and wiring them, one local proxy actor per remote stage (nodes/stage_proxy.hpp:
/// it speaks the stage actor's protocol to the scheduler, so the scheduler does not know where
/// its stages live), and asking nodes whether they answer.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>

#include <actorpipe/options.hpp>
#include <actorpipe/partition.hpp>
#include <actorpipe/results.hpp>

#include "actors/messages.hpp"
#include "nodes/protocol.hpp"

namespace actorpipe::comm {
class tensor_hub;
}

namespace actorpipe::nodes {

/// Stages placed on nodes, as the scheduler sees them.
struct remote_stages {
  /// One proxy per stage actor, in order.
  std::vector<actors::stage_actor> proxies;
  /// Where the nodes' output and state frames arrive.
  std::shared_ptr<comm::tensor_hub> hub;
  /// The nodes reached, by "host:port" (authenticated).
  std::map<std::string, caf::actor> nodes;
  /// Where each stage actor takes frames, in order.
  std::vector<endpoint> data;
};

/// Connects to every node of options.placement (authenticating with its secret), has each
/// build its stage of `model` cut by `cut` (options.chunks parts each), wires the stages to
/// each other and spawns the proxies reporting to `scheduler`. With replicas
/// (options.data_parallel), each stage forms its group with the other replicas' same stage
/// under `group_prefix`. Throws pipeline_error naming the node on any failure, after releasing
/// the stages already built.
remote_stages connect_stages(caf::actor_system& sys, const remote_model& model,
                             const partition& cut, const pipeline_options& options,
                             std::size_t threads, const actors::stage_listener_actor& scheduler,
                             const std::string& group_prefix = {});

/// The actor published at host:port (a node's, or a driver's join listener), reached within
/// `timeout`: remote_actor blocks (a SYN to a silent host waits minutes, a plain peer of a TLS
/// node for ever), so it runs on a thread of its own. Throws pipeline_error naming host:port.
caf::actor reach(caf::actor_system& sys, const std::string& host, uint16_t port, bool tls,
                 std::chrono::milliseconds timeout);

/// For each of `addresses`, whether its node answers: a node in `known` is asked over its
/// connection for a heartbeat within placement.heartbeat_timeout (a hello within
/// connect_timeout when heartbeats are off), any other is reached and greeted within
/// connect_timeout. All are asked at once, so the whole costs one deadline at most.
/// `quiet`: a node that does not answer is logged at debug level, not as a warning (asked again
/// and again, as pipeline::rejoin_nodes() asks the lost ones).
std::vector<bool> answering(caf::actor_system& sys, const std::vector<std::string>& addresses,
                            const std::map<std::string, caf::actor>& known,
                            const node_placement& placement, bool quiet = false);

/// Kept snapshots (nodes/kept_snapshots.cpp), `nodes[i]` the node of stage i:
/// snapshot `number` came whole to the driver: each node keeps its stage's copy, with `note`.
/// Where `data` is given (each stage's data endpoint), each node also sends its copy to its
/// neighbour, the next node in stage order (round) that is another, which holds it beside its
/// own: a node lost with the driver loses nothing. Sent, not waited for.
void keep_snapshot(caf::actor_system& sys, const std::vector<caf::actor>& nodes,
                   const std::vector<endpoint>& data, uint64_t number, const std::string& note);
/// One snapshot of one stage actor that a node keeps: its own stage's, or a neighbour's (copy).
struct kept_stage {
  uint32_t stage = 0;
  uint64_t number = 0;
  std::string note;
  bool copy = false;
};
/// What each node keeps, of whichever stages it held: a node keeps the newest snapshot of every
/// stage index it hosted, so after a recovery or a rejoin placed stages anew it can keep another
/// stage's than it hosts now. Empty for a node that keeps nothing or did not answer within
/// `timeout` (all are asked at once).
std::vector<std::vector<kept_stage>> kept_by(caf::actor_system& sys,
                                             const std::vector<caf::actor>& nodes,
                                             std::chrono::milliseconds timeout);
/// Stage `index`'s kept snapshot `number` goes from the node `from` that keeps it (its own, or
/// the copy it holds of a lost neighbour's) to the node `to`, whose data port is `to_data`: `to`
/// holds it as a copy, with `note`, for restore_kept (which on `to` waits for the copy's bytes
/// while they are on their way). False when `to` keeps no copies or `from` does not keep it,
/// each asked within `timeout`.
bool hand_over_kept(caf::actor_system& sys, const caf::actor& from, const caf::actor& to,
                    const endpoint& to_data, uint32_t index, uint64_t number,
                    const std::string& note, std::chrono::milliseconds timeout);
/// Every stage loads kept snapshot `number` on its node, all at once, each within `timeout`;
/// throws pipeline_error (io) naming the first stage that did not and its node (`addresses[i]`).
void restore_kept(caf::actor_system& sys, const std::vector<caf::actor>& nodes,
                  const std::vector<std::string>& addresses, uint64_t number,
                  std::chrono::milliseconds timeout);

} // namespace actorpipe::nodes
