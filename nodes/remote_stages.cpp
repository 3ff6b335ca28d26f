#include "nodes/remote_stages.hpp"

#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/udp.hpp>
#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <caf/openssl/remote_actor.hpp>
#include <nlohmann/json.hpp>

#include "actors/request_error.hpp"
#include "comm/tensor_hub.hpp"
#include "logging/log.hpp"
#include "nodes/heartbeat.hpp"
#include "nodes/protocol.hpp"
#include "nodes/stage_proxy.hpp"

namespace actorpipe::nodes {
namespace {

using namespace actorpipe::actors;

// Where a setup request goes: the node's address, and the stage it is for, if one.
struct asked {
  const caf::actor& node;
  const std::string& address;
  std::optional<std::size_t> stage;
};

// A failed setup request as a pipeline_error: the node's refusal, its fields completed by the
// stage and node asked, or the request's own failure (a timeout, a node that went).
pipeline_error setup_failure(caf::actor_system& sys, const caf::error& err, const asked& to,
                             std::chrono::milliseconds timeout, const char* what) {
  auto details = actors::is_pipeline_error(err) ? actors::details_of_pipeline_error(err)
                                                : error_details{actors::request_error_kind(err)};
  // A refusal in a stage's name says which stage in its sentence already.
  auto names_stage = details.stage.has_value();
  details.stage = names_stage ? details.stage : to.stage;
  if (details.node.empty()) {
    details.node = to.address;
  }
  if (details.kind == error_kind::stage_lost) {
    details.kind = error_kind::node_lost;
  }
  auto sentence = actors::carried_sentence(err);
  auto message = sentence ? *sentence
                          : detail::concat("node ", to.address, ", asked '", what, "', ",
                                           actors::request_error(sys, err, timeout));
  if (to.stage && !names_stage) {
    message = detail::concat("stage ", *to.stage, ": ", message);
  }
  return pipeline_error(message, std::move(details));
}

// One setup request answered by an R, or the pipeline_error of its failure.
template <class R, class... Ts>
R ask(caf::scoped_actor& self, const asked& to, std::chrono::milliseconds timeout, const char* what,
      Ts&&... xs) {
  std::optional<R> reply;
  caf::error failure;
  self->request(to.node, timeout, std::forward<Ts>(xs)...)
    .receive([&](R& r) { reply = std::move(r); }, [&](caf::error& e) { failure = std::move(e); });
  if (!reply) {
    throw setup_failure(self->system(), failure, to, timeout, what);
  }
  return std::move(*reply);
}

// The address of this host on the route to `host` (a UDP "connect" sends nothing).
std::string local_address_towards(const std::string& host, uint16_t port) {
  if (comm::is_loopback(host)) {
    return "127.0.0.1";
  }
  namespace asio = boost::asio;
  asio::io_context io;
  asio::ip::udp::resolver resolver(io);
  boost::system::error_code ec;
  auto found = resolver.resolve(host, std::to_string(port), ec);
  if (ec || found.empty()) {
    throw pipeline_error(detail::concat("cannot resolve node host '", host, "'"));
  }
  asio::ip::udp::socket socket(io);
  socket.connect(found.begin()->endpoint(), ec);
  if (ec) {
    throw pipeline_error(detail::concat("no route to node host '", host, "': ", ec.message()));
  }
  return socket.local_endpoint().address().to_string();
}

// The scheduler's end of the data channel: output and state frames go to the proxy of their
// stage (through `routes`), anything else is refused.
std::shared_ptr<comm::tensor_hub> scheduler_hub(const node_placement& placement,
                                                std::shared_ptr<proxy_routes> routes) {
  auto [first_host, first_port] = parse_host_port(placement.nodes.front(), "node");
  comm::hub_options hub_options;
  hub_options.host = local_address_towards(first_host, first_port);
  hub_options.secret = placement.secret;
  hub_options.tls = placement.tls;
  try {
    return std::make_shared<comm::tensor_hub>(hub_options, [routes](comm::frame&& f) {
      const auto& h = f.header;
      if (h.kind == comm::frame_kind::output) {
        caf::anon_send(routes->proxy(h.stage), output_atom::value, h.step, h.microbatch,
                       std::move(f.tensor));
      } else if (h.kind == comm::frame_kind::state && f.tensor.scalar_type() == torch::kUInt8) {
        caf::anon_send(routes->proxy(h.stage), state_atom::value, h.stage, h.step,
                       std::move(f.tensor));
      } else {
        throw comm::frame_error(
          detail::concat("a scheduler takes no ", comm::to_string(h.kind), " frames"));
      }
    });
  } catch (const comm::comm_error& e) {
    throw pipeline_error(e.what());
  }
}

// The node at host:port, reached within the connect timeout and authenticated (hello, then the
// answer to its challenge).
caf::actor authenticated(caf::actor_system& sys, caf::scoped_actor& self,
                         const node_placement& placement, const std::string& address) {
  auto timeout = placement.connect_timeout;
  auto [host, port] = parse_host_port(address, "node");
  auto handle = reach(sys, host, port, placement.tls.enabled(), timeout);
  asked to{handle, address, std::nullopt};
  auto challenge = ask<std::string>(self, to, timeout, "hello", hello_atom::value);
  ask<bool>(self, to, timeout, "auth", auth_atom::value,
            to_hex(comm::handshake_answer(placement.secret, challenge)));
  return handle;
}

// Each file (the model's, the hooks' TorchScript) goes once to every node, which keeps it by its
// digest for the builds; returns the model with digests in place of the files.
remote_model send_models(caf::scoped_actor& self, const std::map<std::string, caf::actor>& handles,
                         const remote_model& model, std::chrono::milliseconds timeout) {
  auto described = by_digest(model);
  auto files = file_fields(model);
  auto digests = file_fields(std::as_const(described));
  for (std::size_t f = 0; f < files.size(); ++f) {
    if (files[f]->empty()) {
      continue;
    }
    for (const auto& [address, handle] : handles) {
      ask<bool>(self, {handle, address, std::nullopt}, timeout, "model", model_atom::value,
                *digests[f], *files[f]);
    }
  }
  return described;
}

// Asks `node` to build stage `i` from `spec`; checks that it took the settings sent and returns
// where the stage takes frames.
endpoint build_stage(caf::scoped_actor& self, const asked& to, const stage_spec& spec,
                     std::chrono::milliseconds timeout) {
  auto reply = nlohmann::json::parse(
    ask<std::string>(self, to, timeout, "build", build_atom::value, to_json(spec)));
  auto sent = nlohmann::json::parse(to_json(spec.settings));
  auto taken = reply.value("settings", nlohmann::json{});
  if (taken != sent) {
    throw pipeline_error(
      detail::concat("stage ", *to.stage, ": the node at ", to.address,
                     " built it with other settings than sent (", taken.dump(), " for ",
                     sent.dump(), ")"),
      error_details{error_kind::other, to.stage, std::nullopt, std::nullopt, to.address});
  }
  return {reply.at("data_host").get<std::string>(), reply.at("data_port").get<uint16_t>(), ""};
}

// The placement's nodes, each reached and authenticated once: a handle per address, and per
// stage its node's handle and its name ("node HOST:PORT", for messages).
struct placed_nodes {
  std::map<std::string, caf::actor> handles;
  std::vector<caf::actor> nodes;
  std::vector<std::string> names;
};

placed_nodes reach_placed(caf::actor_system& sys, caf::scoped_actor& self,
                          const node_placement& placement) {
  placed_nodes placed;
  for (const auto& address : placement.nodes) {
    auto [host, port] = parse_host_port(address, "node");
    placed.names.push_back(detail::concat("node ", host, ":", port));
    auto it = placed.handles.find(address);
    if (it == placed.handles.end()) {
      it = placed.handles.emplace(address, authenticated(sys, self, placement, address)).first;
    }
    placed.nodes.push_back(it->second);
  }
  return placed;
}

// What a node builds stage `i` of `count` from: the model as sent, the cut, the stage's settings
// and its replicas' group.
stage_spec spec_of_stage(const remote_model& described, const partition& cut,
                         const pipeline_options& options, std::size_t i, std::size_t count,
                         std::size_t threads, const std::string& group_prefix) {
  stage_spec spec;
  spec.model = described;
  spec.bounds = cut.bounds;
  spec.settings = stage_settings_for(options, i, count, threads, options.data_parallel.bmuf);
  if (options.data_parallel.replicas > 1) {
    spec.data_parallel = options.data_parallel;
    spec.data_parallel.local = nullptr;
    spec.group_prefix = group_prefix;
  }
  return spec;
}

// The built stages' proxies, wired to their nodes (each node learns the peer table and its
// proxy), then their heartbeats.
void wire_proxies(caf::actor_system& sys, caf::scoped_actor& self, const placed_nodes& placed,
                  const node_placement& placement, const peer_table& peers,
                  const stage_listener_actor& scheduler,
                  const std::shared_ptr<proxy_routes>& routes, const pipeline_options& options,
                  remote_stages& result) {
  auto count = peers.stages.size();
  auto table = to_json(peers);
  for (std::size_t i = 0; i < count; ++i) {
    result.proxies.push_back(spawn_proxy(sys, placed.nodes[i], placed.names[i],
                                         static_cast<uint32_t>(i), peers.stages[i], scheduler,
                                         result.hub, options.wait_timeout));
  }
  {
    std::lock_guard<std::mutex> lock(routes->mutex);
    for (const auto& proxy : result.proxies) {
      routes->proxies.push_back(caf::actor_cast<caf::weak_actor_ptr>(proxy));
    }
  }
  for (std::size_t i = 0; i < count; ++i) {
    ask<bool>(self, {placed.nodes[i], placement.nodes[i], i}, placement.connect_timeout, "wire",
              wire_atom::value, static_cast<uint32_t>(i), table,
              caf::actor_cast<caf::actor>(result.proxies[i]));
  }
  for (std::size_t i = 0; i < count; ++i) {
    start_heartbeat(sys, placed.nodes[i], placement.nodes[i], static_cast<uint32_t>(i),
                    caf::actor_cast<caf::actor>(result.proxies[i]), placement.heartbeat_timeout);
  }
}

} // namespace

caf::actor reach(caf::actor_system& sys, const std::string& host, uint16_t port, bool tls,
                 std::chrono::milliseconds timeout) {
  auto result = std::make_shared<std::promise<caf::expected<caf::actor>>>();
  auto future = result->get_future();
  std::thread([&sys, host, port, tls, result] {
    result->set_value(tls ? caf::openssl::remote_actor(sys, host, port)
                          : sys.middleman().remote_actor(host, port));
  }).detach();
  if (future.wait_for(timeout) != std::future_status::ready) {
    throw pipeline_error(detail::concat("node ", host, ":", port, " did not answer within ",
                                        timeout.count(), " ms (is `actorpipe node --listen ", host,
                                        ":", port, "` running", tls ? " with TLS" : "", "?)"));
  }
  auto handle = future.get();
  if (!handle) {
    throw pipeline_error(detail::concat(
      "cannot reach node ", host, ":", port, ": ", sys.render(handle.error()),
      tls ? " (is it running with TLS, and did our CA sign its certificate and its CA ours?)"
          : detail::concat(" (is `actorpipe node --listen ", host, ":", port, "` running?)")));
  }
  return *handle;
}

remote_stages connect_stages(caf::actor_system& sys, const remote_model& model,
                             const partition& cut, const pipeline_options& options,
                             std::size_t threads, const stage_listener_actor& scheduler,
                             const std::string& group_prefix) {
  const auto& placement = options.placement;
  // Stage actors; each holds options.chunks parts of the cut.
  auto count = cut.stages() / options.chunks;
  ACTORPIPE_CHECK(placement.nodes.size() == count, "pipeline: ", placement.nodes.size(),
                  " nodes given for ", count, " stages");
  auto timeout = placement.connect_timeout;
  caf::scoped_actor self{sys};
  remote_stages result;
  // The hub first: it checks the TLS files (invalid_argument naming the one that fails).
  auto routes = std::make_shared<proxy_routes>();
  result.hub = scheduler_hub(placement, routes);
  auto placed = reach_placed(sys, self, placement);
  auto described = send_models(self, placed.handles, model, timeout);
  std::size_t built = 0;
  auto release_all = [&] {
    for (std::size_t i = 0; i < built; ++i) {
      // From the authenticated scoped actor: a node refuses anonymous senders.
      self->send(placed.nodes[i], release_atom::value, static_cast<uint32_t>(i));
    }
    for (auto& proxy : result.proxies) {
      caf::anon_send_exit(proxy, caf::exit_reason::user_shutdown);
    }
  };
  try {
    peer_table peers;
    for (std::size_t i = 0; i < count; ++i) {
      auto spec = spec_of_stage(described, cut, options, i, count, threads, group_prefix);
      auto data = build_stage(self, {placed.nodes[i], placement.nodes[i], i}, spec, timeout);
      ++built;
      data.node = placement.nodes[i];
      peers.stages.push_back(std::move(data));
    }
    peers.scheduler = {result.hub->host(), result.hub->port(), "scheduler"};
    result.data = peers.stages;
    wire_proxies(sys, self, placed, placement, peers, scheduler, routes, options, result);
  } catch (const nlohmann::json::exception& e) {
    release_all();
    throw pipeline_error(detail::concat("a node sent a malformed reply: ", e.what()));
  } catch (...) {
    release_all();
    throw;
  }
  result.nodes = std::move(placed.handles);
  log::get()->info("pipeline: {} stages on nodes {}; frames back to {}:{}", count,
                   fmt::join(placement.nodes, ", "), result.hub->host(), result.hub->port());
  return result;
}

std::vector<bool> answering(caf::actor_system& sys, const std::vector<std::string>& addresses,
                            const std::map<std::string, caf::actor>& known,
                            const node_placement& placement, bool quiet) {
  auto timeout = placement.connect_timeout;
  // A node still connected is asked for a heartbeat, which it answers within heartbeat_timeout
  // unless frozen; a node to reach again gets connect_timeout for the hello.
  auto heartbeat = placement.heartbeat_timeout;
  std::vector<std::future<bool>> replies;
  for (const auto& address : addresses) {
    auto it = known.find(address);
    auto handle = it == known.end() ? caf::actor{} : it->second;
    replies.push_back(std::async(
      std::launch::async, [&sys, address, handle, &placement, timeout, heartbeat, quiet] {
        try {
          auto [host, port] = parse_host_port(address, "node");
          auto node = handle ? handle : reach(sys, host, port, placement.tls.enabled(), timeout);
          // A node whose connection closed is known at once (its handle is down); one that is
          // connected but silent runs out of time.
          caf::scoped_actor self{sys};
          self->monitor(node);
          bool by_heartbeat = handle && heartbeat.count() > 0;
          auto wait = by_heartbeat ? heartbeat : timeout;
          if (by_heartbeat) {
            self->send(node, heartbeat_atom::value);
          } else {
            self->send(node, hello_atom::value);
          }
          std::string why;
          self->receive(
            [](std::string&) {}, [](bool) {},
            [&](caf::down_msg& down) {
              why = "its connection is gone (" + sys.render(down.reason) + ")";
            },
            caf::after(wait) >>
              [&] { why = detail::concat("it did not answer within ", wait.count(), " ms"); });
          if (!why.empty()) {
            throw pipeline_error(why);
          }
          return true;
        } catch (const std::exception& e) {
          log::get()->log(quiet ? spdlog::level::debug : spdlog::level::warn,
                          "pipeline: node {} does not answer: {}", address, e.what());
          return false;
        }
      }));
  }
  std::vector<bool> result;
  for (auto& reply : replies) {
    result.push_back(reply.get());
  }
  return result;
}

} // namespace actorpipe::nodes
