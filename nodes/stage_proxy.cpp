#include "nodes/stage_proxy.hpp"

#include <functional>
#include <map>
#include <optional>
#include <utility>

#include <caf/all.hpp>

#include "actors/pipeline_errc.hpp"
#include "actors/request_error.hpp"
#include "comm/tensor_hub.hpp"
#include "stages/checkpoint.hpp"

namespace actorpipe::nodes {
namespace {

using namespace actorpipe::actors;

// A save (the state frame goes to `path`) or a fetch (it goes back to the scheduler in memory):
// complete once the node replied and, unless it failed, the state frame came.
struct save_request {
  std::string path;
  caf::typed_response_promise<bool> promise;
  bool fetch = false;
  // A snapshot's number (0: none), which the node keeps a copy of once the driver has it whole.
  uint64_t keep_as = 0;
  caf::typed_response_promise<std::shared_ptr<const tensor_map>> fetch_promise;
  bool replied = false;
  // The node refused, the request to it failed, or the node is gone (actors/request_error.hpp).
  caf::error failure;
  torch::Tensor state;

  void fail(caf::error why) {
    if (fetch) {
      fetch_promise.deliver(std::move(why));
    } else {
      promise.deliver(std::move(why));
    }
  }
};

struct proxy_state {
  caf::actor node;
  // The same node as the stage protocol's peer (node_stage_actor): what this proxy asks it.
  node_stage_actor stages;
  std::string label;
  uint32_t index = 0;
  endpoint data;
  stage_listener_actor scheduler;
  std::shared_ptr<comm::tensor_hub> hub;
  std::chrono::milliseconds timeout{60000};
  uint64_t step = 0;
  bool running = false;
  // Forward-only: the report waits for the output frames.
  bool reported = false;
  stage_report report;
  std::size_t outputs_expected = 0;
  std::map<std::pair<uint64_t, int32_t>, torch::Tensor> outputs;
  uint64_t next_id = 0;
  std::map<uint64_t, save_request> saves;
  // The node left its heartbeats unanswered: a step fails at once, and an abort is not asked of
  // it (it would wait for a frozen process until its deadline).
  bool silent = false;
  // Requests to the node in flight (abort, optimizer step) by id: a missed heartbeat answers
  // them at once with what it says, instead of their deadline.
  uint64_t next_pending = 0;
  std::map<uint64_t, std::function<void(const caf::error&)>> pending;

  static inline const char* name = "actorpipe.remote_stage";
};

using proxy_actor = remote_stage_actor::stateful_pointer<proxy_state>;

// The node's "host:port" (its label is "node host:port").
std::string address_of(const proxy_state& s) {
  return s.label.substr(s.label.find(' ') + 1);
}

// A refusal in the name of this stage on this node: `kind`, the stage, the node, `sentence`.
caf::error refusal(const proxy_state& s, error_kind kind, std::string sentence) {
  return actors::make_stage_refusal(kind, s.index, address_of(s), std::move(sentence));
}

// Fails `step` on the scheduler: a failure of this stage, on this proxy's node unless `why`
// names another.
void fail_step(proxy_actor self, uint64_t step, failure why) {
  auto& s = self->state;
  s.running = false;
  why.details.stage = s.index;
  why.details.step = step;
  if (why.details.node.empty()) {
    why.details.node = address_of(s);
  }
  self->send(s.scheduler, failed_atom::value, step, std::move(why));
}

void maybe_report(proxy_actor self) {
  auto& s = self->state;
  if (!s.running || !s.reported) {
    return;
  }
  s.report.outputs.resize(s.outputs_expected);
  for (std::size_t mb = 0; mb < s.outputs_expected; ++mb) {
    auto it = s.outputs.find({s.step, static_cast<int32_t>(mb)});
    if (it == s.outputs.end()) {
      return;
    }
    s.report.outputs[mb] = it->second;
  }
  s.outputs.clear();
  s.running = false;
  self->send(s.scheduler, done_atom::value, std::move(s.report));
}

void finish_save(proxy_actor self, uint64_t id) {
  auto& s = self->state;
  auto it = s.saves.find(id);
  if (it == s.saves.end() || !it->second.replied ||
      (!it->second.failure && !it->second.state.defined())) {
    return;
  }
  auto request = std::move(it->second);
  s.saves.erase(it);
  if (request.failure) {
    request.fail(std::move(request.failure));
    return;
  }
  try {
    // Views of the frame's buffer: a snapshot keeps it, a save pickles it into the file.
    auto state =
      stages::unpack_tensors(request.state, detail::concat("stage ", s.index, "'s state"));
    if (request.fetch) {
      request.fetch_promise.deliver(std::make_shared<const tensor_map>(std::move(state)));
    } else {
      stages::save_tensors(request.path, state);
      request.promise.deliver(true);
    }
  } catch (const std::exception& e) {
    request.fail(refusal(s, kind_of(e, error_kind::io), e.what()));
  }
}

// A refusal from the node's stage passes as it is; a request the node did not answer fails as a
// timeout, any other failure as a node that is gone, each with the sentence saying so.
caf::error forwarded(proxy_actor self, const char* action, const caf::error& e) {
  if (actors::is_pipeline_error(e)) {
    return e;
  }
  const auto& st = self->state;
  return refusal(st, e == caf::sec::request_timeout ? error_kind::timeout : error_kind::node_lost,
                 detail::concat("stage ", st.index, " on ", st.label, ", asked to ", action, ", ",
                                actors::request_error(self->system(), e, st.timeout)));
}

// Answers every save and fetch in flight with `error`.
void fail_saves(proxy_state& st, const caf::error& error) {
  for (auto& [id, save] : st.saves) {
    save.fail(error);
  }
  st.saves.clear();
}

// What the stage's heartbeat says (nodes/heartbeat.hpp): a node that stopped answering fails the
// running step, and every request to it in flight is answered now rather than at its deadline.
void heard(proxy_actor self, bool answers, const std::string& why) {
  auto& st = self->state;
  st.silent = !answers;
  if (answers) {
    return;
  }
  if (st.running) {
    fail_step(self, st.step, failure{{error_kind::node_lost}, why});
  }
  auto error = refusal(st, error_kind::node_lost, why);
  auto pending = std::move(st.pending);
  st.pending.clear();
  for (auto& [id, answer] : pending) {
    answer(error);
  }
  fail_saves(st, error);
}

// Asks the node for this stage (`xs`: a message of node_stage_actor) and answers with its reply,
// a refusal as it is, or a refusal naming the stage, the node and `action` (a request it did not
// answer: a timeout; any other failure: a lost node). A silent node (its heartbeat missed) is
// not asked, and a request in flight when it falls silent is answered at once: with
// `if_silent`, or with the node's loss.
template <class Reply, class... Ts>
caf::result<Reply> ask_node(proxy_actor self, const char* action, std::optional<Reply> if_silent,
                            Ts... xs) {
  auto& st = self->state;
  auto silent = [=](const caf::error& why) -> caf::result<Reply> {
    if (if_silent) {
      return *if_silent;
    }
    return why;
  };
  if (st.silent) {
    return silent(refusal(st, error_kind::node_lost,
                          detail::concat("stage ", st.index, " on ", st.label, " cannot ", action,
                                         ": its node is silent")));
  }
  auto rp = self->make_response_promise<Reply>();
  auto id = ++st.next_pending;
  st.pending[id] = [rp, if_silent](const caf::error& e) mutable {
    if (if_silent) {
      rp.deliver(*if_silent);
    } else {
      rp.deliver(e);
    }
  };
  self->request(st.stages, st.timeout, xs...)
    .then(
      [=](Reply reply) mutable {
        if (self->state.pending.erase(id) > 0) {
          rp.deliver(std::move(reply));
        }
      },
      [=](caf::error& e) mutable {
        if (self->state.pending.erase(id) > 0) {
          rp.deliver(forwarded(self, action, e));
        }
      });
  return rp;
}

// The node hosting the stage is gone: fails the running step and every pending save, and the
// proxy quits.
void node_down(proxy_actor self, const caf::down_msg& msg) {
  auto& st = self->state;
  if (msg.source != st.node.address()) {
    return;
  }
  auto what = detail::concat(st.label, " hosting stage ", st.index, " was lost (",
                             self->system().render(msg.reason), ")");
  if (st.running) {
    fail_step(self, st.step,
              failure{{error_kind::node_lost},
                      detail::concat(what, " while the scheduler waited for stage ", st.index,
                                     " to finish its program of step ", st.step)});
  }
  fail_saves(st, refusal(st, error_kind::node_lost, what));
  self->quit(refusal(st, error_kind::node_lost, what));
}

// Files `request` under a fresh id and asks the node for the stage's state frame; finish_save
// completes the request.
void ask_for_state(proxy_actor self, save_request request) {
  auto& st = self->state;
  auto id = ++st.next_id;
  auto keep_as = request.keep_as;
  st.saves[id] = std::move(request);
  self->request(st.stages, st.timeout, save_atom::value, st.index, id, keep_as)
    .then(
      [=](bool) {
        auto it = self->state.saves.find(id);
        if (it != self->state.saves.end()) {
          it->second.replied = true;
          finish_save(self, id);
        }
      },
      [=](caf::error& e) {
        auto it = self->state.saves.find(id);
        if (it != self->state.saves.end()) {
          it->second.replied = true;
          it->second.failure = forwarded(self, "save its state", e);
          finish_save(self, id);
        }
      });
}

// Sends the step's inputs and targets to the node's data port, then the plan itself.
void send_plan(proxy_actor self, const step_plan& plan) {
  auto& st = self->state;
  st.step = plan.step;
  st.running = true;
  st.reported = false;
  st.outputs.erase(st.outputs.begin(), st.outputs.lower_bound({plan.step, INT32_MIN}));
  auto send_all = [&](comm::frame_kind kind, const std::vector<torch::Tensor>& parts) {
    for (std::size_t mb = 0; mb < parts.size(); ++mb) {
      st.hub->send(
        st.data.host, st.data.port,
        comm::describe(kind, st.index, plan.step, static_cast<int32_t>(mb), 0, parts[mb]),
        parts[mb]);
    }
  };
  try {
    send_all(comm::frame_kind::activation, plan.inputs);
    send_all(comm::frame_kind::target, plan.targets);
  } catch (const std::exception& e) {
    fail_step(self, plan.step,
              failure{{error_kind::node_lost},
                      detail::concat("sending step ", plan.step, "'s data to stage ", st.index,
                                     " on ", st.label, " failed: ", e.what())});
    return;
  }
  self->send(st.stages, plan_atom::value, st.index, to_json(plan, plan.targets.size()));
}

// The node's report of the running step (as JSON).
void took_report(proxy_actor self, const std::string& text) {
  auto& st = self->state;
  try {
    st.report = stage_report_from_json(text, st.outputs_expected);
  } catch (const std::exception& e) {
    fail_step(self, st.step,
              failure{{}, detail::concat(st.label, " sent a bad report: ", e.what())});
    return;
  }
  if (st.report.step != st.step) {
    return;
  }
  st.reported = true;
  maybe_report(self);
}

// Sends `all` to the node as a state frame and asks it to load it.
caf::result<bool> send_state(proxy_actor self, const tensor_map& all) {
  auto& st = self->state;
  auto id = ++st.next_id;
  try {
    auto bytes = stages::pack_tensors(all);
    auto blob = torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, torch::kUInt8);
    st.hub->send(st.data.host, st.data.port,
                 comm::describe(comm::frame_kind::state, st.index, id, 0, 0, blob), blob);
  } catch (const std::exception& e) {
    return refusal(st, error_kind::io,
                   detail::concat("stage ", st.index, " on ", st.label, ": ", e.what()));
  }
  return ask_node<bool>(self, "load its state", std::nullopt, load_atom::value, st.index, id);
}

// The node's stage failed the step: the failure as the node sent it, naming the node.
void node_failed(proxy_actor self, uint64_t step, uint8_t kind, int32_t microbatch,
                 const std::string& node, const std::string& message) {
  auto& st = self->state;
  if (!st.running || (step != st.step && step != 0)) {
    return;
  }
  failure why{{error_kind_from_wire(kind)}, detail::concat(message, " [", st.label, "]")};
  if (microbatch >= 0) {
    why.details.microbatch = microbatch;
  }
  why.details.node = node;
  fail_step(self, st.step, std::move(why));
}

// A save (to `path`) or a fetch (kept as snapshot `keep_as`) of the stage's state: the node
// sends it over the hub, and the promise is kept once it is here.
caf::result<bool> save_through_node(proxy_actor self, const std::string& path) {
  save_request request;
  request.path = path;
  request.promise = self->make_response_promise<bool>();
  auto rp = request.promise;
  ask_for_state(self, std::move(request));
  return rp;
}

caf::result<std::shared_ptr<const tensor_map>> fetch_through_node(proxy_actor self,
                                                                  uint64_t keep_as) {
  save_request request;
  request.fetch = true;
  request.keep_as = keep_as;
  request.fetch_promise = self->make_response_promise<std::shared_ptr<const tensor_map>>();
  auto rp = request.fetch_promise;
  ask_for_state(self, std::move(request));
  return rp;
}

remote_stage_actor::behavior_type proxy_behavior(proxy_actor self, caf::actor node,
                                                 std::string label, uint32_t index, endpoint data,
                                                 stage_listener_actor scheduler,
                                                 std::shared_ptr<comm::tensor_hub> hub,
                                                 std::chrono::milliseconds timeout) {
  auto& s = self->state;
  s.node = std::move(node);
  s.stages = caf::actor_cast<node_stage_actor>(s.node);
  s.label = std::move(label);
  s.index = index;
  s.data = std::move(data);
  s.scheduler = std::move(scheduler);
  s.hub = std::move(hub);
  s.timeout = timeout;
  self->monitor(s.node);
  self->set_down_handler([=](caf::down_msg& msg) { node_down(self, msg); });
  return {
    [=](plan_atom, step_plan& plan) { send_plan(self, plan); },
    [=](done_atom, uint32_t, const std::string& text) { took_report(self, text); },
    [=](output_atom, uint64_t step, int32_t microbatch, torch::Tensor& t) {
      self->state.outputs[{step, microbatch}] = std::move(t);
      maybe_report(self);
    },
    [=](failed_atom, uint32_t, uint64_t step, uint8_t kind, int32_t microbatch,
        const std::string& node,
        const std::string& message) { node_failed(self, step, kind, microbatch, node, message); },
    [=](heartbeat_atom, bool answers, const std::string& why) { heard(self, answers, why); },
    [=](abort_atom, uint64_t step) -> caf::result<bool> {
      // A silent node is not asked: it would hold the scheduler until the deadline.
      self->state.running = false;
      return ask_node<bool>(self, "abort", false, abort_atom::value, self->state.index, step);
    },
    [=](update_atom, uint64_t step, double lr, double scale) -> caf::result<double> {
      return ask_node<double>(self, "step its optimizer", std::nullopt, update_atom::value,
                              self->state.index, step, lr, scale);
    },
    [=](block_atom) -> caf::result<bool> {
      // Replicas on nodes with a sharded optimizer (the pipeline constructor refuses BMUF there).
      return ask_node<bool>(self, "gather its state", std::nullopt, block_atom::value,
                            self->state.index);
    },
    [=](save_atom, const std::string& path) { return save_through_node(self, path); },
    [=](fetch_atom, uint64_t keep_as) { return fetch_through_node(self, keep_as); },
    [=](state_atom, uint32_t, uint64_t id, torch::Tensor& blob) {
      auto it = self->state.saves.find(id);
      if (it != self->state.saves.end()) {
        it->second.state = std::move(blob);
        finish_save(self, id);
      }
    },
    [=](load_atom, const std::shared_ptr<const tensor_map>& all) -> caf::result<bool> {
      return send_state(self, *all);
    },
  };
}

} // namespace

actors::stage_actor spawn_proxy(caf::actor_system& sys, caf::actor node, std::string label,
                                uint32_t index, endpoint data,
                                actors::stage_listener_actor scheduler,
                                std::shared_ptr<comm::tensor_hub> hub,
                                std::chrono::milliseconds timeout) {
  // Pooled, not detached: nodes hold handles of the proxies, and CAF 0.17 may then keep a
  // detached actor's thread waiting for the actor's destruction past system shutdown.
  return sys.spawn(proxy_behavior, std::move(node), std::move(label), index, std::move(data),
                   std::move(scheduler), std::move(hub), timeout);
}

} // namespace actorpipe::nodes
