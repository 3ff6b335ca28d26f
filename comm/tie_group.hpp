/// \file
/// Tied parameters between stages of one pipeline in one process: the stage actors holding
/// copies of one parameter (a GPT's token embedding and its LM head) meet after their last
/// backward, and each gradient becomes the sum over the holders, as Megatron's embedding group
/// all-reduces its word-embedding gradients. The sum is added in member order, so every holder
/// gets the same bits and the copies stay equal.
///
/// Nothing here knows of actors: a stage actor calls sum() on its own thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include <torch/types.h>

namespace actorpipe::comm {

class tie_group {
public:
  /// `members`: the stage actors (by index) that hold tied parameters; each takes part in every
  /// step's sum.
  explicit tie_group(std::set<std::size_t> members);

  /// Member `member`'s part of `step`: each tensor of `gradients` (tie name -> gradient, the
  /// member's own holders already added up) is overwritten with the sum over the members that
  /// hold that tie. Waits at most `timeout` for the others; throws pipeline_error (timeout)
  /// naming the members that did not arrive, or (stage_failure) the member that cancelled.
  void sum(uint64_t step, std::size_t member, std::map<std::string, torch::Tensor>& gradients,
           std::chrono::milliseconds timeout);

  /// `member` failed `step`: members waiting in (or later arriving at) that step's sum throw.
  void cancel(uint64_t step, std::size_t member);

  const std::set<std::size_t>& members() const noexcept { return members_; }

private:
  void start(uint64_t step);

  const std::set<std::size_t> members_;
  std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t step_ = 0;
  bool started_ = false;
  std::map<std::size_t, std::map<std::string, torch::Tensor>> parts_;
  std::map<std::string, torch::Tensor> sums_;
  std::size_t collected_ = 0;
  std::optional<std::size_t> cancelled_by_;
};

} // namespace actorpipe::comm
