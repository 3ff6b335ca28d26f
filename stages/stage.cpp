// A stage's passes in a step: the forward (and the last stage's loss), the stash and
// recomputation, the backward whole or split into its input and weight halves, and the step's
// begin, end and abort with its buffers (stages/stage.hpp). Making a stage: make_stage.cpp; its
// state and optimizer between steps: stage_state.cpp.
#include "stages/stage.hpp"

#include "stages/device.hpp"
#include "stages/precision.hpp"
#include "stages/stage_helpers.hpp"
#include "stages/weight_pass.hpp"

#include <actorpipe/batch_norm.hpp>

#include <shared_mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/memory.hpp>
#include <actorpipe/torch_compat.hpp>

namespace actorpipe::stages {
using namespace stage_helpers;
namespace {

// The state of the generator the stage's device draws from (the CPU's, or its GPU's).
torch::Tensor generator_state(c10::Device device) {
  auto generator = default_generator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_generator_state(c10::Device device, const torch::Tensor& state) {
  auto generator = default_generator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// Runs `forward` holding the generator lock as the stage needs it: exclusively for a forward
// that will be recomputed (its generator state kept in `state`), shared for the other forwards
// of a stage that draws, not at all for a stage that never draws.
template <class Forward>
auto drawing(bool draws, bool recompute, c10::Device device, torch::Tensor& state,
             Forward&& forward) {
  if (!draws) {
    return forward();
  }
  if (recompute) {
    std::unique_lock<std::shared_mutex> exclusive(generator_lock());
    state = generator_state(device);
    return forward();
  }
  std::shared_lock<std::shared_mutex> shared(generator_lock());
  return forward();
}

} // namespace

std::string stage::where(int32_t microbatch) const {
  return detail::concat("stage ", config_.index, ", microbatch ", microbatch);
}

error_details stage::details(int32_t microbatch, error_kind kind) const {
  return error_details{kind, config_.index, microbatch};
}

void stage::begin_step(bool train) {
  std::lock_guard<std::mutex> guard{mutex_};
  train_ = train;
  stash_.clear();
  *stash_tally_ = {};
  peak_stash_ = 0;
  for (auto& l : layers_) {
    if (auto m = l.module()) {
      m->train(train);
    }
  }
  for (auto& p : parameters()) {
    p.mutable_grad().reset();
  }
  buffer_snapshot_.clear();
  for (auto& bn : batch_norms_) {
    bn->discard();
  }
  if (train) {
    buffer_snapshot_ = copy_buffers();
  }
}

bundle stage::run(int32_t microbatch, const bundle& input) const {
  auto x = input;
  {
    // Autocast is thread-local: set here, on the thread that runs the stage, for the layers
    // only (the loss and the boundary casts below run outside it).
    autocast_scope autocast(config_.precision, config_.device.type());
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      const auto& l = layers_[i];
      auto source = [&] {
        if (i > 0) {
          return detail::concat("the output of layer '", layers_[i - 1].name(), "'");
        }
        return is_first() ? std::string("the input")
                          : detail::concat("the activation from stage ", config_.index - 1);
      };
      if (!l.takes_bundles() && x.size() != 1) {
        throw pipeline_error(detail::concat(where(microbatch), ": layer '", l.name(),
                                            "' (model layer ", config_.first_layer + i,
                                            ") takes one tensor, but ", source(),
                                            " is a bundle of ", x.size(), ": ", x.describe()),
                             details(microbatch, error_kind::shape_mismatch));
      }
      try {
        x = l.forward(x);
      } catch (const std::exception& e) {
        if (auto oom = cuda::out_of_memory(e); !oom.empty()) {
          throw pipeline_error(detail::concat(where(microbatch), ": layer '", l.name(),
                                              "' ran out of memory on ", config_.device.str(), ": ",
                                              oom),
                               details(microbatch, error_kind::out_of_memory));
        }
        std::string what = dynamic_cast<const c10::Error*>(&e) != nullptr
                             ? static_cast<const c10::Error&>(e).what_without_backtrace()
                             : e.what();
        auto expected = l.expected_input();
        throw pipeline_error(detail::concat(where(microbatch), ": layer '", l.name(),
                                            "' (model layer ", config_.first_layer + i,
                                            ") cannot take ", source(), " of shape ", shape_of(x),
                                            expected.empty() ? "" : "; it expects ", expected,
                                            ". libtorch: ", detail::first_line(what)),
                             // libtorch refusing the tensor is (almost always) its shape; anything
                             // else the layer threw is the layer's own failure.
                             details(microbatch, dynamic_cast<const c10::Error*>(&e) != nullptr
                                                   ? error_kind::shape_mismatch
                                                   : error_kind::stage_failure));
      }
    }
  }
  for (auto& t : x.tensors()) {
    t = boundary_cast(t, config_.precision, is_last());
  }
  return x;
}

bundle stage::receive(const bundle& input, bool train) const {
  auto x = input;
  for (auto& t : x.tensors()) {
    if (!t.defined()) {
      continue;
    }
    bool flagged = !is_first() && bundle::needs_gradient(t);
    // From pinned host memory (the batch, for a stage on a GPU) the copy does not block.
    t = t.to(t.options().device(config_.device), /*non_blocking=*/t.is_pinned()).detach();
    if (train && flagged) {
      t.requires_grad_(true);
    }
  }
  return x;
}

int64_t stage::input_bytes(const stash_entry& entry) {
  int64_t bytes = 0;
  for (const auto& t : entry.input.tensors()) {
    if (t.defined()) {
      bytes += static_cast<int64_t>(t.numel() * t.element_size());
    }
  }
  if (entry.generator_state.defined()) {
    bytes += static_cast<int64_t>(entry.generator_state.numel());
  }
  return bytes;
}

void stage::stash(int32_t microbatch, stash_entry entry, int64_t retained) {
  // What the entry keeps: its input (which the previous stage, or the batch, allocated) and
  // what this forward allocated that is still alive: the graph's saved activations and the
  // output (nothing of the forward's, recomputed).
  entry.bytes = retained + input_bytes(entry);
  add_stashed(entry.bytes);
  stash_[microbatch] = std::move(entry);
  peak_stash_ = std::max(peak_stash_, stash_.size());
}

void stage::unstash(std::map<int32_t, stash_entry>::iterator it) {
  add_stashed(-it->second.bytes);
  stash_.erase(it);
}

graph_book::use stage::graph_use(int32_t microbatch, const bundle& input,
                                 const torch::Tensor* target, bool recompute) {
  if (!graphs_ || graphs_->book.is_off()) {
    return graph_book::use::eager;
  }
  if (recompute) {
    graphs_->book.turn_off("recomputation keeps a micro-batch's input alone, a graph all of it");
  }
  return graphs_->book.forward(microbatch, target != nullptr ? tensor_signature::of(input, *target)
                                                             : tensor_signature::of(input));
}

bundle stage::forward(int32_t microbatch, const bundle& input, bool recompute) {
  std::lock_guard<std::mutex> guard{mutex_};
  if (graphs_) {
    graphs_->replayed_last = false; // an eager result is never marked graph-owned
  }
  if (!train_) {
    torch::NoGradGuard no_grad;
    return run(microbatch, receive(input, false));
  }
  torch::AutoGradMode grad_mode{true};
  ACTORPIPE_ASSERT(stash_.count(microbatch) == 0);
  stash_entry entry;
  entry.input = receive(input, true);
  if (auto use = graph_use(microbatch, entry.input, nullptr, recompute);
      use != graph_book::use::eager) {
    if (auto sent = graphed_forward(microbatch, entry.input, use)) {
      return std::move(*sent);
    }
  }
  // With recomputation the graph is built (it says which outputs need a gradient) and dropped
  // at once: only the input, and where the stage draws random numbers the generator's state,
  // stay until backward.
  memory_tally tally{config_.device};
  auto y = drawing(draws_random_, recompute, config_.device, entry.generator_state,
                   [&] { return run(microbatch, entry.input); });
  auto sent = detach_keeping_flags(y);
  entry.recompute = recompute;
  if (!recompute) {
    entry.output = std::move(y);
  }
  note_held(stash_tally_->bytes + input_bytes(entry) + tally.peak_bytes());
  entry.count = tally.count();
  stash(microbatch, std::move(entry), recompute ? 0 : tally.live_bytes());
  return sent;
}

torch::Tensor stage::loss_of(int32_t microbatch, const bundle& outputs, const torch::Tensor& target,
                             const loss_function& loss) const {
  if (outputs.size() != 1) {
    throw pipeline_error(detail::concat(where(microbatch), ": the last stage's output is a bundle ",
                                        outputs.describe(), ", but the loss takes one tensor"),
                         details(microbatch, error_kind::shape_mismatch));
  }
  const auto& y = outputs[0];
  torch::Tensor value;
  try {
    value = loss(y, target.to(target.options().device(config_.device), target.is_pinned()));
  } catch (const c10::Error& e) {
    throw pipeline_error(
      detail::concat(where(microbatch), ": the loss function failed on output ", shape_of(y),
                     " and target ", shape_of(target),
                     ". libtorch: ", detail::first_line(e.what_without_backtrace())),
      details(microbatch, error_kind::stage_failure));
  }
  if (value.numel() != 1) {
    throw pipeline_error(detail::concat(where(microbatch),
                                        ": the loss function must return a scalar, got shape ",
                                        shape_of(value)),
                         details(microbatch, error_kind::stage_failure));
  }
  return value;
}

torch::Tensor stage::forward_loss(int32_t microbatch, const bundle& input,
                                  const torch::Tensor& target, const loss_function& loss,
                                  double scale, bool recompute) {
  std::lock_guard<std::mutex> guard{mutex_};
  if (graphs_) {
    graphs_->replayed_last = false;
  }
  ACTORPIPE_ASSERT(train_ && is_last());
  ACTORPIPE_ASSERT(stash_.count(microbatch) == 0);
  stash_entry entry;
  entry.input = receive(input, true);
  if (auto use = graph_use(microbatch, entry.input, &target, recompute);
      use != graph_book::use::eager) {
    torch::AutoGradMode grad_mode{true};
    if (auto value = graphed_forward(microbatch, entry.input, use, target, &loss, scale)) {
      return (*value)[0];
    }
  }
  torch::Tensor value;
  memory_tally tally{config_.device};
  {
    // Recomputed, the forward runs without a graph (the last stage sends no activation whose
    // flags would need one); the loss function and target wait for backward.
    torch::AutoGradMode grad_mode{!recompute};
    value = drawing(draws_random_, recompute, config_.device, entry.generator_state, [&] {
      return loss_of(microbatch, run(microbatch, entry.input), target, loss);
    });
  }
  entry.recompute = recompute;
  if (recompute) {
    entry.target = target;
    entry.loss = loss;
    entry.scale = scale;
  } else {
    entry.output = bundle(value * scale);
  }
  note_held(stash_tally_->bytes + input_bytes(entry) + tally.peak_bytes());
  entry.count = tally.count();
  stash(microbatch, std::move(entry), recompute ? 0 : tally.live_bytes());
  return value.detach();
}

void stage::recompute(int32_t microbatch, stash_entry& entry) {
  if (!entry.recompute) {
    return;
  }
  torch::AutoGradMode grad_mode{true};
  // The recomputed forward must not count the micro-batch again in batch-norm statistics.
  auto saved = copy_buffers();
  for (auto& bn : batch_norms_) {
    bn->recomputing = true;
  }
  auto restore = [&] {
    restore_buffers(saved);
    for (auto& bn : batch_norms_) {
      bn->recomputing = false;
    }
  };
  // What the rebuilt forward keeps, until its backward frees it.
  memory_tally tally{config_.device};
  auto rerun = [&] {
    auto y = run(microbatch, entry.input);
    return is_last() && entry.loss
             ? bundle(loss_of(microbatch, y, entry.target, entry.loss) * entry.scale)
             : y;
  };
  try {
    if (entry.generator_state.defined()) {
      // Replay the forward's run of the generator, then leave it where it was.
      std::unique_lock<std::shared_mutex> exclusive(generator_lock());
      auto now = generator_state(config_.device);
      set_generator_state(config_.device, entry.generator_state);
      try {
        entry.output = rerun();
      } catch (...) {
        set_generator_state(config_.device, now);
        throw;
      }
      set_generator_state(config_.device, now);
    } else {
      entry.output = rerun();
    }
  } catch (...) {
    restore();
    throw;
  }
  restore();
  entry.recompute = false;
  entry.generator_state = torch::Tensor();
  // The rebuilt activations count in the stash while they live: a recomputing stage's peak
  // is its stashed inputs plus the one micro-batch being backed up.
  note_held(stash_tally_->bytes + tally.peak_bytes()); // the entry's input is in the stash
  entry.count = tally.count();
  entry.bytes += tally.live_bytes();
  add_stashed(tally.live_bytes());
}

void stage::pair_gradients(int32_t microbatch, stash_entry& entry,
                           const bundle& output_gradient) const {
  entry.roots.clear();
  entry.root_gradients.clear();
  if (is_last()) {
    // Backward starts from the scaled loss.
    if (entry.output[0].requires_grad()) {
      entry.roots.push_back(entry.output[0]);
    }
    return;
  }
  std::vector<std::size_t> needing;
  for (std::size_t i = 0; i < entry.output.size(); ++i) {
    if (bundle::needs_gradient(entry.output[i])) {
      needing.push_back(i);
    }
  }
  auto from = detail::concat("the gradients from stage ", config_.index + 1);
  if (output_gradient.size() != needing.size()) {
    std::string which;
    for (auto i : needing) {
      which += (which.empty() ? "" : ", ") + entry.output.label(i);
    }
    throw pipeline_error(
      detail::concat(where(microbatch), ": ", from, " are ", output_gradient.size(),
                     " tensors, but ", needing.size(), " of the stage's outputs need one",
                     which.empty() ? std::string{} : detail::concat(" (", which, ")"), "; outputs ",
                     entry.output.describe()),
      details(microbatch, error_kind::shape_mismatch));
  }
  for (std::size_t k = 0; k < needing.size(); ++k) {
    auto i = needing[k];
    const auto& y = entry.output[i];
    if (output_gradient.is_named() && entry.output.is_named() &&
        output_gradient.names()[k] != entry.output.names()[i]) {
      throw pipeline_error(detail::concat(where(microbatch), ": ", from, " name '",
                                          output_gradient.names()[k], "' where the output ",
                                          entry.output.label(i), " needs its gradient"),
                           details(microbatch, error_kind::shape_mismatch));
    }
    auto g = output_gradient[k].to(config_.device);
    if (!g.sizes().equals(y.sizes())) {
      throw pipeline_error(detail::concat(where(microbatch), ": the gradient from stage ",
                                          config_.index + 1, " for output ", entry.output.label(i),
                                          " has shape ", shape_of(g), " but the output has shape ",
                                          shape_of(y)),
                           details(microbatch, error_kind::shape_mismatch));
    }
    entry.roots.push_back(y);
    entry.root_gradients.push_back(g.to(y.scalar_type()));
  }
}

std::vector<torch::Tensor> stage::gradient_inputs(const stash_entry& entry) {
  std::vector<torch::Tensor> inputs;
  for (const auto& t : entry.input.tensors()) {
    if (t.defined() && t.requires_grad()) {
      inputs.push_back(t);
    }
  }
  return inputs;
}

bundle stage::input_gradients(const stash_entry& entry, std::vector<torch::Tensor> grads) const {
  if (is_first()) {
    return {};
  }
  std::vector<std::pair<std::string, torch::Tensor>> named;
  std::vector<torch::Tensor> positional;
  std::size_t k = 0;
  for (std::size_t i = 0; i < entry.input.size(); ++i) {
    const auto& x = entry.input[i];
    if (!x.defined() || !x.requires_grad()) {
      continue;
    }
    auto g = k < grads.size() && grads[k].defined() ? grads[k].detach() : torch::zeros_like(x);
    ++k;
    if (entry.input.is_named()) {
      named.emplace_back(entry.input.names()[i], std::move(g));
    } else {
      positional.push_back(std::move(g));
    }
  }
  return entry.input.is_named() ? bundle::named(std::move(named)) : bundle(std::move(positional));
}

bundle stage::backward(int32_t microbatch, const bundle& output_gradient) {
  std::lock_guard<std::mutex> guard{mutex_};
  auto it = stash_.find(microbatch);
  if (it == stash_.end()) {
    throw pipeline_error(detail::concat(where(microbatch), ": backward without a stashed forward"),
                         details(microbatch, error_kind::stage_failure));
  }
  if (graphs_) {
    graphs_->replayed_last = false;
    if (it->second.graphed) {
      return graphed_backward(microbatch, it, output_gradient);
    }
  }
  recompute(microbatch, it->second);
  pair_gradients(microbatch, it->second, output_gradient);
  auto entry = std::move(it->second);
  unstash(it);
  torch::AutoGradMode grad_mode{true};
  // Counted with what the forward kept (freed as the graph is backed up): the micro-batch's
  // whole at its peak, beside the rest of the stash.
  auto gradients_before = held_gradient_bytes();
  auto count = entry.count ? entry.count : std::make_shared<memory::tally_count>();
  count->reset_peak();
  memory_tally tally{config_.device, count};
  if (!entry.roots.empty()) {
    compat::backward_on_this_thread here;
    torch::autograd::backward(entry.roots, entry.root_gradients);
  }
  std::vector<torch::Tensor> grads;
  for (const auto& x : gradient_inputs(entry)) {
    grads.push_back(x.grad());
  }
  auto sent = input_gradients(entry, std::move(grads));
  note_held(stash_tally_->bytes + input_bytes(entry) + tally.peak_bytes() -
            (held_gradient_bytes() - gradients_before));
  return sent;
}

bundle stage::backward_input(int32_t microbatch, const bundle& output_gradient) {
  std::lock_guard<std::mutex> guard{mutex_};
  if (graphs_) {
    graphs_->replayed_last = false;
  }
  auto it = stash_.find(microbatch);
  if (it == stash_.end() || it->second.input_done) {
    throw pipeline_error(detail::concat(where(microbatch), ": input-gradient backward without a "
                                                           "stashed forward"),
                         details(microbatch, error_kind::stage_failure));
  }
  auto& entry = it->second;
  recompute(microbatch, entry);
  pair_gradients(microbatch, entry, output_gradient);
  entry.input_done = true;
  auto inputs = gradient_inputs(entry);
  if (is_first() || inputs.empty() || entry.roots.empty()) {
    return input_gradients(entry, {});
  }
  torch::AutoGradMode grad_mode{true};
  if (use_weight_pass_) {
    entry.weights = weight_pass::prepare(entry.roots, inputs, parameters());
  }
  // The graph is kept for W; only the inputs' gradients (and norm layers') are computed now.
  auto grads = input_backward(entry.roots, inputs, entry.root_gradients, entry.weights.get());
  if (entry.weights) {
    // What W will read: part of the stash until then.
    auto kept = entry.weights->kept_bytes();
    entry.bytes += kept;
    add_stashed(kept);
  }
  return input_gradients(entry, std::move(grads));
}

void stage::backward_weight(int32_t microbatch) {
  std::lock_guard<std::mutex> guard{mutex_};
  auto it = stash_.find(microbatch);
  if (it == stash_.end() || !it->second.input_done) {
    throw pipeline_error(detail::concat(where(microbatch), ": weight-gradient backward before "
                                                           "its input-gradient backward"),
                         details(microbatch, error_kind::stage_failure));
  }
  auto entry = std::move(it->second);
  unstash(it);
  std::vector<torch::Tensor> params;
  for (auto& p : parameters()) {
    if (p.requires_grad()) {
      params.push_back(p);
    }
  }
  if (params.empty() || entry.roots.empty()) {
    return;
  }
  torch::AutoGradMode grad_mode{true};
  if (weight_backward(entry.roots, entry.root_gradients, params, entry.weights.get())) {
    ++weight_passes_;
  } else {
    ++weight_walks_;
  }
}

void stage::use_weight_pass(bool on) {
  std::lock_guard<std::mutex> guard{mutex_};
  use_weight_pass_ = on;
}

std::pair<std::size_t, std::size_t> stage::weight_passes() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return {weight_passes_, weight_walks_};
}

void stage::end_step() {
  std::lock_guard<std::mutex> guard{mutex_};
  for (auto& bn : batch_norms_) {
    bn->commit();
  }
}

std::size_t stage::synchronise_batch_norm(const c10::intrusive_ptr<batch_norm_sync>& sync) {
  std::lock_guard<std::mutex> guard{mutex_};
  for (auto& bn : batch_norms_) {
    bn->sync = sync;
  }
  return batch_norms_.size();
}

void stage::abort_step() {
  std::lock_guard<std::mutex> guard{mutex_};
  if (graphs_ && graphs_->book.abandon_capture()) {
    graphs_->passes.clear(); // some micro-batches may have a forward graph and no backward
  }
  for (const auto& [microbatch, entry] : stash_) {
    add_stashed(-entry.bytes); // the other chunks of a shared tally keep theirs
  }
  stash_.clear();
  for (auto& p : parameters()) {
    p.mutable_grad().reset();
  }
  for (auto& bn : batch_norms_) {
    bn->discard();
  }
  if (!buffer_snapshot_.empty()) {
    restore_buffers(buffer_snapshot_);
  }
}

std::vector<torch::Tensor> stage::step_start_buffers() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return buffer_snapshot_;
}

void stage::restore_step_start_buffers(const std::vector<torch::Tensor>& snapshot) {
  std::lock_guard<std::mutex> guard{mutex_};
  if (!snapshot.empty()) {
    restore_buffers(snapshot);
  }
}

std::vector<torch::Tensor> stage::copy_buffers() const {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> copies;
  for (const auto& b : buffers()) {
    copies.push_back(b.clone());
  }
  return copies;
}

void stage::restore_buffers(const std::vector<torch::Tensor>& copies) {
  torch::NoGradGuard no_grad;
  auto current = buffers();
  ACTORPIPE_ASSERT(current.size() == copies.size());
  for (std::size_t i = 0; i < current.size(); ++i) {
    // Through .data(): a recomputed graph saved the buffers it read, and their version counter
    // must not change (backward in training mode uses the batch's own statistics).
    current[i].data().copy_(copies[i]);
  }
}

} // namespace actorpipe::stages
