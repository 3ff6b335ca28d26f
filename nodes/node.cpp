#include <actorpipe/node.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <set>

#include <pthread.h>

#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <nlohmann/json.hpp>

#include <actorpipe/exported.hpp>
#include <actorpipe/hooks.hpp>
#include <actorpipe/losses.hpp>
#include <actorpipe/memory.hpp>
#include <actorpipe/models.hpp>
#include <actorpipe/optimizers.hpp>
#include <actorpipe/torchscript.hpp>

#include "actors/request_error.hpp"
#include "actors/stage_actor.hpp"
#include "comm/bundle_frames.hpp"
#include "comm/replica_group.hpp"
#include "comm/tensor_hub.hpp"
#include "comm/tie_group.hpp"
#include "logging/log.hpp"
#include "nodes/node_host.hpp"
#include "nodes/node_state.hpp"
#include "nodes/protocol.hpp"
#include "stages/checkpoint.hpp"
#include "stages/device.hpp"
#include "stages/stage.hpp"

namespace actorpipe {
namespace nodes {

namespace {

using namespace actorpipe::actors;

void release(node_actor* self, uint32_t index) {
  auto& s = self->state;
  auto it = s.stages.find(index);
  if (it == s.stages.end()) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(s.route->mutex);
    s.route->stages.erase(index);
    s.route->ties.erase(index);
  }
  caf::anon_send_exit(it->second.actor, caf::exit_reason::user_shutdown);
  for (auto& link : it->second.links) {
    caf::anon_send_exit(link, caf::exit_reason::user_shutdown);
  }
  s.stages.erase(it);
  for (auto w = s.awaiting_copies.begin(); w != s.awaiting_copies.end();) {
    if (w->first.first == index) { // a restore of the stage that went: nothing to load into
      w->second.deliver(no_stage(self, index));
      w = s.awaiting_copies.erase(w);
    } else {
      ++w;
    }
  }
  if (s.stages.empty()) {
    // The state buffers go with the last stage (after its frame, if one is on its way), but for
    // the kept snapshots: those wait `keep_for` for a driver that starts again.
    if (s.sending.valid()) {
      s.sending.wait();
    }
    s.snapshots.release_pending();
    if (!s.snapshots.empty()) {
      self->delayed_send(self, s.keep_for, expire_atom::value, ++s.generation);
    }
    // The buffers of frames that came for the stages that were here.
    s.hub->release_cached_buffers();
    memory::release_free_heap();
  }
  log::get()->info("node {}: released stage {}", s.label, index);
}

void deliver_plan(node_actor* self, hosted& h) {
  auto& plan = h.plan;
  plan.targets.clear();
  for (std::size_t mb = 0; mb < h.targets_expected; ++mb) {
    auto it = h.targets.find({plan.step, static_cast<int32_t>(mb)});
    plan.targets.push_back(std::move(it->second));
  }
  h.targets.erase(h.targets.begin(), h.targets.lower_bound({plan.step + 1, INT32_MIN}));
  h.pending = false;
  self->send(h.actor, plan_atom::value, std::move(plan));
}

bool targets_complete(const hosted& h) {
  for (std::size_t mb = 0; mb < h.targets_expected; ++mb) {
    if (h.targets.count({h.plan.step, static_cast<int32_t>(mb)}) == 0) {
      return false;
    }
  }
  return true;
}

hosted* find_by_actor(node_state& s, const caf::strong_actor_ptr& sender) {
  for (auto& [index, h] : s.stages) {
    if (sender && h.actor.address() == sender->address()) {
      return &h;
    }
  }
  return nullptr;
}

// The bytes of a model file (TorchScript or PT2) this node was sent, by digest.
const std::string& received(const node_state& s, const std::string& digest, const char* what) {
  auto it = std::find_if(s.models.begin(), s.models.end(),
                         [&](const auto& m) { return m.first == digest; });
  ACTORPIPE_CHECK(it != s.models.end(), "no ", what, " file ", digest, " was sent to this node");
  return it->second;
}

// The model's layers as the spec names them: from its seed, or from a file this node was sent.
layer_list spec_layers(const node_state& s, const stage_spec& spec) {
  layer_list layers;
  if (spec.model.file.empty()) {
    layers = make_seeded_model(spec.model.name, spec.model.options, spec.model.seed);
  } else {
    layers = load_model_file(received(s, spec.model.file, "model"), "the model " + spec.model.name,
                             exported_options{spec.model.segments});
  }
  ACTORPIPE_CHECK(spec.bounds.front() == 0 && spec.bounds.back() == layers.size(), "partition of ",
                  spec.bounds.size() - 1, " stages does not cover ", spec.model.name, "'s ",
                  layers.size(), " layers");
  return layers;
}

// Makes the stage's chunks into `h`; returns the actors holding parameters tied with them and
// the chunks' layers in words ("3 layers 0..2").
std::pair<std::set<std::size_t>, std::string> make_chunks(hosted& h, const stage_spec& spec,
                                                          const layer_list& layers) {
  const auto& settings = spec.settings;
  partition cut{spec.bounds};
  std::set<std::size_t> tie_holders;
  std::string layer_ranges;
  for (std::size_t c = 0; c < settings.chunks; ++c) {
    auto k = virtual_stage_of(settings.placement, settings.count, settings.index, c);
    auto begin = cut.begin(k);
    auto end = cut.end(k);
    ACTORPIPE_CHECK(begin < end, "stage ", k, " would be empty");
    h.chunks.push_back(stages::make_stage(
      layers, cut, k, settings.device, make_optimizer(spec.model.optimizer), settings.precision));
    // The tie group's members are stage actors: a virtual stage's holder is the actor of it.
    for (auto holder : h.chunks.back()->config().tie_holders) {
      tie_holders.insert(holder_of(settings.placement, settings.count, holder).stage);
    }
    layer_ranges += detail::concat(layer_ranges.empty() ? "" : ", ", end - begin, " layers ", begin,
                                   "..", end - 1);
  }
  return {std::move(tie_holders), std::move(layer_ranges)};
}

// The stage actor's options: the settings whole, as a stage in the driver's process gets them;
// then what does not cross processes as a value: the loss and hooks, built here from their
// descriptions (a hook's TorchScript arrives as a digest), and the replicas' group.
stage_actor_options stage_options(const node_state& s, const stage_spec& spec) {
  auto hooks = spec.model.hooks;
  for (auto* hook : {&hooks.after_forward, &hooks.after_backward}) {
    if (!hook->torchscript.empty()) {
      hook->torchscript = received(s, hook->torchscript, "hook");
    }
  }
  stage_actor_options options(spec.settings);
  options.loss = builtin_loss(spec.model.loss);
  options.hooks = make_hooks(hooks);
  if (spec.data_parallel.replicas > 1) {
    // Gradients averaged with the same stage of the other replicas, on their nodes. Every
    // replica builds the model from the same seed or bytes: they start equal without a
    // broadcast (their drivers agreed on the model).
    options.sync = comm::join_stage_group(spec.data_parallel, spec.settings.index,
                                          spec.group_prefix, spec.settings.device);
  }
  return options;
}

// Parameters tied with other stages: the group summing their gradients, sending through this
// node's hub; returns the ties' names.
std::vector<std::string> join_ties(const node_state& s, hosted& h,
                                   const std::vector<tied_parameter>& ties,
                                   const std::set<std::size_t>& tie_holders) {
  std::vector<std::string> tie_names;
  h.tie_peers = std::make_shared<std::vector<endpoint>>();
  for (const auto& t : ties) {
    tie_names.push_back(t.name);
  }
  h.ties =
    std::make_shared<comm::tie_group>(tie_holders, tie_sender(s.hub, h.tie_peers, tie_names));
  return tie_names;
}

// Builds the stage a driver describes in `text` and hosts it; returns the settings the stage
// actor was given, as the node read them (the driver checks them against what it sent), and
// where the node's hub takes tensors.
std::string build(node_actor* self, const std::string& text) {
  auto& s = self->state;
  auto spec = stage_spec_from_json(text);
  const auto& settings = spec.settings;
  auto index = static_cast<uint32_t>(settings.index);
  stages::check_device(settings.device, detail::concat("node ", s.label, ": stage ", index));
  if (settings.device.is_cuda()) {
    s.hub->receive_into_pinned_memory();
  }
  release(self, index);
  auto layers = spec_layers(s, spec);
  // Before make_stage, which gives a later holder a copy (the tie is then no longer visible).
  auto ties = tied_parameters(layers);
  hosted h;
  h.placement = settings.placement;
  auto [tie_holders, layer_ranges] = make_chunks(h, spec, layers);
  bool tied = std::any_of(h.chunks.begin(), h.chunks.end(),
                          [](const auto& st) { return !st->config().shared_ties.empty(); });
  auto options = stage_options(s, spec);
  std::vector<std::string> tie_names;
  if (tied) {
    tie_names = join_ties(s, h, ties, tie_holders);
    options.ties = h.ties;
  }
  h.deadline = options.wait_timeout;
  // The node is its stage's listener: node_behavior handles done_atom and failed_atom (the node
  // protocol itself is dynamically typed, being a protocol between processes).
  h.actor =
    spawn_stage(self->system(), h.chunks, caf::actor_cast<stage_listener_actor>(self), options);
  {
    std::lock_guard<std::mutex> lock(s.route->mutex);
    s.route->stages[index] = caf::actor_cast<caf::weak_actor_ptr>(h.actor);
    if (h.ties) {
      s.route->ties[index] = routes::tie_route{h.ties, tie_names};
    }
  }
  s.stages.emplace(index, std::move(h));
  // The whole model was built to keep one stage of it.
  memory::release_free_heap();
  log::get()->info("node {}: built stage {} of {} ({} of {}, seed {}) on {}", s.label,
                   settings.index, settings.count, layer_ranges, spec.model.name, spec.model.seed,
                   settings.device.str());
  return nlohmann::json{
    {"data_host", s.hub->host()},
    {"data_port", s.hub->port()},
    {"settings", nlohmann::json::parse(to_json(static_cast<const stage_settings&>(options)))}}
    .dump();
}

caf::error receive_model(node_actor* self, const std::string& digest, const std::string& bytes) {
  auto& s = self->state;
  if (bytes.size() > s.max_model_bytes) {
    ++s.route->rejected;
    return node_refusal(self, error_kind::other,
                        detail::concat("node ", s.label, ": the model file is ", bytes.size(),
                                       " bytes, more than this node takes (", s.max_model_bytes,
                                       "; start it with a larger --max-model-bytes)"));
  }
  if (model_digest(bytes) != digest) {
    ++s.route->rejected;
    return node_refusal(self, error_kind::io,
                        detail::concat("node ", s.label,
                                       ": the model file arrived damaged (its SHA-256 is not ",
                                       digest, ")"));
  }
  auto it = std::find_if(s.models.begin(), s.models.end(),
                         [&](const auto& m) { return m.first == digest; });
  if (it != s.models.end()) {
    s.models.erase(it);
  }
  s.models.emplace_back(digest, bytes);
  constexpr std::size_t kept = 4;
  if (s.models.size() > kept) {
    s.models.erase(s.models.begin());
  }
  log::get()->info("node {}: received a model file of {} bytes ({})", s.label, bytes.size(),
                   digest.substr(0, 12));
  return caf::none;
}

// Unknown messages are counted and dropped; stopping the node stops its stages; a scheduler
// that goes away takes its stages with it.
void install_handlers(node_actor* self) {
  self->set_default_handler(
    [](caf::scheduled_actor* ptr, caf::message_view& x) -> caf::result<caf::message> {
      auto* me = static_cast<node_actor*>(ptr);
      ++me->state.route->rejected;
      log::get()->error("node {}: dropped an unknown message {}", me->state.label,
                        caf::to_string(x.copy_content_to_message()));
      return caf::sec::unexpected_message;
    });
  // Stopping the node stops its stages and links too.
  self->set_exit_handler([=](caf::exit_msg& msg) {
    std::vector<uint32_t> all;
    for (const auto& entry : self->state.stages) {
      all.push_back(entry.first);
    }
    for (auto index : all) {
      release(self, index);
    }
    self->quit(msg.reason);
  });
  self->set_down_handler([=](caf::down_msg& msg) {
    auto& st = self->state;
    std::vector<uint32_t> gone;
    for (auto& [index, h] : st.stages) {
      if (h.proxy && h.proxy.address() == msg.source) {
        gone.push_back(index);
      }
    }
    for (auto index : gone) {
      auto level =
        msg.reason == caf::exit_reason::user_shutdown ? spdlog::level::info : spdlog::level::warn;
      log::get()->log(level,
                      "node {}: the scheduler of stage {} went away ({}); dropping the stage",
                      st.label, index, self->system().render(msg.reason));
      release(self, index);
    }
  });
}

std::string make_challenge(node_actor* self) {
  auto challenge = new_challenge();
  if (auto sender = self->current_sender()) {
    self->state.challenges[sender->node()] = challenge;
  }
  return challenge;
}

caf::error authenticate(node_actor* self, const std::string& answer) {
  auto& st = self->state;
  auto sender = self->current_sender();
  if (!sender) {
    return node_refusal(
      self, error_kind::other,
      detail::concat("node ", st.label, ": anonymous senders cannot authenticate"));
  }
  auto it = st.challenges.find(sender->node());
  if (it == st.challenges.end() || !answers_challenge(st.secret, it->second, answer)) {
    ++st.route->rejected;
    log::get()->error("node {}: refused a scheduler from {}: wrong secret", st.label,
                      caf::to_string(sender->node()));
    return node_refusal(
      self, error_kind::other,
      detail::concat("node ", st.label, " refused the secret (check --secret-file)"));
  }
  st.challenges.erase(it);
  st.authorized.insert(sender->node());
  return caf::none;
}

// The stage actors next to actor `index` of `count` holding `chunks` chunks each: with looped
// chunks the last actor's next is the first's next chunk, and the first's previous the last's
// previous chunk. In a V the chunks turn on the last actor, which sends to itself.
std::set<std::size_t> actors_next_to(uint32_t index, std::size_t count, std::size_t chunks,
                                     chunk_placement placement) {
  std::set<std::size_t> next_to;
  if (placement == chunk_placement::v_shape) {
    next_to.insert(index);
  }
  for (auto j : {static_cast<int64_t>(index) - 1, static_cast<int64_t>(index) + 1}) {
    if (chunks > 1 && placement == chunk_placement::looped) {
      next_to.insert(
        static_cast<std::size_t>((j + static_cast<int64_t>(count)) % static_cast<int64_t>(count)));
    } else if (j >= 0 && j < static_cast<int64_t>(count)) {
      next_to.insert(static_cast<std::size_t>(j));
    }
  }
  return next_to;
}

caf::error wire_stage(node_actor* self, uint32_t index, const std::string& text, caf::actor proxy) {
  if (!allowed(self, "wire")) {
    return refused(self);
  }
  auto* h = find_stage(self, index);
  if (h == nullptr) {
    return no_stage(self, index);
  }
  try {
    h->peers = peer_table_from_json(text);
    auto count = h->peers.stages.size();
    auto built_for = h->chunks.front()->config().count / h->chunks.size();
    ACTORPIPE_CHECK(count == built_for, "peer table lists ", count,
                    " stages, the stage was built for ", built_for);
    if (h->tie_peers) {
      // Before the stage's first step (the connect message below orders it before the plans).
      *h->tie_peers = h->peers.stages;
    }
    std::vector<stage_peer_actor> neighbours(count);
    auto next_to = actors_next_to(index, count, h->chunks.size(), h->placement);
    for (auto j : next_to) {
      if (j == index) {
        neighbours[j] = h->actor;
        continue;
      }
      auto to = h->peers.stages[j];
      auto local = find_stage(self, static_cast<uint32_t>(j));
      if (local != nullptr && to.host == self->state.hub->host() &&
          to.port == self->state.hub->port()) {
        neighbours[j] = local->actor;
      } else {
        auto link = self->system().spawn<caf::detached>(link_actor, self->state.hub, to,
                                                        static_cast<uint32_t>(j), index,
                                                        caf::actor_cast<caf::actor>(self));
        h->links.push_back(link);
        neighbours[j] = link;
      }
    }
    self->send(h->actor, connect_atom::value, std::move(neighbours));
    h->proxy = caf::actor_cast<node_report_listener>(proxy);
    self->monitor(h->proxy);
  } catch (const std::exception& e) {
    return stage_refusal(
      self, index, kind_of(e, error_kind::other),
      detail::concat("node ", self->state.label, ", stage ", index, ": ", e.what()));
  }
  return caf::none;
}

void receive_plan(node_actor* self, uint32_t index, const std::string& text) {
  if (!allowed(self, "plan")) {
    return;
  }
  auto* h = find_stage(self, index);
  if (h == nullptr) {
    log::get()->error("{}", missing_stage(self, index));
    return;
  }
  std::size_t targets = 0;
  try {
    h->plan = step_plan_from_json(text, targets);
  } catch (const std::exception& e) {
    self->send(h->proxy, failed_atom::value, index, uint64_t{0},
               error_kind_to_wire(error_kind::other), int32_t{-1}, std::string{},
               detail::concat("node ", self->state.label, ": ", e.what()));
    return;
  }
  h->plan.origin_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count();
  h->targets_expected = targets;
  h->pending = true;
  // Bundles of earlier steps that never completed (a sender that failed mid-bundle).
  self->state.route->bundles.drop_before(h->plan.step);
  if (targets_complete(*h)) {
    deliver_plan(self, *h);
  }
}

void receive_target(node_actor* self, uint32_t index, uint64_t step, int32_t microbatch,
                    torch::Tensor& t) {
  auto* h = find_stage(self, index);
  if (h == nullptr) {
    return;
  }
  h->targets[{step, microbatch}] = std::move(t);
  if (h->pending && h->plan.step == step && targets_complete(*h)) {
    deliver_plan(self, *h);
  }
}

void report_done(node_actor* self, stage_report& report) {
  auto* h = find_stage(self, static_cast<uint32_t>(report.stats.stage));
  if (h == nullptr || !allowed(self, "done")) {
    return;
  }
  auto index = static_cast<uint32_t>(report.stats.stage);
  try {
    const auto& to = h->peers.scheduler;
    for (std::size_t mb = 0; mb < report.outputs.size(); ++mb) {
      const auto& t = report.outputs[mb];
      self->state.hub->send(to.host, to.port,
                            comm::describe(comm::frame_kind::output, index, report.step,
                                           static_cast<int32_t>(mb), 0, t),
                            t);
    }
  } catch (const std::exception& e) {
    self->send(h->proxy, failed_atom::value, index, report.step,
               error_kind_to_wire(error_kind::other), int32_t{-1}, std::string{},
               detail::concat("stage ", index, " on node ", self->state.label,
                              " could not send its outputs: ", e.what()));
    return;
  }
  self->send(h->proxy, done_atom::value, index, to_json(report));
}

void report_failure(node_actor* self, uint64_t step, const failure& why) {
  auto* h = find_by_actor(self->state, self->current_sender());
  if (h != nullptr) {
    // Say where the neighbour it waited for lives.
    auto text = why.message;
    for (std::size_t j = 0; j < h->peers.stages.size(); ++j) {
      if (why.message.find(detail::concat("from stage ", j, " ")) != std::string::npos) {
        text += detail::concat(" (stage ", j, " is on node ", h->peers.stages[j].node, ")");
      }
    }
    self->send(h->proxy, failed_atom::value,
               static_cast<uint32_t>(h->chunks.front()->config().index), step,
               error_kind_to_wire(why.details.kind), why.details.microbatch.value_or(-1),
               why.details.node, text);
  }
}

// What a relay answers when its request to the node's stage failed: the stage's refusal as it
// is, else a refusal naming the stage, this node and what it was asked.
caf::error relayed(node_actor* self, uint32_t index, const char* asked, const caf::error& e,
                   std::chrono::milliseconds deadline) {
  if (actors::is_pipeline_error(e)) {
    return e;
  }
  return stage_refusal(
    self, index, e == caf::sec::request_timeout ? error_kind::timeout : error_kind::stage_failure,
    detail::concat("stage ", index, " on node ", self->state.label, ", asked to ", asked, ", ",
                   request_error(self->system(), e, deadline)));
}

// The stage protocol's request `xs` to the node's stage `index` (the node's `permission` to
// take it checked first), its reply passed back; `asked` says what in a refusal.
template <class Reply, class... Ts>
caf::result<Reply> relay(node_actor* self, uint32_t index, const char* permission,
                         const char* asked, Ts... xs) {
  auto* h = find_stage(self, index);
  if (h == nullptr || !allowed(self, permission)) {
    return no_stage(self, index);
  }
  auto rp = self->make_response_promise<Reply>();
  auto deadline = h->deadline;
  self->request(h->actor, deadline, xs...)
    .then([=](Reply reply) mutable { rp.deliver(std::move(reply)); },
          [=](caf::error& e) mutable { rp.deliver(relayed(self, index, asked, e, deadline)); });
  return rp;
}

// The stage protocol as the node takes it for its stages (node_stage_actor, nodes/protocol.hpp):
// a behaviour of that interface, so that a handler of another message or reply does not build.
caf::message_handler stage_relays(node_actor* self) {
  node_stage_actor::behavior_type relays{
    [=](plan_atom, uint32_t index, const std::string& text) { receive_plan(self, index, text); },
    [=](abort_atom, uint32_t index, uint64_t step) -> caf::result<bool> {
      auto* h = find_stage(self, index);
      if (h == nullptr || !allowed(self, "abort")) {
        return no_stage(self, index);
      }
      h->pending = false;
      if (h->ties) {
        // A stage waiting in the tied-gradient sum for a holder that failed stops waiting.
        h->ties->cancel(step, index);
      }
      return relay<bool>(self, index, "abort", "abort", abort_atom::value, step);
    },
    [=](update_atom, uint32_t index, uint64_t step, double lr,
        double scale) -> caf::result<double> {
      return relay<double>(self, index, "update", "step its optimizer", update_atom::value, step,
                           lr, scale);
    },
    [=](save_atom, uint32_t index, uint64_t id, uint64_t keep_as) -> caf::result<bool> {
      return actors::done_unless(send_state(self, index, id, keep_as));
    },
    [=](load_atom, uint32_t index, uint64_t id) -> caf::result<bool> {
      return load_state_frame(self, index, id);
    },
    [=](block_atom, uint32_t index) -> caf::result<bool> {
      return relay<bool>(self, index, "block", "gather its replicas' state", block_atom::value);
    },
  };
  return caf::message_handler{relays.unbox().as_behavior_impl()};
}

// A driver's request to build a stage: the stage's settings as the node read them, or the
// refusal (the kind of what failed; the driver adds the stage it asked for).
caf::result<std::string> answer_build(node_actor* self, const std::string& spec) {
  if (!allowed(self, "build")) {
    return refused(self);
  }
  try {
    return build(self, spec);
  } catch (const std::exception& e) {
    log::get()->error("node {}: cannot build a stage: {}", self->state.label, e.what());
    return node_refusal(self, kind_of(e, error_kind::other),
                        detail::concat("node ", self->state.label, ": ", e.what()));
  }
}

caf::behavior node_behavior(node_actor* self, std::string label, std::string secret,
                            std::shared_ptr<comm::tensor_hub> hub, std::shared_ptr<routes> route,
                            std::size_t max_model_bytes, std::chrono::seconds keep_for) {
  auto& s = self->state;
  s.max_model_bytes = max_model_bytes;
  s.keep_for = keep_for;
  s.label = std::move(label);
  s.secret = std::move(secret);
  s.hub = std::move(hub);
  s.route = std::move(route);
  install_handlers(self);
  caf::message_handler control{
    [=](hello_atom) -> std::string { return make_challenge(self); },
    // Answers nothing but that the process runs and its link carries messages.
    [=](heartbeat_atom) { return true; },
    [=](auth_atom, const std::string& answer) {
      return actors::done_unless(authenticate(self, answer));
    },
    [=](model_atom, const std::string& digest, const std::string& bytes) {
      return actors::done_unless(allowed(self, "model") ? receive_model(self, digest, bytes)
                                                        : refused(self));
    },
    [=](build_atom, const std::string& spec) { return answer_build(self, spec); },
    [=](wire_atom, uint32_t index, const std::string& text, caf::actor proxy) {
      return actors::done_unless(wire_stage(self, index, text, proxy));
    },
    [=](target_atom, uint32_t index, uint64_t step, int32_t microbatch, torch::Tensor& t) {
      receive_target(self, index, step, microbatch, t);
    },
    [=](done_atom, stage_report& report) { report_done(self, report); },
    [=](failed_atom, uint64_t step, const failure& why) { report_failure(self, step, why); },
    [=](link_failed_atom, uint32_t index, uint64_t step, int32_t microbatch,
        const std::string& node, const std::string& message) {
      if (auto* h = find_stage(self, index); h != nullptr && allowed(self, "link")) {
        self->send(h->proxy, failed_atom::value, index, step,
                   error_kind_to_wire(error_kind::node_lost), microbatch, node, message);
      }
    },
    [=](label_atom, std::string& label) {
      if (self->state.label.empty()) {
        self->state.label = std::move(label);
      }
    },
    [=](release_atom, uint32_t index) {
      if (allowed(self, "release")) {
        release(self, index);
      }
    },
  };
  return control.or_else(stage_relays(self)).or_else(state_handlers(self));
}

} // namespace

caf::actor spawn_node_host(caf::actor_system& sys, std::string secret,
                           std::shared_ptr<comm::tensor_hub> hub, std::shared_ptr<routes> route,
                           std::size_t max_model_bytes, std::chrono::seconds keep_snapshots) {
  return sys.spawn(node_behavior, std::string{}, std::move(secret), std::move(hub),
                   std::move(route), max_model_bytes, keep_snapshots);
}

} // namespace nodes
} // namespace actorpipe
