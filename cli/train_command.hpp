/// \file
/// `actorpipe train`: trains a built-in model, pipelined, on Fashion-MNIST, text or synthetic data.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <actorpipe/options.hpp>
#include <actorpipe/tls.hpp>
#include <actorpipe/training.hpp>

#include "cli/flags.hpp"

namespace CLI {
class App;
}

namespace actorpipe::cli {

/// Flags of `actorpipe train`. Empty or zero values take the data set's default.
struct train_args {
  /// What train() takes: the flags that name its fields fill them here (--warmup, --min-lr,
  /// checkpoints, --resume, --metrics, snapshots, recoveries, --slow-factor); run_train() adds
  /// what follows from the data, the model and the other flags.
  train_options train;
  /// --print-config: print `settings` and exit.
  bool print_config = false;
  /// Every flag's value as TOML (program::settings), recorded in checkpoints.
  std::string settings;
  model_args model;
  /// The run's declared settings (training/settings.hpp's table, each as a flag): the planner's
  /// (run.plan) and the pipeline's (run.pipeline); run_train() completes them with
  /// training::settings_for, adding the loss, the optimizer, hooks, nodes, the secret and the
  /// replicas, before planning. The flags below that name a pipeline option's field fill it here
  /// too: the nodes' placement (--nodes, --spare-nodes, --accept-joins, TLS); the plan's fields
  /// and devices are the plan's (training::run_plan::options).
  training::run_settings run;
  std::string data_dir;
  /// --data text: a UTF-8 file (or folder) instead of Debian's fortunes.
  std::string text_file;
  /// --data text: characters of sample text generated at the end (0: none).
  int64_t sample = 200;
  /// 0: 3 for synthetic data, all epochs for Fashion-MNIST.
  std::size_t steps = 0;
  /// 0: 1 for Fashion-MNIST, 4 for text.
  int64_t epochs = 0;
  /// --optimizer, --lr, --momentum, --weight-decay, --nesterov fill it; an optimizer, learning
  /// rate or momentum not given is the model's and data's own (optimizer_for in
  /// cli/train_command.cpp: Adam at 3e-3 for gpt, momentum 0.9 for Fashion-MNIST).
  optimizer_spec optimizer;
  /// --loss mse|cross_entropy (empty: the data's own).
  std::string loss;
  /// Fashion-MNIST: random crops (padding 2) and horizontal flips of the training images.
  bool augment = false;
  /// images:DIR: background threads decoding batches ahead of the pipeline.
  std::size_t workers = 2;
  /// --data tensors:PATH: a new order for every pass over the file.
  bool shuffle = false;
  /// --data tensors:PATH: the fraction of the file held out and evaluated after each epoch
  /// (--holdout; with it or --epochs the file is a data set, not a stream).
  double holdout = 0;
  /// Write the trained TorchScript model here.
  std::string export_path;
  /// Write the trained weights as safetensors into this folder (--save-safetensors), in shards
  /// of at most this many bytes (--max-shard-size).
  std::string save_safetensors;
  uint64_t max_shard_bytes = uint64_t{5} << 30;
  int64_t train_samples = 0;
  int64_t test_samples = 0;
  int64_t max_steps = 0;
  bool no_progress = false;
  std::string json;
  std::string trace;
  /// Data parallelism: replicas in this process, or this process's place among processes
  /// (defaults from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
  std::size_t replicas = 1;
  int64_t rank = -1;
  int64_t world_size = 0;
  std::string master_addr;
  int64_t master_port = 0;
  /// --sync gradients|bmuf, and BMUF's block flags (used with bmuf only).
  std::string sync = "gradients";
  bmuf_options bmuf{/*block_steps=*/8};
  /// --after-forward, --after-backward: a built-in hook or a TorchScript file (hook_from_text).
  std::string after_forward;
  std::string after_backward;
  /// --devices: one device per stage ("cpu", "cuda:0", ...); empty: every stage on the CPU.
  std::vector<std::string> devices;
  /// --shard-optimizer (ZeRO-1), --shard-gradients (ZeRO-2): data_parallel_options::shard.
  bool shard_optimizer = false;
  bool shard_gradients = false;
  std::string secret_file;
  /// A lost node: fail (end the run) or continue (recover onto spares or the nodes left, from
  /// the newest snapshot, taken every train.snapshot_every steps, at most train.max_recoveries
  /// times).
  std::string on_node_loss = "fail";
  std::string on_slow_node = "name";
  /// Whether a flag was given on the command line (set by add_train_command; unset: none was).
  std::function<bool(const std::string&)> given;
};

/// Adds the `train` subcommand; `args` receives the parsed flags.
CLI::App* add_train_command(CLI::App& app, train_args& args);

/// Runs it: prints per-step loss and time; returns the process exit code.
int run_train(const train_args& args);

/// Whether `--data tensors:PATH` is a data set visited epoch by epoch (--epochs or --holdout
/// given) rather than a stream of --steps batches.
bool tensor_data_set(const train_args& a);

/// Refuses, by name and with why, a flag given where it does not apply: one kind of data's flag
/// with another, a flag that needs another (cli/train_flags.cpp, beside the flags). Before
/// planning: a schedule given with chunks it cannot take the planner refuses (given_layout).
void check_flags_apply(const train_args& a, const model_setup& setup);

} // namespace actorpipe::cli
