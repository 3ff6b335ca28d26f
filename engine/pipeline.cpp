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
#include <actorpipe/exported.hpp>
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
#include "engine/pipeline_impl.hpp"
#include "engine/recovery/membership.hpp"
#include "logging/log.hpp"
#include "models/model_formats.hpp"
#include "nodes/protocol.hpp"
#include "nodes/remote_stages.hpp"
#include "scheduler/scheduler_actor.hpp"
#include "stages/checkpoint.hpp"
#include "stages/device.hpp"
#include "stages/precision.hpp"
#include "stages/stage.hpp"

namespace actorpipe {

engine::engine(std::size_t worker_threads) : impl_(std::make_unique<impl>(worker_threads)) {}

engine::~engine() = default;

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

// ZeRO (data_parallel_options::shard) needs replicas that step together.
void check_sharding(const data_parallel_options& dp) {
  if (dp.shard == shard_mode::none) {
    return;
  }
  ACTORPIPE_CHECK(dp.replicas > 1, "pipeline: data_parallel.shard (", to_string(dp.shard),
                  ") divides the optimizer's state among replicas: it needs "
                  "data_parallel.replicas > 1");
  ACTORPIPE_CHECK(dp.bmuf.block_steps == 0,
                  "pipeline: BMUF replicas step their own optimizers on their own gradients "
                  "within a block, so each needs its whole optimizer state: data_parallel.shard (",
                  to_string(dp.shard), ") cannot be combined with BMUF");
}

// Checks the replicas' BMUF and synchronised batch norm settings against the model; the BMUF
// settings with a negative block momentum resolved (1 - 1/replicas).
bmuf_options checked_bmuf(const pipeline_options& options, const layer_list& layers) {
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
  check_sharding(dp);
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
  return bmuf;
}

// The scheduler's options; with replicas, a failed step is announced to them.
scheduler::scheduler_options scheduler_options_of(const pipeline_options& options,
                                                  const comm::replica_group* replicas) {
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
  if (replicas != nullptr) {
    so.on_step_failure = replicas->failure_announcer();
  }
  return so;
}

// Intra-op threads per stage: as given, else this process's cores shared by its stages (and
// the replicas in it).
std::size_t threads_per_stage(const pipeline_options& options, std::size_t stage_count) {
  if (options.threads_per_stage != 0) {
    return options.threads_per_stage;
  }
  const auto& dp = options.data_parallel;
  auto cores = std::max(1u, std::thread::hardware_concurrency());
  auto local_replicas = dp.local ? std::max<std::size_t>(1, dp.replicas) : 1;
  return std::max<std::size_t>(1, cores / (stage_count * local_replicas));
}

// The virtual stages in model order, each on the device of the actor holding it.
std::vector<std::shared_ptr<stages::stage>> make_virtual_stages(const layer_list& layers,
                                                                const partition& cut,
                                                                const pipeline_options& options,
                                                                std::size_t stage_count) {
  auto placement = options.chunk_layout();
  std::vector<std::shared_ptr<stages::stage>> made;
  for (std::size_t k = 0; k < cut.stages(); ++k) {
    auto device = options.devices.empty()
                    ? c10::Device(c10::kCPU)
                    : options.devices[holder_of(placement, stage_count, k).stage];
    made.push_back(
      stages::make_stage(layers, cut, k, device, options.optimizer, options.precision));
  }
  return made;
}

// Parameters tied across stages: the group in which the actors holding them sum their
// gradients every step; none when nothing is tied across stages.
std::shared_ptr<comm::tie_group>
tie_group_of(const std::vector<std::shared_ptr<stages::stage>>& virtual_stages,
             const pipeline_options& options, std::size_t stage_count) {
  auto placement = options.chunk_layout();
  std::set<std::size_t> holders;
  for (std::size_t k = 0; k < virtual_stages.size(); ++k) {
    if (!virtual_stages[k]->config().shared_ties.empty()) {
      holders.insert(holder_of(placement, stage_count, k).stage);
    }
  }
  return holders.empty() ? nullptr : std::make_shared<comm::tie_group>(holders);
}

// With replicas, every replica starts from rank 0's parameters and buffers.
void broadcast_from_rank_0(const std::vector<std::shared_ptr<stages::stage>>& chunks,
                           comm::stage_sync& sync) {
  for (const auto& chunk : chunks) {
    chunk->with_tensors(
      [&](const std::vector<torch::Tensor>& parameters, const std::vector<torch::Tensor>& buffers) {
        auto all = parameters;
        all.insert(all.end(), buffers.begin(), buffers.end());
        sync.broadcast(all);
      });
  }
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
  auto bmuf = checked_bmuf(options, layers);
  auto threads = threads_per_stage(options, stage_count);
  impl_ = std::make_unique<impl>(cut, options);
  auto& self = *impl_;
  self.layers = layers;
  if (dp.replicas > 1) {
    self.replicas = std::make_unique<comm::replica_group>(dp, stage_count, options.devices);
  }
  auto& actor_system = sys.internals().system;
  self.scheduler =
    scheduler::spawn_scheduler(actor_system, scheduler_options_of(options, self.replicas.get()));
  // Virtual stage k (model order) lives on the actor and chunk the placement says.
  self.stages = make_virtual_stages(layers, cut, options, stage_count);
  auto ties = tie_group_of(self.stages, options, stage_count);
  auto placement = options.chunk_layout();
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
      actor_options.sync = self.replicas->stage(i);
      broadcast_from_rank_0(chunks, *actor_options.sync);
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
  check_sharding(dp);
  options.loss = builtin_loss(model.loss);
  options.optimizer = make_optimizer(model.optimizer);
  impl_ = std::make_unique<impl>(std::move(cut), std::move(options));
  auto& self = *impl_;
  self.remote = std::move(model);
  self.sys = &sys;
  self.members->given = self.options.placement.nodes;
  self.members->given_cut = self.cut;
  const auto& at = self.options.placement.accept_joins;
  ACTORPIPE_CHECK(at.empty() || self.options.data_parallel.replicas <= 1,
                  "pipeline: accept_joins (", at,
                  ") takes nodes into one pipeline; replicas of it take joins together "
                  "(replicated_pipeline), not one replica's pipeline");
  self.meet_replicas();
  self.place_on_nodes();
  if (!at.empty()) {
    self.members->joins = std::make_unique<nodes::join_listener>(
      sys.internals().system, at, self.options.placement.secret,
      self.options.placement.tls.enabled());
  }
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
  layers = model.file.empty() ? make_seeded_model(model.name, model.options, model.seed)
                              : load_model_file(model.file, "the model " + model.name,
                                                exported_options{model.segments});
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
  auto so = scheduler_options_of(options, replicas.get());
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
    stage_data = std::move(placed.data);
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
    self.snapshots->newest = std::move(all);
    self.snapshots->number = 0;
  }
}

void pipeline::save_torchscript(const std::string& path) {
  auto& self = *impl_;
  ACTORPIPE_CHECK(is_torchscript(self.layers),
                  "save_torchscript: this pipeline's model was not loaded from TorchScript "
                  "(load_torchscript); only such a model can be written back as TorchScript");
  actorpipe::save_torchscript(self.layers, state_dict(), path);
}

void pipeline::save_model(const std::string& path) {
  auto& self = *impl_;
  const auto* format = models::format_of(self.layers);
  ACTORPIPE_CHECK(format,
                  "save_model: this pipeline's model is built in, not loaded from a model "
                  "file, so there is no file to write back (save_state writes its weights)");
  format->save(self.layers, state_dict(), path);
}

void pipeline::save_exported(const std::string& path) {
  auto& self = *impl_;
  ACTORPIPE_CHECK(is_exported(self.layers),
                  "save_exported: this pipeline's model was not loaded from a PT2 archive "
                  "(load_exported); only such a model can be written back as one");
  actorpipe::save_exported(self.layers, state_dict(), path);
}

std::map<std::string, torch::Tensor> pipeline::state_dict() {
  // As a checkpoint gives them (between steps, from every stage, on nodes too).
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
  return state;
}

void pipeline::end_block() {
  auto& self = *impl_;
  const auto& dp = self.options.data_parallel;
  if (!self.replicas || (dp.bmuf.block_steps == 0 && dp.shard == shard_mode::none)) {
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

const std::vector<std::string>& pipeline::nodes() const {
  static const std::vector<std::string> none;
  return impl_->remote ? impl_->options.placement.nodes : none;
}

const std::vector<std::string>& pipeline::spares() const {
  static const std::vector<std::string> none;
  return impl_->remote ? impl_->options.placement.spares : none;
}

std::string pipeline::join_address() const {
  return impl_->members->join_address();
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
