#include "nodes/join.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <thread>

#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <caf/openssl/publish.hpp>

#include <actorpipe/errors.hpp>

#include "actors/pipeline_errc.hpp"
#include "comm/tensor_hub.hpp"
#include "logging/log.hpp"
#include "nodes/protocol.hpp"
#include "nodes/remote_stages.hpp"

namespace actorpipe::nodes {

struct join_listener::queue {
  std::mutex mutex;
  std::vector<std::string> joined;
};

namespace {

struct join_state {
  std::string secret;
  std::shared_ptr<join_listener::queue> queue;
  // The challenge each peer process (CAF node) was given, until it answers.
  std::map<caf::node_id, std::string> challenges;
  static inline const char* name = "actorpipe.join";
};

using join_actor_ptr = caf::stateful_actor<join_state>*;

// "host:port" of printable characters, or why not (the text itself is not repeated: it came
// from the network).
std::string address_problem(const std::string& address) {
  if (address.empty() || address.size() > 261 ||
      !std::all_of(address.begin(), address.end(), [](char c) { return c > 0x20 && c < 0x7f; })) {
    return "its address is not HOST:PORT";
  }
  try {
    parse_host_port(address, "the joining node's address");
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

caf::result<bool> take_answer(join_actor_ptr self, const std::string& address,
                              const std::string& answer) {
  auto& st = self->state;
  auto sender = self->current_sender();
  auto it = sender ? st.challenges.find(sender->node()) : st.challenges.end();
  if (it == st.challenges.end() || !answers_challenge(st.secret, it->second, answer)) {
    log::get()->error("pipeline: refused a node asking to join: wrong secret");
    return actors::make_pipeline_error(error_kind::other,
                                       "the driver refused the secret (check --secret-file)");
  }
  st.challenges.erase(it);
  if (auto problem = address_problem(address); !problem.empty()) {
    log::get()->error("pipeline: refused a node asking to join: {}", problem);
    return actors::make_pipeline_error(error_kind::other,
                                       "the driver refused the announcement: " + problem);
  }
  {
    std::lock_guard<std::mutex> lock(st.queue->mutex);
    st.queue->joined.push_back(address);
  }
  log::get()->info("pipeline: node {} joins; taken at the next step boundary", address);
  return true;
}

caf::behavior join_actor(join_actor_ptr self, std::string secret,
                         std::shared_ptr<join_listener::queue> queue) {
  self->state.secret = std::move(secret);
  self->state.queue = std::move(queue);
  return {
    [=](join_atom) -> std::string {
      auto challenge = new_challenge();
      if (auto sender = self->current_sender()) {
        self->state.challenges[sender->node()] = challenge;
      }
      return challenge;
    },
    [=](join_atom, const std::string& address, const std::string& answer) {
      return take_answer(self, address, answer);
    },
  };
}

// One request answered by `T`, or the error's text.
template <class T, class... Ts>
std::string ask_join(caf::scoped_actor& self, const caf::actor& to, T& reply, Ts&&... xs) {
  std::string failure;
  self->request(to, std::chrono::seconds(5), std::forward<Ts>(xs)...)
    .receive([&](T& r) { reply = std::move(r); },
             [&](caf::error& e) { failure = self->system().render(e); });
  return failure;
}

} // namespace

join_listener::join_listener(caf::actor_system& sys, const std::string& address, std::string secret,
                             bool tls)
  : sys_(sys), queue_(std::make_shared<queue>()) {
  auto [host, port] = parse_host_port(address, "accept_joins");
  actor_ = sys.spawn(join_actor, std::move(secret), queue_);
  auto published = tls ? caf::openssl::publish(actor_, port, host.c_str(), true)
                       : sys.middleman().publish(actor_, port, host.c_str(), true);
  if (!published) {
    caf::anon_send_exit(actor_, caf::exit_reason::user_shutdown);
    throw pipeline_error(detail::concat("cannot listen for joining nodes on ", address, ": ",
                                        sys.render(published.error())));
  }
  host_ = host;
  port_ = *published;
  log::get()->info("pipeline: nodes may join at {}{}", this->address(), tls ? " (TLS)" : "");
}

join_listener::~join_listener() {
  sys_.middleman().unpublish(actor_, port_);
  caf::anon_send_exit(actor_, caf::exit_reason::user_shutdown);
}

std::string join_listener::address() const {
  return detail::concat(host_, ":", port_);
}

std::vector<std::string> join_listener::take() {
  std::lock_guard<std::mutex> lock(queue_->mutex);
  return std::exchange(queue_->joined, {});
}

void announce_join(caf::actor_system& sys, const std::string& driver, const std::string& address,
                   const std::string& secret, bool tls, std::chrono::milliseconds timeout,
                   const std::atomic<bool>& stop) {
  auto [host, port] = parse_host_port(driver, "--join");
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string last = "nothing tried";
  while (!stop && std::chrono::steady_clock::now() < deadline) {
    std::string refusal;
    try {
      auto handle = reach(sys, host, port, tls, std::chrono::milliseconds(2000));
      caf::scoped_actor self{sys};
      std::string challenge;
      last = ask_join(self, handle, challenge, join_atom::value);
      if (last.empty()) {
        bool taken = false;
        refusal = ask_join(self, handle, taken, join_atom::value, address,
                           to_hex(comm::handshake_answer(secret, challenge)));
        if (refusal.empty()) {
          return;
        }
      }
    } catch (const pipeline_error& e) {
      last = e.what(); // nobody there yet
    }
    if (!refusal.empty()) {
      // Refused: another try would be refused too.
      throw pipeline_error(detail::concat("joining the driver at ", driver, ": ", refusal));
    }
    for (int k = 0; k < 20 && !stop && std::chrono::steady_clock::now() < deadline; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  throw pipeline_error(detail::concat("joining the driver at ", driver,
                                      ": nobody took the "
                                      "announcement within ",
                                      timeout.count() / 1000.0, " s (last: ", last, ")"),
                       error_details{error_kind::timeout});
}

} // namespace actorpipe::nodes
