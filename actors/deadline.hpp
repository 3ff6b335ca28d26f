/// \file
/// A deadline checked by one timer at most per actor.
///
/// CAF's clock is a thread of its own: every delayed message set wakes it, and stays queued until
/// it is due. A timer per wait (or per step) would wake it on every hand-off and pile up entries
/// for the deadline's whole length. Instead an actor keeps at most one timer pending: `arm` sets
/// it only when none is; when its message arrives, `expired` looks at the wait running then, and
/// either finds it past its limit or sets the timer again for what is left of it. Every wait
/// still gets its whole deadline.
#pragma once

#include <chrono>

namespace actorpipe::actors {

class deadline_timer {
public:
  using clock = std::chrono::steady_clock;

  /// Sends `atom` to `self` after `limit` unless a timer is already pending.
  template <class Self, class Atom>
  void arm(Self* self, std::chrono::milliseconds limit, Atom atom) {
    if (!pending_) {
      pending_ = true;
      self->delayed_send(self, limit, atom);
    }
  }

  /// On the timer's message: whether a wait that began at `start` (`running`: one is) has run
  /// past `limit`. When one runs but is not past it, the timer is set again for what is left.
  template <class Self, class Atom>
  bool expired(Self* self, bool running, clock::time_point start, std::chrono::milliseconds limit,
               Atom atom) {
    pending_ = false;
    if (!running) {
      return false;
    }
    auto waited = clock::now() - start;
    if (waited >= limit) {
      return true;
    }
    pending_ = true;
    self->delayed_send(self, limit - waited, atom);
    return false;
  }

private:
  bool pending_ = false;
};

} // namespace actorpipe::actors
