// What a stage does after its program that needs no actor: the replica sync, tied gradients,
// BMUF blocks, the early optimizer step and its confirmation (actors/stage_state.hpp).
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "actors/pipeline_errc.hpp"
#include "actors/stage_state.hpp"
#include "comm/tie_group.hpp"
#include "logging/log.hpp"

namespace actorpipe::actors::stage_parts {

// The report's loss: each micro-batch's loss times its scale, summed in the order computed.
void add_losses(stage_state& s) {
  for (std::size_t i = 0; i < s.losses.size(); ++i) {
    s.report.loss += s.plan.loss_scales.at(s.loss_positions[i]) * s.losses[i].item<double>();
  }
  s.losses.clear();
  s.loss_positions.clear();
}

// After a training program: average gradients (and buffers) with the other replicas' same
// stage. Runs on this stage's thread while earlier stages may still be in backward.
void sync_replicas(stage_state& s, clock_type::time_point origin) {
  auto& sync = *s.options.sync;
  auto start = clock_type::now();
  // Mean-reduced losses: replica r's gradients count n_r / sum(n) (its share of all samples);
  // sum-reduced ones are summed. The loss (known on the last stage) is combined alike.
  bool mean = s.options.reduction == loss_reduction::mean;
  double weight = mean ? static_cast<double>(s.plan.samples) : 1.0;
  bool last = s.chunks.back()->is_last(); // the last virtual stage is its holder's last chunk
  auto total = sync.sum(weight, last ? s.report.loss * weight : 0.0);
  if (last) {
    s.report.loss = mean ? total.weighted_loss / total.weight : total.weighted_loss;
  }
  double scale = mean ? weight / total.weight : 1.0;
  for (auto it = s.chunks.rbegin(); it != s.chunks.rend(); ++it) {
    auto layout =
      s.options.shard == shard_mode::gradients ? (*it)->shards() : stages::stage::shard_layout{};
    (*it)->with_tensors(
      [&](const std::vector<torch::Tensor>& parameters, const std::vector<torch::Tensor>&) {
        s.report.stats.sync_bytes +=
          layout.ranks > 1 ? sync.reduce_gradients(parameters, layout.owner, layout.tied, scale)
                           : sync.all_reduce_gradients(parameters, scale);
      });
  }
  if (s.options.buffers != buffer_sync::none) {
    for (auto& chunk : s.chunks) {
      chunk->with_tensors(
        [&](const std::vector<torch::Tensor>&, const std::vector<torch::Tensor>& buffers) {
          sync.sync_buffers(buffers, s.options.buffers);
        });
    }
  }
  s.report.stats.sync_start_ms = std::chrono::duration<double, std::milli>(start - origin).count();
  s.report.stats.sync_end_ms = ms_since(origin);
  log::get()->debug("stage {}, step {}: replica sync of {} bytes took {:.1f} ms", s.options.index,
                    s.plan.step, s.report.stats.sync_bytes,
                    s.report.stats.sync_end_ms - s.report.stats.sync_start_ms);
}

// After a training program: losses, batch-norm commits, the replica sync, tied gradients, the
// memory the stage holds and its gradients' sum of squares, in the report.
void end_training_program(stage_state& s, clock_type::time_point origin) {
  add_losses(s);
  for (auto& chunk : s.chunks) {
    chunk->end_step();
  }
  if (s.options.sync && !s.bmuf()) {
    sync_replicas(s, origin);
  }
  if (s.options.ties) {
    sum_tied_gradients(s);
  }
  for (auto& chunk : s.chunks) {
    s.report.stats.optimizer_bytes += chunk->optimizer_bytes();
    s.report.stats.gradient_bytes += chunk->gradient_bytes();
  }
  if (!s.options.report_gradient_norm) {
    return;
  }
  // ZeRO-2: each rank holds its own parameters' summed gradients; the stage's sum of squares is
  // the sum over the ranks of theirs.
  bool partial = sharded(s) && s.options.shard == shard_mode::gradients;
  for (auto& chunk : s.chunks) {
    s.report.gradient_square_sum += chunk->gradient_square_sum(partial);
  }
  if (partial) {
    auto sum = torch::tensor({s.report.gradient_square_sum}, torch::kDouble)
                 .to(s.chunks.front()->config().device);
    s.options.sync->all_reduce_sum(sum, "gradient norm all-reduce");
    s.report.gradient_square_sum = sum.cpu().item<double>();
  }
}

// BMUF: ends the warm-up (every replica takes rank 0's parameters and buffers) or the running
// block (parameters averaged and filtered, buffers as options.buffers says), then clears the
// optimizers' state if asked. The collectives come first and fail with pipeline_error past their
// deadline, before any chunk's block state changes.
void end_block(stage_state& s) {
  auto& sync = *s.options.sync;
  const auto& b = s.options.bmuf;
  for (auto& chunk : s.chunks) {
    chunk->with_tensors(
      [&](const std::vector<torch::Tensor>& parameters, const std::vector<torch::Tensor>& buffers) {
        if (!s.warmed_up) {
          auto all = parameters;
          all.insert(all.end(), buffers.begin(), buffers.end());
          sync.broadcast(all);
        } else {
          sync.average(parameters, "BMUF parameter all-reduce");
          sync.sync_buffers(buffers, s.options.buffers);
        }
      });
  }
  for (auto& chunk : s.chunks) {
    if (!s.warmed_up) {
      chunk->start_blocks();
    } else {
      chunk->end_block(b.block_lr, b.block_momentum);
    }
    if (b.reset_momentum) {
      chunk->reset_optimizer_state();
    }
  }
  log::get()->debug("stage {}: BMUF {} after {} local steps", s.options.index,
                    s.warmed_up ? "block" : "warm-up", s.block_position);
  s.warmed_up = true;
  s.block_position = 0;
}

// BMUF after an optimizer step: whether this step ends the warm-up or a block.
bool ends_block(const stage_state& s) {
  const auto& b = s.options.bmuf;
  return s.block_position + 1 >= (s.warmed_up ? b.block_steps : b.warmup_steps);
}

// After the replica sync: the gradients of parameters tied to other stages become the sum over
// their holders (this actor's chunks first, then the tie group).
void sum_tied_gradients(stage_state& s) {
  if (s.options.ties->members().count(s.options.index) == 0) {
    return;
  }
  std::map<std::string, torch::Tensor> local;
  std::vector<std::map<std::string, torch::Tensor>> per_chunk;
  torch::NoGradGuard no_grad;
  for (auto& chunk : s.chunks) {
    per_chunk.push_back(chunk->shared_parameters());
    for (const auto& [name, p] : per_chunk.back()) {
      // Summed on the CPU: the holders may be on different devices and streams (a blocking
      // copy from a GPU; a copy of the CPU's gradient, as before).
      auto it = local.find(name);
      if (it == local.end()) {
        local.emplace(name, p.grad().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
      } else {
        it->second.add_(p.grad().to(torch::kCPU));
      }
    }
  }
  s.options.ties->sum(s.plan.step, s.options.index, local, s.options.wait_timeout);
  for (auto& chunk : per_chunk) {
    for (auto& [name, p] : chunk) {
      p.mutable_grad().copy_(local.at(name));
    }
  }
}

namespace {

// This stage's refusal of the optimizer step of `step`: stage_failure, with the stage and step.
pipeline_error update_failure(const stage_state& s, uint64_t step, const std::string& sentence) {
  return pipeline_error(
    detail::concat("stage ", s.options.index, ", step ", step, ": ", sentence),
    error_details{error_kind::stage_failure, s.options.index, std::nullopt, step});
}

} // namespace

// ZeRO, after the optimizer step: every parameter takes its owner's value. When a broadcast
// fails, the chunks go back to `before` (owned_only: owned_state()'s copies, else state()'s)
// and this throws what failed.
void gather_parameters(stage_state& s, uint64_t step,
                       const std::vector<stages::stage::tensor_map>& before, bool owned_only) {
  try {
    for (auto& chunk : s.chunks) {
      auto layout = chunk->shards();
      chunk->with_tensors(
        [&](const std::vector<torch::Tensor>& parameters, const std::vector<torch::Tensor>&) {
          s.options.sync->broadcast_from_owners(parameters, layout.owner);
        });
    }
  } catch (const std::exception& e) {
    for (std::size_t c = 0; c < before.size(); ++c) {
      owned_only ? s.chunks[c]->load_owned_state(before[c]) : s.chunks[c]->load_state(before[c]);
    }
    throw update_failure(
      s, step,
      detail::concat("the sharded optimizer step's parameter broadcast failed: ", e.what()));
  }
}

void gather_optimizer_state(stage_state& s) {
  for (auto& chunk : s.chunks) {
    // The chunk's own tensors, not copies (only the parameters it owns have optimizer state;
    // the gather pickles what it sends).
    stages::stage::tensor_map optimizer;
    for (auto& [name, t] : chunk->state(/*copy=*/false, /*tie_copies=*/true)) {
      if (name.rfind("optimizer/", 0) == 0) {
        optimizer.emplace(name, t);
      }
    }
    chunk->keep_gathered_state(
      s.options.sync->gather_on_first(optimizer, "optimizer state gather"));
  }
  log::get()->debug("stage {}, data parallel rank {}: the replicas' optimizer state gathered{}",
                    s.options.index, s.options.sync->rank(),
                    s.options.sync->rank() == 0 ? " here" : "");
}

namespace {

// An early optimizer step is settled (kept or undone): its saved state leaves the stage, which
// holds none any more; returns the state from before it.
std::vector<stages::stage::tensor_map> take_before_update(stage_state& s) {
  auto before = std::move(s.before_update);
  s.before_update.clear();
  s.early_buffers.clear();
  s.stepped_early = 0;
  return before;
}

} // namespace

void restore_before_update(stage_state& s) {
  auto step = s.stepped_early;
  auto before = take_before_update(s);
  try {
    for (std::size_t c = 0; c < before.size(); ++c) {
      s.chunks[c]->load_state(before[c]);
    }
  } catch (const std::exception& e) {
    throw update_failure(s, step,
                         detail::concat("undoing the early optimizer step failed: ", e.what()));
  }
}

void undo_early_step(stage_state& s) noexcept {
  try {
    restore_before_update(s);
  } catch (const std::exception& e) {
    log::get()->error("{}", e.what());
  }
}

// Post-validation: the optimizer step right after the program, while the other stages still
// work (and the scheduler waits for them), from gradients not yet scaled by a global clip. The
// update that follows confirms it or has it undone (update()); an abort undoes it.
void step_early(stage_state& s) {
  auto start = clock_type::now();
  try {
    for (auto& chunk : s.chunks) {
      s.before_update.push_back(chunk->state(/*copy=*/true, /*tie_copies=*/true));
      s.early_buffers.push_back(chunk->step_start_buffers());
    }
    for (auto& chunk : s.chunks) {
      if (s.plan.learning_rate >= 0) {
        chunk->set_learning_rate(s.plan.learning_rate);
      }
      chunk->optimizer_step(1.0);
    }
    s.stepped_early = s.plan.step;
    s.early_learning_rate = s.plan.learning_rate;
  } catch (const std::exception& e) {
    // The update steps again, and reports what fails then.
    log::get()->debug("stage {}: early optimizer step of step {} failed ({}); undone",
                      s.options.index, s.plan.step, e.what());
    s.stepped_early = s.plan.step;
    undo_early_step(s);
  }
  s.early_ms = ms_since(start);
}

namespace {

// The update of `step` after an early optimizer step: true when it confirms it (the same step
// and rate, no clipping), which stays; otherwise the early step is undone, false. Throws what
// fails.
bool confirms_early_step(stage_state& s, uint64_t step, double learning_rate,
                         double gradient_scale) {
  bool same = s.stepped_early == step && gradient_scale == 1.0 &&
              (learning_rate < 0 || learning_rate == s.early_learning_rate);
  if (same) {
    auto before = take_before_update(s);
    if (sharded(s)) {
      gather_parameters(s, step, before, false);
    }
    return true;
  }
  if (s.plan.step != step) {
    throw update_failure(s, step,
                         detail::concat("its early optimizer step cannot be redone, step ",
                                        s.plan.step, " already runs on its parameters"));
  }
  // Clipping scaled the gradients (or another rate came): the step from the state before.
  restore_before_update(s);
  return false;
}

// Every chunk's optimizer step; returns the state a failure after it restores: a block's last
// step keeps the state before it (for the block sync), a sharded one what it changes here (for
// the parameters' broadcast).
std::vector<stages::stage::tensor_map> step_chunks(stage_state& s, uint64_t step,
                                                   double learning_rate, double gradient_scale,
                                                   bool block_end) {
  std::vector<stages::stage::tensor_map> before;
  try {
    for (auto& chunk : s.chunks) {
      if (block_end) {
        before.push_back(chunk->state());
      } else if (sharded(s)) {
        before.push_back(chunk->owned_state());
      }
      if (learning_rate >= 0) {
        chunk->set_learning_rate(learning_rate);
      }
      chunk->optimizer_step(gradient_scale);
    }
  } catch (const std::exception& e) {
    throw update_failure(s, step, detail::concat("optimizer step failed: ", e.what()));
  }
  return before;
}

// BMUF after the optimizer step: the block goes on, or ends with its sync; a failed sync puts
// the chunks back to `before` and throws.
void advance_block(stage_state& s, uint64_t step, bool block_end,
                   const std::vector<stages::stage::tensor_map>& before) {
  ++s.block_position;
  if (!block_end) {
    return;
  }
  try {
    end_block(s);
  } catch (const std::exception& e) {
    --s.block_position;
    for (std::size_t c = 0; c < before.size(); ++c) {
      s.chunks[c]->load_state(before[c]);
    }
    throw update_failure(s, step, detail::concat("BMUF block sync failed: ", e.what()));
  }
}

} // namespace

caf::expected<double> update(stage_state& s, uint64_t step, double learning_rate,
                             double gradient_scale) {
  auto start = clock_type::now();
  try {
    if (s.stepped_early != 0 && confirms_early_step(s, step, learning_rate, gradient_scale)) {
      return s.early_ms + ms_since(start);
    }
    bool block_end = s.bmuf() && ends_block(s);
    auto before = step_chunks(s, step, learning_rate, gradient_scale, block_end);
    if (sharded(s)) {
      gather_parameters(s, step, before, true);
    } else if (s.bmuf()) {
      advance_block(s, step, block_end, before);
    }
  } catch (const pipeline_error& e) {
    return make_pipeline_error(e.details(), e.what());
  } catch (const std::exception& e) {
    auto why = update_failure(s, step, e.what());
    return make_pipeline_error(why.details(), why.what());
  }
  return ms_since(start);
}

} // namespace actorpipe::actors::stage_parts
