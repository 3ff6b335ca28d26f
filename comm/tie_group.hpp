/// \file
/// Tied parameters between stages of one pipeline: the stage actors holding copies of one
/// parameter (a GPT's token embedding and its LM head) meet after their last backward, and each
/// gradient becomes the sum over the holders, as Megatron's embedding group all-reduces its
/// word-embedding gradients. The sum is added in member order, so every holder gets the same
/// bits and the copies stay equal.
///
/// In one process the members share one group. Across processes (stages on nodes) each member
/// has a group of its own with a sender: its part goes to every other member through the sender
/// and theirs come in through deliver() (from a transport's thread, even before this member
/// reached the step); each group adds all parts in member order itself.
///
/// Nothing here knows of actors: a stage actor calls sum() on its own thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include <torch/types.h>

namespace actorpipe::comm {

class tie_group {
public:
  /// Sends member `from`'s part of `step` to member `to` (in another process); throws on failure.
  using sender = std::function<void(std::size_t to, uint64_t step, std::size_t from,
                                    const std::map<std::string, torch::Tensor>& part)>;

  /// `members`: the stage actors (by index) that hold tied parameters; each takes part in every
  /// step's sum. Without `send`, every member calls sum() on this group; with it, one member
  /// does and the others' parts come through deliver().
  explicit tie_group(std::set<std::size_t> members, sender send = {});

  /// Member `member`'s part of `step`: each tensor of `gradients` (tie name -> gradient, the
  /// member's own holders already added up) is overwritten with the sum over the members that
  /// hold that tie. Waits at most `timeout` for the others; throws pipeline_error (timeout)
  /// naming the members that did not arrive, or (stage_failure) the member that cancelled.
  void sum(uint64_t step, std::size_t member, std::map<std::string, torch::Tensor>& gradients,
           std::chrono::milliseconds timeout);

  /// `member` failed `step`: members waiting in (or later arriving at) that step's sum throw.
  void cancel(uint64_t step, std::size_t member);

  /// Member `from`'s part of `step`, sent by its own group (another process). Parts of steps
  /// after the current one wait for it; older ones are dropped.
  void deliver(uint64_t step, std::size_t from, std::map<std::string, torch::Tensor> part);

  const std::set<std::size_t>& members() const noexcept { return members_; }

private:
  void start(uint64_t step);
  // Adds the parts up once every member's is there.
  void add_up_when_complete();

  const std::set<std::size_t> members_;
  const sender send_;
  // Parts delivered for steps this group has not reached yet.
  std::map<uint64_t, std::map<std::size_t, std::map<std::string, torch::Tensor>>> early_;
  std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t step_ = 0;
  bool started_ = false;
  std::map<std::size_t, std::map<std::string, torch::Tensor>> parts_;
  std::map<std::string, torch::Tensor> sums_;
  std::size_t collected_ = 0;
  std::optional<std::size_t> cancelled_by_;
  // Cancellations of steps after a round whose sums members are still taking (overlapping
  // steps: a member done with step n may fail step n + 1 before the others have copied step n's
  // sum), applied when their round starts.
  std::map<uint64_t, std::size_t> cancelled_later_;
};

} // namespace actorpipe::comm
