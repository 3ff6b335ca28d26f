/// \file
/// Lingering: a thread that expects a message soon polls for it for a short window before it
/// goes to sleep.
///
/// A detached CAF actor whose mailbox runs empty sleeps on a condition variable; the next
/// message then costs a futex wake on the sender's side and a reschedule on the receiver's
/// (10-20 us each on the shared VMs this engine is measured on, against ~1 us to take a message
/// from a running thread). A step is a chain of such hand-offs (caller -> scheduler -> stages ->
/// scheduler -> caller), so at small micro-batches the wake-ups are most of its cost. An actor
/// that has just handled a step message therefore keeps polling its mailbox for `window` before
/// its handler returns: a message that arrives meanwhile is taken by the running thread, and the
/// sender finds the mailbox not blocked and wakes nobody. As OpenMP's KMP_BLOCKTIME or NCCL's
/// busy polling, it trades a little CPU for latency: at most `window` per message handled, and
/// the poll yields the core to any runnable thread (sched_yield), so it never delays a stage
/// that has work.
#pragma once

#include <chrono>

#include <sched.h>

namespace actorpipe::actors {

/// How long an idle actor or caller polls before it sleeps (pipeline_options::linger).
using linger_window = std::chrono::microseconds;

/// Polls `ready()` until it holds or `window` has passed; returns what it last said.
template <class Ready>
bool poll_for(linger_window window, Ready&& ready) {
  if (ready()) {
    return true;
  }
  if (window.count() <= 0) {
    return false;
  }
  auto until = std::chrono::steady_clock::now() + window;
  while (std::chrono::steady_clock::now() < until) {
    // Lets any other runnable thread of this core go first (a stage with work, the sender).
    sched_yield();
    if (ready()) {
      return true;
    }
  }
  return false;
}

/// From inside a handler of `self`: keeps the actor's thread awake until a message is in its
/// mailbox or `window` has passed, so that the message is handled without a wake-up.
template <class Self>
void linger(Self* self, linger_window window) {
  poll_for(window, [self] { return !self->mailbox().empty(); });
}

} // namespace actorpipe::actors
