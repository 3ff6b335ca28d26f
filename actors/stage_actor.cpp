#include "actors/stage_actor.hpp"

#include <algorithm>
#include <climits>
#include <deque>
#include <map>
#include <tuple>
#include <utility>

#include <pthread.h>

#include <ATen/Parallel.h>
#include <actorpipe/batch_norm.hpp>
#include <actorpipe/memory.hpp>
#include <caf/all.hpp>

#include "actors/deadline.hpp"
#include "actors/linger.hpp"
#include "actors/messages.hpp"
#include "actors/pipeline_errc.hpp"
#include "actors/stage_state.hpp"
#include "comm/replica_group.hpp"
#include "comm/tie_group.hpp"
#include "logging/log.hpp"
#include "stages/device.hpp"
#include "stages/stage.hpp"

namespace actorpipe::actors {
using namespace stage_parts;
namespace {

/// The stage protocol plus the deadline timer the stage sets itself.
using stage_self_actor = local_stage_actor::extend<caf::reacts_to<timeout_atom>>;
using stage_actor_type = stage_self_actor::stateful_pointer<stage_state>;

void drop_older_than(std::map<key, bundle>& inputs, uint64_t step) {
  inputs.erase(inputs.begin(), inputs.lower_bound(key{step, INT32_MIN, INT32_MIN}));
}

void drop_step(std::map<key, bundle>& inputs, uint64_t step) {
  inputs.erase(inputs.lower_bound(key{step, INT32_MIN, INT32_MIN}),
               inputs.upper_bound(key{step, INT32_MAX, INT32_MAX}));
}

void abort_chunks(stage_state& s) {
  s.device->end_chunks(); // what follows runs on the stage's stream, after the chunks'
  for (auto& chunk : s.chunks) {
    chunk->abort_step();
  }
}

void fail(stage_actor_type self, failure why) {
  auto& s = self->state;
  s.active = false;
  abort_chunks(s);
  drop_step(s.activations, s.plan.step);
  drop_step(s.gradients, s.plan.step);
  self->send(s.scheduler, failed_atom::value, s.plan.step, std::move(why));
  // Wake the holders of tied parameters waiting for this stage: their failures, which follow
  // from this one, reach the scheduler after it.
  if (s.options.ties) {
    s.options.ties->cancel(s.plan.step, s.options.index);
  }
}

// Fails the step with what `e` says, from this stage (and micro-batch, when one was running).
void fail(stage_actor_type self, const std::exception& e,
          std::optional<int32_t> microbatch = std::nullopt) {
  auto& s = self->state;
  auto why = failure_of(e, s.options.index, s.plan.step, microbatch);
  if (auto oom = stages::cuda::out_of_memory(e); !oom.empty()) {
    // Out of GPU memory in a backward, a weight pass or the replica sync (a layer's forward
    // says so itself): what was asked for, on which device.
    why.details.kind = error_kind::out_of_memory;
    why.message = detail::concat(
      "stage ", s.options.index, microbatch ? detail::concat(", microbatch ", *microbatch) : "",
      ", step ", s.plan.step, ": out of memory on ", s.device->device().str(), ": ", oom);
  }
  fail(self, std::move(why));
}

// "stage 2" or, with chunks, "stage 2 chunk 1".
std::string name_of_virtual(const stage_state& s, std::size_t virtual_stage) {
  auto holder = holder_of(s.options.placement, s.actor_count(), virtual_stage);
  return s.chunks.size() == 1 ? detail::concat("stage ", holder.stage)
                              : detail::concat("stage ", holder.stage, " chunk ", holder.chunk);
}

std::string describe_wait(const stage_state& s, const action& a) {
  auto virtual_stage = s.virtual_index(a.chunk);
  if (a.kind == action_kind::forward) {
    return detail::concat(name_of_virtual(s, virtual_stage),
                          " waits for the activation of microbatch ", a.microbatch, " from ",
                          name_of_virtual(s, virtual_stage - 1));
  }
  return detail::concat(name_of_virtual(s, virtual_stage), " waits for the gradient of microbatch ",
                        a.microbatch, " from ", name_of_virtual(s, virtual_stage + 1));
}

// Sends to the actor holding virtual stage `virtual_stage`.
template <class Atom>
void send_to_virtual(stage_actor_type self, std::size_t virtual_stage, Atom atom,
                     int32_t microbatch, bundle t) {
  auto& s = self->state;
  auto holder = holder_of(s.options.placement, s.actor_count(), virtual_stage);
  self->send(s.stages[holder.stage], atom, s.plan.step, microbatch,
             static_cast<int32_t>(holder.chunk), std::move(t));
}

// Runs a user hook on each tensor of `b`; a replacement must keep the shape, and keeps the flag
// saying whether the tensor needs a gradient.
template <class Hook>
void run_hook(const stage_state& s, const action& a, const Hook& hook, bundle& b,
              const char* name) {
  for (std::size_t i = 0; i < b.size(); ++i) {
    auto& t = b[i];
    hook_context context{s.options.index,
                         static_cast<std::size_t>(a.chunk),
                         a.microbatch,
                         s.plan.step,
                         s.plan.train,
                         i,
                         b.is_named() ? b.names()[i] : std::string{}};
    auto shape = t.sizes().vec();
    bool flagged = bundle::needs_gradient(t);
    try {
      hook(context, t);
    } catch (const std::exception& e) {
      throw pipeline_error(detail::concat("stage ", s.options.index, ", microbatch ", a.microbatch,
                                          ": the ", name, " hook failed on ", b.label(i), ": ",
                                          e.what()));
    }
    ACTORPIPE_CHECK(t.defined() && t.sizes().vec() == shape, "stage ", s.options.index,
                    ", microbatch ", a.microbatch, ": the ", name, " hook replaced ", b.label(i),
                    " of shape ", c10::IntArrayRef(shape), " by one of shape ",
                    t.defined() ? t.sizes() : c10::IntArrayRef{});
    t = t.detach();
    if (flagged && t.is_floating_point()) {
      t.requires_grad_(true);
    }
  }
}

// Whether the forward `a` keeps only its input, to be recomputed at backward.
bool recompute(const stage_state& s, const action& a) {
  switch (s.options.recompute) {
  case recompute_mode::never:
    return false;
  case recompute_mode::except_last:
    return a.microbatch + 1 < s.microbatches;
  case recompute_mode::always:
    return true;
  }
  return false;
}

// The last stage's forward in training: its loss, read once the program has run (add_losses:
// on a GPU, reading waits for the device).
void run_forward_loss(stage_state& s, stages::stage& st, const action& a, const bundle& input,
                      bool recomputed) {
  auto position = static_cast<std::size_t>(a.microbatch);
  // The plain loss by reference (no copy of the function per micro-batch).
  loss_function with_inputs;
  if (s.options.loss_with_inputs) {
    with_inputs = [&s, position](const torch::Tensor& output, const torch::Tensor& target) {
      return s.options.loss_with_inputs(output, target, s.plan.loss_inputs.at(position));
    };
  }
  const auto& loss = s.options.loss_with_inputs ? with_inputs : s.options.loss;
  s.losses.push_back(st.forward_loss(a.microbatch, input, s.plan.targets.at(position), loss,
                                     s.plan.loss_scales.at(position), recomputed));
  s.loss_positions.push_back(position);
}

// A forward whose input is there; returns the bytes it sent.
int64_t run_forward(stage_actor_type self, stages::stage& st, const action& a) {
  auto& s = self->state;
  const key k{s.plan.step, a.microbatch, a.chunk};
  auto input = std::move(s.activations[k]);
  s.activations.erase(k);
  s.device->adopt(input);
  if (s.plan.train) {
    s.peak_live = std::max(s.peak_live, ++s.live);
  }
  bool recomputed = s.plan.train && recompute(s, a);
  s.report.stats.recomputed += recomputed ? 1 : 0;
  if (s.plan.train && st.is_last()) {
    run_forward_loss(s, st, a, input, recomputed);
    return 0;
  }
  auto output = st.forward(a.microbatch, input, recomputed);
  if (s.options.hooks.after_forward) {
    run_hook(s, a, s.options.hooks.after_forward, output, "after_forward");
  }
  if (st.is_last()) {
    s.report.outputs.at(static_cast<std::size_t>(a.microbatch)) = output.single(
      detail::concat("stage ", s.options.index, ": the pipeline's output (forward-only)"));
    return 0;
  }
  auto bytes = static_cast<int64_t>(output.nbytes());
  output.set_ready(s.device->record(st.replayed_last()));
  send_to_virtual(self, s.virtual_index(a.chunk) + 1, forward_atom::value, a.microbatch,
                  std::move(output));
  return bytes;
}

// A backward (whole, or the input half of a split one) whose gradient is there; returns the
// bytes it sent.
int64_t run_backward(stage_actor_type self, stages::stage& st, const action& a, bool split) {
  auto& s = self->state;
  bundle grad;
  if (!st.is_last()) {
    const key k{s.plan.step, a.microbatch, a.chunk};
    grad = std::move(s.gradients[k]);
    s.gradients.erase(k);
    s.device->adopt(grad);
  }
  auto input_grad = split ? st.backward_input(a.microbatch, grad) : st.backward(a.microbatch, grad);
  if (!split) {
    --s.live;
  }
  if (st.is_first()) {
    return 0;
  }
  if (s.options.hooks.after_backward) {
    run_hook(s, a, s.options.hooks.after_backward, input_grad, "after_backward");
  }
  auto bytes = static_cast<int64_t>(input_grad.nbytes());
  input_grad.set_ready(s.device->record(st.replayed_last()));
  send_to_virtual(self, s.virtual_index(a.chunk) - 1, backward_atom::value, a.microbatch,
                  std::move(input_grad));
  return bytes;
}

// Runs one action whose input is there; returns the bytes it sent.
int64_t run_action(stage_actor_type self, const action& a) {
  auto& s = self->state;
  auto& st = *s.chunks.at(static_cast<std::size_t>(a.chunk));
  switch (a.kind) {
  case action_kind::forward:
    return run_forward(self, st, a);
  case action_kind::backward:
    return run_backward(self, st, a, s.split_actions.at(s.next_action));
  case action_kind::weight:
    st.backward_weight(a.microbatch);
    --s.live;
    return 0;
  }
  return 0;
}

void start_queued(stage_actor_type self);
void say_graph_notes(stage_state& s);

// Whether the input of `a` is there (a weight pass's is the stage's own).
bool input_is_there(const stage_state& s, const action& a) {
  const key k{s.plan.step, a.microbatch, a.chunk};
  switch (a.kind) {
  case action_kind::forward:
    return s.activations.count(k) == 1;
  case action_kind::backward:
    return s.chunks.at(static_cast<std::size_t>(a.chunk))->is_last() || s.gradients.count(k) == 1;
  case action_kind::weight:
    return true;
  }
  return true;
}

// Runs `a` and records it in the report (times, bytes); false when it failed the step.
bool run_recorded(stage_actor_type self, const action& a, clock_type::time_point origin) {
  auto& s = self->state;
  auto start = clock_type::now();
  int64_t bytes = 0;
  s.device->select(static_cast<std::size_t>(a.chunk));
  int first_mark = s.options.device_timing ? s.device->mark() : -1;
  try {
    bytes = run_action(self, a);
  } catch (const std::exception& e) {
    fail(self, e, a.microbatch);
    return false;
  }
  if (s.options.device_timing) {
    s.action_marks.emplace_back(first_mark, s.device->mark());
  }
  auto end = clock_type::now();
  auto took = std::chrono::duration<double, std::milli>(end - start).count();
  if (log::get()->should_log(spdlog::level::trace)) {
    log::get()->trace("stage {}, step {}: {} took {:.3f} ms, sent {} bytes", s.options.index,
                      s.plan.step, to_string(a), took, bytes);
  }
  (a.kind == action_kind::forward ? s.report.stats.forward_ms : s.report.stats.backward_ms) += took;
  if (s.options.cuda_graphs == cuda_graph_mode::automatic) {
    s.chunks.at(static_cast<std::size_t>(a.chunk))->observe_action_ms(took);
  }
  s.report.stats.actions.push_back(
    {a, std::chrono::duration<double, std::milli>(start - origin).count(),
     std::chrono::duration<double, std::milli>(end - origin).count(), bytes});
  return true;
}

// The report's memory figures and, with device timing, each action's time on the device.
// Waits for the stream: the report's loss and outputs are read by other threads.
void complete_report(stage_state& s) {
  s.report.stats.peak_stash =
    static_cast<double>(s.peak_live) / static_cast<double>(s.chunks.size());
  // The chunks count their stash together (set_up): the stage's peak.
  s.report.stats.peak_stash_bytes = s.chunks.front()->peak_stash_bytes();
  s.report.stats.peak_working_bytes =
    s.device->is_cuda() ? -1 : s.chunks.front()->peak_working_bytes();
  // A GPU's peak is the process's: this stage's when it is alone there.
  if (s.device->is_cuda() && stages::cuda::stages_on(s.device->device()) == 1) {
    s.report.stats.device_peak_bytes = stages::cuda::peak_allocated_bytes(s.device->device());
  }
  s.device->synchronize();
  for (std::size_t i = 0; i < s.action_marks.size(); ++i) {
    auto& record = s.report.stats.actions.at(i);
    record.device_start_ms = s.device->at_ms(s.action_marks[i].first);
    record.device_end_ms = s.device->at_ms(s.action_marks[i].second);
  }
}

// The whole program has run: the report goes to the scheduler, then the early optimizer step
// and, with overlapping steps, the next plan.
void finish_program(stage_actor_type self, clock_type::time_point origin) {
  auto& s = self->state;
  s.device->end_chunks();
  if (s.options.cuda_graphs != cuda_graph_mode::off) {
    say_graph_notes(s);
  }
  if (s.plan.train) {
    try {
      end_training_program(s, origin);
    } catch (const std::exception& e) {
      fail(self, e);
      return;
    }
  }
  s.active = false;
  complete_report(s);
  // One early step at a time: with overlapping steps the one before may be unconfirmed yet.
  bool early = s.plan.train && s.plan.optimistic && !s.bmuf() && s.stepped_early == 0;
  s.report.stats.early_update = early;
  self->send(s.scheduler, done_atom::value, std::move(s.report));
  if (early) {
    step_early(s);
  }
  if (s.plan.train && s.plan.overlapped) {
    // The next step may start on the parameters of an early step that nothing validates (no
    // clipping: the update can only confirm it, or a failure undo both steps); otherwise the
    // update steps or confirms first.
    // Sharded, the parameters are whole only after the update's broadcast.
    s.awaiting_update =
      sharded(s) || !(s.stepped_early == s.plan.step && !s.options.report_gradient_norm);
    start_queued(self);
  }
}

// Runs the program as far as its inputs allow.
void advance(stage_actor_type self) {
  auto& s = self->state;
  if (s.waiting) {
    s.report.stats.wait_ms += ms_since(s.wait_start);
    s.waiting = false;
  }
  auto origin = clock_type::time_point(std::chrono::nanoseconds(s.plan.origin_ns));
  while (s.active && s.next_action < s.plan.program.size()) {
    const auto a = s.plan.program[s.next_action];
    if (!input_is_there(s, a)) {
      s.waiting = true;
      s.wait_start = clock_type::now();
      s.deadline.arm(self, s.options.wait_timeout, timeout_atom::value);
      return;
    }
    if (!run_recorded(self, a, origin)) {
      return;
    }
    ++s.next_action;
  }
  if (s.active) {
    finish_program(self, origin);
  }
}

// What the chunks' graphs have to say, each line once: a warning where they were asked for.
void say_graph_notes(stage_state& s) {
  for (auto& chunk : s.chunks) {
    for (const auto& line : chunk->take_graph_notes()) {
      if (s.options.cuda_graphs == cuda_graph_mode::on) {
        log::get()->warn("{}", line);
      } else {
        log::get()->info("{}", line);
      }
    }
  }
}

// Each chunk's part of the program, as its graphs see it (training steps).
void begin_graph_steps(stage_state& s) {
  if (s.options.cuda_graphs == cuda_graph_mode::off || !s.plan.train) {
    return;
  }
  std::vector<std::vector<stages::graph_action>> programs(s.chunks.size());
  for (std::size_t i = 0; i < s.plan.program.size(); ++i) {
    const auto& a = s.plan.program[i];
    auto what = a.kind == action_kind::forward ? stages::graph_action::kind::forward
                : a.kind == action_kind::backward && !s.split_actions.at(i)
                  ? stages::graph_action::kind::backward
                  : stages::graph_action::kind::weight; // a split B, or its W
    programs.at(static_cast<std::size_t>(a.chunk)).push_back({what, a.microbatch});
  }
  for (std::size_t c = 0; c < s.chunks.size(); ++c) {
    s.chunks[c]->begin_graph_step(programs[c]);
  }
}

// CUDA graphs (stages/graphs.hpp), each chunk with a book and a pool of its own.
void set_up_graphs(stage_state& s) {
  if (s.options.cuda_graphs == cuda_graph_mode::off) {
    return;
  }
  for (std::size_t c = 0; c < s.chunks.size(); ++c) {
    auto who = s.chunks.size() == 1 ? detail::concat("stage ", s.options.index)
                                    : detail::concat("stage ", s.options.index, ", chunk ", c);
    s.chunks[c]->use_graphs(s.device, s.options.cuda_graphs, who);
    if (s.options.loss_with_inputs && s.chunks[c]->is_last()) {
      s.chunks[c]->turn_off_graphs("its loss takes the batch's inputs, which stay on the host");
    }
  }
  say_graph_notes(s);
}

void set_threads(stage_state& s) {
  if (!s.threads_set) {
    // With OpenMP this sets the calling (stage) thread's team size.
    at::set_num_threads(static_cast<int>(s.options.threads));
    if (s.options.warm_memory) {
      memory::use_warm_memory_on_this_thread();
    }
    s.device->bind_current_thread();
    s.threads_set = true;
  }
}

// A step before `plan` stepped the optimizer early and neither an update nor an abort came for
// it (overlapping steps excepted, whose step before may still wait): it did not complete, and
// its early step is undone. Returns whether the step before is still unconfirmed and overlaps.
bool settle_step_before(stage_state& s, const step_plan& plan) {
  bool follows = s.plan.overlapped && s.stepped_early == s.plan.step;
  if (s.stepped_early != 0 && s.stepped_early < plan.step && !follows) {
    log::get()->warn("stage {}: step {} was neither confirmed nor aborted; its early "
                     "optimizer step is undone",
                     s.options.index, s.stepped_early);
    undo_early_step(s);
  }
  return follows;
}

// A fresh report, timeline and peak for the step of `plan`.
void begin_report(stage_state& s, const step_plan& plan, bool follows) {
  s.report = stage_report{};
  s.losses.clear();
  s.loss_positions.clear();
  s.action_marks.clear();
  if (s.options.device_timing) {
    s.device->begin_timeline(
      std::chrono::duration<double, std::milli>(
        clock_type::now() - clock_type::time_point(std::chrono::nanoseconds(plan.origin_ns)))
        .count());
  }
  if (s.device->is_cuda()) {
    stages::cuda::reset_peak_allocated(s.device->device());
  }
  s.report.step = plan.step;
  s.report.stats.stage = s.options.index;
  s.report.stats.overlapped = follows;
  if (s.chunks.back()->is_last() && !plan.train) {
    s.report.outputs.resize(static_cast<std::size_t>(plan.microbatches));
  }
}

// Starts a step's plan: its inputs join those that came before it, and the program runs as far
// as they allow.
void start_plan(stage_actor_type self, step_plan plan) {
  auto& s = self->state;
  set_threads(s);
  bool follows = settle_step_before(s, plan);
  drop_older_than(s.activations, plan.step);
  drop_older_than(s.gradients, plan.step);
  begin_report(s, plan, follows);
  if (s.options.chunk_streams) {
    s.device->begin_chunks(s.chunks.size());
  }
  for (std::size_t position = 0; position < plan.inputs.size(); ++position) {
    s.activations[key{plan.step, static_cast<int32_t>(position), 0}] =
      std::move(plan.inputs[position]);
  }
  plan.inputs.clear();
  s.plan = std::move(plan);
  if (s.batch_norm_sync) {
    // Mean-reduced losses weight a replica's gradients by its samples (sync_replicas).
    s.batch_norm_sync->weight = s.options.reduction == loss_reduction::mean
                                  ? static_cast<double>(std::max<int64_t>(1, s.plan.samples))
                                  : 1.0;
  }
  s.split_actions = split_backwards(s.plan.program);
  s.microbatches = s.plan.microbatches;
  s.next_action = 0;
  s.live = 0;
  s.peak_live = 0;
  s.waiting = false;
  s.active = true;
  try {
    begin_graph_steps(s);
    for (auto& chunk : s.chunks) {
      chunk->begin_step(s.plan.train);
    }
  } catch (const std::exception& e) {
    fail(self, e);
    return;
  }
  advance(self);
}

// Overlapping steps: the next plan, once this stage is done with the step before it.
void start_queued(stage_actor_type self) {
  auto& s = self->state;
  if (!s.active && !s.awaiting_update && !s.queued.empty()) {
    auto plan = std::move(s.queued.front());
    s.queued.pop_front();
    start_plan(self, std::move(plan));
  }
}

// After a step message: the thread polls for the next one before it sleeps.
void rest(stage_actor_type self) {
  linger(self, self->state.options.linger);
}

bool stale(const stage_state& s, uint64_t step) {
  return step < s.plan.step || (step == s.plan.step && !s.active && s.next_action > 0);
}

// The stage actor's state at its start: its chunks, scheduler and options, BMUF blocks and
// synchronised batch norm where the options ask for them.
void set_up(stage_state& s, std::vector<std::shared_ptr<stages::stage>> chunks,
            stage_listener_actor scheduler, stage_actor_options options) {
  // The chunks were built on the device (spawn_stage checked they agree): the stage holds it.
  s.device = stages::make_device_context(chunks.front()->config().device);
  s.chunks = std::move(chunks);
  for (std::size_t c = 1; c < s.chunks.size(); ++c) {
    s.chunks[c]->count_stash_with(*s.chunks.front()); // the stage's stash, not each chunk's
  }
  s.scheduler = std::move(scheduler);
  s.options = std::move(options);
  if (s.bmuf()) {
    for (auto& chunk : s.chunks) {
      chunk->enable_blocks(s.options.bmuf.nesterov);
    }
    s.warmed_up = s.options.bmuf.warmup_steps == 0;
  }
  if (sharded(s)) {
    for (auto& chunk : s.chunks) {
      chunk->shard_optimizer(s.options.sync->rank(), s.options.sync->size());
    }
  }
  if (s.options.sync && s.options.sync_batch_norm) {
    s.batch_norm_sync = c10::make_intrusive<replica_batch_norm_sync>(s.options.sync);
    for (auto& chunk : s.chunks) {
      chunk->synchronise_batch_norm(s.batch_norm_sync);
    }
  }
  set_up_graphs(s);
}

// The wait deadline fired: fails the step naming what the stage waited for, unless the wait
// ended meanwhile.
void waited_too_long(stage_actor_type self) {
  auto& s = self->state;
  if (!s.deadline.expired(self, s.active && s.waiting, s.wait_start, s.options.wait_timeout,
                          timeout_atom::value)) {
    return;
  }
  const auto& a = s.plan.program[s.next_action];
  auto step = s.plan.step;
  fail(self, failure{{error_kind::timeout, s.options.index, a.microbatch, step},
                     detail::concat(describe_wait(s, a), " (step ", step, ", action ",
                                    s.next_action, " of its program) and gave up after ",
                                    s.options.wait_timeout.count(), " ms")});
}

// Drops step `step`: its inputs, its queued plan, its early optimizer step and buffers.
void abort_step(stage_actor_type self, uint64_t step) {
  auto& s = self->state;
  set_threads(s);
  drop_step(s.activations, step);
  drop_step(s.gradients, step);
  s.queued.erase(std::remove_if(s.queued.begin(), s.queued.end(),
                                [&](const step_plan& p) { return p.step == step; }),
                 s.queued.end());
  // A failed step changes no parameter: an early optimizer step of it (or of the step before,
  // which the scheduler aborts next) is undone first, then the running step's buffers go
  // back to its start, then to the start of the early-stepped one.
  std::vector<std::vector<torch::Tensor>> buffers;
  if (s.stepped_early != 0 && s.stepped_early <= step) {
    buffers = std::move(s.early_buffers);
    undo_early_step(s);
  }
  if (step == s.plan.step) {
    s.active = false;
    s.awaiting_update = false;
    abort_chunks(s);
  }
  try {
    for (std::size_t c = 0; c < buffers.size(); ++c) {
      s.chunks[c]->restore_step_start_buffers(buffers[c]);
    }
  } catch (const std::exception& e) {
    log::get()->error("stage {}: restoring the buffers of an aborted step failed: {}",
                      s.options.index, e.what());
  }
  // The parameters are as before the step once this replies (on a GPU: the stream is done).
  s.device->synchronize();
  start_queued(self);
}

// An activation or gradient from a neighbour: kept for its action, which runs now if it is the
// running step's turn (one of a step already done, or an older one, is dropped).
void take_input(stage_actor_type self, std::map<key, bundle>& inputs, const key& k, bundle b) {
  auto& s = self->state;
  auto step = std::get<0>(k);
  if (stale(s, step)) {
    return;
  }
  inputs[k] = std::move(b);
  if (s.active && step == s.plan.step) {
    advance(self);
  }
  rest(self);
}

// The optimizer step the scheduler asks for once every stage has its gradients; replied before
// the actor lingers for the next step's plan.
caf::result<double> answer_update(stage_actor_type self, uint64_t step, double learning_rate,
                                  double gradient_scale) {
  auto& s = self->state;
  set_threads(s);
  auto promise = self->make_response_promise<double>();
  auto ms = update(s, step, learning_rate, gradient_scale);
  // The caller may read the parameters once this replies (on a GPU: from another stream).
  s.device->synchronize();
  if (ms) {
    promise.deliver(*ms);
  } else {
    promise.deliver(ms.error());
  }
  if (s.awaiting_update && step == s.plan.step) {
    s.awaiting_update = false;
    start_queued(self);
  }
  rest(self);
  return promise;
}

stage_self_actor::behavior_type stage_behavior(stage_actor_type self,
                                               std::vector<std::shared_ptr<stages::stage>> chunks,
                                               stage_listener_actor scheduler,
                                               stage_actor_options options) {
  pthread_setname_np(pthread_self(), "ap.stage");
  set_up(self->state, std::move(chunks), std::move(scheduler), std::move(options));
  return {
    [=](connect_atom, std::vector<stage_peer_actor>& stages) {
      self->state.stages = std::move(stages);
    },
    [=](plan_atom, step_plan& plan) {
      auto& s = self->state;
      if (!s.queued.empty() || (s.plan.overlapped && (s.active || s.awaiting_update))) {
        // Overlapping steps: its turn comes when this stage is done with the step before.
        s.queued.push_back(std::move(plan));
      } else {
        start_plan(self, std::move(plan));
      }
      rest(self);
    },
    [=](forward_atom, uint64_t step, int32_t microbatch, int32_t chunk, bundle& x) {
      take_input(self, self->state.activations, key{step, microbatch, chunk}, std::move(x));
    },
    [=](backward_atom, uint64_t step, int32_t microbatch, int32_t chunk, bundle& g) {
      take_input(self, self->state.gradients, key{step, microbatch, chunk}, std::move(g));
    },
    [=](timeout_atom) { waited_too_long(self); },
    [=](abort_atom, uint64_t step) -> caf::result<bool> {
      abort_step(self, step);
      return true;
    },
    [=](update_atom, uint64_t step, double learning_rate, double gradient_scale) {
      return answer_update(self, step, learning_rate, gradient_scale);
    },
    [=](block_atom) -> caf::result<bool> {
      set_threads(self->state);
      return done_unless(end_block_now(self->state));
    },
    [=](save_atom, const std::string& path) -> caf::result<bool> {
      set_threads(self->state);
      return done_unless(save_state(self->state, path));
    },
    [=](fetch_atom, uint64_t) -> caf::result<std::shared_ptr<const tensor_map>> {
      set_threads(self->state);
      auto state = fetch_state(self->state);
      if (!state) {
        return std::move(state.error());
      }
      return std::move(*state);
    },
    [=](load_atom, const std::shared_ptr<const tensor_map>& all) -> caf::result<bool> {
      set_threads(self->state);
      return done_unless(load_state(self->state, *all));
    },
  };
}

} // namespace

local_stage_actor spawn_stage(caf::actor_system& sys,
                              std::vector<std::shared_ptr<stages::stage>> chunks,
                              stage_listener_actor scheduler, stage_actor_options options) {
  ACTORPIPE_CHECK(!chunks.empty(), "stage ", options.index, ": a stage actor needs a chunk");
  for (const auto& chunk : chunks) {
    ACTORPIPE_CHECK(chunk->config().device == chunks.front()->config().device, "stage ",
                    options.index, ": its chunks were built on ",
                    chunks.front()->config().device.str(), " and ", chunk->config().device.str(),
                    ": a stage actor computes on one device");
  }
  return sys.spawn<caf::detached>(stage_behavior, std::move(chunks), std::move(scheduler),
                                  std::move(options));
}

} // namespace actorpipe::actors
