// pipeline::impl and engine::impl, which engine/pipeline.cpp (building and stepping) and
// engine/pipeline_snapshots.cpp (snapshots, and the door recovery goes through) share. Private
// to engine/; the recovery room (engine/recovery/) drives a pipeline, alone or a replica, only
// through recovery::placed_stages.
#pragma once

#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <caf/all.hpp>
#include <caf/io/middleman.hpp>
#include <caf/openssl/manager.hpp>

#include <actorpipe/errors.hpp>
#include <actorpipe/pipeline.hpp>
#include <actorpipe/replicas.hpp>

#include "actors/linger.hpp"
#include "actors/messages.hpp"
#include "actors/pipeline_errc.hpp"
#include "actors/stage_actor.hpp"
#include "comm/replica_group.hpp"
#include "comm/tensor_hub.hpp"
#include "comm/tie_group.hpp"
#include "comm/tls.hpp"
#include "logging/log.hpp"
#include "nodes/join.hpp"
#include "nodes/protocol.hpp"
#include "nodes/remote_stages.hpp"
#include "scheduler/scheduler_actor.hpp"
#include "stages/checkpoint.hpp"
#include "stages/device.hpp"
#include "stages/stage.hpp"

namespace actorpipe {

namespace recovery {
struct membership;
struct snapshots;
} // namespace recovery

struct engine::impl {
  explicit impl(std::size_t workers) : system(configure(config, workers)) {}

  static caf::actor_system_config& configure(caf::actor_system_config& cfg, std::size_t workers) {
    cfg.set("scheduler.max-threads", std::max<std::size_t>(1, workers));
    // The middleman reaches stages on other processes (remote pipelines), over TLS through the
    // OpenSSL module when their placement has certificates; both idle otherwise.
    cfg.load<caf::io::middleman>();
    cfg.load<caf::openssl::manager>();
    cfg.set("logger.verbosity", caf::atom("quiet"));
    actors::add_pipeline_errors(cfg); // stages' refusals render as their sentence
    return cfg;
  }

  // TLS sessions read the identity from the config when they connect, so it is set once,
  // before the first, and never changed.
  void use_tls(const tls_options& tls) {
    std::lock_guard<std::mutex> lock(tls_mutex);
    if (tls_identity.enabled()) {
      ACTORPIPE_CHECK(tls == tls_identity,
                      "pipeline: this engine already uses the TLS "
                      "certificate '",
                      tls_identity.certificate, "'; one identity per engine");
      return;
    }
    comm::tls_context check(tls);
    nodes::set_tls_identity(config, tls);
    tls_identity = tls;
  }

  // Declared first: the system keeps a reference to its config.
  caf::actor_system_config config;
  caf::actor_system system;
  std::mutex tls_mutex;
  tls_options tls_identity;
};

struct pipeline::impl {
  partition cut;
  pipeline_options options;
  std::vector<std::shared_ptr<stages::stage>> stages;
  std::vector<actors::stage_actor> stage_actors;
  scheduler::scheduler_actor scheduler;
  // Data parallelism: this replica's process groups (null without replicas).
  std::unique_ptr<comm::replica_group> replicas;
  // Stages on nodes: their proxies' transport (null in process). `stages` then holds local
  // copies of the initial stages, used to check checkpoints and count parameters only.
  std::shared_ptr<comm::tensor_hub> remote_hub;
  // The model as given (layers share the stages' modules in process), for save_torchscript.
  layer_list layers;
  // Carried by every training request; < 0 keeps the optimizers' own.
  double learning_rate = -1;
  // Stages on nodes: the model they build, the engine they were placed from and the nodes
  // reached (recover() places them again).
  std::optional<remote_model> remote;
  engine* sys = nullptr;
  std::map<std::string, caf::actor> nodes;
  // Where each stage actor takes frames: a node's kept snapshot goes to its neighbour's.
  std::vector<nodes::endpoint> stage_data;
  // Training and forward steps submitted: the scheduler's step counter, which a recovered
  // pipeline continues.
  std::atomic<uint64_t> steps{0};
  // The snapshots a recovery restores from, and the nodes beyond those the stages are on now
  // (the recovery room's types: engine/recovery/membership.hpp).
  std::unique_ptr<recovery::snapshots> snapshots;
  std::unique_ptr<recovery::membership> members;

  impl(partition p, pipeline_options o);
  ~impl();

  caf::actor_system& system() const { return sys->internals().system; }

  void stop_actors() {
    for (auto& a : stage_actors) {
      caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    }
    stage_actors.clear();
    if (scheduler) {
      caf::anon_send_exit(scheduler, caf::exit_reason::user_shutdown);
    }
    scheduler = nullptr;
  }

  // Stages on nodes: builds the local copy of the model and its stages (which check
  // checkpoints and count parameters), the scheduler and the stages on options.placement.nodes
  // cut by `cut`.
  void place_on_nodes();

  // Stages on nodes with replicas: meets the other replicas' drivers (options.data_parallel's
  // rank and world) and agrees with them on the model their nodes build.
  void meet_replicas();

  // Every stage takes its tensors from `state` (a snapshot, number `number`; null: nothing to
  // restore). `what` names the caller in errors.
  void restore(const std::shared_ptr<const stages::tensor_map>& state, uint64_t number,
               const char* what);

  // Splits along dimension 0 into m parts differing by at most one sample; forward-only passes
  // take fewer parts when the batch is smaller than m (`at_most`).
  // A part bound for a stage on a GPU comes from pinned host memory (its copy does not block).
  std::vector<torch::Tensor> split(const torch::Tensor& x, const char* what, bool at_most = false,
                                   bool to_last = false) const {
    ACTORPIPE_CHECK(x.defined() && x.dim() >= 1 && x.size(0) >= 1, what,
                    " must have a batch dimension with at least one sample");
    auto m = static_cast<int64_t>(options.microbatches);
    if (at_most) {
      m = std::min(m, x.size(0));
    }
    ACTORPIPE_CHECK(x.size(0) >= m, what, ": batch of ", x.size(0),
                    " samples cannot be split into ", m, " micro-batches");
    bool to_gpu = false;
    if (auto count = options.devices.size(); count > 0) {
      auto last = holder_of(options.chunk_layout(), count, count * options.chunks - 1).stage;
      to_gpu = options.devices[to_last ? last : 0].is_cuda();
    }
    // A batch made on a GPU by the caller's stream is complete before the stages' streams read it.
    stages::cuda::wait_for_current_stream(x);
    return torch::tensor_split(to_gpu ? stages::cuda::pinned(x) : x, m, 0);
  }

  // Queues a step; the future holds extract(outcome) or the step's error.
  template <class T, class Extract>
  std::future<T> submit(std::shared_ptr<scheduler::step_request> request, Extract extract) {
    if (!scheduler) {
      throw pipeline_error("pipeline: its stages were lost and not placed again (a recover() "
                           "failed); call recover() again",
                           error_details{error_kind::node_lost});
    }
    if (request->kind == scheduler::request_kind::train ||
        request->kind == scheduler::request_kind::forward) {
      ++steps;
    }
    auto promise = std::make_shared<std::promise<T>>();
    auto future = promise->get_future();
    request->finish = [promise, extract](scheduler::step_outcome outcome) {
      if (outcome.error) {
        promise->set_exception(outcome.error);
      } else {
        promise->set_value(extract(outcome));
      }
    };
    caf::anon_send(scheduler, actors::run_atom::value, std::move(request));
    return future;
  }

  // Waits with a deadline: the scheduler's own step timeout answers first unless the actor
  // system itself is stuck.
  template <class T>
  T wait(std::future<T>& future, const char* what) const {
    auto deadline = options.step_timeout + std::chrono::seconds(30);
    // The result of a short step is taken by this thread still running (actors/linger.hpp).
    bool ready = actors::poll_for(options.linger, [&] {
      return future.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    });
    if (!ready && future.wait_for(deadline) != std::future_status::ready) {
      throw pipeline_error(detail::concat(what, ": the scheduler did not answer within ",
                                          std::chrono::milliseconds(deadline).count(), " ms"),
                           error_details{error_kind::timeout});
    }
    return future.get();
  }

  // Queues a fetch of every stage's state, in the background or not; for snapshot `keep_as`
  // (pipeline::snapshot; 0: not a snapshot), which nodes keep a copy of.
  std::future<std::shared_ptr<std::map<std::string, torch::Tensor>>>
  submit_fetch(bool background, uint64_t keep_as = 0);
  // Every stage's state now, fetched and waited for (`what` names the caller in errors).
  std::shared_ptr<const stages::tensor_map> fetch_now(const char* what) {
    auto future = submit_fetch(false);
    return std::make_shared<const stages::tensor_map>(std::move(*wait(future, what)));
  }
  // Waits for a snapshot still arriving and, when all of it came, makes it the newest.
  void settle_snapshot();
  // The same for a snapshot that has arrived, without waiting (before each step: so the nodes
  // keep it as soon as it is whole).
  void settle_if_arrived();
  // Makes `state` the newest snapshot, number `number`; stages on nodes: each node keeps its
  // stages' copy, with `note`.
  void install_snapshot(std::shared_ptr<std::map<std::string, torch::Tensor>> state,
                        uint64_t number, const std::string& note);
  // Stages on nodes: the node of each stage actor, in stage order.
  std::vector<caf::actor> stage_nodes() const;

  // Checks and queues a training step on micro-batches.
  std::future<step_result> submit_train(std::vector<torch::Tensor> inputs,
                                        std::vector<torch::Tensor> targets) {
    settle_if_arrived();
    ACTORPIPE_CHECK(options.loss || options.loss_with_inputs,
                    "train_step: pipeline_options.loss is not set");
    ACTORPIPE_CHECK(static_cast<bool>(options.optimizer),
                    "train_step: pipeline_options.optimizer is not set");
    ACTORPIPE_CHECK(inputs.size() == options.microbatches && targets.size() == inputs.size(),
                    "train_step: ", inputs.size(), " input and ", targets.size(),
                    " target micro-batches given for ", options.microbatches);
    double total = 0;
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      ACTORPIPE_CHECK(inputs[k].defined() && targets[k].defined() && inputs[k].dim() >= 1 &&
                        targets[k].dim() >= 1 && inputs[k].size(0) >= 1 &&
                        inputs[k].size(0) == targets[k].size(0),
                      "train_step: micro-batch ", k,
                      " needs inputs and targets with the same, non-zero batch size");
      total += static_cast<double>(inputs[k].size(0));
    }
    auto request = std::make_shared<scheduler::step_request>();
    request->kind = scheduler::request_kind::train;
    request->learning_rate = learning_rate;
    for (const auto& mb : inputs) {
      request->loss_scales.push_back(
        options.reduction == loss_reduction::mean ? static_cast<double>(mb.size(0)) / total : 1.0);
    }
    request->inputs = std::move(inputs);
    request->targets = std::move(targets);
    return submit<step_result>(std::move(request),
                               [](scheduler::step_outcome& o) { return std::move(o.result); });
  }

  // Stages on nodes: their state comes back in memory (a fetch request to every stage).
  std::vector<std::pair<std::string, torch::Tensor>> named_remote(bool gradients) {
    if (gradients) {
      throw pipeline_error("named_gradients: the gradients of stages on nodes stay on the nodes");
    }
    auto all = fetch_now("named_parameters");
    std::vector<std::pair<std::string, torch::Tensor>> result;
    for (const auto& st : stages) {
      for (auto& [name, initial] : st->named_tensors(false)) {
        // A tied parameter's state is kept once, under its tie's name.
        auto tie = st->config().tied.find(name);
        auto it = all->find(tie == st->config().tied.end() ? name : tie->second);
        if (it == all->end()) {
          throw pipeline_error(detail::concat("named_parameters: stage ", st->config().index,
                                              " did not return '", name, "'"));
        }
        result.emplace_back(name, it->second);
      }
    }
    return result;
  }

  std::vector<std::pair<std::string, torch::Tensor>> named(bool gradients) {
    if (remote_hub) {
      return named_remote(gradients);
    }
    std::vector<std::pair<std::string, torch::Tensor>> all;
    for (const auto& st : stages) {
      auto part = st->named_tensors(gradients);
      all.insert(all.end(), std::make_move_iterator(part.begin()),
                 std::make_move_iterator(part.end()));
    }
    return all;
  }
};

} // namespace actorpipe
