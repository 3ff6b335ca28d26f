// The node as a program embeds it (include/actorpipe/node.hpp): its data hub, whose frames go
// to the stages it hosts, and its host actor, published for the driver (nodes/node.cpp).
#include <actorpipe/node.hpp>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/openssl/publish.hpp>

#include "actors/messages.hpp"
#include "actors/pipeline_errc.hpp"
#include "logging/log.hpp"
#include "nodes/join.hpp"
#include "nodes/node_host.hpp"
#include "nodes/protocol.hpp"

namespace actorpipe {

struct node::impl {
  caf::actor_system_config config;
  std::unique_ptr<caf::actor_system> system;
  std::shared_ptr<nodes::routes> route = std::make_shared<nodes::routes>();
  std::shared_ptr<comm::tensor_hub> hub;
  caf::actor host;
  std::string host_name;
  uint16_t port = 0;
  // node_options::join: announcing this node to a driver, beside its work.
  std::thread joiner;
  std::atomic<bool> stop_joining{false};
  std::atomic<node::join_state> joining{node::join_state::none};
  mutable std::mutex join_mutex;
  std::string join_error;
};

namespace {

// A frame from the data hub's reader thread to the node's stage (or host actor) it is for.
void route_frame(nodes::routes& route, comm::frame&& f) {
  const auto& h = f.header;
  switch (h.kind) {
  case comm::frame_kind::activation:
  case comm::frame_kind::gradient: {
    auto stage = route.stage(h.stage);
    auto step = h.step;
    auto microbatch = h.microbatch;
    auto chunk = h.chunk;
    auto kind = h.kind;
    auto b = route.bundles.add(std::move(f));
    if (!b) {
      return;
    }
    if (kind == comm::frame_kind::activation) {
      caf::anon_send(stage, actors::forward_atom::value, step, microbatch, chunk, std::move(*b));
    } else {
      caf::anon_send(stage, actors::backward_atom::value, step, microbatch, chunk, std::move(*b));
    }
    return;
  }
  case comm::frame_kind::target:
    route.stage(h.stage);
    caf::anon_send(route.host(), nodes::target_atom::value, h.stage, h.step, h.microbatch,
                   std::move(f.tensor));
    return;
  case comm::frame_kind::state:
    ACTORPIPE_CHECK(f.tensor.scalar_type() == torch::kUInt8 && f.tensor.dim() == 1,
                    "a state frame must hold bytes");
    caf::anon_send(route.host(), nodes::state_atom::value, h.stage, h.step, std::move(f.tensor));
    return;
  case comm::frame_kind::tied_gradient: {
    auto tie = route.tie(h.stage);
    auto step = h.step;
    auto from = h.microbatch;
    auto b = route.bundles.add(std::move(f));
    if (!b) {
      return;
    }
    nodes::receive_tied_gradients(tie, step, from, *b);
    return;
  }
  case comm::frame_kind::output:
    break;
  }
  ++route.rejected;
  throw comm::frame_error(detail::concat("a node takes no ", comm::to_string(h.kind), " frames"));
}

// The node's tensor hub, listening on its data port; every frame goes to the node's routes.
std::shared_ptr<comm::tensor_hub> start_hub(const node_options& options,
                                            std::shared_ptr<nodes::routes> route) {
  comm::hub_options hub_options;
  hub_options.host = options.host;
  hub_options.port = options.data_port;
  hub_options.secret = options.secret;
  // Checks the TLS files (invalid_argument naming the one that fails) before CAF reads them.
  hub_options.tls = options.tls;
  try {
    return std::make_shared<comm::tensor_hub>(
      hub_options, [route](comm::frame&& f) { route_frame(*route, std::move(f)); });
  } catch (const comm::comm_error& e) {
    throw pipeline_error(e.what());
  }
}

} // namespace

node::node(node_options options) : impl_(std::make_unique<impl>()) {
  auto& self = *impl_;
  ACTORPIPE_CHECK(!options.secret.empty() || options.tls.enabled() ||
                    comm::is_loopback(options.host),
                  "node: refusing to listen on ", options.host,
                  " without a secret or TLS: give --secret-file or --tls-cert/--tls-key/--tls-ca "
                  "(or listen on 127.0.0.1)");
  auto route = self.route;
  self.hub = start_hub(options, route);
  self.config.load<caf::io::middleman>();
  if (options.tls.enabled()) {
    self.config.load<caf::openssl::manager>();
    nodes::set_tls_identity(self.config, options.tls);
  }
  self.config.set("scheduler.max-threads", 2);
  self.config.set("logger.verbosity", caf::atom("quiet"));
  actors::add_pipeline_errors(self.config); // stages' refusals render as their sentence
  self.system = std::make_unique<caf::actor_system>(self.config);
  // Pooled, not detached: a detached actor's thread waits for the actor object's destruction,
  // which CAF 0.17 sometimes delays past the system's shutdown once remote nodes held handles
  // of it (seen as a hang in ~actor_system). Its rare blocking work (output and checkpoint
  // frames) occupies one of the two workers meanwhile.
  self.host = nodes::spawn_node_host(*self.system, options.secret, self.hub, route,
                                     options.max_model_bytes, options.keep_snapshots);
  {
    std::lock_guard<std::mutex> lock(route->mutex);
    route->host_ptr = caf::actor_cast<caf::weak_actor_ptr>(self.host);
  }
  auto published =
    options.tls.enabled()
      ? caf::openssl::publish(self.host, options.port, options.host.c_str(), true)
      : self.system->middleman().publish(self.host, options.port, options.host.c_str(), true);
  if (!published) {
    caf::anon_send_exit(self.host, caf::exit_reason::user_shutdown);
    throw pipeline_error(detail::concat("node: cannot listen on ", options.host, ":", options.port,
                                        ": ", self.system->render(published.error())));
  }
  self.host_name = options.host;
  self.port = *published;
  caf::anon_send(self.host, nodes::label_atom::value, address());
  log::get()->info("node {} listening (data {}:{}, {})", address(), self.hub->host(),
                   self.hub->port(),
                   options.tls.enabled()    ? "TLS"
                   : options.secret.empty() ? "loopback, no secret"
                                            : "shared secret");
  if (!options.join.empty()) {
    start_joining(options);
  }
}

void node::start_joining(const node_options& options) {
  auto& self = *impl_;
  self.joining = join_state::trying;
  self.joiner = std::thread([&self, options, address = address()] {
    try {
      nodes::announce_join(*self.system, options.join, address, options.secret,
                           options.tls.enabled(), options.join_timeout, self.stop_joining);
      log::get()->info("node {}: joined the driver at {}", address, options.join);
      self.joining = join_state::joined;
    } catch (const std::exception& e) {
      log::get()->error("node {}: {}", address, e.what());
      std::lock_guard<std::mutex> lock(self.join_mutex);
      self.join_error = e.what();
      self.joining = join_state::failed;
    }
  });
}

node::join_state node::joining() const {
  return impl_->joining.load();
}

std::string node::join_error() const {
  std::lock_guard<std::mutex> lock(impl_->join_mutex);
  return impl_->join_error;
}

node::~node() {
  auto& self = *impl_;
  self.stop_joining = true;
  if (self.joiner.joinable()) {
    self.joiner.join();
  }
  self.system->middleman().unpublish(self.host, self.port);
  caf::anon_send_exit(self.host, caf::exit_reason::user_shutdown);
  // The actor system waits for every actor to be destroyed: drop our handles first.
  self.host = caf::actor{};
  self.hub.reset();
  self.system.reset();
}

std::string node::address() const {
  return detail::concat(impl_->host_name, ":", impl_->port);
}

uint16_t node::port() const {
  return impl_->port;
}

uint16_t node::data_port() const {
  return impl_->hub->port();
}

std::size_t node::stages() const {
  std::lock_guard<std::mutex> lock(impl_->route->mutex);
  return impl_->route->stages.size();
}

uint64_t node::rejected() const {
  return impl_->route->rejected + impl_->hub->frames_rejected();
}

} // namespace actorpipe
