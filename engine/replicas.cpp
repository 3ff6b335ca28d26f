// Replicas of a pipeline: settings from the environment, and R replicas in one process.
#include <actorpipe/replicas.hpp>

#include <cerrno>
#include <cstdlib>
#include <exception>
#include <functional>
#include <future>
#include <optional>
#include <thread>
#include <utility>

#include "comm/replica_group.hpp"
#include "engine/futures.hpp"
#include "engine/pipeline_impl.hpp"
#include "engine/recovery/membership.hpp"
#include "nodes/join.hpp"

namespace actorpipe {
namespace {

using detail::get_all;

// The value of `name` as a number in [min, max], or nothing when unset.
std::optional<uint64_t> number_from_env(const char* name, uint64_t min, uint64_t max) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    return std::nullopt;
  }
  char* end = nullptr;
  errno = 0;
  auto value = std::strtoull(text, &end, 10);
  ACTORPIPE_CHECK(errno == 0 && *end == '\0' && text[0] != '-' && value >= min && value <= max,
                  "environment variable ", name, "='", text, "' is not a number in [", min, ", ",
                  max, "]");
  return value;
}

// R pipelines built side by side, since each waits at the rendezvous for the others; `build(r)`
// makes replica r's. The rendezvous and the initial broadcast are bounded by `deadline`.
std::vector<std::unique_ptr<pipeline>>
build_replicas(std::size_t replicas, std::chrono::milliseconds deadline,
               const std::function<std::unique_ptr<pipeline>(std::size_t)>& build) {
  std::vector<std::future<std::unique_ptr<pipeline>>> building;
  for (std::size_t r = 0; r < replicas; ++r) {
    building.push_back(std::async(std::launch::async, [&build, r] { return build(r); }));
  }
  return get_all(building, deadline, "replicated_pipeline");
}

} // namespace

data_parallel_options data_parallel_from_env(data_parallel_options o) {
  if (auto v = number_from_env("WORLD_SIZE", 1, 1u << 20)) {
    o.replicas = *v;
  }
  if (auto v = number_from_env("RANK", 0, 1u << 20)) {
    o.rank = *v;
  }
  if (auto v = number_from_env("MASTER_PORT", 1, 65535)) {
    o.master_port = static_cast<uint16_t>(*v);
  }
  if (const char* addr = std::getenv("MASTER_ADDR"); addr && *addr) {
    o.master_addr = addr;
  }
  // torchrun's agent serves MASTER_PORT itself and keeps it across restarts of the group.
  if (const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
      agent && agent == std::string("True")) {
    o.launcher_store = true;
    o.group = detail::concat(
      "actorpipe/attempt_", number_from_env("TORCHELASTIC_RESTART_COUNT", 0, 1u << 20).value_or(0));
  }
  ACTORPIPE_CHECK(o.rank < o.replicas, "rank ", o.rank, " (RANK) must be below the world size ",
                  o.replicas, " (WORLD_SIZE)");
  return o;
}

std::shared_ptr<detail::local_store> make_local_rendezvous() {
  return comm::make_local_store();
}

replicated_pipeline::replicated_pipeline(engine& sys, const model_factory& make_model,
                                         partition cut, pipeline_options options,
                                         std::size_t replicas) {
  ACTORPIPE_CHECK(replicas >= 1, "replicated_pipeline: replicas must be >= 1");
  ACTORPIPE_CHECK(static_cast<bool>(make_model), "replicated_pipeline: no model factory");
  options.data_parallel.replicas = replicas;
  options.data_parallel.local = comm::make_local_store();
  // Models are made here, in rank order (factories usually seed the global generator).
  std::vector<layer_list> models;
  for (std::size_t r = 0; r < replicas; ++r) {
    models.push_back(make_model());
  }
  replicas_ = build_replicas(replicas, 2 * options.data_parallel.timeout + std::chrono::seconds(30),
                             [&](std::size_t r) {
                               auto o = options;
                               o.data_parallel.rank = r;
                               return std::make_unique<pipeline>(sys, std::move(models[r]), cut, o);
                             });
  deadline_ = options.step_timeout + std::chrono::seconds(30);
  members_ = std::make_unique<recovery::membership>();
}

replicated_pipeline::replicated_pipeline(engine& sys, const remote_model& model, partition cut,
                                         pipeline_options options, std::size_t replicas) {
  ACTORPIPE_CHECK(replicas >= 1, "replicated_pipeline: replicas must be >= 1");
  ACTORPIPE_CHECK(options.chunks >= 1 && cut.stages() % options.chunks == 0,
                  "replicated_pipeline: a partition of ", cut.stages(),
                  " parts cannot be spread over stage actors of ", options.chunks, " chunks each");
  auto stages = cut.stages() / options.chunks;
  const auto all = options.placement.nodes;
  ACTORPIPE_CHECK(all.size() == replicas * stages, "replicated_pipeline: ", all.size(),
                  " nodes given for ", replicas, " replicas of ", stages,
                  " stages (one per stage of each replica, replica after replica)");
  options.data_parallel.replicas = replicas;
  // The nodes reach the rendezvous over TCP: rank 0 serves it here, the others are its clients.
  options.data_parallel.local = nullptr;
  auto deadline = 2 * options.data_parallel.timeout + 2 * options.placement.connect_timeout +
                  std::chrono::seconds(30);
  // The replicas take joins together (rejoin_nodes), not each its own pipeline.
  const auto joins_at = std::exchange(options.placement.accept_joins, std::string{});
  replicas_ = build_replicas(replicas, deadline, [&](std::size_t r) {
    auto o = options;
    o.data_parallel.rank = r;
    o.placement.nodes.assign(all.begin() + static_cast<std::ptrdiff_t>(r * stages),
                             all.begin() + static_cast<std::ptrdiff_t>((r + 1) * stages));
    return std::make_unique<pipeline>(sys, model, cut, o);
  });
  deadline_ = options.step_timeout + std::chrono::seconds(30);
  members_ = std::make_unique<recovery::membership>();
  members_->given = all;
  members_->given_cut = cut;
  if (!joins_at.empty()) {
    members_->joins = std::make_unique<nodes::join_listener>(
      sys.internals().system, joins_at, options.placement.secret, options.placement.tls.enabled());
  }
}

std::string replicated_pipeline::join_address() const {
  return members_->join_address();
}

replicated_pipeline::~replicated_pipeline() {
  // The replicas go all at once: each one's rendezvous waits at its end for the others' (rank
  // 0's serves the store until all are done, within data_parallel.timeout).
  std::vector<std::future<void>> leaving;
  for (auto& p : replicas_) {
    leaving.push_back(std::async(std::launch::async, [&p] { p.reset(); }));
  }
  for (auto& f : leaving) {
    f.wait();
  }
}

step_result replicated_pipeline::train_step(torch::Tensor inputs, torch::Tensor targets) {
  auto r = static_cast<int64_t>(replicas_.size());
  ACTORPIPE_CHECK(inputs.defined() && targets.defined() && inputs.dim() >= 1 &&
                    targets.dim() >= 1 && inputs.size(0) == targets.size(0),
                  "replicated train_step: inputs and targets need the same batch size");
  ACTORPIPE_CHECK(inputs.size(0) >= r, "replicated train_step: a batch of ", inputs.size(0),
                  " samples cannot feed ", r, " replicas");
  return train_step_scattered(torch::tensor_split(inputs, r, 0),
                              torch::tensor_split(targets, r, 0));
}

step_result replicated_pipeline::train_step_scattered(std::vector<torch::Tensor> inputs,
                                                      std::vector<torch::Tensor> targets) {
  ACTORPIPE_CHECK(inputs.size() == replicas_.size() && targets.size() == replicas_.size(),
                  "replicated train_step: ", inputs.size(), " input and ", targets.size(),
                  " target parts for ", replicas_.size(), " replicas (one each)");
  for (std::size_t r = 0; r < inputs.size(); ++r) {
    ACTORPIPE_CHECK(inputs[r].defined() && targets[r].defined() && inputs[r].dim() >= 1 &&
                      targets[r].dim() >= 1 && inputs[r].size(0) >= 1 &&
                      inputs[r].size(0) == targets[r].size(0),
                    "replicated train_step: part ", r,
                    " needs inputs and targets with the same, non-zero number of samples");
  }
  std::vector<std::future<step_result>> running;
  for (std::size_t k = 0; k < replicas_.size(); ++k) {
    running.push_back(replicas_[k]->train_step_async(inputs[k], targets[k]));
  }
  last_results_.assign(running.size(), std::nullopt);
  auto results = get_all<step_result>(
    running, deadline_, "replicated train_step", &last_outcomes_,
    [this](std::size_t r, const step_result& result) { last_results_[r] = result; });
  auto result = results.front();
  for (const auto& other : results) {
    result.wall_ms = std::max(result.wall_ms, other.wall_ms);
  }
  return result;
}

void replicated_pipeline::end_block() {
  std::vector<std::future<bool>> running;
  for (auto& p : replicas_) {
    running.push_back(std::async(std::launch::async, [&p] {
      p->end_block();
      return true;
    }));
  }
  get_all(running, deadline_, "replicated end_block");
}

void replicated_pipeline::save_state(const std::string& dir) {
  end_block();
  replicas_.front()->save_state(dir);
}

void replicated_pipeline::set_learning_rate(double lr) {
  for (auto& p : replicas_) {
    p->set_learning_rate(lr);
  }
}

std::vector<torch::Tensor> replicated_pipeline::forward_scattered(torch::Tensor inputs) {
  ACTORPIPE_CHECK(inputs.defined() && inputs.dim() >= 1 && inputs.size(0) >= 1,
                  "replicated forward: inputs need a batch dimension with at least one sample");
  auto parts = std::min<int64_t>(static_cast<int64_t>(replicas_.size()), inputs.size(0));
  return forward_scattered(torch::tensor_split(inputs, parts, 0));
}

std::vector<torch::Tensor>
replicated_pipeline::forward_scattered(const std::vector<torch::Tensor>& parts) {
  ACTORPIPE_CHECK(!parts.empty() && parts.size() <= replicas_.size(),
                  "replicated forward: ", parts.size(), " scattered parts for ", replicas_.size(),
                  " replicas (give 1 to ", replicas_.size(), ")");
  std::vector<std::future<torch::Tensor>> running;
  for (std::size_t r = 0; r < parts.size(); ++r) {
    ACTORPIPE_CHECK(parts[r].defined() && parts[r].dim() >= 1 && parts[r].size(0) >= 1,
                    "replicated forward: part ", r, " holds no samples");
  }
  for (std::size_t r = 0; r < parts.size(); ++r) {
    running.push_back(std::async(std::launch::async,
                                 [p = replicas_[r].get(), x = parts[r]] { return p->forward(x); }));
  }
  return get_all(running, deadline_, "replicated forward");
}

torch::Tensor replicated_pipeline::forward(torch::Tensor inputs) {
  return torch::cat(forward_scattered(std::move(inputs)), 0);
}

torch::Tensor replicated_pipeline::forward(const std::vector<torch::Tensor>& parts) {
  return torch::cat(forward_scattered(parts), 0);
}

uint64_t replicated_pipeline::snapshot(const std::string& note) {
  return replicas_.front()->snapshot(note);
}

uint64_t replicated_pipeline::snapshot_in_background(const std::string& note) {
  return replicas_.front()->snapshot_in_background(note);
}

uint64_t replicated_pipeline::newest_snapshot() {
  return replicas_.front()->newest_snapshot();
}

std::size_t replicated_pipeline::replicas() const {
  return replicas_.size();
}

pipeline& replicated_pipeline::replica(std::size_t rank) {
  ACTORPIPE_CHECK(rank < replicas_.size(), "replica ", rank, " of ", replicas_.size(),
                  " does not exist");
  return *replicas_.at(rank);
}

} // namespace actorpipe
