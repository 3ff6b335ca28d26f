// A stage between steps: the optimizer step, BMUF blocks, the gradients' norm, learning rates,
// and its state for checkpoints and snapshots (stages/stage.hpp).
#include "stages/stage.hpp"

#include <algorithm>
#include <set>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <actorpipe/errors.hpp>

#include "stages/checkpoint.hpp"
#include "stages/stage_helpers.hpp"

namespace actorpipe::stages {
using namespace stage_helpers;

namespace {

// Adam's and AdamW's per-parameter state: the same fields under two types. Calls f with the
// state as its own type; false when it is neither.
template <class F>
bool with_adam_state(torch::optim::OptimizerParamState& s, F&& f) {
  if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(&s)) {
    f(*adam);
    return true;
  }
  if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(&s)) {
    f(*adamw);
    return true;
  }
  return false;
}

} // namespace

bool stage::owns(const torch::Tensor& p) const {
  return shards_.ranks == 1 || owned_.count(p.unsafeGetTensorImpl()) != 0;
}

void stage::shard_optimizer(std::size_t rank, std::size_t ranks) {
  ACTORPIPE_CHECK(ranks >= 1 && rank < ranks, "stage ", config_.index, ": shard ", rank, " of ",
                  ranks, " does not exist");
  std::lock_guard<std::mutex> guard{mutex_};
  auto all = parameters();
  shards_ = shard_layout{rank, ranks, {}, {}};
  optimizer_.reset();
  owned_.clear();
  gathered_.reset();
  if (ranks > 1) {
    // Largest first (stable: model order among equals), each to the least loaded rank.
    std::vector<std::size_t> order(all.size());
    for (std::size_t i = 0; i < order.size(); ++i) {
      order[i] = i;
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return all[a].numel() > all[b].numel(); });
    shards_.owner.assign(all.size(), 0);
    std::vector<int64_t> load(ranks, 0);
    for (auto i : order) {
      auto least =
        static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      shards_.owner[i] = least;
      load[least] += all[i].numel();
    }
    // Tied to another stage: all-reduced under ZeRO-2 (the tie's holders sum the gradient).
    std::set<const c10::TensorImpl*> tied;
    for_each_named(layers_, false, config_.tied,
                   [&](const std::string& name, const torch::Tensor& p) {
                     if (config_.shared_ties.count(name) != 0) {
                       tied.insert(p.unsafeGetTensorImpl());
                     }
                   });
    for (const auto& p : all) {
      shards_.tied.push_back(tied.count(p.unsafeGetTensorImpl()) != 0);
    }
  }
  std::vector<torch::Tensor> mine;
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (ranks == 1 || shards_.owner[i] == rank) {
      mine.push_back(all[i]);
      owned_.insert(all[i].unsafeGetTensorImpl());
    }
  }
  if (make_optimizer_ && !mine.empty()) {
    optimizer_ = make_optimizer_(std::move(mine));
  }
}

stage::shard_layout stage::shards() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return shards_;
}

int64_t stage::optimizer_bytes() const {
  std::lock_guard<std::mutex> guard{mutex_};
  int64_t bytes = 0;
  if (!optimizer_) {
    return bytes;
  }
  for (const auto& entry : optimizer_->state()) {
    if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(entry.second.get())) {
      if (sgd->momentum_buffer().defined()) {
        bytes += static_cast<int64_t>(sgd->momentum_buffer().nbytes());
      }
    } else {
      with_adam_state(*entry.second, [&](auto& adam) {
        for (const auto& t : {adam.exp_avg(), adam.exp_avg_sq(), adam.max_exp_avg_sq()}) {
          bytes += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
        }
      });
    }
  }
  return bytes;
}

int64_t stage::gradient_bytes() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return held_gradient_bytes();
}

int64_t stage::held_gradient_bytes() const {
  int64_t bytes = 0;
  for (const auto& p : parameters()) {
    bytes += p.grad().defined() ? static_cast<int64_t>(p.grad().nbytes()) : 0;
  }
  return bytes;
}

void stage::optimizer_step(double gradient_scale) {
  std::lock_guard<std::mutex> guard{mutex_};
  gathered_.reset();
  if (gradient_scale != 1.0) {
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) {
      if (p.grad().defined()) {
        p.mutable_grad().mul_(gradient_scale);
      }
    }
  }
  if (optimizer_) {
    optimizer_->step();
  }
}

void stage::enable_blocks(bool nesterov) {
  std::lock_guard<std::mutex> guard{mutex_};
  blocks_ = true;
  block_nesterov_ = nesterov;
  reset_blocks({});
}

void stage::start_blocks() {
  std::lock_guard<std::mutex> guard{mutex_};
  reset_blocks({});
}

void stage::load_blocks(const tensor_map& all) {
  std::lock_guard<std::mutex> guard{mutex_};
  ACTORPIPE_ASSERT(blocks_);
  reset_blocks(all);
}

void stage::reset_blocks(const tensor_map& all) {
  torch::NoGradGuard no_grad;
  block_states_.clear();
  for_each_named(
    layers_, false, config_.tied, [&](const std::string& name, const torch::Tensor& p) {
      auto loaded = [&](const char* field) {
        auto it = all.find("optimizer/" + name + "/" + field);
        return it == all.end() ? torch::zeros_like(p) : it->second.to(p.device()).clone();
      };
      block_state b;
      b.global = p.detach().clone();
      b.momentum = loaded("block_momentum");
      if (block_nesterov_) {
        b.previous = loaded("block_previous");
      }
      block_states_.emplace(name, std::move(b));
    });
}

void stage::end_block(double block_lr, double block_momentum) {
  std::lock_guard<std::mutex> guard{mutex_};
  ACTORPIPE_ASSERT(blocks_);
  torch::NoGradGuard no_grad;
  for_each_named(layers_, false, config_.tied,
                 [&](const std::string& name, const torch::Tensor& p) {
                   auto& b = block_states_.at(name);
                   // v = mu v + eta (mean(x) - g); g = g + v; Nesterov: g -= mu (v - v_prev),
                   // v_prev = v.
                   b.momentum.mul_(block_momentum).add_(p - b.global, block_lr);
                   b.global.add_(b.momentum);
                   if (block_nesterov_) {
                     b.global.sub_(b.momentum - b.previous, block_momentum);
                     b.previous.copy_(b.momentum);
                   }
                   const_cast<torch::Tensor&>(p).copy_(b.global);
                 });
}

void stage::reset_optimizer_state() {
  std::lock_guard<std::mutex> guard{mutex_};
  if (optimizer_) {
    optimizer_->state().clear();
  }
}

double stage::gradient_square_sum(bool owned_only) const {
  std::lock_guard<std::mutex> guard{mutex_};
  double sum = 0;
  for_each_named(layers_, false, config_.tied,
                 [&](const std::string& name, const torch::Tensor& p) {
                   if (p.grad().defined() && !is_copy(name) && (!owned_only || owns(p))) {
                     sum += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
                   }
                 });
  return sum;
}

void stage::with_tensors(const std::function<void(const std::vector<torch::Tensor>&,
                                                  const std::vector<torch::Tensor>&)>& fn) {
  std::lock_guard<std::mutex> guard{mutex_};
  torch::NoGradGuard no_grad;
  fn(parameters(), buffers());
}

std::size_t stage::stash_size() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return stash_.size();
}

std::size_t stage::peak_stash() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return peak_stash_;
}

int64_t stage::peak_working_bytes() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return std::max<int64_t>(0, stash_tally_->peak_held - stash_tally_->peak);
}

int64_t stage::peak_stash_bytes() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return stash_tally_->peak;
}

void stage::count_stash_with(const stage& other) {
  std::scoped_lock guard{mutex_, other.mutex_};
  stash_tally_ = other.stash_tally_;
}

int64_t stage::parameter_count() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return actorpipe::parameter_count(layers_, 0, layers_.size());
}

std::vector<std::pair<std::string, torch::Tensor>> stage::named_tensors(bool gradients) const {
  std::lock_guard<std::mutex> guard{mutex_};
  std::vector<std::pair<std::string, torch::Tensor>> result;
  torch::NoGradGuard no_grad;
  for (const auto& l : layers_) {
    if (auto m = l.module()) {
      for (const auto& item : m->named_parameters()) {
        auto t = gradients ? item.value().grad() : item.value();
        result.emplace_back(l.qualified(item.key()), t.defined() ? t.detach().clone() : t);
      }
    }
  }
  return result;
}

void stage::set_learning_rate(double lr) {
  std::lock_guard<std::mutex> guard{mutex_};
  if (!optimizer_) {
    return;
  }
  for (auto& group : optimizer_->param_groups()) {
    if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&group.options())) {
      sgd->lr(lr);
    } else if (auto* adam = dynamic_cast<torch::optim::AdamOptions*>(&group.options())) {
      adam->lr(lr);
    } else if (auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&group.options())) {
      adamw->lr(lr);
    } else {
      throw invalid_argument("set_learning_rate: only SGD, Adam and AdamW optimizers are "
                             "supported");
    }
  }
}

stage::tensor_map stage::state(bool copy, bool tie_copies) const {
  std::lock_guard<std::mutex> guard{mutex_};
  return collect_state(copy, tie_copies, /*owned_only=*/false);
}

stage::tensor_map stage::owned_state() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return collect_state(/*copy=*/true, /*tie_copies=*/true, /*owned_only=*/true);
}

void stage::load_owned_state(const tensor_map& part) {
  std::lock_guard<std::mutex> guard{mutex_};
  torch::NoGradGuard no_grad;
  for_each_named(layers_, false, config_.tied,
                 [&](const std::string& name, const torch::Tensor& p) {
                   if (auto it = part.find(name); it != part.end() && owns(p)) {
                     const_cast<torch::Tensor&>(p).copy_(it->second);
                   }
                 });
  load_optimizer_state(part);
}

void stage::keep_gathered_state(tensor_map optimizer_state) {
  std::lock_guard<std::mutex> guard{mutex_};
  gathered_ = std::move(optimizer_state);
}

bool stage::holds_gathered_state() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return gathered_.has_value();
}

stage::tensor_map stage::checkpoint_state(bool copy) const {
  std::lock_guard<std::mutex> guard{mutex_};
  auto all = collect_state(copy, /*tie_copies=*/false, /*owned_only=*/false);
  if (shards_.ranks > 1 && (!gathered_ || shards_.rank != 0)) {
    all[partial_state_key] = torch::tensor(
      {static_cast<int64_t>(shards_.rank), static_cast<int64_t>(shards_.ranks)}, torch::kInt64);
    return all;
  }
  if (gathered_) {
    for (const auto& [name, t] : *gathered_) {
      // "optimizer/<parameter>/<field>", for the parameters this stage stores.
      auto parameter = name.substr(10, name.rfind('/') - 10);
      if (all.count(parameter) != 0) {
        all[name] = copy ? t.clone() : t;
      }
    }
  }
  return all;
}

stage::tensor_map stage::collect_state(bool copy, bool tie_copies, bool owned_only) const {
  torch::NoGradGuard no_grad;
  tensor_map result;
  auto take = [copy](const torch::Tensor& t) { return copy ? t.detach().clone() : t.detach(); };
  auto save_optimizer = [&](const std::string& name, const torch::Tensor& p) {
    if (!optimizer_) {
      return;
    }
    auto it = optimizer_->state().find(optimizer_key(p));
    if (it == optimizer_->state().end()) {
      return;
    }
    auto prefix = "optimizer/" + name + "/";
    if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
      if (sgd->momentum_buffer().defined()) {
        result[prefix + "momentum_buffer"] = take(sgd->momentum_buffer());
      }
    } else if (!with_adam_state(*it->second, [&](auto& adam) {
                 result[prefix + "step"] = torch::tensor(adam.step(), torch::kInt64);
                 result[prefix + "exp_avg"] = take(adam.exp_avg());
                 result[prefix + "exp_avg_sq"] = take(adam.exp_avg_sq());
                 if (adam.max_exp_avg_sq().defined()) {
                   result[prefix + "max_exp_avg_sq"] = take(adam.max_exp_avg_sq());
                 }
               })) {
      throw invalid_argument("checkpoint: only SGD, Adam and AdamW optimizer state can be saved");
    }
  };
  for_each_named(layers_, false, config_.tied,
                 [&](const std::string& name, const torch::Tensor& p) {
                   if ((is_copy(name) && !tie_copies) || (owned_only && !owns(p))) {
                     return; // the stage of the tie's first holder stores it, once
                   }
                   result[name] = take(p);
                   save_optimizer(name, p);
                   if (auto it = block_states_.find(name); it != block_states_.end()) {
                     result["optimizer/" + name + "/block_momentum"] = take(it->second.momentum);
                     if (it->second.previous.defined()) {
                       result["optimizer/" + name + "/block_previous"] = take(it->second.previous);
                     }
                   }
                 });
  if (!owned_only) {
    for_each_named(
      layers_, true, config_.tied,
      [&](const std::string& name, const torch::Tensor& b) { result[name] = take(b); });
  }
  return result;
}

std::map<std::string, std::vector<int64_t>> stage::required_keys() const {
  std::lock_guard<std::mutex> guard{mutex_};
  std::map<std::string, std::vector<int64_t>> keys;
  for (bool buffers : {false, true}) {
    for_each_named(
      layers_, buffers, config_.tied,
      [&](const std::string& name, const torch::Tensor& t) { keys[name] = t.sizes().vec(); });
  }
  return keys;
}

void stage::load_state(const tensor_map& all) {
  if (all.count(partial_state_key) != 0) {
    throw invalid_argument(detail::concat("stage ", config_.index, ": ", partial_state_error(all)));
  }
  auto required = required_keys();
  for (const auto& [name, shape] : required) {
    auto it = all.find(name);
    if (it == all.end()) {
      throw pipeline_error(
        detail::concat("stage ", config_.index, ": the checkpoint has no tensor '", name, "'"),
        error_details{error_kind::io, config_.index});
    }
    if (it->second.sizes().vec() != shape) {
      throw pipeline_error(detail::concat("stage ", config_.index, ": checkpoint tensor '", name,
                                          "' has shape ", shape_of(it->second), " but ",
                                          c10::IntArrayRef(shape), " is needed"),
                           error_details{error_kind::shape_mismatch, config_.index});
    }
  }
  std::lock_guard<std::mutex> guard{mutex_};
  torch::NoGradGuard no_grad;
  for (bool buffers : {false, true}) {
    for_each_named(layers_, buffers, config_.tied,
                   [&](const std::string& name, const torch::Tensor& t) {
                     const_cast<torch::Tensor&>(t).copy_(all.at(name));
                   });
  }
  load_optimizer_state(all);
}

void stage::load_optimizer_state(const tensor_map& all) {
  gathered_.reset();
  if (!optimizer_) {
    return;
  }
  auto& options = optimizer_->param_groups().front().options();
  auto is_adamw = dynamic_cast<torch::optim::AdamWOptions*>(&options) != nullptr;
  auto is_adam = is_adamw || dynamic_cast<torch::optim::AdamOptions*>(&options) != nullptr;
  auto& states = optimizer_->state();
  for_each_named(layers_, false, config_.tied,
                 [&](const std::string& name, const torch::Tensor& p) {
                   auto prefix = "optimizer/" + name + "/";
                   auto key = optimizer_key(p);
                   states.erase(key);
                   if (!owns(p)) {
                     return; // sharded: another replica keeps (and loads) its state
                   }
                   auto field = [&](const char* f) {
                     auto it = all.find(prefix + f);
                     return it == all.end() ? torch::Tensor{} : it->second.to(p.device()).clone();
                   };
                   if (is_adam) {
                     auto step = field("step");
                     if (!step.defined()) {
                       return;
                     }
                     std::unique_ptr<torch::optim::OptimizerParamState> st;
                     if (is_adamw) {
                       st = std::make_unique<torch::optim::AdamWParamState>();
                     } else {
                       st = std::make_unique<torch::optim::AdamParamState>();
                     }
                     with_adam_state(*st, [&](auto& adam) {
                       adam.step(step.item<int64_t>());
                       adam.exp_avg(field("exp_avg"));
                       adam.exp_avg_sq(field("exp_avg_sq"));
                       adam.max_exp_avg_sq(field("max_exp_avg_sq"));
                     });
                     states[key] = std::move(st);
                   } else if (auto momentum = field("momentum_buffer"); momentum.defined()) {
                     auto st = std::make_unique<torch::optim::SGDParamState>();
                     st->momentum_buffer(momentum);
                     states[key] = std::move(st);
                   }
                 });
}

} // namespace actorpipe::stages
