/// \file
/// Vocabulary: everything a pipeline is configured with, as plain values (no CAF, no engine):
/// loss and optimizer factories, hooks, data parallelism, placement on nodes, TLS identities,
/// built-in model options, and pipeline_options, which gathers them. Every layer may include
/// this header; the functions that make factories are in <actorpipe/optimizers.hpp>.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
// Also gives std::unique_ptr and std::shared_ptr (the optimizer interface returns them).
#include <torch/optim/optimizer.h>

#include <actorpipe/actions.hpp>
#include <actorpipe/errors.hpp>

namespace actorpipe {

/// Computes a micro-batch's loss from the last stage's output and the micro-batch's target.
/// Called on the last stage's thread.
using loss_function =
  std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

/// A loss that also sees the micro-batch's inputs: the part of the tensor given to train_step
/// that went into stage 0 (a reconstruction loss, a loss masked by the input's padding). Called
/// on the last stage's thread.
using loss_with_inputs_function = std::function<torch::Tensor(
  const torch::Tensor& output, const torch::Tensor& target, const torch::Tensor& inputs)>;

/// Makes a stage's optimizer over that stage's parameters. Called once per stage.
using optimizer_factory =
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor> parameters)>;

/// An optimizer described by value, so that a node in another process can build it
/// (make_optimizer in <actorpipe/optimizers.hpp>).
struct optimizer_spec {
  /// "sgd", "adam" or "adamw".
  std::string name = "sgd";
  double lr = 0.05;
  /// SGD only.
  double momentum = 0;
  double weight_decay = 0;
  /// SGD only: Nesterov momentum (needs momentum > 0, as torch.optim.SGD).
  bool nesterov = false;
};

/// What a built-in model is built for (make_model in <actorpipe/models.hpp>).
struct model_options {
  /// Output classes.
  int64_t num_classes = 1000;
  /// Input channels (3 for the ResNets' RGB images, 1 for 28x28 grey images).
  int64_t in_channels = 3;
  /// Input side length; the MLP's first layer depends on it, the ResNets adapt by pooling.
  int64_t image_size = 224;
  /// ResNets: batch norm updates its running statistics once per step from the whole batch's
  /// statistics instead of once per micro-batch (see batch_norm.hpp).
  bool deferred_batch_norm = false;
  /// ResNets: a stem for small images (Fashion-MNIST's 28 px, CIFAR's 32 px): conv1 is a 3x3
  /// convolution with stride 1 instead of torchvision's 7x7 with stride 2, so layer1 sees half
  /// the input side (after the max-pool) instead of a quarter. Layer names stay the same.
  bool small_stem = false;
  /// ResNets: one layer per residual block ("layer1.0", "layer1.1", ...: 16 for ResNet-50)
  /// instead of one per torchvision stage ("layer1".."layer4"), so that a partition can cut
  /// between any two blocks. The same modules, parameters and state keys ("layer1.0.conv1.weight"
  /// either way), so checkpoints load into either.
  bool block_layers = false;

  /// gpt (a GPT-2 style language model, docs/transformers.md): tokens it knows (its inputs are
  /// token ids below this, its outputs one logit per token), transformer blocks, attention heads,
  /// width (embedding size, a multiple of heads), context (the longest sequence it takes) and
  /// dropout probability (0: none; dropout masks are reproduced under recomputation).
  int64_t vocabulary = 256;
  int64_t layers = 2;
  int64_t heads = 2;
  int64_t width = 32;
  int64_t context = 32;
  double dropout = 0.0;
};

/// PEM files of one process's TLS identity. Both ends of every connection present their
/// certificate and accept only a peer whose certificate the CA signed (mutual TLS, TLS 1.2 or
/// newer); host names are not checked, the CA is the trust boundary. All three files are needed
/// once any is given (docs/distributed.md).
struct tls_options {
  /// Certificate chain of this process (PEM).
  std::string certificate;
  /// Private key of that certificate (PEM, unencrypted).
  std::string private_key;
  /// Certificates of the CA(s) that signed the peers' certificates (PEM).
  std::string ca_file;

  bool enabled() const { return !certificate.empty() || !private_key.empty() || !ca_file.empty(); }
  bool operator==(const tls_options& other) const {
    return certificate == other.certificate && private_key == other.private_key &&
           ca_file == other.ca_file;
  }
  bool operator!=(const tls_options& other) const { return !(*this == other); }
};

/// Where a hook runs.
struct hook_context {
  /// The stage actor and, with interleaved schedules, the local chunk.
  std::size_t stage = 0;
  std::size_t chunk = 0;
  int32_t microbatch = 0;
  uint64_t step = 0;
  /// False in forward-only passes.
  bool train = true;
  /// Which tensor of the bundle the hook sees (hooks run once per tensor): its position and, in
  /// a named bundle, its name.
  std::size_t tensor = 0;
  std::string name;
};

/// Per-stage hooks (as torchgpipe and the pipeline library actorpipe grew from allow), called on
/// the stage's thread, once per tensor of the bundle crossing the boundary. A hook may read the
/// tensor or replace it with one of the same shape (for instance to clip, quantise or record it). A
/// hook that throws fails the step like any stage error, naming the stage.
struct stage_hooks {
  /// After a stage's forward of a micro-batch, with its output (the activation about to be sent
  /// to the next stage, or the last stage's output in forward-only passes). Not called with the
  /// last stage's loss in training.
  std::function<void(const hook_context&, torch::Tensor& output)> after_forward;
  /// After a stage's backward of a micro-batch, with the gradient of its input about to be sent
  /// to the previous stage (not called on the first stage, which sends none).
  std::function<void(const hook_context&, torch::Tensor& input_gradient)> after_backward;
};

/// A hook described by value, as stages on nodes need it (functions do not cross processes): a
/// built-in by name, or a TorchScript module. make_hook (<actorpipe/hooks.hpp>) turns it into a
/// stage_hooks function, which in-process stages may use too.
struct hook_spec {
  /// A built-in: "clamp:V" (every value clamped to [-V, V]) or "check_finite" (a NaN or an
  /// infinity fails the step, naming stage, micro-batch and tensor). Empty: see `torchscript`.
  std::string builtin;
  /// The bytes of a TorchScript file (torch.jit.save of a scripted nn.Module whose
  /// forward(x: Tensor) -> Tensor returns the tensor to send on, of x's shape); runs without
  /// autograd. `name` names it in messages (a file name, say).
  std::string torchscript;
  std::string name;
};

/// stage_hooks described by value (remote_model::hooks).
struct hook_specs {
  hook_spec after_forward;
  hook_spec after_backward;
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

/// "broadcast", "average", "none" (--buffers).
inline const char* to_string(buffer_sync sync) {
  switch (sync) {
  case buffer_sync::average:
    return "average";
  case buffer_sync::none:
    return "none";
  case buffer_sync::broadcast:
    break;
  }
  return "broadcast";
}

/// The buffer sync named by to_string; invalid_argument naming the choices otherwise.
inline buffer_sync parse_buffer_sync(const std::string& text) {
  for (auto sync : {buffer_sync::broadcast, buffer_sync::average, buffer_sync::none}) {
    if (text == to_string(sync)) {
      return sync;
    }
  }
  throw invalid_argument("unknown buffer sync '" + text + "' (choose broadcast, average or none)");
}

/// ZeRO (Rajbhandari et al., SC'20) across data-parallel replicas: what each replica keeps of a
/// stage's optimizer step. Each stage's parameters are divided among the R replicas by whole
/// tensors, largest first, each to the replica holding the fewest elements so far (PyTorch's
/// ZeroRedundancyOptimizer); a replica's optimizer holds and steps its own part only, and after
/// the step every parameter is broadcast from its owner. Parameters stay those of the unsharded
/// run (the same update of the same summed gradients). docs/memory.md.
enum class shard_mode {
  /// Every replica keeps the whole optimizer state (DDP).
  none,
  /// ZeRO-1 (--shard-optimizer): optimizer state 1/R per replica; gradients all-reduced.
  optimizer,
  /// ZeRO-2 (--shard-gradients): also gradients reduced to their owner only (parameters tied
  /// across stages still all-reduced, for the tie's sum); the others' are released.
  gradients,
};

/// "none", "optimizer", "gradients".
inline const char* to_string(shard_mode mode) {
  switch (mode) {
  case shard_mode::optimizer:
    return "optimizer";
  case shard_mode::gradients:
    return "gradients";
  case shard_mode::none:
    break;
  }
  return "none";
}

/// The shard mode named by to_string; invalid_argument naming the choices otherwise.
inline shard_mode parse_shard_mode(const std::string& text) {
  for (auto mode : {shard_mode::none, shard_mode::optimizer, shard_mode::gradients}) {
    if (text == to_string(mode)) {
      return mode;
    }
  }
  throw invalid_argument("unknown shard mode '" + text + "' (choose none, optimizer or gradients)");
}

namespace detail {
/// An in-process rendezvous store shared by replicas of one process (see replicated_pipeline).
struct local_store;
} // namespace detail

/// Blockwise model-update filtering (BMUF: Chen and Huo, ICASSP 2016; Caffe2's
/// data_parallel_model.Parallelize_BMUF), an alternative to averaging gradients every step for
/// replicas on slow links. Each replica steps its own optimizer on its own gradients for
/// `block_steps` steps (a block), with no communication; then the replicas average their
/// parameters x, and every parameter's global value g and block momentum v (kept alike on every
/// replica) are updated as Caffe2 does:
///
///     v = block_momentum * v + block_lr * (mean_r(x_r) - g)
///     g = g + v                      (Nesterov: g = g + v - block_momentum * (v - v_prev))
///     x_r = g on every replica
///
/// Before the first block, `warmup_steps` steps train each replica alone and then every replica
/// takes rank 0's parameters (Caffe2's warm-up broadcast). Buffers follow
/// data_parallel_options::buffers at each block's end.
struct bmuf_options {
  /// Local steps per block; 0: no BMUF (gradients are averaged every step).
  int64_t block_steps = 0;
  double block_lr = 1.0;
  /// In [0, 1); negative: 1 - 1 / replicas (Caffe2's default).
  double block_momentum = -1;
  bool nesterov = false;
  /// Clears every replica's optimizer state (SGD's momentum buffers) after each block, as
  /// Caffe2's reset_momentum_sgd.
  bool reset_momentum = false;
  int64_t warmup_steps = 0;
};

/// Which c10d backend averages a stage's gradients across replicas.
enum class dp_backend {
  /// NCCL for a stage on a GPU, Gloo for one on the CPU.
  automatic,
  gloo,
  nccl,
};

/// Data parallelism: this pipeline is replica `rank` of `replicas` identical pipelines (each
/// fed its own part of the batch). After its last backward, each stage averages its gradients
/// with the same stage of every other replica over c10d (one process group per stage index:
/// Gloo on the CPU, NCCL on GPUs), so R replicas on B/R samples each step exactly like one
/// pipeline on B samples.
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
  /// SyncBatchNorm: the model's batch norms (actorpipe::DeferredBatchNorm2d) normalise each
  /// micro-batch by the statistics of that micro-batch on all replicas together, as one batch
  /// norm over the replicas' micro-batches concatenated (see batch_norm.hpp). Off: each replica
  /// normalises by its own micro-batch's statistics (DDP without SyncBatchNorm).
  bool sync_batch_norm = false;
  /// BMUF instead of averaging gradients every step (bmuf.block_steps > 0).
  bmuf_options bmuf;
  /// The launcher serves the store at master_addr:master_port (torchrun's agent,
  /// TORCHELASTIC_USE_AGENT_STORE=True): rank 0 is a client of it as the others are.
  bool launcher_store = false;
  /// Key prefix in the store, so several replicated pipelines can share one rendezvous (under a
  /// launcher's store, one per restart of the group: "actorpipe/attempt_<n>").
  std::string group = "actorpipe";
  /// The collectives' backend, chosen per stage group (--dp-backend).
  dp_backend backend = dp_backend::automatic;
  /// ZeRO-1 or ZeRO-2 (shard_mode): not with BMUF, whose replicas step on their own.
  shard_mode shard = shard_mode::none;
  /// Set by replicated_pipeline for replicas that live in one process; empty for processes.
  std::shared_ptr<detail::local_store> local;
};

/// A built-in model described by value: what a node needs to build its own stage, so that no
/// model code ships. Every node builds the model from the same seed and keeps its part.
struct remote_model {
  /// A make_model name ("resnet50", "mlp", "cnn", ...; or one register_model added), or, with
  /// `file`, what to call the model in messages.
  std::string name;
  model_options options;
  /// torch::manual_seed before the model is built (the same parameters in every process).
  uint64_t seed = 0;
  /// builtin_loss name, used by the last stage.
  std::string loss = "mse";
  optimizer_spec optimizer;
  /// The bytes of a model file written in Python, a TorchScript file (load_torchscript) or a
  /// PT2 archive (load_exported): when not empty, every node receives them once and builds its
  /// stage from them (`options` and `seed` are then unused, `name` only names the model in
  /// messages).
  std::string file;
  /// A PT2 archive's cut into layers (exported_options::segments).
  std::string segments = "auto";
  /// Hooks every stage runs on its node (as pipeline_options::hooks in process).
  hook_specs hooks;
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
  /// How long a node may leave a heartbeat unanswered before the step fails with node_lost
  /// naming it: a frozen process (SIGSTOP) or a cut link is found within about this long,
  /// whatever the longest action, since the node answers heartbeats beside its stages' work.
  /// Heartbeats go every sixth of it, answered or not, while the pipeline lives, so a node is
  /// found lost between this and a sixth more after it stops answering; 0: none (such a node
  /// is then found at wait_timeout).
  std::chrono::milliseconds heartbeat_timeout{1000};
  /// Nodes standing by ("host:port"): pipeline::recover() moves a lost node's stages to the
  /// first of them that answers before it shrinks the pipeline onto the survivors.
  std::vector<std::string> spares;
  /// "host:port" (port 0: any free one) where this process listens for nodes that join the run
  /// (node_options::join, `actorpipe node --join`): one that proves the secret is taken at the
  /// next pipeline::rejoin_nodes(), as a spare, or to cut the model back onto after a loss;
  /// with replicas (replicated_pipeline::rejoin_nodes()), in a lost node's place in a replica
  /// that left, else as a spare. Empty: none.
  std::string accept_joins;
};

/// Activation recomputation (torchgpipe's checkpoint modes): which micro-batches keep only
/// their stage input between forward and backward, their forward recomputed during backward.
enum class recompute_mode {
  /// Keep every micro-batch's activations (fastest, most memory).
  never,
  /// Recompute all but each step's last micro-batch (whose backward comes right after its
  /// forward in 1F1B, so keeping it costs little).
  except_last,
  /// Recompute every micro-batch.
  always,
};

/// "never", "except_last", "always".
inline const char* to_string(recompute_mode mode) {
  switch (mode) {
  case recompute_mode::never:
    return "never";
  case recompute_mode::except_last:
    return "except_last";
  case recompute_mode::always:
    return "always";
  }
  return "never";
}

/// The mode named by to_string; invalid_argument naming the choices otherwise.
inline recompute_mode parse_recompute_mode(const std::string& text) {
  for (auto mode : {recompute_mode::never, recompute_mode::except_last, recompute_mode::always}) {
    if (text == to_string(mode)) {
      return mode;
    }
  }
  throw invalid_argument("unknown recompute mode '" + text +
                         "' (choose never, except_last or always)");
}

/// The arithmetic of the stages' forward and backward (docs/transformers.md#precision).
/// CUDA graphs for stages on GPUs (docs/gpu.md#cuda-graphs): after two eager training steps
/// each stage captures a forward and a backward graph per micro-batch, in its program's order,
/// and replays them from then on; a micro-batch of another shape, a step of another program, and
/// what cannot be captured run eagerly (said once, with the reason). Nothing on the CPU.
enum class cuda_graph_mode {
  /// Always eager.
  off,
  /// Every GPU stage that can captures.
  on,
  /// A GPU stage captures where its eager actions over the warm-up averaged under
  /// graph_auto_below_ms on the host: there its kernels' launches are a visible part of each.
  automatic,
};

/// auto's threshold: an action the host queues in under this many milliseconds is launch-bound
/// (a kernel's launch costs the host ~5 us; at a few hundred kernels an action, that is it).
constexpr double graph_auto_below_ms = 2.0;

/// "off", "on", "auto".
inline const char* to_string(cuda_graph_mode mode) {
  switch (mode) {
  case cuda_graph_mode::off:
    return "off";
  case cuda_graph_mode::on:
    return "on";
  case cuda_graph_mode::automatic:
    return "auto";
  }
  return "off";
}

/// The mode named by to_string; invalid_argument naming the choices otherwise.
inline cuda_graph_mode parse_cuda_graph_mode(const std::string& text) {
  for (auto mode : {cuda_graph_mode::off, cuda_graph_mode::on, cuda_graph_mode::automatic}) {
    if (text == to_string(mode)) {
      return mode;
    }
  }
  throw invalid_argument("unknown CUDA graph mode '" + text + "' (choose auto, on or off)");
}

enum class precision_mode {
  /// Everything in float32.
  fp32,
  /// bf16 mixed precision: each stage's forward runs under libtorch's CPU autocast to
  /// bfloat16 (matrix products and convolutions in bf16, reductions and losses in fp32),
  /// set on the stage's own thread; float activations and their gradients cross stages in
  /// bf16; parameters, their gradients (accumulated over micro-batches), the optimizer and
  /// checkpoints stay float32; the last stage's output and loss are float32.
  bf16,
};

/// "fp32", "bf16".
inline const char* to_string(precision_mode p) {
  return p == precision_mode::bf16 ? "bf16" : "fp32";
}

/// The precision named by to_string; invalid_argument naming the choices otherwise.
inline precision_mode parse_precision(const std::string& text) {
  for (auto p : {precision_mode::fp32, precision_mode::bf16}) {
    if (text == to_string(p)) {
      return p;
    }
  }
  throw invalid_argument("unknown precision '" + text + "' (choose fp32 or bf16)");
}

/// Everything a pipeline needs besides its layers and partition.
struct pipeline_options {
  /// Micro-batches per step (m >= 1). The batch is split into m parts whose sizes differ by at
  /// most one (earlier parts take the remainder); the batch must hold at least m samples.
  std::size_t microbatches = 1;
  schedule_kind schedule = schedule_kind::one_f_one_b;
  /// Model chunks per stage actor (interleaved, interleaved_zb: any; the V schedules: 2): the
  /// partition must then have stages x chunks parts, and chunk c of actor i holds the part
  /// chunk_layout() gives (looped: c * stages + i; a V: stage 0 holds the first and the last
  /// part).
  std::size_t chunks = 1;
  /// A user-supplied training schedule (e.g. load_schedule(file)); used instead of `schedule`
  /// when not empty, validated before its first step.
  actorpipe::schedule custom_schedule;

  /// How the stages' chunks map onto the partition's parts: the custom schedule's placement, else
  /// the built-in schedule's (v_shape for the V schedules, looped for the others).
  chunk_placement chunk_layout() const {
    return custom_schedule.empty() ? placement_of(schedule) : custom_schedule.placement;
  }

  /// Required for train_step (or loss_with_inputs).
  loss_function loss;
  /// Instead of `loss`: a loss that also sees each micro-batch's inputs, which the scheduler
  /// then sends to the last stage with the targets (in process they are shared, not copied).
  /// Stages in this process only (a function cannot travel to a node); set one of the two.
  loss_with_inputs_function loss_with_inputs;
  loss_reduction reduction = loss_reduction::mean;
  /// Required for train_step.
  optimizer_factory optimizer;
  /// One device per stage actor (stage i's modules are moved to devices[i] and its inputs
  /// arrive there); empty means every stage on the CPU. CPU devices only unless actorpipe was
  /// built with ACTORPIPE_WITH_CUDA.
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
  /// How long an idle thread of the pipeline (the scheduler, a stage, the caller waiting for a
  /// step) keeps polling for the message it expects before it sleeps: a message taken by a
  /// polling thread costs ~1 us, one that wakes a sleeping thread 10-20 us on a VM. Costs at most
  /// this much CPU per message, and the poll yields to any thread with work
  /// (docs/control-plane.md). 0: sleep at once.
  std::chrono::microseconds linger{50};
  /// Global gradient-norm clipping: when > 0, all gradients of all stages (after the replica
  /// sync, hence of all replicas) are scaled by max_grad_norm / (norm + 1e-6) when that is
  /// below 1, as torch::nn::utils::clip_grad_norm_ does on one model. A NaN or infinite norm
  /// fails the step (no parameter changes).
  double max_grad_norm = 0;
  /// Optimizer post-validation (Qi et al.): a stage steps its optimizers as soon as its program
  /// has run, keeping its state from before, instead of waiting until every stage has its
  /// gradients; the scheduler's update then confirms the step, or has it undone and stepped
  /// again with the clipped gradients, and a failed step undoes it. The stage that finished
  /// last in the previous step waits as before (its early step could only delay the
  /// confirmation), and so does every stage after a clipped step. Parameters are those of the
  /// waiting path bit for bit. Off by default: the copy doubles what a stage holds of
  /// parameters and optimizer state, and the step it saves is the optimizer time of the
  /// stages that finish early (1% of the ResNet-50 bench step, below its noise:
  /// docs/schedules.md, BENCHMARKS.md).
  bool optimistic_update = false;
  /// Overlapping steps: while a training step runs, the next one already submitted
  /// (train_step_async) goes to the stages, and each stage starts it as soon as it is done with
  /// the step before: its program has run and its optimizers stepped (early, as
  /// optimistic_update, on every stage). Step n+1's first forwards then run while later stages
  /// still finish step n (the weight-gradient actions of the zero-bubble schedules), and no
  /// stage waits for the scheduler's round between steps. Parameters are those of steps run one
  /// after the other, bit for bit. With clipping (max_grad_norm > 0) a stage waits for the
  /// update before it starts the next step (it may be undone and stepped again), so only the
  /// round trip is saved. A failed step also fails the step behind it, which ran on parameters
  /// the failed one would have set; both leave the pipeline as it was before the failed one.
  /// Stages in this process only (not on nodes). Off by default (docs/schedules.md).
  bool overlap_steps = false;
  /// Stages on GPUs record timed CUDA events around every action, so that each
  /// action_record has the device's times (device_start_ms, device_end_ms) beside the host's.
  /// Off by default: four CUDA calls per action (`actorpipe train --trace` turns it on).
  bool device_timing = false;
  /// A stage of several chunks (interleaved and V schedules) on a GPU runs each chunk on a CUDA
  /// stream of its own, so that one chunk's forward and another's backward may run side by side
  /// on the device (DualPipeV's pairs); false: one stream per stage. Nothing changes on the CPU
  /// or for one chunk (docs/gpu.md).
  bool chunk_streams = true;
  /// Replicas of this pipeline (off by default).
  data_parallel_options data_parallel;
  /// Hooks run by every stage (none by default).
  stage_hooks hooks;
  /// Activation recomputation on every stage (docs/transformers.md#recomputation). Gradients
  /// equal those without; dropout draws the same masks in forward and recomputation; batch-norm
  /// statistics are updated once.
  recompute_mode recompute = recompute_mode::never;
  /// Mixed precision on every stage (fp32: none).
  precision_mode precision = precision_mode::fp32;
  /// CUDA graphs on GPU stages (cuda_graph_mode). Off by default until measured on a GPU
  /// (docs/gpu.md#cuda-graphs); nothing changes on the CPU.
  cuda_graph_mode cuda_graphs = cuda_graph_mode::off;
  /// Stage actors on `actorpipe node` processes (see the remote_model constructor).
  node_placement placement;
};

} // namespace actorpipe
