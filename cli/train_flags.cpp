// `actorpipe train`'s flags: each one's help and the train_args field it fills, and the rules of
// where a flag applies (cli/train_command.cpp runs the command).
#include <CLI/CLI.hpp>
#include <algorithm>

#include <actorpipe/errors.hpp>
#include <actorpipe/exported.hpp>

#include "cli/flags.hpp"
#include "cli/node_command.hpp"
#include "cli/train_command.hpp"
#include "models/model_formats.hpp"

namespace actorpipe::cli {

namespace {

// Adds an option to `cmd` whose help shows its default.
auto option_adder(CLI::App* cmd) {
  return [cmd](const std::string& name, auto& value, const std::string& help) {
    return cmd->add_option(name, value, help)->capture_default_str();
  };
}

// Where each stage computes, its hooks, and the loader.
void add_stage_flags(CLI::App* cmd, train_args& a) {
  auto opt = option_adder(cmd);
  cmd
    ->add_option("--devices", a.devices,
                 "One device per stage, comma-separated: cpu, cuda or cuda:N (e.g. cuda:0,cuda:1; "
                 "two stages may share a GPU); with --stages auto the devices the planner may "
                 "use, one stage each, profiled on the first; the CUDA build only (docs/gpu.md)")
    ->delimiter(',');
  opt("--after-forward", a.after_forward,
      "A hook on every stage's activation before it is sent on: clamp:V (clamp to [-V, V]), "
      "check_finite (a NaN or an infinity fails the step), or a TorchScript file whose "
      "forward(x) returns the tensor to send (in process and on nodes; docs/api.md#hooks)");
  opt("--after-backward", a.after_backward,
      "A hook on every stage's input gradient before it is sent back: clamp:V, check_finite or "
      "a TorchScript file, as --after-forward");
  cmd->add_flag("--augment", a.augment,
                "Fashion-MNIST: augment every training batch as torchvision's RandomCrop(28, "
                "padding=2) and RandomHorizontalFlip (docs/images.md)");
  opt("--workers", a.workers,
      "images:DIR: background threads decoding, cropping and flipping batches ahead of the "
      "pipeline (0: on the training thread)");
}

// What a run reads and writes: samples, checkpoints, metrics, progress.
void add_run_flags(CLI::App* cmd, train_args& a) {
  auto opt = option_adder(cmd);
  opt("--train-samples", a.train_samples, "Fashion-MNIST: use only the first N training samples");
  opt("--test-samples", a.test_samples, "Fashion-MNIST: use only the first N test samples");
  opt("--max-steps", a.max_steps, "The same as --steps (its older name)");
  opt("--checkpoint-dir", a.train.checkpoint_dir, "Write checkpoints into this folder");
  opt("--checkpoint-every", a.train.checkpoint_every,
      "Checkpoint every N steps (0: only at the end)");
  opt("--keep", a.train.keep, "Checkpoints to keep");
  opt("--resume", a.train.resume,
      "Continue from a checkpoint (or the newest in a folder; the stage count may differ), or "
      "'nodes': from the newest snapshot the --nodes keep (a driver that died, started again)");
  opt("--metrics", a.train.metrics,
      "Per-epoch metrics file (.csv, else JSON lines); synthetic data: one row for the run");
  cmd->add_flag("--no-progress", a.no_progress,
                "No progress bar (synthetic data: no line per step)");
  opt("--json", a.json, "Write every step's loss (full precision) and timings to this JSON file");
}

// Replicas, ranks, nodes and their recovery, slow nodes.
void add_distributed_flags(CLI::App* cmd, train_args& a) {
  auto opt = option_adder(cmd);
  opt("--replicas", a.replicas,
      "Data parallelism in this process: replicas of the pipeline, each on batch/replicas "
      "samples, averaging gradients per stage (c10d Gloo); under torchrun or srun, the world "
      "holds --stages x --replicas stages, one per process (rank 0 drives)");
  opt("--rank", a.rank, "Data parallelism across processes: this process's rank (default: RANK)");
  opt("--world-size", a.world_size,
      "Data parallelism across processes: number of ranks (default: WORLD_SIZE, else 1)");
  opt("--master-addr", a.master_addr,
      "Rendezvous address served by rank 0 (default: MASTER_ADDR, else 127.0.0.1)");
  opt("--master-port", a.master_port, "Rendezvous port (default: MASTER_PORT, else 29500)");
  cmd
    ->add_option("--nodes", a.run.pipeline.placement.nodes,
                 "Run stage i on the `actorpipe node` at the i-th HOST:PORT (comma-separated, one "
                 "per stage); activations go node to node")
    ->delimiter(',');
  opt("--secret-file", a.secret_file,
      "The nodes' shared secret (their --secret-file; not given: the variable ACTORPIPE_SECRET's "
      "text)");
  add_tls_flags(cmd, a.run.pipeline.placement.tls);
  opt("--on-node-loss", a.on_node_loss,
      "--nodes: when a node is lost (its connection closes, or it leaves its heartbeats "
      "unanswered for --heartbeat-timeout), fail (end the run) or continue: move its stages to a "
      "--spare-nodes node that answers, else cut the model anew over the nodes left, restore the "
      "newest snapshot and replay the data from there (docs/distributed.md)")
    ->check(CLI::IsMember({"fail", "continue"}));
  cmd
    ->add_option("--spare-nodes", a.run.pipeline.placement.spares,
                 "--on-node-loss continue: `actorpipe node`s standing by (HOST:PORT, "
                 "comma-separated), taken in order for lost nodes")
    ->delimiter(',');
  opt("--accept-joins", a.run.pipeline.placement.accept_joins,
      "--on-node-loss continue: listen on HOST:PORT for new nodes (`actorpipe node --join "
      "HOST:PORT`, the same secret): one that joins is taken at the next step, cutting the model "
      "back onto it after a loss (--replicas: taking a lost node's place in a replica that left), "
      "else standing by as a spare");
  opt("--snapshot-every", a.train.snapshot_every,
      "--on-node-loss continue: copy every stage's parameters, buffers and optimizer state into "
      "this process's memory every N steps (and at the start); a recovery replays from the "
      "newest");
  opt("--max-recoveries", a.train.max_recoveries,
      "--on-node-loss continue: recoveries a run may make before a lost node ends it");
  opt("--slow-factor", a.train.slow_factor,
      "Name a stage whose forward and backward take this many times as long as over its first "
      "steps (medians of its last 5 and of steps 2-6); 0: do not watch. Default: 2 with "
      "--nodes; in process only when given");
  opt("--on-slow-node", a.on_slow_node,
      "When a stage is found slow: name it (log line, --json), or recut: with --nodes, cut the "
      "model anew by the measured speeds (fewer layers on the slow node), from the state then")
    ->check(CLI::IsMember({"name", "recut"}));
}

// How replicas stay together: the sharding flags' short forms, BMUF.
void add_replica_sync_flags(CLI::App* cmd, train_args& a) {
  auto opt = option_adder(cmd);
  cmd->add_flag("--shard-optimizer", a.shard_optimizer, "The same as --shard optimizer (ZeRO-1)");
  cmd->add_flag("--shard-gradients", a.shard_gradients, "The same as --shard gradients (ZeRO-2)");
  opt("--sync", a.sync,
      "How replicas stay together: gradients (averaged every step) or bmuf (blockwise model-update "
      "filtering: --block-steps local steps, then parameters averaged with block momentum; "
      "docs/data-parallel.md)")
    ->check(CLI::IsMember({"gradients", "bmuf"}));
  opt("--block-steps", a.bmuf.block_steps, "--sync bmuf: local steps per block");
  opt("--block-lr", a.bmuf.block_lr, "--sync bmuf: the block learning rate");
  opt("--block-momentum", a.bmuf.block_momentum,
      "--sync bmuf: the block momentum, in [0, 1) (-1: 1 - 1/replicas)");
  cmd->add_flag("--block-nesterov", a.bmuf.nesterov, "--sync bmuf: Nesterov block momentum");
  cmd->add_flag("--reset-momentum", a.bmuf.reset_momentum,
                "--sync bmuf: clear the optimizer's momentum after every block");
  opt("--bmuf-warmup", a.bmuf.warmup_steps,
      "--sync bmuf: steps each replica trains alone before all take rank 0's parameters");
}

// Where the data comes from and how it is visited.
void add_data_flags(CLI::App* cmd, train_args& a) {
  auto opt = option_adder(cmd);
  opt("--data-dir", a.data_dir,
      "Folder with Fashion-MNIST's IDX files (default: /usr/share/datasets/fashion-mnist)");
  opt("--text-file", a.text_file,
      "--data text: a UTF-8 text file (or a folder of them) instead of Debian's fortunes "
      "(/usr/share/games/fortunes); the last tenth of each file is held out for validation");
  opt("--sample", a.sample,
      "--data text: characters of text the trained model writes at the end (0: none)");
  cmd
    ->add_option("--loss", a.loss,
                 "--data tensors:PATH: mse, or cross_entropy (outputs (N, ..., C) of class scores "
                 "against class indices (N, ...)); default cross_entropy for int64 targets, else "
                 "mse")
    ->check(CLI::IsMember({"mse", "cross_entropy"}));
  cmd->add_flag("--shuffle", a.shuffle,
                "--data tensors:PATH: visit the file in a new random order (from --seed) on "
                "every pass instead of in order");
  opt("--holdout", a.holdout,
      "--data tensors:PATH: hold this fraction of the file out (drawn from --seed) and "
      "evaluate it after each epoch: its loss, and top-1 for class targets (e.g. 0.1)")
    ->check(CLI::Range(0.0, 0.99));
}

// The optimizer and its learning rate's schedule.
void add_optimizer_flags(CLI::App* cmd, train_args& a) {
  auto opt = option_adder(cmd);
  opt("--lr", a.optimizer.lr,
      "Learning rate (fashion-mnist and text: peak of the cosine schedule; gpt trains with Adam "
      "at 3e-3 unless given)")
    ->check(at_least(0));
  opt("--momentum", a.optimizer.momentum,
      "SGD momentum (not given: 0.9 for fashion-mnist, 0 for synthetic and tensor files)")
    ->check(at_least(0));
  cmd
    ->add_option("--optimizer", a.optimizer.name, "sgd, adam or adamw (default: sgd; adam for gpt)")
    ->check(CLI::IsMember({"sgd", "adam", "adamw"}));
  opt("--weight-decay", a.optimizer.weight_decay,
      "The optimizer's weight decay (L2, as torch.optim's; AdamW's is decoupled, 0.01 unless "
      "given, as torch.optim.AdamW's)")
    ->check(at_least(0));
  cmd->add_flag("--nesterov", a.optimizer.nesterov,
                "SGD with Nesterov momentum (torch.optim.SGD's nesterov=True; needs momentum)");
  opt("--min-lr", a.train.min_lr,
      "Fashion-MNIST, text and a tensor file's epochs: the learning rate the cosine schedule "
      "ends at (torch's eta_min, "
      "e.g. a hundredth of --lr)");
  opt("--warmup", a.train.warmup_steps,
      "Fashion-MNIST, text and a tensor file's epochs: linear warm-up steps of the cosine "
      "schedule (a tensor file: 0, and a constant --lr unless this or --min-lr is given)");
}

} // namespace

CLI::App* add_train_command(CLI::App& app, train_args& a) {
  auto* cmd = app.add_subcommand(
    "train", "Train a built-in model pipelined across stage actors: a CNN on Fashion-MNIST by "
             "default, or any model on synthetic data as in the PyTorch RPC pipeline tutorial "
             "(random images, one-hot targets, MSE loss, SGD)");
  add_model_flags(cmd, a.model);
  add_setting_flags(cmd, a.run, training::train_front);
  add_data_flags(cmd, a);
  auto opt = option_adder(cmd);
  opt("--steps", a.steps,
      "Steps (batches) to train in all, counting those before a --resume (0: 3 for synthetic "
      "data; Fashion-MNIST: all --epochs)");
  opt("--epochs", a.epochs,
      "Fashion-MNIST, text and tensor files: epochs (0: 1 for Fashion-MNIST and a file, 4 for "
      "text); with it (or --holdout) --data tensors:PATH is a data set visited epoch by epoch");
  add_optimizer_flags(cmd, a);
  opt("--export", a.export_path,
      "After training, write the trained model file back with its new weights: a PT2 archive "
      "(--model PATH.pt2), which torch.export.load(PATH).module() runs, or TorchScript (--model "
      "PATH.pt), which torch.jit.load runs");
  opt("--save-safetensors", a.save_safetensors,
      "--model PATH.pt2: after training, write the trained weights into this folder as "
      "save_pretrained does (model.safetensors, or shards and an index past --max-shard-size), "
      "under the names --init-from's file had (else the program's), with its config.json: "
      "from_pretrained(DIR) loads them");
  cmd
    ->add_option_function<std::string>(
      "--max-shard-size",
      [&a](const std::string& v) { a.max_shard_bytes = parse_bytes("--max-shard-size", v); },
      "--save-safetensors: the most bytes of one file; more weights go to shards")
    ->default_str("5GiB");
  add_stage_flags(cmd, a);
  add_run_flags(cmd, a);
  add_distributed_flags(cmd, a);
  add_replica_sync_flags(cmd, a);
  cmd
    ->add_flag("--print-config", a.print_config,
               "Print every flag's value as TOML (defaults included) and exit: that text, given to "
               "--config, runs the same; checkpoints keep it as run.toml (docs/config.md)")
    ->configurable(false);
  opt("--trace", a.trace,
      "Write a Chrome trace (Perfetto, chrome://tracing) of every step and print planned against "
      "measured bubbles");
  a.given = [cmd](const std::string& flag) { return cmd->count(flag) > 0; };
  return cmd;
}

namespace {

// Refuses `flag`, saying `why`, when the command line gave it.
void refuse_if_given(const train_args& a, const char* flag, const char* why) {
  ACTORPIPE_CHECK(!a.given || !a.given(flag), flag, " ", why);
}

// The flags of stages on nodes, of their recovery and of overlapping steps, where they apply.
void check_node_flags_apply(const train_args& a) {
  auto refuse = [&](const char* flag, const char* why) { refuse_if_given(a, flag, why); };
  if (a.run.pipeline.placement.nodes.empty()) {
    for (const char* flag : {"--on-node-loss", "--spare-nodes", "--snapshot-every",
                             "--max-recoveries", "--accept-joins"}) {
      refuse(flag, "applies to stages on nodes (--nodes)");
    }
  } else if (a.on_node_loss != "continue") {
    for (const char* flag :
         {"--spare-nodes", "--snapshot-every", "--max-recoveries", "--accept-joins"}) {
      refuse(flag, "applies to --on-node-loss continue");
    }
  }
  if (!a.run.pipeline.placement.nodes.empty()) {
    refuse("--overlap-steps", "runs stages in this process; stages on nodes (--nodes) take one "
                              "step at a time");
  }
  if (a.replicas > 1) {
    refuse("--overlap-steps", "applies to one pipeline; replicas in this process (--replicas) "
                              "take one step at a time");
  }
  ACTORPIPE_CHECK(a.train.resume != "nodes" || !a.run.pipeline.placement.nodes.empty(),
                  "--resume nodes takes the snapshot that nodes keep of the stages they host: "
                  "give the run's --nodes");
  ACTORPIPE_CHECK(a.train.slow_factor == 0 || a.train.slow_factor > 1, "--slow-factor (",
                  a.train.slow_factor, ") must be 0 (not watched) or above 1");
  if (a.on_slow_node == "recut") {
    ACTORPIPE_CHECK(!a.run.pipeline.placement.nodes.empty() && a.replicas <= 1 &&
                      a.world_size <= 1 && a.train.slow_factor > 0,
                    "--on-slow-node recut places the stages of one pipeline on its --nodes again: "
                    "it needs --nodes, no --replicas and a --slow-factor");
  }
  ACTORPIPE_CHECK(a.train.snapshot_every >= 1, "--snapshot-every (", a.train.snapshot_every,
                  ") must be >= 1");
  ACTORPIPE_CHECK(a.train.max_recoveries >= 1, "--max-recoveries (", a.train.max_recoveries,
                  ") must be >= 1");
}

// The flags that do not apply to --data synthetic, and those only it and images:DIR take.
void check_synthetic_flags_apply(const train_args& a, bool images) {
  auto refuse = [&](const char* flag, const char* why) { refuse_if_given(a, flag, why); };
  if (a.model.data == "synthetic") {
    const char* stream = "does not apply to --data synthetic, an endless stream of generated "
                         "batches: say how long to train with --steps";
    refuse("--epochs", stream);
    refuse("--data-dir", "does not apply to --data synthetic (no files are read)");
    refuse("--train-samples", "does not apply to --data synthetic (no data set to cut short)");
    refuse("--test-samples", "does not apply to --data synthetic (it has no test set)");
    refuse("--warmup", "does not apply to --data synthetic, which trains at a constant --lr");
    refuse("--min-lr", "does not apply to --data synthetic, which trains at a constant --lr");
  } else if (!images) {
    refuse("--image", "sets the side of synthetic images and of images:DIR; this data comes in "
                      "its own shape");
    refuse("--classes", "sets the synthetic data's classes (or tokens); real data has its own");
  }
}

// The flags of one kind of data, refused for the others.
void check_data_flags_apply(const train_args& a) {
  auto refuse = [&](const char* flag, const char* why) { refuse_if_given(a, flag, why); };
  const bool tensors = !training::tensor_file_of(a.model.data).empty();
  const bool images = !training::image_folder_of(a.model.data).empty();
  if (images) {
    refuse("--data-dir", "is Fashion-MNIST's folder; --data images:DIR names its own folder");
    refuse("--train-samples", "applies to Fashion-MNIST (an image folder is used whole)");
    refuse("--test-samples", "applies to Fashion-MNIST (an image folder is used whole)");
    refuse("--augment", "applies to Fashion-MNIST: images:DIR always crops at random and flips");
    refuse("--classes", "sets the synthetic data's classes: an image folder has a class per "
                        "sub-folder");
  } else {
    refuse("--workers", "applies to --data images:DIR (the loader's threads)");
    refuse("--channels", "applies to --data images:DIR");
    refuse("--bad-images", "applies to --data images:DIR");
  }
  if (tensors) {
    if (!tensor_data_set(a)) {
      const char* constant = "does not apply to --data tensors:PATH read as a stream of --steps "
                             "batches at a constant --lr: give --epochs (and --holdout) to "
                             "train on the file epoch by epoch under the cosine schedule";
      refuse("--warmup", constant);
      refuse("--min-lr", constant);
    }
    refuse("--data-dir", "is Fashion-MNIST's folder; --data tensors:PATH names its own file");
    refuse("--train-samples", "applies to Fashion-MNIST (a tensor file is used whole)");
    refuse("--test-samples", "applies to Fashion-MNIST: hold part of a tensor file out with "
                             "--holdout F");
  } else {
    refuse("--shuffle", "applies to --data tensors:PATH (other data has its own order)");
    refuse("--loss", "applies to --data tensors:PATH (the other data sets decide their loss)");
    refuse("--holdout", "applies to --data tensors:PATH (the other data sets have their own "
                        "held-out part)");
  }
  if (a.model.data != "fashion-mnist" && !images) {
    refuse("--augment", "applies to Fashion-MNIST's images (random crops and flips)");
  }
  if (a.model.data != "text") {
    refuse("--text-file", "applies to --data text (the text to train on)");
    refuse("--sample", "applies to --data text (text written by the trained model)");
  } else {
    refuse("--data-dir", "is Fashion-MNIST's folder: give --data text its text with --text-file");
    refuse("--train-samples", "applies to Fashion-MNIST (text: give a shorter --text-file)");
    refuse("--test-samples", "applies to Fashion-MNIST (text holds out a tenth of every file)");
  }
  check_synthetic_flags_apply(a, images);
}

// The flags of a model file, of the built-in ResNets' batch norm, or of gpt's sizes.
void check_model_flags_apply(const train_args& a, const model_setup& setup) {
  auto refuse = [&](const char* flag, const char* why) { refuse_if_given(a, flag, why); };
  if (setup.model_file.empty()) {
    refuse("--export", "writes a model file back: it needs --model PATH.pt2 (or PATH.pt)");
    refuse("--segments", "cuts a PT2 archive into layers: it needs --model PATH.pt2");
    refuse("--init-from", "sets a PT2 archive's weights: it needs --model PATH.pt2 (a built-in "
                          "model starts from a checkpoint: --resume)");
    refuse("--save-safetensors", "writes a PT2 archive's weights: it needs --model PATH.pt2 "
                                 "(a built-in model's are in --checkpoint-dir)");
  } else {
    if (!models::format_of(setup.layers)->graph) {
      refuse("--segments", "cuts a PT2 archive into layers; a TorchScript model's layers are "
                           "its Sequential's children");
      refuse("--save-safetensors", "writes a PT2 archive's weights; a TorchScript model's are "
                                   "written back with --export");
    }
    refuse("--deferred-bn", "applies to the built-in ResNets' batch norm");
  }
  if (training::model_name(a.model) != "gpt") {
    for (const char* flag : {"--layers", "--heads", "--width", "--context", "--dropout"}) {
      refuse(flag, "sets a size of --model gpt, which this run does not train");
    }
  } else {
    bool sgd_given = a.given && a.given("--optimizer") && a.optimizer.name == "sgd";
    if (!sgd_given) {
      refuse("--momentum", "is SGD's: gpt trains with Adam (unless --optimizer sgd)");
    }
    refuse("--deferred-bn", "applies to the ResNets' batch norm; gpt has LayerNorm");
  }
}

} // namespace

bool tensor_data_set(const train_args& a) {
  return !training::tensor_file_of(a.model.data).empty() && a.given &&
         (a.given("--epochs") || a.given("--holdout"));
}

// Flags that belong to one kind of data, or need another flag, are refused elsewhere with why.
void check_flags_apply(const train_args& a, const model_setup& setup) {
  check_node_flags_apply(a);
  check_data_flags_apply(a);
  check_model_flags_apply(a, setup);
  ACTORPIPE_CHECK(a.max_shard_bytes > 0, "--max-shard-size must be more than 0 bytes");
  if (a.save_safetensors.empty()) {
    refuse_if_given(a, "--max-shard-size", "sizes the files of --save-safetensors");
  }
  ACTORPIPE_CHECK(!a.given || !(a.given("--steps") && a.given("--max-steps")),
                  "--steps and --max-steps both give the steps of the run in all: give one");
}

} // namespace actorpipe::cli
