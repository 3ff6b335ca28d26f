/// Failed steps among replicas, counted in the rendezvous store, so that no replica waits in a
/// collective for one that will not come (a failed step used to end only at --dp-timeout).
///
/// A replica whose step fails announces it (replica_group::failure_announcer): a count under
/// `key` and the reason. Every rank's stage sync watches the count while it waits in a Gloo
/// collective and before each step's first collective: a failure announced since its group
/// formed ends the wait at once and abandons the group for good (it may hold a collective the
/// failed replica never joined): the replicas are built again (recover() on nodes, or new
/// pipelines from the last checkpoint), and their groups count from there. Internal to comm/.
#pragma once

#include <cstdint>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace actorpipe::comm {

/// What an abandoned wait says; an announcement that repeats it is not counted again.
inline constexpr const char* abandoned_because = "another replica's step failed";

class failure_watch {
public:
  explicit failure_watch(std::string key) : key_(std::move(key)) {}

  /// The rendezvous store (a node's stage connects at its first collective).
  void attach(c10::intrusive_ptr<c10d::Store> store) { store_ = std::move(store); }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  /// Failed steps announced so far (-1: no store, or it cannot say).
  int64_t announced() const;
  /// The group forms: the failures announced so far are the past.
  void start();
  /// A failure announced since start().
  bool news() const { return started_ && announced() > seen_; }
  /// The reason of the last announcement, for messages.
  std::string last() const;

  /// Counts a failed step under `key` with its reason, unless it is an abandoned wait's own
  /// failure (abandoned_because): one failure, one count. Never throws; returns false when the
  /// store could not be told.
  static bool announce(c10d::Store& store, const std::string& key, const std::string& why);

private:
  std::string key_;
  c10::intrusive_ptr<c10d::Store> store_;
  int64_t seen_ = 0;
  bool started_ = false;
};

} // namespace actorpipe::comm
