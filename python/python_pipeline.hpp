/// \file
/// What the Python module drives: a pipeline (or in-process replicas of one) of a TorchScript
/// model, configured by value from Python's keyword arguments. No Python in here: module.cpp
/// converts, this file builds and runs, and every call that computes runs without the GIL.
#pragma once

#include <cstddef>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <actorpipe/exported.hpp>
#include <actorpipe/pipeline.hpp>
#include <actorpipe/replicas.hpp>

#include "training/cluster.hpp"
#include "training/planning.hpp"
#include "training/settings.hpp"

namespace actorpipe::python {

/// Everything `actorpipe.Pipeline(...)` takes, as plain values (python/actorpipe/__init__.py
/// checks types and turns Python objects into these). The run's settings are the table's
/// (training/settings.hpp), whose defaults the Python signature shows.
struct pipeline_config {
  /// The bytes of a model file: a PT2 archive (torch.export.save) or a TorchScript file of an
  /// nn.Sequential; `model_name` names it in messages.
  std::string model;
  std::string model_name = "model";
  /// A PT2 archive's cut into layers (exported_options::segments).
  std::string segments = exported_options{}.segments;
  /// A PT2 archive's weights from a safetensors file or a save_pretrained folder (init_exported).
  std::string init_from;
  /// The run's settings Python's keywords gave, each set through training/settings.hpp's
  /// table (Config.set): the planner's, precision, timeouts, sharding and the others; a setting
  /// not given keeps the table's default.
  training::run_settings declared;
  optimizer_spec optimizer;
  /// A built-in loss ("mse", "cross_entropy"), or the bytes of a scripted module whose
  /// forward(output, target) returns the loss (`loss_module`; stages in this process only).
  std::string loss = "mse";
  std::string loss_module;
  /// One device per stage ("cpu", "cuda:0", ...); empty: every stage on the CPU.
  std::vector<std::string> devices;
  hook_specs hooks;
  /// Stage actors on `actorpipe node` processes ("host:port", replica after replica).
  std::vector<std::string> nodes;
  std::string secret;
  std::size_t replicas = 1;
  /// Python's `replicas=` was given: under a cluster's launcher (torchrun's or Slurm's
  /// variables, a world of more than one process) the world then holds stages x replicas, one
  /// stage per process, rank 0 driving (training/cluster.hpp).
  bool cluster = false;
  /// Where rank 0 serves its replicas' store in such a world (set by create, not by Python).
  std::string master_addr;
  uint16_t master_port = 0;
  /// A batch like the ones to come, for the planner (stages == 0, schedule "auto", partition
  /// "time").
  torch::Tensor example;
};

/// The layout a pipeline was built with (what the planner chose, when it did).
struct pipeline_layout {
  std::size_t stages = 0;
  std::vector<std::size_t> bounds;
  std::string schedule;
  std::size_t microbatches = 0;
  std::size_t chunks = 1;
  std::size_t threads = 0;
  std::vector<int64_t> parameters;
  /// The layers' names: an exported program's segments (`model.model.layers.3`, ...).
  std::vector<std::string> layers;
};

class python_pipeline;

/// A step under way: wait() with a deadline, get() the result (or the step's exception).
class step_future {
public:
  step_future(std::shared_future<step_result> future, std::weak_ptr<python_pipeline> owner)
    : future_(std::move(future)), owner_(std::move(owner)) {}
  /// True when the result is there; waits at most `seconds` (negative: without limit).
  bool wait(double seconds) const;
  bool done() const { return wait(0); }
  step_result get() const;

private:
  std::shared_future<step_result> future_;
  std::weak_ptr<python_pipeline> owner_;
};

/// Thrown by python_pipeline::create on a cluster run's rank other than 0 once rank 0 ended the
/// job (the Python module raises SystemExit with rank 0's code).
struct cluster_job_ended {
  int code = 0;
};

/// A pipeline of a TorchScript model built from a pipeline_config; the process shares one
/// engine among all of them.
class python_pipeline : public std::enable_shared_from_this<python_pipeline> {
public:
  static std::shared_ptr<python_pipeline> create(pipeline_config config);
  ~python_pipeline();

  step_future train_step_async(torch::Tensor inputs, torch::Tensor targets);
  step_result train_step(torch::Tensor inputs, torch::Tensor targets);
  torch::Tensor forward(torch::Tensor inputs);
  void set_learning_rate(double lr);
  void save_state(const std::string& dir);
  void load_state(const std::string& dir);
  /// The model written back at `path` in the format it came in, with the trained weights.
  void save_model(const std::string& path);
  /// That format's file ending (".pt2", ".pt": models/model_formats.hpp).
  std::string model_suffix() const { return suffix_; }
  /// A PT2 archive's trained weights as save_pretrained writes them into `dir`, under the names
  /// init_from's file had (else the program's), with its config.json (write_pretrained).
  void save_safetensors(const std::string& dir, uint64_t max_shard_bytes);
  /// The trained parameters and persistent buffers, named as the Python module's state_dict
  /// names them (a tied parameter under each of its names).
  std::vector<std::pair<std::string, torch::Tensor>> state_dict();
  std::vector<std::pair<std::string, torch::Tensor>> named_parameters();

  const pipeline_layout& layout() const { return layout_; }
  /// The newest step's result that a caller collected (empty before the first).
  std::optional<step_result> last_result() const;
  void record(const step_result& result);
  /// Stops the stage actors; every later call throws. Idempotent. In a cluster run, rank 0 then
  /// tells the other ranks the job ended.
  void close();

private:
  explicit python_pipeline(pipeline_config config);
  pipeline& first();

  pipeline_config config_;
  /// This process's rank of a cluster run (config.cluster under a launcher), rank 0's.
  std::shared_ptr<training::cluster_rank> cluster_;
  std::shared_ptr<engine> engine_;
  std::unique_ptr<pipeline> pipeline_;
  std::unique_ptr<replicated_pipeline> replicas_;
  pipeline_layout layout_;
  /// A PT2 archive's model: its names in Python (state_dict's) with the pipeline's for them.
  bool exported_ = false;
  std::string suffix_;
  std::vector<std::pair<std::string, std::string>> state_names_;
  /// The names of init_from's file (or the program's own) for save_safetensors
  /// (training::start_weights).
  weight_names weights_;
  /// In-process replicas have no queue of their own: each step waits for the one before.
  std::shared_future<step_result> previous_replica_step_;
  mutable std::mutex mutex_;
  std::optional<step_result> last_;
};

/// Drops the process's engine once no pipeline holds it (at interpreter exit).
void release_engine();

} // namespace actorpipe::python
