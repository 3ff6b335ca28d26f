#include "comm/tie_group.hpp"

#include <actorpipe/errors.hpp>

namespace actorpipe::comm {

tie_group::tie_group(std::set<std::size_t> members, sender send)
  : members_(std::move(members)), send_(std::move(send)) {
  ACTORPIPE_CHECK(!members_.empty(), "a tie group needs members");
}

// Begins the round of `step` when it is newer than the current one (a failed step's round may
// be left behind; its tensors are dropped).
void tie_group::start(uint64_t step) {
  if (started_ && step <= step_) {
    return;
  }
  step_ = step;
  started_ = true;
  parts_.clear();
  sums_.clear();
  collected_ = 0;
  cancelled_by_.reset();
  if (auto later = cancelled_later_.find(step); later != cancelled_later_.end()) {
    cancelled_by_ = later->second;
  }
  cancelled_later_.erase(cancelled_later_.begin(), cancelled_later_.upper_bound(step));
  auto early = early_.find(step);
  if (early != early_.end()) {
    parts_ = std::move(early->second);
  }
  early_.erase(early_.begin(), early_.upper_bound(step));
  add_up_when_complete();
}

void tie_group::add_up_when_complete() {
  if (parts_.size() != members_.size() || !sums_.empty()) {
    return;
  }
  // In member order: every holder adds the same tensors in the same order.
  for (const auto& [index, part] : parts_) {
    for (const auto& [name, g] : part) {
      auto it = sums_.find(name);
      if (it == sums_.end()) {
        sums_.emplace(name, g.clone());
      } else {
        it->second.add_(g);
      }
    }
  }
  changed_.notify_all();
}

void tie_group::deliver(uint64_t step, std::size_t from,
                        std::map<std::string, torch::Tensor> part) {
  std::lock_guard<std::mutex> guard{mutex_};
  if (members_.count(from) == 0 || (started_ && step < step_)) {
    return;
  }
  if (!started_ || step > step_) {
    early_[step][from] = std::move(part);
    return;
  }
  parts_[from] = std::move(part);
  add_up_when_complete();
}

void tie_group::cancel(uint64_t step, std::size_t member) {
  std::lock_guard<std::mutex> guard{mutex_};
  if (started_ && step < step_) {
    return;
  }
  if (started_ && step > step_ && !sums_.empty()) {
    // The round before is complete and members are still taking their sums from it: it stays.
    cancelled_later_.emplace(step, member);
    return;
  }
  start(step);
  if (!cancelled_by_) {
    cancelled_by_ = member;
  }
  changed_.notify_all();
}

namespace {

// A member's failure to sum the tied gradients of `step`: another member failed it, or the
// round was abandoned (a later step began).
pipeline_error abandoned(std::size_t member, uint64_t step, std::optional<std::size_t> by) {
  auto why =
    by ? detail::concat("stage ", *by, " failed the step") : std::string("the step was abandoned");
  return pipeline_error(
    detail::concat("stage ", member, ": summing tied gradients of step ", step, ": ", why),
    error_details{error_kind::stage_failure, member});
}

// "stage 1, stage 3": the members whose part has not come.
std::string
missing_parts(const std::set<std::size_t>& members,
              const std::map<std::size_t, std::map<std::string, torch::Tensor>>& parts) {
  std::string missing;
  for (auto m : members) {
    if (parts.count(m) == 0) {
      missing += detail::concat(missing.empty() ? "" : ", ", "stage ", m);
    }
  }
  return missing;
}

} // namespace

void tie_group::sum(uint64_t step, std::size_t member,
                    std::map<std::string, torch::Tensor>& gradients,
                    std::chrono::milliseconds timeout) {
  ACTORPIPE_CHECK(members_.count(member) == 1, "stage ", member, " is not in the tie group");
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock{mutex_};
  start(step);
  auto failed = [&] {
    return abandoned(member, step, step_ == step ? cancelled_by_ : std::nullopt);
  };
  if (step < step_ || cancelled_by_) {
    throw failed();
  }
  parts_[member] = gradients;
  add_up_when_complete();
  if (send_) {
    // The other members are elsewhere: each gets this member's part (outside the lock, which
    // deliver() takes on a transport's thread).
    lock.unlock();
    for (auto to : members_) {
      if (to == member) {
        continue;
      }
      try {
        send_(to, step, member, gradients);
      } catch (const std::exception& e) {
        cancel(step, member);
        throw pipeline_error(detail::concat("stage ", member, ": sending tied gradients of step ",
                                            step, " to stage ", to, ": ", e.what()),
                             error_details{error_kind::stage_failure, member});
      }
    }
    lock.lock();
    if (step_ != step) {
      throw failed();
    }
  }
  auto ready = [&] { return step_ != step || cancelled_by_ || parts_.size() == members_.size(); };
  if (!changed_.wait_until(lock, deadline, ready)) {
    auto missing = missing_parts(members_, parts_);
    auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count();
    // Leave the round: the others may still come and must not wait for this member forever.
    cancelled_by_ = member;
    changed_.notify_all();
    throw pipeline_error(detail::concat("stage ", member, ": summing tied gradients of step ", step,
                                        ": ", missing, " did not arrive within ", waited, " ms"),
                         error_details{error_kind::timeout, member});
  }
  if (step_ != step || cancelled_by_) {
    throw failed();
  }
  for (auto& [name, g] : gradients) {
    g.copy_(sums_.at(name));
  }
  // Every member here has its sum (with a sender, this group's one member).
  if (++collected_ == (send_ ? 1 : members_.size())) {
    parts_.clear();
    sums_.clear();
  }
}

} // namespace actorpipe::comm
