// The embedding facade: engine and pipeline over the stage and scheduler actors.
#include <actorpipe/pipeline.hpp>

#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <unistd.h>

#include <caf/all.hpp>
#include <caf/io/middleman.hpp>
#include <caf/openssl/manager.hpp>

#include <actorpipe/batch_norm.hpp>
#include <actorpipe/hooks.hpp>
#include <actorpipe/memory.hpp>
#include <actorpipe/replicas.hpp>
#include <actorpipe/torchscript.hpp>

#include "actors/linger.hpp"
#include "actors/messages.hpp"
#include "actors/stage_actor.hpp"
#include "comm/replica_group.hpp"
#include "comm/tensor_hub.hpp"
#include "comm/tie_group.hpp"
#include "comm/tls.hpp"
#include "engine/futures.hpp"
#include "logging/log.hpp"
#include "nodes/protocol.hpp"
#include "nodes/remote_stages.hpp"
#include "scheduler/scheduler_actor.hpp"
#include "stages/checkpoint.hpp"
#include "stages/device.hpp"
#include "stages/precision.hpp"
#include "stages/stage.hpp"

namespace actorpipe {

struct engine::impl {
  explicit impl(std::size_t workers) : system(configure(config, workers)) {}

  static caf::actor_system_config& configure(caf::actor_system_config& cfg, std::size_t workers) {
    cfg.set("scheduler.max-threads", std::max<std::size_t>(1, workers));
    // The middleman reaches stages on other processes (remote pipelines), over TLS through the
    // OpenSSL module when their placement has certificates; both idle otherwise.
    cfg.load<caf::io::middleman>();
    cfg.load<caf::openssl::manager>();
    cfg.set("logger.verbosity", caf::atom("quiet"));
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

engine::engine(std::size_t worker_threads) : impl_(std::make_unique<impl>(worker_threads)) {}

engine::~engine() = default;

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
  // Training and forward steps submitted: the scheduler's step counter, which a recovered
  // pipeline continues.
  std::atomic<uint64_t> steps{0};
  // The newest snapshot (null: the state the stages were built with), and its number.
  std::shared_ptr<const stages::tensor_map> snapshot;
  uint64_t snapshot_number = 0;
  uint64_t snapshots_taken = 0;
  // A snapshot still arriving (snapshot_in_background), and its number.
  std::future<std::shared_ptr<std::map<std::string, torch::Tensor>>> pending_snapshot;
  uint64_t pending_number = 0;

  impl(partition p, pipeline_options o) : cut(std::move(p)), options(std::move(o)) {}

  ~impl() { stop_actors(); }

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

  // Queues a fetch of every stage's state (pipeline::snapshot), in the background or not.
  std::future<std::shared_ptr<std::map<std::string, torch::Tensor>>> submit_fetch(bool background);
  // Waits for a snapshot still arriving and, when all of it came, makes it the newest.
  void settle_snapshot();
  // Makes `state` the newest snapshot, number `number`.
  void install_snapshot(std::shared_ptr<std::map<std::string, torch::Tensor>> state,
                        uint64_t number);

  // Checks and queues a training step on micro-batches.
  std::future<step_result> submit_train(std::vector<torch::Tensor> inputs,
                                        std::vector<torch::Tensor> targets) {
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
    auto request = std::make_shared<scheduler::step_request>();
    request->kind = scheduler::request_kind::fetch;
    auto future = submit<std::shared_ptr<std::map<std::string, torch::Tensor>>>(
      std::move(request), [](scheduler::step_outcome& o) { return std::move(o.state); });
    auto all = wait(future, "named_parameters");
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

namespace {

// Checks what both constructors share; returns the number of stage actors.
std::size_t check_pipeline(std::size_t layer_count, const partition& cut,
                           const pipeline_options& options) {
  ACTORPIPE_CHECK(layer_count > 0, "pipeline: the model has no layers");
  ACTORPIPE_CHECK(cut.stages() >= 1 && cut.bounds.front() == 0 && cut.bounds.back() == layer_count,
                  "pipeline: partition ", cut.to_string(), " does not cover the model's ",
                  layer_count, " layers");
  for (std::size_t s = 0; s < cut.stages(); ++s) {
    ACTORPIPE_CHECK(cut.begin(s) < cut.end(s), "pipeline: stage ", s, " of partition ",
                    cut.to_string(), " is empty");
  }
  ACTORPIPE_CHECK(options.microbatches >= 1, "microbatches (", options.microbatches,
                  ") must be >= 1");
  ACTORPIPE_CHECK(options.wait_timeout.count() > 0, "wait_timeout must be > 0 ms");
  ACTORPIPE_CHECK(options.step_timeout.count() > 0, "step_timeout must be > 0 ms");
  ACTORPIPE_CHECK(options.linger.count() >= 0, "linger (", options.linger.count(),
                  " us) must be >= 0");
  ACTORPIPE_CHECK(options.chunks >= 1, "chunks (", options.chunks, ") must be >= 1");
  ACTORPIPE_CHECK(cut.stages() % options.chunks == 0, "pipeline: a partition of ", cut.stages(),
                  " parts cannot be spread over stage actors of ", options.chunks, " chunks each");
  auto stage_count = cut.stages() / options.chunks;
  if (options.custom_schedule.empty() &&
      placement_of(options.schedule) == chunk_placement::v_shape) {
    ACTORPIPE_CHECK(options.chunks == 2, "pipeline: schedule ", to_string(options.schedule),
                    " runs two chunks per stage in a V: set chunks to 2 (it is ", options.chunks,
                    ") and cut the model into twice as many parts as stages");
  }
  ACTORPIPE_CHECK(options.devices.empty() || options.devices.size() == stage_count,
                  "pipeline: ", options.devices.size(), " devices given for ", stage_count,
                  " stages");
  if (!options.custom_schedule.empty()) {
    validate(options.custom_schedule, options.microbatches, true);
  }
  ACTORPIPE_CHECK(options.max_grad_norm >= 0, "max_grad_norm (", options.max_grad_norm,
                  ") must be >= 0");
  ACTORPIPE_CHECK(!(options.loss && options.loss_with_inputs),
                  "pipeline: both pipeline_options.loss and loss_with_inputs are set: give one");
  if (auto warning = stages::precision_warning(options.precision); !warning.empty()) {
    // Once per process: every pipeline of a sweep would say it again.
    static std::once_flag once;
    std::call_once(once, [&] { log::get()->warn("pipeline: {}", warning); });
  }
  return stage_count;
}

// "a, b, c" or "none": a recovery's lists in the log.
template <class T>
std::string list_or_none(const std::vector<T>& items) {
  return items.empty() ? std::string("none") : fmt::format("{}", fmt::join(items, ", "));
}

// After a step failed on nodes: which nodes answer, and a spare for each that does not.
struct node_census {
  // The nodes that did not answer, in placement order.
  std::vector<std::string> lost;
  // A spare per lost node, in order, among those that answer and hold no stage yet.
  std::map<std::string, std::string> replacement;
  std::vector<std::string> spares_used;
  // The spares that answered, in order (replicas hand them out their own way).
  std::vector<std::string> spares;

  bool is_lost(const std::string& node) const {
    return std::find(lost.begin(), lost.end(), node) != lost.end();
  }
  // `nodes` with each lost node replaced by its spare, or left out when none took it.
  std::vector<std::string> placed(const std::vector<std::string>& nodes) const {
    std::vector<std::string> result;
    for (const auto& n : nodes) {
      if (!is_lost(n)) {
        result.push_back(n);
      } else if (auto it = replacement.find(n); it != replacement.end()) {
        result.push_back(it->second);
      }
    }
    return result;
  }
};

// Asks every node of `nodes` (repeats asked once) and the spares, each within the placement's
// connect timeout, all at once.
node_census take_census(caf::actor_system& sys, const std::vector<std::string>& nodes,
                        const std::map<std::string, caf::actor>& known,
                        const node_placement& placement) {
  std::vector<std::string> distinct;
  for (const auto& n : nodes) {
    if (std::find(distinct.begin(), distinct.end(), n) == distinct.end()) {
      distinct.push_back(n);
    }
  }
  auto alive = nodes::answering(sys, distinct, known, placement);
  node_census census;
  for (std::size_t i = 0; i < distinct.size(); ++i) {
    if (!alive[i]) {
      census.lost.push_back(distinct[i]);
    }
  }
  if (census.lost.empty()) {
    return census;
  }
  std::vector<std::string> candidates;
  for (const auto& spare : placement.spares) {
    if (std::find(distinct.begin(), distinct.end(), spare) == distinct.end() &&
        std::find(candidates.begin(), candidates.end(), spare) == candidates.end()) {
      candidates.push_back(spare);
    }
  }
  auto ready = nodes::answering(sys, candidates, {}, placement);
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    if (ready[i]) {
      census.spares.push_back(candidates[i]);
    }
  }
  for (std::size_t i = 0; i < census.lost.size() && i < census.spares.size(); ++i) {
    census.replacement[census.lost[i]] = census.spares[i];
    census.spares_used.push_back(census.spares[i]);
  }
  return census;
}

scheduler::scheduler_options scheduler_options_of(const pipeline_options& options) {
  scheduler::scheduler_options so;
  so.schedule = options.schedule;
  so.chunks = options.chunks;
  so.placement = options.chunk_layout();
  so.custom = options.custom_schedule;
  so.step_timeout = options.step_timeout;
  so.abort_timeout = options.wait_timeout;
  so.max_grad_norm = options.max_grad_norm;
  so.optimistic_update = options.optimistic_update;
  so.overlap_steps = options.overlap_steps;
  so.linger = options.linger;
  so.inputs_to_loss = static_cast<bool>(options.loss_with_inputs);
  return so;
}

} // namespace

pipeline::pipeline(engine& sys, layer_list layers, partition cut, pipeline_options options) {
  auto stage_count = check_pipeline(layers.size(), cut, options);
  // Devices in this process are checked here; a node checks those of its stages itself.
  for (std::size_t i = 0; i < options.devices.size(); ++i) {
    stages::check_device(options.devices[i], detail::concat("pipeline: stage ", i));
  }
  ACTORPIPE_CHECK(options.placement.nodes.empty(),
                  "pipeline: stages on nodes need a "
                  "remote_model (nodes build their stages themselves)");
  const auto& dp = options.data_parallel;
  auto bmuf = dp.bmuf;
  if (bmuf.block_steps != 0) {
    ACTORPIPE_CHECK(bmuf.block_steps > 0, "pipeline: bmuf.block_steps (", bmuf.block_steps,
                    ") must be >= 1, or 0 for no BMUF");
    ACTORPIPE_CHECK(dp.replicas > 1, "pipeline: BMUF needs replicas (data_parallel.replicas > 1)");
    ACTORPIPE_CHECK(bmuf.block_lr > 0, "pipeline: bmuf.block_lr (", bmuf.block_lr, ") must be > 0");
    ACTORPIPE_CHECK(bmuf.block_momentum < 1, "pipeline: bmuf.block_momentum (", bmuf.block_momentum,
                    ") must be below 1 (negative: 1 - 1/replicas)");
    ACTORPIPE_CHECK(bmuf.warmup_steps >= 0, "pipeline: bmuf.warmup_steps (", bmuf.warmup_steps,
                    ") must be >= 0");
    ACTORPIPE_CHECK(!dp.sync_batch_norm, "pipeline: BMUF replicas do not communicate within a "
                                         "block, so their batch norms cannot synchronise");
    if (bmuf.block_momentum < 0) {
      bmuf.block_momentum = 1.0 - 1.0 / static_cast<double>(dp.replicas);
    }
  }
  if (dp.sync_batch_norm) {
    auto local = local_batch_norms(layers);
    std::string names;
    for (const auto& n : local) {
      names += (names.empty() ? "" : ", ") + n;
    }
    ACTORPIPE_CHECK(local.empty(), "pipeline: sync_batch_norm: the batch norm",
                    local.size() > 1 ? "s " : " ", names,
                    " cannot synchronise across replicas (use actorpipe::DeferredBatchNorm2d)");
    ACTORPIPE_CHECK(count_batch_norms(layers) > 0,
                    "pipeline: sync_batch_norm: the model has no batch norm "
                    "(actorpipe::DeferredBatchNorm2d) to synchronise");
  }
  auto threads = options.threads_per_stage;
  if (threads == 0) {
    // Replicas in this process share its cores.
    auto cores = std::max(1u, std::thread::hardware_concurrency());
    auto local_replicas = dp.local ? std::max<std::size_t>(1, dp.replicas) : 1;
    threads = std::max<std::size_t>(1, cores / (stage_count * local_replicas));
  }
  impl_ = std::make_unique<impl>(cut, options);
  auto& self = *impl_;
  self.layers = layers;
  if (dp.replicas > 1) {
    self.replicas = std::make_unique<comm::replica_group>(dp, stage_count, options.devices);
  }
  auto& actor_system = sys.internals().system;
  self.scheduler = scheduler::spawn_scheduler(actor_system, scheduler_options_of(options));
  // Virtual stage k (model order) lives on the actor and chunk the placement says.
  auto placement = options.chunk_layout();
  for (std::size_t k = 0; k < cut.stages(); ++k) {
    auto device = options.devices.empty()
                    ? c10::Device(c10::kCPU)
                    : options.devices[holder_of(placement, stage_count, k).stage];
    self.stages.push_back(
      stages::make_stage(layers, cut, k, device, options.optimizer, options.precision));
  }
  // Parameters tied across stages: the actors holding them sum their gradients every step.
  std::set<std::size_t> holders;
  for (std::size_t k = 0; k < cut.stages(); ++k) {
    if (!self.stages[k]->config().shared_ties.empty()) {
      holders.insert(holder_of(placement, stage_count, k).stage);
    }
  }
  auto ties = holders.empty() ? nullptr : std::make_shared<comm::tie_group>(holders);
  std::vector<actors::local_stage_actor> local;
  for (std::size_t i = 0; i < stage_count; ++i) {
    std::vector<std::shared_ptr<stages::stage>> chunks;
    for (std::size_t c = 0; c < options.chunks; ++c) {
      chunks.push_back(self.stages[virtual_stage_of(placement, stage_count, i, c)]);
    }
    actors::stage_actor_options actor_options(
      stage_settings_for(options, i, stage_count, threads, bmuf));
    actor_options.loss = options.loss;
    actor_options.loss_with_inputs = options.loss_with_inputs;
    actor_options.hooks = options.hooks;
    actor_options.ties = ties;
    if (self.replicas) {
      // Every replica starts from rank 0's parameters and buffers.
      actor_options.sync = self.replicas->stage(i);
      for (auto& chunk : chunks) {
        chunk->with_tensors([&](const std::vector<torch::Tensor>& parameters,
                                const std::vector<torch::Tensor>& buffers) {
          auto all = parameters;
          all.insert(all.end(), buffers.begin(), buffers.end());
          actor_options.sync->broadcast(all);
        });
      }
    }
    local.push_back(actors::spawn_stage(actor_system, std::move(chunks), self.scheduler,
                                        std::move(actor_options)));
  }
  // Every stage learns the actors holding its neighbours before the scheduler can plan a step.
  std::vector<actors::stage_peer_actor> peers(local.begin(), local.end());
  for (const auto& stage : local) {
    caf::anon_send(stage, actors::connect_atom::value, peers);
  }
  self.stage_actors.assign(local.begin(), local.end());
  caf::anon_send(self.scheduler, actors::connect_atom::value, self.stage_actors);
  log::get()->info("pipeline: {} stage actors ({} chunks each) over partition {}, {} "
                   "micro-batches, {} intra-op threads per stage{}",
                   stage_count, options.chunks, cut.to_string(), options.microbatches, threads,
                   self.replicas ? detail::concat(", replica ", dp.rank, " of ", dp.replicas)
                                 : std::string{});
}

pipeline::pipeline(engine& sys, remote_model model, partition cut, pipeline_options options) {
  const auto& dp = options.data_parallel;
  if (dp.replicas > 1) {
    ACTORPIPE_CHECK(dp.rank < dp.replicas, "pipeline: data-parallel rank ", dp.rank,
                    " is not below the ", dp.replicas, " replicas");
    ACTORPIPE_CHECK(!dp.local,
                    "pipeline: replicas of stages on nodes meet at rank 0's store "
                    "(data_parallel.master_addr:master_port), which the nodes reach over TCP; an "
                    "in-process rendezvous (data_parallel.local) cannot reach them");
    ACTORPIPE_CHECK(dp.bmuf.block_steps == 0,
                    "pipeline: replicas of stages on nodes average their gradients every step; "
                    "BMUF (bmuf.block_steps > 0) runs with stages in process only");
  }
  ACTORPIPE_CHECK(!options.hooks.after_forward && !options.hooks.after_backward,
                  "pipeline: stages on nodes run remote_model::hooks (built-ins by name or "
                  "TorchScript); options.hooks are functions, which do not cross processes");
  // Checked here, before any node is reached: an unknown built-in or TorchScript that is no hook.
  make_hooks(model.hooks);
  ACTORPIPE_CHECK(!options.loss_with_inputs,
                  "pipeline: stages on nodes compute remote_model::loss (a built-in loss by name); "
                  "loss_with_inputs is a function, which does not cross processes");
  ACTORPIPE_CHECK(!options.overlap_steps,
                  "pipeline: overlap_steps runs stages in this process; stages on nodes take one "
                  "step at a time");
  ACTORPIPE_CHECK(!options.placement.nodes.empty(),
                  "pipeline: a remote_model needs options.placement.nodes");
  options.loss = builtin_loss(model.loss);
  options.optimizer = make_optimizer(model.optimizer);
  impl_ = std::make_unique<impl>(std::move(cut), std::move(options));
  auto& self = *impl_;
  self.remote = std::move(model);
  self.sys = &sys;
  self.meet_replicas();
  self.place_on_nodes();
}

void pipeline::impl::meet_replicas() {
  if (options.data_parallel.replicas <= 1) {
    return;
  }
  // The rendezvous of the replicas' drivers; the stages' groups form on their nodes.
  replicas = std::make_unique<comm::replica_group>(options.data_parallel, 0);
  // Every node builds its stage from the spec: the replicas start equal only if their drivers
  // give the same model, cut and chunks.
  nodes::stage_spec spec;
  spec.model = nodes::by_digest(*remote);
  spec.bounds = cut.bounds;
  spec.settings.chunks = options.chunks;
  spec.settings.placement = options.chunk_layout();
  spec.settings.count = cut.stages() / options.chunks;
  replicas->agree("the model on nodes (its spec, seed, hooks, cut and chunks)",
                  static_cast<int64_t>(std::hash<std::string>{}(nodes::to_json(spec))));
}

void pipeline::impl::restore(const std::shared_ptr<const stages::tensor_map>& state,
                             uint64_t number, const char* what) {
  if (!state) {
    return;
  }
  stages::check_checkpoint(*state, stages, detail::concat("snapshot ", number));
  auto request = std::make_shared<scheduler::step_request>();
  request->kind = scheduler::request_kind::load;
  request->state = state;
  auto future = submit<bool>(std::move(request), [](scheduler::step_outcome&) { return true; });
  wait(future, what);
}

void pipeline::impl::place_on_nodes() {
  const auto& model = *remote;
  // A local copy of the initial model checks the partition and, later, checkpoints.
  layers = model.torchscript.empty()
             ? make_seeded_model(model.name, model.options, model.seed)
             : load_torchscript_bytes(model.torchscript, "the TorchScript model " + model.name);
  auto stage_count = check_pipeline(layers.size(), cut, options);
  if (options.data_parallel.sync_batch_norm) {
    ACTORPIPE_CHECK(count_batch_norms(layers) > 0, "pipeline: sync_batch_norm: the model ",
                    model.name,
                    " has no batch norm (actorpipe::DeferredBatchNorm2d) to synchronise");
  }
  auto threads = options.threads_per_stage;
  if (threads == 0) {
    // Stages on one host share its cores, whichever node process holds them.
    std::map<std::string, std::size_t> per_host;
    std::size_t most = 0;
    for (const auto& node : options.placement.nodes) {
      most = std::max(most, ++per_host[node.substr(0, node.rfind(':'))]);
    }
    threads = std::max<std::size_t>(1, std::max(1u, std::thread::hardware_concurrency()) / most);
  }
  stages.clear();
  for (std::size_t k = 0; k < cut.stages(); ++k) {
    stages.push_back(
      stages::make_stage(layers, cut, k, c10::kCPU, options.optimizer, options.precision));
  }
  if (options.placement.tls.enabled()) {
    sys->internals().use_tls(options.placement.tls);
  }
  auto& actor_system = sys->internals().system;
  auto so = scheduler_options_of(options);
  so.nodes = options.placement.nodes;
  so.first_step = steps;
  scheduler = scheduler::spawn_scheduler(actor_system, std::move(so));
  try {
    // Each placement forms its replica groups anew, under a prefix all ranks agree on.
    auto prefix = replicas ? replicas->fresh_prefix("nodes") : std::string{};
    auto placed =
      nodes::connect_stages(actor_system, model, cut, options, threads, scheduler, prefix);
    stage_actors = std::move(placed.proxies);
    remote_hub = std::move(placed.hub);
    nodes = std::move(placed.nodes);
  } catch (...) {
    caf::anon_send_exit(scheduler, caf::exit_reason::user_shutdown);
    scheduler = nullptr;
    throw;
  }
  caf::anon_send(scheduler, actors::connect_atom::value, stage_actors);
  log::get()->info("pipeline: {} stages of {} on nodes, partition {}, {} micro-batches, {} "
                   "intra-op threads per stage{}",
                   stage_count, model.name, cut.to_string(), options.microbatches, threads,
                   replicas ? detail::concat(", replica ", options.data_parallel.rank, " of ",
                                             options.data_parallel.replicas)
                            : std::string{});
}

pipeline::~pipeline() = default;

std::future<step_result> pipeline::train_step_async(torch::Tensor inputs, torch::Tensor targets) {
  auto& self = *impl_;
  ACTORPIPE_CHECK(targets.defined() && targets.dim() >= 1 && inputs.defined() &&
                    inputs.dim() >= 1 && targets.size(0) == inputs.size(0),
                  "train_step: inputs and targets must have the same batch size, got ",
                  inputs.defined() ? inputs.sizes() : c10::IntArrayRef{}, " and ",
                  targets.defined() ? targets.sizes() : c10::IntArrayRef{});
  return self.submit_train(self.split(inputs, "train_step inputs"),
                           self.split(targets, "train_step targets", false, /*to_last=*/true));
}

step_result pipeline::train_step(std::vector<torch::Tensor> inputs,
                                 std::vector<torch::Tensor> targets) {
  auto future = impl_->submit_train(std::move(inputs), std::move(targets));
  return impl_->wait(future, "train_step");
}

step_result pipeline::train_step(torch::Tensor inputs, torch::Tensor targets) {
  auto future = train_step_async(std::move(inputs), std::move(targets));
  return impl_->wait(future, "train_step");
}

std::vector<torch::Tensor> pipeline::forward_scattered(torch::Tensor inputs) {
  auto& self = *impl_;
  auto request = std::make_shared<scheduler::step_request>();
  request->kind = scheduler::request_kind::forward;
  request->inputs = self.split(inputs, "forward inputs", /*at_most=*/true);
  auto future = self.submit<std::vector<torch::Tensor>>(
    std::move(request), [](scheduler::step_outcome& o) { return std::move(o.outputs); });
  return self.wait(future, "forward");
}

torch::Tensor pipeline::forward(torch::Tensor inputs) {
  return torch::cat(forward_scattered(std::move(inputs)), 0);
}

void pipeline::set_learning_rate(double lr) {
  ACTORPIPE_CHECK(lr >= 0, "set_learning_rate: learning rate (", lr, ") must be >= 0");
  impl_->learning_rate = lr;
}

void pipeline::save_state(const std::string& dir) {
  auto& self = *impl_;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    throw pipeline_error(detail::concat("save_state: cannot create '", dir, "': ", ec.message()),
                         error_details{error_kind::io});
  }
  auto request = std::make_shared<scheduler::step_request>();
  request->kind = scheduler::request_kind::save;
  request->path = dir;
  auto future =
    self.submit<bool>(std::move(request), [](scheduler::step_outcome&) { return true; });
  self.wait(future, "save_state");
}

void pipeline::load_state(const std::string& dir) {
  auto& self = *impl_;
  self.settle_snapshot(); // a snapshot still arriving must not replace what is loaded here
  // All-or-nothing: every stage's needs and every file's tensors are checked before any loads.
  auto all = std::make_shared<stages::tensor_map>(stages::read_checkpoint(dir));
  stages::check_checkpoint(*all, self.stages, dir);
  auto request = std::make_shared<scheduler::step_request>();
  request->kind = scheduler::request_kind::load;
  request->state = all;
  auto future =
    self.submit<bool>(std::move(request), [](scheduler::step_outcome&) { return true; });
  self.wait(future, "load_state");
  if (self.remote) {
    // What recover() restores until the next snapshot.
    self.snapshot = std::move(all);
    self.snapshot_number = 0;
  }
}

std::future<std::shared_ptr<std::map<std::string, torch::Tensor>>>
pipeline::impl::submit_fetch(bool background) {
  auto request = std::make_shared<scheduler::step_request>();
  request->kind = scheduler::request_kind::fetch;
  request->background = background;
  return submit<std::shared_ptr<std::map<std::string, torch::Tensor>>>(
    std::move(request), [](scheduler::step_outcome& o) { return std::move(o.state); });
}

void pipeline::impl::settle_snapshot() {
  if (!pending_snapshot.valid()) {
    return;
  }
  auto number = pending_number;
  try {
    install_snapshot(wait(pending_snapshot, "snapshot"), number);
  } catch (const std::exception& e) {
    // A node lost while its state was on the way: the step after it fails too, and recover()
    // restores the newest snapshot that did arrive.
    log::get()->warn("snapshot {} did not arrive ({}); {} stays the newest", number, e.what(),
                     snapshot_number == 0 ? std::string("the starting state")
                                          : detail::concat("snapshot ", snapshot_number));
    memory::release_free_heap(); // whatever of it did arrive
  }
  pending_snapshot = {};
}

void pipeline::impl::install_snapshot(std::shared_ptr<std::map<std::string, torch::Tensor>> state,
                                      uint64_t number) {
  snapshot = std::make_shared<const stages::tensor_map>(std::move(*state));
  snapshot_number = number;
  // The frames and the snapshot this one replaced were megabytes of heap.
  memory::release_free_heap();
}

uint64_t pipeline::snapshot() {
  auto& self = *impl_;
  self.settle_snapshot();
  auto future = self.submit_fetch(false);
  self.install_snapshot(self.wait(future, "snapshot"), ++self.snapshots_taken);
  return self.snapshot_number;
}

uint64_t pipeline::snapshot_in_background() {
  auto& self = *impl_;
  self.settle_snapshot();
  self.pending_snapshot = self.submit_fetch(true);
  self.pending_number = ++self.snapshots_taken;
  return self.pending_number;
}

uint64_t pipeline::newest_snapshot() {
  auto& self = *impl_;
  self.settle_snapshot();
  return self.snapshot_number;
}

recovery_report pipeline::recover(std::function<partition(std::size_t)> repartition) {
  auto& self = *impl_;
  ACTORPIPE_CHECK(self.remote, "recover: the stages of this pipeline are in this process; "
                               "recover() places stages on nodes again");
  ACTORPIPE_CHECK(!self.replicas, "recover: this pipeline is replica ",
                  self.options.data_parallel.rank, " of ", self.options.data_parallel.replicas,
                  "; the replicas recover together, through replicated_pipeline::recover()");
  auto started = std::chrono::steady_clock::now();
  // A snapshot still on its way arrives (or fails) before the newest is chosen.
  self.settle_snapshot();
  auto& actor_system = self.sys->internals().system;
  // The failed pipeline's proxies go first: a node drops the stages of a proxy that went.
  self.stop_actors();
  auto& placement = self.options.placement;
  auto census = take_census(actor_system, placement.nodes, self.nodes, placement);
  recovery_report report;
  report.lost = census.lost;
  report.spares_used = census.spares_used;
  auto placed = census.placed(placement.nodes);
  if (placed.empty()) {
    throw pipeline_error(
      detail::concat("recover: no node is left (", report.lost.size(), " lost, no spare answered)"),
      error_details{error_kind::node_lost});
  }
  auto cut = self.cut;
  if (placed.size() != placement.nodes.size()) {
    // Fewer stage actors: the model is cut anew over the nodes left, each holding as many
    // chunks as before.
    auto parts = placed.size() * self.options.chunks;
    cut = repartition ? repartition(parts) : partition_by_params(self.layers, parts);
    ACTORPIPE_CHECK(cut.stages() == parts, "recover: the repartition gave ", cut.stages(),
                    " stages for the ", placed.size(), " nodes left (", self.options.chunks,
                    " chunks each)");
  }
  self.cut = cut;
  placement.nodes = placed;
  self.place_on_nodes();
  self.restore(self.snapshot, self.snapshot_number, "recover");
  // The failed pipeline's actors, the local model built again, the snapshot's frames.
  memory::release_free_heap();
  report.nodes = placed;
  report.bounds = cut.bounds;
  report.snapshot = self.snapshot_number;
  report.seconds =
    std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  log::get()->info("pipeline: recovered in {:.2f} s: lost {}, spares used {}, now {} stages on "
                   "{} cut {}, restored snapshot {}",
                   report.seconds, list_or_none(report.lost), list_or_none(report.spares_used),
                   placed.size(), fmt::join(placed, ", "), cut.to_string(), report.snapshot);
  return report;
}

// replicated_pipeline::recover() lives here: it re-places each replica's stages through its
// pipeline::impl, as pipeline::recover() does one pipeline's.
recovery_report replicated_pipeline::recover() {
  auto& first = *replicas_.front()->impl_;
  ACTORPIPE_CHECK(first.remote, "recover: these replicas' stages are in this process; recover() "
                                "places stages on nodes again");
  auto started = std::chrono::steady_clock::now();
  // Replica 0 keeps the snapshots (a snapshot still on its way arrives, or fails, first).
  first.settle_snapshot();
  auto state = first.snapshot;
  auto number = first.snapshot_number;
  auto taken = first.snapshots_taken;
  const auto dp = first.options.data_parallel;
  const auto placement = first.options.placement;
  std::vector<std::string> all;
  std::map<std::string, caf::actor> known;
  for (auto& p : replicas_) {
    auto& r = *p->impl_;
    // The failed step's proxies go first: a node drops the stages of a proxy that went.
    r.stop_actors();
    all.insert(all.end(), r.options.placement.nodes.begin(), r.options.placement.nodes.end());
    known.insert(r.nodes.begin(), r.nodes.end());
  }
  auto census = take_census(first.sys->internals().system, all, known, placement);
  recovery_report report;
  report.lost = census.lost;
  // A replica goes on when spares replace every node it lost, the replicas served in rank order
  // (a replica is given spares only when there are enough for all its lost nodes); the others
  // leave.
  std::vector<std::size_t> whole;
  std::vector<std::vector<std::string>> layouts;
  std::size_t next_spare = 0;
  for (std::size_t r = 0; r < replicas_.size(); ++r) {
    const auto& nodes = replicas_[r]->impl_->options.placement.nodes;
    std::map<std::string, std::string> replacement;
    for (const auto& n : nodes) {
      if (census.is_lost(n) && replacement.count(n) == 0) {
        auto index = next_spare + replacement.size();
        replacement.emplace(n, index < census.spares.size() ? census.spares[index] : std::string{});
      }
    }
    bool enough = std::all_of(replacement.begin(), replacement.end(),
                              [](const auto& kv) { return !kv.second.empty(); });
    if (!enough) {
      report.replicas_left.push_back(r);
      continue;
    }
    std::vector<std::string> placed;
    for (const auto& n : nodes) {
      auto it = replacement.find(n);
      placed.push_back(it == replacement.end() ? n : it->second);
    }
    for (std::size_t k = 0; k < replacement.size(); ++k) {
      report.spares_used.push_back(census.spares[next_spare++]);
    }
    whole.push_back(r);
    layouts.push_back(std::move(placed));
  }
  if (whole.empty()) {
    throw pipeline_error(detail::concat("recover: no replica is left whole (lost ",
                                        list_or_none(census.lost), "; ", census.spares.size(),
                                        " spares answered)"),
                         error_details{error_kind::node_lost});
  }
  // Every driver's rendezvous goes before any meets again (rank 0's serves the store that the
  // next rank 0 serves anew), all at once: each waits at its end for the others'.
  std::vector<std::future<void>> leaving;
  for (auto& p : replicas_) {
    leaving.push_back(
      std::async(std::launch::async, [&group = p->impl_->replicas] { group.reset(); }));
  }
  for (auto& f : leaving) {
    f.get(); // each bounded by data_parallel.timeout; the destructor throws nothing
  }
  std::vector<std::unique_ptr<pipeline>> kept;
  for (auto r : whole) {
    kept.push_back(std::move(replicas_[r]));
  }
  replicas_ = std::move(kept);
  const auto world = replicas_.size();
  for (std::size_t k = 0; k < world; ++k) {
    auto& r = *replicas_[k]->impl_;
    r.options.data_parallel.rank = k;
    r.options.data_parallel.replicas = world;
    r.options.placement.nodes = layouts[k];
  }
  auto& lead = *replicas_.front()->impl_;
  lead.snapshot = state;
  lead.snapshot_number = number;
  lead.snapshots_taken = std::max(lead.snapshots_taken, taken);
  // Each replica on a thread of its own: each waits for the others at the rendezvous and at its
  // stages' first collective.
  std::vector<std::future<bool>> placing;
  for (auto& p : replicas_) {
    placing.push_back(std::async(std::launch::async, [&r = *p->impl_, &state, number] {
      r.meet_replicas();
      r.place_on_nodes();
      r.restore(state, number, "recover");
      return true;
    }));
  }
  detail::get_all(
    placing, 2 * dp.timeout + 2 * placement.connect_timeout + std::chrono::seconds(30), "recover");
  memory::release_free_heap();
  for (const auto& nodes : layouts) {
    report.nodes.insert(report.nodes.end(), nodes.begin(), nodes.end());
  }
  report.bounds = lead.cut.bounds;
  report.snapshot = number;
  report.replicas = world;
  report.seconds =
    std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  log::get()->info(
    "replicas: recovered in {:.2f} s: lost {}, spares used {}, replicas left {}, now {} "
    "replicas on {}, restored snapshot {}",
    report.seconds, list_or_none(report.lost), list_or_none(report.spares_used),
    list_or_none(report.replicas_left), world, fmt::join(report.nodes, ", "), report.snapshot);
  return report;
}

void pipeline::save_torchscript(const std::string& path) {
  auto& self = *impl_;
  ACTORPIPE_CHECK(is_torchscript(self.layers),
                  "save_torchscript: this pipeline's model was not loaded from TorchScript "
                  "(load_torchscript); only such a model can be written back as TorchScript");
  // The trained tensors as a checkpoint gives them (between steps, from every stage, on nodes
  // too), then into a fresh copy of the file.
  static std::atomic<uint64_t> exports{0};
  auto dir = std::filesystem::temp_directory_path() /
             detail::concat("actorpipe-export-", ::getpid(), "-", exports++);
  stages::tensor_map state;
  try {
    save_state(dir.string());
    state = stages::read_checkpoint(dir.string());
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    throw;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  actorpipe::save_torchscript(self.layers, state, path);
}

void pipeline::end_block() {
  auto& self = *impl_;
  if (!self.replicas || self.options.data_parallel.bmuf.block_steps == 0) {
    return;
  }
  auto request = std::make_shared<scheduler::step_request>();
  request->kind = scheduler::request_kind::end_block;
  auto future =
    self.submit<bool>(std::move(request), [](scheduler::step_outcome&) { return true; });
  self.wait(future, "end_block");
}

void pipeline::replicas_agree(const std::string& what, int64_t value) {
  if (impl_->replicas) {
    impl_->replicas->agree(what, value);
  }
}

actorpipe::schedule pipeline::training_schedule() const {
  const auto& o = impl_->options;
  return o.custom_schedule.empty() ? make_schedule(o.schedule, stages(), o.microbatches, o.chunks)
                                   : o.custom_schedule;
}

std::size_t pipeline::stages() const {
  return impl_->stage_actors.size();
}

const partition& pipeline::cut() const {
  return impl_->cut;
}

std::vector<int64_t> pipeline::stage_parameter_counts() const {
  std::vector<int64_t> counts(stages(), 0);
  for (std::size_t k = 0; k < impl_->stages.size(); ++k) {
    counts[holder_of(impl_->options.chunk_layout(), counts.size(), k).stage] +=
      impl_->stages[k]->parameter_count();
  }
  return counts;
}

std::vector<std::pair<std::string, torch::Tensor>> pipeline::named_parameters() const {
  return impl_->named(false);
}

std::vector<std::pair<std::string, torch::Tensor>> pipeline::named_gradients() const {
  return impl_->named(true);
}

} // namespace actorpipe
