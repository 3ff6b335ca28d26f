#include "python_pipeline.hpp"

#include <chrono>
#include <sstream>

#include <torch/script.h>

#include <actorpipe/exported.hpp>
#include <actorpipe/hooks.hpp>
#include <actorpipe/torchscript.hpp>

#include "models/model_formats.hpp"
#include "training/model_setup.hpp"
#include "training/run_plan.hpp"

namespace actorpipe::python {

namespace {

std::mutex engine_mutex;
std::weak_ptr<engine> shared_engine;
// Kept from the first pipeline until release_engine(): an engine started and stopped with every
// pipeline would cost a CAF system each time.
std::shared_ptr<engine> kept_engine;

std::shared_ptr<engine> the_engine() {
  std::lock_guard<std::mutex> guard(engine_mutex);
  auto sys = shared_engine.lock();
  if (!sys) {
    sys = std::make_shared<engine>(1);
    shared_engine = sys;
    kept_engine = sys;
  }
  return sys;
}

// A scripted module whose forward(output, target) returns the loss.
loss_function scripted_loss(const std::string& bytes) {
  std::istringstream in(bytes);
  torch::jit::Module module;
  try {
    module = torch::jit::load(in);
  } catch (const std::exception& e) {
    throw invalid_argument("loss: not a TorchScript module (" + detail::first_line(e.what()) + ")");
  }
  ACTORPIPE_CHECK(module.find_method("forward").has_value(),
                  "loss: the scripted module has no forward(output, target)");
  return [module](const torch::Tensor& output, const torch::Tensor& target) mutable {
    auto value = module.forward({output, target});
    ACTORPIPE_CHECK(value.isTensor(), "loss: the scripted module's forward returned a ",
                    value.tagKind(), ", not a tensor");
    return value.toTensor();
  };
}

// The batch choose_plan reads (its size; its samples only when it profiles).
torch::Tensor planning_batch(const pipeline_config& c, const training::planning_args& a) {
  bool profiles = a.automatic() || a.partition == "time";
  if (c.example.defined()) {
    return c.example;
  }
  ACTORPIPE_CHECK(!profiles, "example: stages='auto', schedule='auto' and partition='time' "
                             "profile the model on a batch; give example=<a batch like the ones "
                             "to come>");
  return torch::zeros({static_cast<int64_t>(std::max<std::size_t>(1, a.microbatches))});
}

// The run's settings (training::plan_run): the keywords' (Config.set), completed by
// training::settings_for with what Python brings beside them, errors naming the keywords.
training::run_settings settings_of(const pipeline_config& c) {
  auto declared = c.declared;
  declared.plan.devices = training::parse_devices(c.devices, declared.plan, "devices");
  if (!c.master_addr.empty()) {
    declared.pipeline.data_parallel.master_addr = c.master_addr;
    declared.pipeline.data_parallel.master_port = c.master_port;
  }
  training::run_parts parts;
  if (c.loss_module.empty()) {
    parts.loss = builtin_loss(c.loss);
  } else {
    ACTORPIPE_CHECK(c.nodes.empty(), "loss: a scripted loss runs in this process only; stages on "
                                     "nodes take a built-in loss ('mse' or 'cross_entropy')");
    parts.loss = scripted_loss(c.loss_module);
  }
  parts.optimizer = c.optimizer;
  parts.hooks = c.hooks;
  parts.secret = c.secret;
  parts.nodes = c.nodes;
  parts.replicas = c.replicas;
  return training::settings_for(std::move(declared), std::move(parts),
                                [](const std::string& name) { return name; });
}

// The model as start_run takes it: on nodes the file's bytes, each node reads them; in this
// process the layers read here, and a maker of each replica's own when there are several.
training::run_model run_model_of(const pipeline_config& c, layer_list layers) {
  training::run_model model;
  if (!c.nodes.empty()) {
    auto& remote = model.remote;
    remote.name = c.model_name;
    remote.file = c.model;
    remote.segments = c.segments;
    remote.loss = c.loss;
    remote.optimizer = c.optimizer;
  } else if (c.replicas > 1) {
    model.replica = [bytes = c.model, name = c.model_name, how = exported_options{c.segments}] {
      return load_model_file(bytes, name, how);
    };
  } else {
    model.layers = std::move(layers);
  }
  return model;
}

} // namespace

void release_engine() {
  std::lock_guard<std::mutex> guard(engine_mutex);
  kept_engine.reset();
}

bool step_future::wait(double seconds) const {
  if (seconds < 0) {
    future_.wait();
    return true;
  }
  auto wait = std::chrono::duration<double>(seconds);
  return future_.wait_for(wait) == std::future_status::ready;
}

step_result step_future::get() const {
  auto result = future_.get();
  if (auto owner = owner_.lock()) {
    owner->record(result);
  }
  return result;
}

std::shared_ptr<python_pipeline> python_pipeline::create(pipeline_config config) {
  auto world = training::cluster_from_env();
  if (!config.cluster || !world || world->size == 1 || !config.nodes.empty()) {
    return std::shared_ptr<python_pipeline>(new python_pipeline(std::move(config)));
  }
  // A launcher's world: this process hosts a stage; rank 0 also drives every rank's.
  const auto stages = config.declared.plan.stages;
  ACTORPIPE_CHECK(stages > 0, "stages='auto' plans one machine's cores: under ", world->launcher,
                  " with replicas= give a stage count");
  training::check_world_fits(*world, stages, config.replicas);
  if (config.secret.empty()) {
    config.secret = training::secret_from("");
  }
  auto me = std::make_shared<training::cluster_rank>(*world, config.secret, tls_options{},
                                                     std::chrono::seconds(60),
                                                     "secret=, or the variable ACTORPIPE_SECRET");
  if (world->rank != 0) {
    throw cluster_job_ended{me->host_until_end()};
  }
  try {
    config.nodes = me->gather_nodes(stages, config.replicas);
    config.master_addr = me->host();
    config.master_port = me->replica_store_port();
    auto made = std::shared_ptr<python_pipeline>(new python_pipeline(std::move(config)));
    made->cluster_ = me;
    return made;
  } catch (const std::exception& e) {
    me->finish(dynamic_cast<const invalid_argument*>(&e) ? 2 : 1, e.what());
    throw;
  }
}

python_pipeline::python_pipeline(pipeline_config config) : config_(std::move(config)) {
  const auto& c = config_;
  auto layers = load_model_file(c.model, c.model_name, {c.segments});
  exported_ = is_exported(layers);
  suffix_ = models::format_of(layers)->suffix;
  weights_ = training::start_weights(layers, c.init_from, config_.model);
  if (exported_) {
    state_names_ = exported_state_names(layers);
  }
  auto settings = settings_of(c);
  auto batch = planning_batch(c, settings.plan);
  const auto plan = training::plan_run(layers, batch, std::move(settings));
  const auto& choice = plan.choice();
  layout_.stages = choice.stages();
  layout_.bounds = choice.cut.bounds;
  layout_.schedule = choice.schedule_name;
  layout_.microbatches = choice.microbatches;
  layout_.chunks = choice.chunks;
  layout_.threads = plan.options().threads_per_stage;
  layout_.parameters = stage_parameter_counts(layers, choice.cut);
  for (const auto& l : layers) {
    layout_.layers.push_back(l.name());
  }
  engine_ = the_engine();
  auto run = training::start_run(*engine_, run_model_of(c, std::move(layers)), plan);
  pipeline_ = std::move(run.single);
  replicas_ = std::move(run.replicated);
}

python_pipeline::~python_pipeline() {
  close();
}

void python_pipeline::close() {
  std::unique_ptr<pipeline> single;
  std::unique_ptr<replicated_pipeline> replicated;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    single = std::move(pipeline_);
    replicated = std::move(replicas_);
  }
  single.reset();
  replicated.reset();
  engine_.reset();
  if (auto me = std::exchange(cluster_, nullptr)) {
    me->finish(0, "");
  }
}

pipeline& python_pipeline::first() {
  std::lock_guard<std::mutex> guard(mutex_);
  ACTORPIPE_CHECK(pipeline_ || replicas_, "the pipeline was closed");
  return pipeline_ ? *pipeline_ : replicas_->replica(0);
}

step_future python_pipeline::train_step_async(torch::Tensor inputs, torch::Tensor targets) {
  first(); // refuses a closed pipeline
  if (pipeline_) {
    return {pipeline_->train_step_async(std::move(inputs), std::move(targets)).share(),
            weak_from_this()};
  }
  // Replicas in this process step together on threads of their own, one step after the other.
  std::lock_guard<std::mutex> guard(mutex_);
  auto previous = previous_replica_step_;
  auto* replicas = replicas_.get();
  auto step = std::async(std::launch::async, [=]() mutable {
                if (previous.valid()) {
                  previous.wait();
                }
                return replicas->train_step(std::move(inputs), std::move(targets));
              }).share();
  previous_replica_step_ = step;
  return {step, weak_from_this()};
}

step_result python_pipeline::train_step(torch::Tensor inputs, torch::Tensor targets) {
  return train_step_async(std::move(inputs), std::move(targets)).get();
}

torch::Tensor python_pipeline::forward(torch::Tensor inputs) {
  auto& lead = first();
  return replicas_ ? replicas_->forward(std::move(inputs)) : lead.forward(std::move(inputs));
}

void python_pipeline::set_learning_rate(double lr) {
  auto& lead = first();
  replicas_ ? replicas_->set_learning_rate(lr) : lead.set_learning_rate(lr);
}

void python_pipeline::save_state(const std::string& dir) {
  if (replicas_) {
    replicas_->save_state(dir); // the optimizer state gathered when it is sharded
    return;
  }
  first().save_state(dir);
}

void python_pipeline::load_state(const std::string& dir) {
  auto& lead = first();
  if (!replicas_) {
    lead.load_state(dir);
    return;
  }
  for (std::size_t r = 0; r < replicas_->replicas(); ++r) {
    replicas_->replica(r).load_state(dir);
  }
}

void python_pipeline::save_model(const std::string& path) {
  first().save_model(path);
}

void python_pipeline::save_safetensors(const std::string& dir, uint64_t max_shard_bytes) {
  ACTORPIPE_CHECK(exported_, "save_safetensors: the model is TorchScript; its weights go back "
                             "with module()");
  write_pretrained(dir, weights_for_file(first().state_dict(), weights_), max_shard_bytes,
                   weights_.config_folder);
}

std::vector<std::pair<std::string, torch::Tensor>> python_pipeline::state_dict() {
  auto state = first().state_dict();
  std::vector<std::pair<std::string, torch::Tensor>> named;
  if (!exported_) {
    named.assign(state.begin(), state.end());
    return named;
  }
  for (const auto& [python, ours] : state_names_) {
    auto it = state.find(ours);
    ACTORPIPE_CHECK(it != state.end(), "state_dict: the pipeline's state has no '", ours, "'");
    named.emplace_back(python, it->second);
  }
  return named;
}

std::vector<std::pair<std::string, torch::Tensor>> python_pipeline::named_parameters() {
  return first().named_parameters();
}

std::optional<step_result> python_pipeline::last_result() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return last_;
}

void python_pipeline::record(const step_result& result) {
  std::lock_guard<std::mutex> guard(mutex_);
  if (!last_ || last_->step < result.step) {
    last_ = result;
  }
}

} // namespace actorpipe::python
