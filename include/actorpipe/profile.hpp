/// \file
/// Per-layer costs measured on a sample micro-batch, and what they predict: time-balanced
/// partitions and per-stage action costs for the schedule simulator.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <actorpipe/actions.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/partition.hpp>

namespace actorpipe {

/// What one layer costs on the profiled micro-batch: medians over the timed rounds, with their
/// spread.
struct layer_profile {
  std::string name;
  double forward_ms = 0;
  /// Backward in one pass (input and weight gradients), from a random output gradient.
  double backward_ms = 0;
  /// Split backward, as zero-bubble schedules run it (0 when not profiled): the input gradient
  /// alone (B, keeping the graph) and then the weight gradients (W).
  double input_backward_ms = 0;
  double weight_backward_ms = 0;
  /// Bytes of the layer's output (the activation a cut after it would send), and of its input
  /// (for the first layer, a micro-batch of the model's input).
  int64_t output_bytes = 0;
  int64_t input_bytes = 0;
  /// Bytes a training forward of the layer allocates and keeps until its backward (its output
  /// and the tensors autograd saved), measured as a stage measures its stash: the allocation
  /// tally (<actorpipe/memory.hpp>) on the CPU, the CUDA caching allocator's allocations on a
  /// GPU (stages::memory_tally). 0 for a view of its input (a flatten); -1 where not measured
  /// (the planner counts output_bytes then).
  int64_t retained_bytes = -1;
  /// Bytes of the layer's input that nothing keeps once it has run, in a chain of the layers
  /// (the previous layer's output, where neither graph saved it: a batch norm's output read
  /// by a ReLU, which saves its own result): a stage holding both layers does not keep them.
  /// Measured by one chained forward, as retained_bytes.
  int64_t freed_input_bytes = 0;
  /// What the layer needs for a moment beyond what it keeps (-1: not measured): a training
  /// forward's temporaries (the most it had allocated at once, less what it kept), and a fused
  /// backward's from its output gradient (its input gradient and temporaries: on the CPU the
  /// most its own allocations held at once, on a GPU the caching allocator's peak above its
  /// start). A stage at its peak holds its stash and one layer's working set
  /// (planner.hpp's working_bytes).
  int64_t forward_working_bytes = -1;
  int64_t backward_working_bytes = -1;
  /// The most a forward without autograd had allocated at once, its output included (-1: not
  /// measured): a recomputing stage's first forward keeps nothing, but holds what the layer
  /// would have saved for a moment.
  int64_t no_grad_forward_bytes = -1;
  /// What a split backward's B keeps for its W (zero-bubble schedules, DualPipeV): the
  /// gradients the weight pass holds for the layer's weight nodes (stages/weight_pass.hpp),
  /// which a micro-batch between its B and its W holds beside its stash. Measured by the
  /// profile's split backward (profile_options::split_backward); -1 where not measured.
  int64_t weight_kept_bytes = -1;
  /// On a GPU: what the layer's forward and backward leave allocated on the device that is no
  /// tensor of theirs, the workspaces cuBLAS keeps for each thread and stream that multiplied
  /// matrices (a stage's own thread and autograd's backward thread), measured once more after
  /// cuBLAS gave its workspaces back; a stage with such a layer holds them too. 0 for a layer
  /// that multiplies no matrices, and on the CPU.
  int64_t workspace_bytes = 0;
  int64_t parameters = 0;
  /// Spread of the timed rounds: (upper quartile - lower quartile) / median of forward and of
  /// backward; 0.05 means the middle half of the rounds lay within 5% of the median.
  double forward_spread = 0;
  double backward_spread = 0;
};

/// How layers are profiled.
struct profile_options {
  /// Untimed passes over the whole model first: allocators, caches and oneDNN's primitives warm.
  int warmup = 2;
  /// Timed rounds; each round forwards every layer in order, then backs them up in reverse
  /// order, so a disturbance spreads over all layers instead of skewing one. Medians are kept.
  int repeats = 5;
  /// Also time the split backward (B then W) in every round.
  bool split_backward = false;
  /// Where to run them: a GPU's layers are moved there for the profile and back afterwards, and
  /// every timing waits for the device (a GPU runs kernels after the host queued them).
  c10::Device device{c10::kCPU};
};

/// Runs the layers on `sample` (their input, e.g. one micro-batch) in train mode, on the calling
/// thread with its intra-op threads, as a stage runs them: float inputs between layers take a
/// gradient, the model's input does not (the first stage computes no input gradient). Timed as
/// `options` says. Parameters' gradients are cleared afterwards; batch-norm statistics restored.
/// On a GPU it gives back cuBLAS's workspaces (stages::cuda::release_blas_workspaces): profile
/// while no stage computes on that device.
std::vector<layer_profile> profile_layers(const layer_list& layers, const torch::Tensor& sample,
                                          const profile_options& options);

/// As above with `repeats` timed rounds and the other options' defaults.
std::vector<layer_profile> profile_layers(const layer_list& layers, const torch::Tensor& sample,
                                          int repeats = 5);

/// Milliseconds an optimizer step's memory traffic takes over the layers' parameters on the
/// calling thread (its intra-op threads): an SGD update (parameter += -lr x gradient) and
/// clearing the gradient, on scratch tensors of the same sizes on `device` (the parameters are
/// untouched); the median of `repeats` after one warm-up.
double profile_update(const layer_list& layers, int repeats = 3,
                      c10::Device device = c10::Device(c10::kCPU));

/// The largest forward and backward spread over the layers whose time is at least `floor_share`
/// of the model's (tiny layers' relative spread says little).
double profile_spread(const std::vector<layer_profile>& profile, double floor_share = 0.02);

/// `stages` non-empty stages minimising the slowest stage's forward + backward time.
partition partition_by_time(const std::vector<layer_profile>& profile, std::size_t stages);

/// `parts` parts cut as `spec` says: "time" balances `profile` (partition_by_time), anything else
/// is parse_partition's ("uniform", "params", "cut:I,J").
partition partition_by_spec(const std::string& spec, const layer_list& layers, std::size_t parts,
                            const std::vector<layer_profile>& profile);

/// Action costs per part of `cut` (virtual stages, model order) in milliseconds, scaled by
/// `scale` (e.g. micro-batch size / profiled size). A fused backward costs the profiled
/// backward; a split one the profiled B and W when the profile has them, else half each. The
/// model's first part computes no input gradient: its B costs 0.
std::vector<action_costs> costs_of(const std::vector<layer_profile>& profile, const partition& cut,
                                   double scale = 1.0);

} // namespace actorpipe
