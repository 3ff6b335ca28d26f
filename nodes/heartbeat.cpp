#include "nodes/heartbeat.hpp"

#include <algorithm>
#include <utility>

#include <actorpipe/errors.hpp>

#include "nodes/protocol.hpp"

namespace actorpipe::nodes {
namespace {

// The heartbeat actor's own timer (never crosses a process).
using heartbeat_tick_atom = caf::atom_constant<caf::atom("hbtick")>;

struct heartbeat_state {
  caf::actor node;
  std::string address;
  uint32_t index = 0;
  caf::actor proxy;
  std::chrono::milliseconds timeout{0};
  // Heartbeats missed in a row (0 once the node answers again).
  uint64_t missed = 0;

  static inline const char* name = "actorpipe.heartbeat";
};

using heartbeat_actor = caf::stateful_actor<heartbeat_state>*;

void missed(heartbeat_actor self) {
  auto& st = self->state;
  ++st.missed;
  auto message =
    detail::concat("node ", st.address, " hosting stage ", st.index,
                   " is lost: it did not answer a heartbeat within ", st.timeout.count(),
                   " ms (a frozen process or a cut link; --heartbeat-timeout sets the wait)");
  caf::anon_send(st.proxy, heartbeat_atom::value, false, std::move(message));
}

caf::behavior heartbeat(heartbeat_actor self, caf::actor node, std::string address, uint32_t index,
                        caf::actor proxy, std::chrono::milliseconds timeout) {
  auto& st = self->state;
  st.node = std::move(node);
  st.address = std::move(address);
  st.index = index;
  st.proxy = std::move(proxy);
  st.timeout = timeout;
  self->monitor(st.proxy);
  self->set_down_handler([=](caf::down_msg&) { self->quit(); });
  self->send(self, heartbeat_tick_atom::value);
  return {
    [=](heartbeat_tick_atom) {
      // A question every sixth of the timeout, whether or not the last was answered: a node
      // that stops answering is missed `timeout` after the first question it left, at most a
      // sixth later than it froze (waiting for each answer before the next question let that
      // grow to a third). The node answers in order, so no question times out after a later
      // one was answered.
      auto& s = self->state;
      self->request(s.node, s.timeout, heartbeat_atom::value)
        .then(
          [=](bool) {
            if (self->state.missed > 0) {
              self->state.missed = 0;
              caf::anon_send(self->state.proxy, heartbeat_atom::value, true, std::string{});
            }
          },
          [=](caf::error& e) {
            if (e != caf::sec::request_timeout) {
              // The node's handle is down: its proxy knows already.
              self->quit();
              return;
            }
            missed(self);
          });
      self->delayed_send(self, std::max(s.timeout / 6, std::chrono::milliseconds{1}),
                         heartbeat_tick_atom::value);
    },
  };
}

} // namespace

void start_heartbeat(caf::actor_system& sys, caf::actor node, std::string address, uint32_t index,
                     caf::actor proxy, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) {
    return;
  }
  sys.spawn(heartbeat, std::move(node), std::move(address), index, std::move(proxy), timeout);
}

} // namespace actorpipe::nodes
