/// \file
/// Vocabulary: what a training step reports (per stage and per action), as plain values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <actorpipe/actions.hpp>

namespace actorpipe {

/// One action as it ran. Times in milliseconds from the step's start (one clock for all stages
/// of a process).
struct action_record {
  action what;
  double start_ms = 0;
  double end_ms = 0;
  /// Bytes of the tensors sent to the neighbour (0 when nothing was sent).
  int64_t bytes_sent = 0;
  /// A stage on a GPU: when the action's work ran on the stage's stream, on the same axis (CUDA
  /// events; the host's times above are when it was queued). Negative where not measured.
  double device_start_ms = -1;
  double device_end_ms = -1;
};

/// What one stage did during a step. Times in milliseconds on the stage's own clock.
struct stage_stats {
  std::size_t stage = 0;
  double forward_ms = 0;
  double backward_ms = 0;
  /// Time spent waiting for inputs (activations or gradients) while the program was not done.
  double wait_ms = 0;
  double optimizer_ms = 0;
  /// The stage stepped its optimizers as soon as its program had run, before the update
  /// confirmed the step (pipeline_options::optimistic_update).
  bool early_update = false;
  /// Overlapping steps (pipeline_options::overlap_steps): the stage started this step before the
  /// scheduler had confirmed the step before (its first actions ran beside other stages' last).
  bool overlapped = false;
  /// Most micro-batches held stashed at once during the step (a chunk's entry counts 1/chunks).
  double peak_stash = 0;
  /// Most bytes stashed at once during the step (an actor's chunks counted together, at the
  /// same moment): the inputs of the micro-batches between forward and backward and the
  /// activations their graphs keep (a recomputed micro-batch keeps its input only until its
  /// backward rebuilds the rest; a split backward's B adds the gradients it keeps for W): the
  /// bytes its forwards allocated and did not free, on the CPU and on a GPU alike.
  int64_t peak_stash_bytes = 0;
  /// A stage on the CPU: the most one action needed during the step beyond the most it kept
  /// (peak_stash_bytes): a forward's temporaries, a backward's input gradients and
  /// temporaries (its own allocations at their peak, less the parameters' gradients it made),
  /// as the planner predicts it (memory_estimate::working, docs/memory.md). -1 on a GPU, where
  /// device_peak_bytes counts it.
  int64_t peak_working_bytes = 0;
  /// A stage on a GPU it has to itself (within its process): the most bytes the CUDA caching
  /// allocator held allocated on it at once from the step's start to the stage's report
  /// (parameters, gradients, optimizer state, stash, the working set of every action, the
  /// cuBLAS workspace; the optimizer step after the report is not included). -1 elsewhere.
  int64_t device_peak_bytes = -1;
  /// Forwards that kept only their input, recomputed at backward (pipeline_options::recompute).
  std::size_t recomputed = 0;
  /// Every action in the order it ran.
  std::vector<action_record> actions;
  /// Data parallelism: the gradient (and buffer) sync with the other replicas after the
  /// stage's last backward, in milliseconds from the step's start; bytes all-reduced.
  double sync_start_ms = 0;
  double sync_end_ms = 0;
  int64_t sync_bytes = 0;
  /// Training: bytes of optimizer state the stage held as its program ended (the steps before
  /// made it; under data_parallel_options::shard, this replica's part), and of parameter
  /// gradients after the replica sync (shard_mode::gradients: this replica's own parameters').
  int64_t optimizer_bytes = 0;
  int64_t gradient_bytes = 0;
};

/// Calls `f(name, field)` for every field of `s` but its actions, in order: the one list that a
/// node's report (written and read back), `actorpipe train --json` and Python's stats are made
/// from, so that a figure added to stage_stats reaches all of them.
template <class Stats, class F>
void visit_scalars(Stats& s, F&& f) {
  f("stage", s.stage);
  f("forward_ms", s.forward_ms);
  f("backward_ms", s.backward_ms);
  f("wait_ms", s.wait_ms);
  f("optimizer_ms", s.optimizer_ms);
  f("early_update", s.early_update);
  f("overlapped", s.overlapped);
  f("peak_stash", s.peak_stash);
  f("peak_stash_bytes", s.peak_stash_bytes);
  f("peak_working_bytes", s.peak_working_bytes);
  f("device_peak_bytes", s.device_peak_bytes);
  f("recomputed", s.recomputed);
  f("sync_start_ms", s.sync_start_ms);
  f("sync_end_ms", s.sync_end_ms);
  f("sync_bytes", s.sync_bytes);
  f("optimizer_bytes", s.optimizer_bytes);
  f("gradient_bytes", s.gradient_bytes);
}

/// The outcome of a training step.
struct step_result {
  /// 1-based step counter of this pipeline.
  uint64_t step = 0;
  /// The full-batch loss: micro-batch losses combined with the same scales as the gradients
  /// (with replicas: over all replicas' samples).
  double loss = 0;
  /// The global gradient norm before clipping (0 unless max_grad_norm > 0).
  double grad_norm = 0;
  /// Wall time from the request to the last optimizer step, in milliseconds.
  double wall_ms = 0;
  /// train(): how long the loop waited for this step's batch before asking for the step, in
  /// milliseconds (about 0 when a loader prepared it ahead); empty when not measured.
  std::optional<double> data_wait_ms;
  /// How the step's schedule placed the stages' chunks (which virtual stage each chunk was).
  chunk_placement placement = chunk_placement::looped;
  std::vector<stage_stats> stages;
};

/// A snapshot the nodes kept (pipeline::kept_on_nodes(), pipeline::restore_from_nodes()): its
/// number, the note it was taken with, and where: the node keeping stage actor i's part at i, and
/// the cut it was taken on. After a recovery or a rejoin these can differ from the nodes' order
/// and the cut the pipeline was built with.
struct kept_snapshot {
  uint64_t number = 0;
  std::string note;
  std::vector<std::string> nodes;
  std::vector<std::size_t> bounds;
};

/// What pipeline::recover() (or replicated_pipeline::recover()) did after a step failed on nodes.
struct recovery_report {
  /// The nodes ("host:port") that did not answer, in placement order.
  std::vector<std::string> lost;
  /// The spares that took over a lost node's stages.
  std::vector<std::string> spares_used;
  /// One node per stage actor now (with replicas: every replica's, replica after replica), and
  /// the partition now (another stage count when the pipeline shrank onto the survivors).
  std::vector<std::string> nodes;
  std::vector<std::size_t> bounds;
  /// Which snapshot every stage was restored from: pipeline::snapshot()'s number (0: the state
  /// the pipeline was built or last loaded with).
  uint64_t snapshot = 0;
  /// From the call to the restored pipeline, in seconds.
  double seconds = 0;
  /// Replicas (replicated_pipeline::recover()): the ranks, as they were numbered before, that
  /// lost a node no spare replaced and left, and how many replicas train now (the others
  /// renumbered 0, 1, ... in their old order). Without replicas: none left, 1.
  std::vector<std::size_t> replicas_left;
  std::size_t replicas = 1;
  /// Replicas: the replica (its rank before the loss) whose stages' live state every stage took,
  /// the state of the last completed step, made snapshot `snapshot`; nothing is replayed. -1:
  /// restored from the newest snapshot taken before the loss.
  int64_t from_replica = -1;
  /// from_replica >= 0, where the failed step had completed on that replica (its all-reduce had
  /// every replica's gradients; another replica failed after it): its result. The state taken is
  /// then that step's, and the step is not taken again.
  std::optional<step_result> failed_step;
  /// Without replicas, on the same cut: the snapshot came from the nodes, each survivor loading
  /// the part it keeps and each spare the copy that its lost node's neighbour keeps (sent node to
  /// node), not from the driver's memory. False: the driver's (the model cut anew, or the nodes
  /// did not keep it whole; the log says why).
  bool from_nodes = false;
  /// rejoin_nodes() (a pipeline's or replicas'): the nodes lost before that answered again, now
  /// holding stages again or standing by as spares (`spares_used` lists those); `lost` is then
  /// empty.
  std::vector<std::string> rejoined;
  /// rejoin_nodes(): new nodes that joined (node_options::join), taken as those are.
  std::vector<std::string> joined;
};

} // namespace actorpipe
