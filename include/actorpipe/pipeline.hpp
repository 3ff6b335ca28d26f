/// \file
/// The embedding API: an engine (the actor system), and pipelines that train and evaluate a
/// layer list cut into stage actors. CAF stays behind this header.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>
#include <torch/optim/optimizer.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/models.hpp>
#include <actorpipe/partition.hpp>
#include <actorpipe/schedule.hpp>
#include <actorpipe/tls.hpp>

namespace actorpipe {

/// Computes a micro-batch's loss from the last stage's output and the micro-batch's target.
/// Called on the last stage's thread.
using loss_function =
  std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

/// Makes a stage's optimizer over that stage's parameters. Called once per stage.
using optimizer_factory =
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor> parameters)>;

/// SGD with the given learning rate, momentum and weight decay.
optimizer_factory sgd(double lr, double momentum = 0.0, double weight_decay = 0.0);

/// Adam with the given learning rate.
optimizer_factory adam(double lr);

/// An optimizer described by value, so that a node in another process can build it.
struct optimizer_spec {
  /// "sgd" or "adam".
  std::string name = "sgd";
  double lr = 0.05;
  /// SGD only.
  double momentum = 0;
  double weight_decay = 0;
};

/// The factory an optimizer_spec describes; throws invalid_argument for an unknown name.
optimizer_factory make_optimizer(const optimizer_spec& spec);

/// A built-in loss, mean over the micro-batch: "mse" (targets shaped like the outputs) or
/// "cross_entropy" (class-index targets). Throws invalid_argument for an unknown name.
loss_function builtin_loss(const std::string& name);

/// Where a hook runs.
struct hook_context {
  /// The stage actor and, with interleaved schedules, the local chunk.
  std::size_t stage = 0;
  std::size_t chunk = 0;
  int32_t microbatch = 0;
  uint64_t step = 0;
  /// False in forward-only passes.
  bool train = true;
};

/// Per-stage hooks (as torchgpipe and the pipeline library actorpipe grew from allow), called on
/// the stage's thread. A hook may read the tensor or replace it with one of the same shape (for
/// instance to clip, quantise or record it). A hook that throws fails the step like any stage
/// error, naming the stage.
struct stage_hooks {
  /// After a stage's forward of a micro-batch, with its output (the activation about to be sent
  /// to the next stage, or the last stage's output in forward-only passes). Not called with the
  /// last stage's loss in training.
  std::function<void(const hook_context&, torch::Tensor& output)> after_forward;
  /// After a stage's backward of a micro-batch, with the gradient of its input about to be sent
  /// to the previous stage (not called on the first stage, which sends none).
  std::function<void(const hook_context&, torch::Tensor& input_gradient)> after_backward;
};

/// How the loss function reduces over a micro-batch, which decides how micro-batch losses are
/// scaled so that accumulated gradients equal the full batch's.
enum class loss_reduction {
  /// The loss is a mean over samples: micro-batch k of n_k samples is scaled by n_k / batch.
  mean,
  /// The loss is a sum over samples: micro-batch losses are added unscaled.
  sum,
};

/// What replicas do with buffers (batch-norm running statistics, "computed params") after
/// each step.
enum class buffer_sync {
  /// Every replica takes rank 0's buffers (as DDP's broadcast_buffers).
  broadcast,
  /// Floating-point buffers are averaged over replicas; integer ones (counters) are equal.
  average,
  /// Each replica keeps its own.
  none,
};

namespace detail {
/// An in-process rendezvous store shared by replicas of one process (see replicated_pipeline).
struct local_store;
} // namespace detail

/// Data parallelism: this pipeline is replica `rank` of `replicas` identical pipelines (each
/// fed its own part of the batch). After its last backward, each stage averages its gradients
/// with the same stage of every other replica over c10d (one Gloo process group per stage
/// index), so R replicas on B/R samples each step exactly like one pipeline on B samples.
struct data_parallel_options {
  /// This replica's rank, 0 <= rank < replicas (RANK).
  std::size_t rank = 0;
  /// Replicas in all (WORLD_SIZE); 1 means no data parallelism.
  std::size_t replicas = 1;
  /// Where rank 0 serves the rendezvous store (MASTER_ADDR, MASTER_PORT).
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  /// Deadline of the rendezvous barrier (a missing rank is named after it) and of every
  /// collective (a replica that died fails the step after it).
  std::chrono::milliseconds timeout{60000};
  /// Gradients are all-reduced in buckets of about this many bytes, last layers first.
  std::size_t bucket_bytes = 25u << 20;
  buffer_sync buffers = buffer_sync::broadcast;
  /// Key prefix in the store, so several replicated pipelines can share one rendezvous.
  std::string group = "actorpipe";
  /// Set by replicated_pipeline for replicas that live in one process; empty for processes.
  std::shared_ptr<detail::local_store> local;
};

/// A built-in model described by value: what a node needs to build its own stage, so that no
/// model code ships. Every node builds the model from the same seed and keeps its part.
struct remote_model {
  /// A make_model name ("resnet50", "mlp", "cnn", ...).
  std::string name;
  model_options options;
  /// torch::manual_seed before the model is built (the same parameters in every process).
  uint64_t seed = 0;
  /// builtin_loss name, used by the last stage.
  std::string loss = "mse";
  optimizer_spec optimizer;
};

/// Where stage actors live when they are not in this process: `actorpipe node` processes.
struct node_placement {
  /// One "host:port" per stage actor (a node may host several); empty: all in this process.
  std::vector<std::string> nodes;
  /// The nodes' shared secret (their --secret-file); may be empty for nodes on loopback.
  std::string secret;
  /// This process's TLS identity, for nodes started with certificates: control and frames
  /// then go over TLS. One identity per engine (its first remote pipeline's).
  tls_options tls;
  /// Deadline for reaching a node and for each control request that is not a step.
  std::chrono::milliseconds connect_timeout{10000};
};

/// Everything a pipeline needs besides its layers and partition.
struct pipeline_options {
  /// Micro-batches per step (m >= 1). The batch is split into m parts whose sizes differ by at
  /// most one (earlier parts take the remainder); the batch must hold at least m samples.
  std::size_t microbatches = 1;
  schedule_kind schedule = schedule_kind::one_f_one_b;
  /// Model chunks per stage actor (interleaved schedule): the partition must then have
  /// stages x chunks parts, and chunk c of actor i holds part c * stages + i.
  std::size_t chunks = 1;
  /// A user-supplied training schedule (e.g. load_schedule(file)); used instead of `schedule`
  /// when not empty, validated before its first step.
  actorpipe::schedule custom_schedule;
  /// Required for train_step.
  loss_function loss;
  loss_reduction reduction = loss_reduction::mean;
  /// Required for train_step.
  optimizer_factory optimizer;
  /// One device per stage; empty means every stage on the CPU.
  std::vector<c10::Device> devices;
  /// Intra-op threads of each stage; 0 means the cores divided evenly among the stages
  /// (at least 1), so stages never oversubscribe the machine.
  std::size_t threads_per_stage = 0;
  /// Stage threads keep freed tensor buffers for their next micro-batches and steps instead of
  /// giving them back to the system (<actorpipe/memory.hpp>); false: libtorch's allocator.
  bool warm_memory = true;
  /// How long a stage waits for an activation or gradient before it fails the step with a
  /// message naming what it waited for. Must exceed the slowest action upstream.
  std::chrono::milliseconds wait_timeout{60000};
  /// Safety net over a whole step (a stage that died or hangs in its own compute).
  std::chrono::milliseconds step_timeout{600000};
  /// Global gradient-norm clipping: when > 0, all gradients of all stages (after the replica
  /// sync, hence of all replicas) are scaled by max_grad_norm / (norm + 1e-6) when that is
  /// below 1, as torch::nn::utils::clip_grad_norm_ does on one model.
  double max_grad_norm = 0;
  /// Replicas of this pipeline (off by default).
  data_parallel_options data_parallel;
  /// Hooks run by every stage (none by default).
  stage_hooks hooks;
  /// Stage actors on `actorpipe node` processes (see the remote_model constructor).
  node_placement placement;
};

/// One action as it ran. Times in milliseconds from the step's start (one clock for all stages
/// of a process).
struct action_record {
  action what;
  double start_ms = 0;
  double end_ms = 0;
  /// Bytes of the tensor sent to the neighbour (0 when nothing was sent).
  int64_t bytes_sent = 0;
};

/// What one stage did during a step. Times in milliseconds on the stage's own clock.
struct stage_stats {
  std::size_t stage = 0;
  double forward_ms = 0;
  double backward_ms = 0;
  /// Time spent waiting for inputs (activations or gradients) while the program was not done.
  double wait_ms = 0;
  double optimizer_ms = 0;
  /// Most micro-batches held stashed at once during the step (a chunk's entry counts 1/chunks).
  double peak_stash = 0;
  /// Every action in the order it ran.
  std::vector<action_record> actions;
  /// Data parallelism: the gradient (and buffer) sync with the other replicas after the
  /// stage's last backward, in milliseconds from the step's start; bytes all-reduced.
  double sync_start_ms = 0;
  double sync_end_ms = 0;
  int64_t sync_bytes = 0;
};

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
  std::vector<stage_stats> stages;
};

/// Owns the actor system that runs stage and scheduler actors. Create one per process and keep
/// it alive longer than its pipelines.
class engine {
public:
  /// `worker_threads` CAF workers serve the scheduler; stage actors run on threads of their own.
  explicit engine(std::size_t worker_threads = 1);
  ~engine();
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  struct impl;
  impl& internals() { return *impl_; }

private:
  std::unique_ptr<impl> impl_;
};

/// A model cut into stage actors plus a scheduler actor that drives them.
///
/// Thread-safety: calls from several threads are queued and run one step at a time in call
/// order. Parameter accessors take each stage's lock and may run during a step.
class pipeline {
public:
  /// Spawns one stage actor per stage of `cut` and a scheduler. The layers' modules are moved to
  /// their stage's device and owned by the stages from now on (the caller's handles alias them).
  /// Throws invalid_argument for an empty model, a partition that does not cover `layers`, a
  /// device count that does not match the stage count, or microbatches == 0.
  pipeline(engine& sys, layer_list layers, partition cut, pipeline_options options);

  /// Places stage actor i on options.placement.nodes[i], an `actorpipe node` process, which
  /// builds its stage from `model` (so no model code ships); activations and gradients go from
  /// node to node, never through this process. The loss and optimizer come from `model`
  /// (options.loss and options.optimizer are ignored). One chunk per stage, no replicas, no
  /// hooks, CPU only. Throws pipeline_error naming the node that cannot be reached, refuses the
  /// secret or cannot build its stage. named_gradients() is not available; named_parameters()
  /// fetches the parameters from the nodes.
  pipeline(engine& sys, remote_model model, partition cut, pipeline_options options);
  ~pipeline();
  pipeline(const pipeline&) = delete;
  pipeline& operator=(const pipeline&) = delete;

  /// Starts one training step on `inputs` (batch dimension first) and `targets`; the future
  /// holds the result or a pipeline_error. Invalid arguments throw before anything runs.
  std::future<step_result> train_step_async(torch::Tensor inputs, torch::Tensor targets);

  /// train_step_async(...).get(), bounded by the step timeout.
  step_result train_step(torch::Tensor inputs, torch::Tensor targets);

  /// A training step on inputs already split into micro-batches (one tensor each, batch
  /// dimension first; as many as pipeline_options::microbatches), e.g. produced scattered by
  /// another pipeline. Losses are scaled by each part's share of all samples.
  step_result train_step(std::vector<torch::Tensor> inputs, std::vector<torch::Tensor> targets);

  /// Forward-only pass (no stash, no gradients), one output per micro-batch on the last stage's
  /// device. A batch smaller than the micro-batch count runs as that many micro-batches.
  std::vector<torch::Tensor> forward_scattered(torch::Tensor inputs);

  /// Forward-only pass with the micro-batch outputs concatenated along dimension 0.
  torch::Tensor forward(torch::Tensor inputs);

  /// Learning rate of every stage's optimizer (all parameter groups) from the next step on.
  /// SGD and Adam; ordered with the steps submitted around it.
  void set_learning_rate(double lr);

  /// Writes every stage's parameters, buffers and optimizer state into `dir` (created when
  /// missing): one file per stage, `stage-<index>.pt`, in libtorch's pickle format, tensors
  /// keyed by layer name ("layer3.0.conv1.weight", "optimizer/fc.weight/momentum_buffer").
  /// Runs between steps, in call order. Throws pipeline_error naming the stage that failed.
  void save_state(const std::string& dir);

  /// Loads what save_state wrote, from a pipeline of the same model cut any way: every
  /// `stage-*.pt` file in `dir` is read and each stage takes its layers' tensors. Everything is
  /// checked (missing, unknown or misshapen tensors) before any stage changes; pipeline_error
  /// names the tensor otherwise.
  void load_state(const std::string& dir);

  /// The training schedule for the configured micro-batch count (built in or custom).
  actorpipe::schedule training_schedule() const;

  /// Stage actors (the partition's parts divided by chunks).
  std::size_t stages() const;
  const partition& cut() const;
  /// Parameter elements per stage actor.
  std::vector<int64_t> stage_parameter_counts() const;

  /// Copies of all parameters named "<layer>.<parameter>", in model order.
  std::vector<std::pair<std::string, torch::Tensor>> named_parameters() const;
  /// Copies of all gradients of the last step (undefined where a parameter got none).
  std::vector<std::pair<std::string, torch::Tensor>> named_gradients() const;

  struct impl;

private:
  std::unique_ptr<impl> impl_;
};

} // namespace actorpipe
