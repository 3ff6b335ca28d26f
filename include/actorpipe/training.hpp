/// \file
/// Training end to end, one loop for every kind of data: epochs over a shuffled data set or steps
/// of a generated stream, a cosine learning-rate schedule with warm-up, evaluation, metrics,
/// progress, and checkpoints that resume exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Generator.h>

#include <actorpipe/data.hpp>
#include <actorpipe/images.hpp>
#include <actorpipe/pipeline.hpp>
#include <actorpipe/replicas.hpp>

namespace actorpipe {

/// Linear warm-up from base_lr / warmup_steps to base_lr, then cosine decay to min_lr at
/// total_steps.
struct cosine_schedule {
  double base_lr = 0.05;
  double min_lr = 0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;

  /// The learning rate of step `step` (0-based).
  double at(int64_t step) const;
};

/// What a checkpoint's manifest records besides the tensors.
struct checkpoint_manifest {
  std::string model;
  /// The partition that wrote it (a resume may use another).
  std::vector<std::size_t> bounds;
  /// Steps completed.
  uint64_t step = 0;
  /// The epoch in progress (0-based) and the next batch in it: the sampler position.
  int64_t epoch = 0;
  int64_t batch_in_epoch = 0;
  /// The data order is drawn from (seed, epoch) alone, so the seed is all the RNG state needed.
  uint64_t seed = 0;
  int64_t batch_size = 0;
  std::string dataset;
  /// The run's settings as `actorpipe train --print-config` writes them (TOML; empty when the
  /// run gave none), kept beside the manifest as run.toml.
  std::string settings;
};

/// Writes a checkpoint of `pipe` as `<root>/step-<step>`: stage files and manifest.json go into
/// a temporary folder first, which is then renamed (atomic on one file system), so a crash
/// mid-write leaves the previous checkpoint intact. Keeps the newest `keep` checkpoints (>= 1).
/// Returns the checkpoint's folder.
std::string write_checkpoint(pipeline& pipe, const std::string& root,
                             const checkpoint_manifest& manifest, std::size_t keep);

/// `path` itself when it holds a manifest.json, else the newest complete `step-*` checkpoint
/// in it. Throws invalid_argument when there is none.
std::string find_checkpoint(const std::string& path);

/// Reads `<dir>/manifest.json`; throws pipeline_error naming the file and field on bad input.
checkpoint_manifest read_manifest(const std::string& dir);

/// The keys whose values differ between two runs' settings (TOML lines `key=value`, and
/// `# key=value` for a default as --print-config writes it; other comments, blank lines and the
/// keys in `ignored` left out), as "key: A -> B" ("(none)" for a key one side lacks), in key
/// order.
std::vector<std::string> settings_differences(const std::string& before, const std::string& now,
                                              const std::vector<std::string>& ignored = {});

/// Accuracy of a forward-only pass.
struct eval_result {
  /// Mean cross-entropy (per sample; per token for a language model).
  double loss = 0;
  double top1 = 0;
  double top5 = 0;
  /// A language model's (outputs [N, T, vocabulary]): the loss in bits per token, which for
  /// character tokens is bits per character.
  bool tokens = false;
  double bits = 0;
  /// Class-index targets: top1 and top5 count. False for other targets (a tensor file's float
  /// targets), scored by the run's loss alone.
  bool classes = true;
};

/// Runs `data` through `pipe` forward-only in batches of `batch` samples. Outputs [N, classes]
/// are scored per sample; [N, T, vocabulary] (a language model) per token.
eval_result evaluate(pipeline& pipe, const dataset& data, int64_t batch);

/// Runs `data` through `pipe` forward-only in batches of `batch` samples and scores it with
/// `loss` (a mean over its batch): the mean over the samples, no top-1 (classes false).
eval_result evaluate(pipeline& pipe, const dataset& data, int64_t batch, const loss_function& loss);

/// `data` cut in two as torch.utils.data.random_split would: `fraction` of its samples (rounded,
/// at least one when fraction > 0) drawn at random from `seed` are held out (second), the rest
/// kept (first); each part keeps the file's order.
std::pair<dataset, dataset> hold_out(const dataset& data, double fraction, uint64_t seed);

/// Where a training run's batches come from: a data set visited in a seeded order every epoch,
/// or an endless stream of generated batches numbered by step. train() serves both alike.
/// Implementations are read from the training thread only.
class batch_source {
public:
  virtual ~batch_source() = default;

  /// Recorded in checkpoints ("fashion-mnist", "synthetic") and checked on resume.
  virtual std::string name() const = 0;

  /// Samples one epoch visits; 0 for an endless stream (which has steps but no epochs).
  virtual int64_t epoch_samples() const = 0;

  /// Inputs and targets of rank `rank`'s part (of `replicas`) of batch `index` of `epoch`, a
  /// batch being `batch` samples over all ranks. A stream takes epoch 0 and index = step.
  virtual std::pair<torch::Tensor, torch::Tensor> batch(int64_t epoch, int64_t index, int64_t batch,
                                                        uint64_t seed, int64_t rank,
                                                        int64_t replicas) const = 0;

  /// Held-out accuracy of `pipe` (after each epoch), or nothing when the source has none.
  virtual std::optional<eval_result> evaluate(pipeline& pipe, int64_t batch) const {
    return std::nullopt;
  }

  /// Whether train() may ask for the next batch on a thread of its own while the step before it
  /// runs (never two calls at once, nor beside evaluate): for a source whose batches depend on
  /// their arguments alone. False by default (a source with effects of its own, or one that
  /// must be called on the loop's thread); the built-in sources but image folders (which have
  /// loader workers of their own) say true.
  virtual bool prefetch() const { return false; }
};

/// Training-time augmentation of a batch of images [N, C, H, W], as torchvision's RandomCrop
/// (with padding) and RandomHorizontalFlip: each image is padded by `pad` pixels on every side
/// with its own darkest value, cropped back to H x W at a random offset, and mirrored with
/// probability 1/2 when `flip`.
struct image_augmentation {
  int64_t pad = 0;
  bool flip = false;

  bool any() const { return pad > 0 || flip; }
};

/// `images` augmented as `augmentation` says, with random draws from `generator` (a new tensor;
/// `images` itself is unchanged).
torch::Tensor augment_images(const torch::Tensor& images, const image_augmentation& augmentation,
                             at::Generator& generator);

/// A classification data set: epoch_order (distributed_order with replicas) over `train`, the
/// last incomplete batch of an epoch dropped; evaluated on `test` after every epoch. Training
/// batches may be augmented (set_augmentation): the draws depend on (seed, epoch, batch, rank)
/// alone, so a resumed run sees the same images as an uninterrupted one.
class dataset_source : public batch_source {
public:
  dataset_source(std::string name, dataset train, dataset test);
  /// Augments every training batch from now on (evaluation never is).
  void set_augmentation(image_augmentation augmentation);
  /// With false, every epoch visits the training set in its own order instead of epoch_order's
  /// (replicas take every replicas-th sample from their rank on, as distributed_order does).
  void set_shuffle(bool shuffle);
  /// Scores the held-out set with `loss` when its targets are not class indices (the default,
  /// cross-entropy and top-1, needs classes).
  void set_evaluation_loss(loss_function loss);
  std::string name() const override { return name_; }
  int64_t epoch_samples() const override { return train_.size(); }
  bool prefetch() const override { return true; }
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t epoch, int64_t index, int64_t batch,
                                                uint64_t seed, int64_t rank,
                                                int64_t replicas) const override;
  /// Nothing when the held-out set is empty.
  std::optional<eval_result> evaluate(pipeline& pipe, int64_t batch) const override;
  /// Samples held out for evaluation.
  int64_t test_samples() const { return test_.size(); }

private:
  std::string name_;
  dataset train_;
  dataset test_;
  image_augmentation augmentation_;
  bool shuffle_ = true;
  loss_function loss_;
  // The order of the epoch last asked for, drawn once per epoch.
  mutable torch::Tensor order_;
  mutable int64_t order_epoch_ = -1;
};

/// The PyTorch RPC tutorial's synthetic data, as an endless stream: batch `step` holds random
/// images [channels, side, side] (standard normal) and one-hot float targets of `classes`
/// classes (for an MSE loss), drawn from a generator seeded by (seed, step) alone, so every rank
/// and every resumed run draws the same batches; a rank takes its part of each.
class synthetic_source : public batch_source {
public:
  synthetic_source(int64_t channels, int64_t side, int64_t classes);
  std::string name() const override { return "synthetic"; }
  int64_t epoch_samples() const override { return 0; }
  bool prefetch() const override { return true; }
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t epoch, int64_t index, int64_t batch,
                                                uint64_t seed, int64_t rank,
                                                int64_t replicas) const override;

private:
  int64_t channels_;
  int64_t side_;
  int64_t classes_;
};

/// Token sequences for a language model, as an endless stream: each sequence of `context`
/// tokens counts from a random start by a random stride modulo `vocabulary` (predictable from
/// its second token on), and its targets are the next tokens; drawn from (seed, step) alone, as
/// synthetic_source's.
class synthetic_tokens_source : public batch_source {
public:
  synthetic_tokens_source(int64_t vocabulary, int64_t context);
  std::string name() const override { return "synthetic"; }
  int64_t epoch_samples() const override { return 0; }
  bool prefetch() const override { return true; }
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t epoch, int64_t index, int64_t batch,
                                                uint64_t seed, int64_t rank,
                                                int64_t replicas) const override;

private:
  int64_t vocabulary_;
  int64_t context_;
};

/// A tensor file (load_tensor_file) as a stream: batch k holds samples [k B, (k + 1) B) of the
/// file, wrapping around at its end, so `--steps` batches read the file in order; with
/// `shuffle`, pass p over the file visits it in epoch_order(N, seed, p) instead. A rank takes
/// its part of each batch. The name ("tensors:PATH") is recorded in checkpoints.
class tensor_file_source : public batch_source {
public:
  tensor_file_source(std::string path, dataset data, bool shuffle);
  std::string name() const override { return "tensors:" + path_; }
  int64_t epoch_samples() const override { return 0; }
  bool prefetch() const override { return true; }
  /// Samples in the file.
  int64_t samples() const { return data_.size(); }
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t epoch, int64_t index, int64_t batch,
                                                uint64_t seed, int64_t rank,
                                                int64_t replicas) const override;

private:
  std::string path_;
  dataset data_;
  bool shuffle_;
};

/// How image_folder_source prepares its batches.
struct image_source_options {
  /// Size, channels, resize and normalisation (training batches crop randomly and flip, the
  /// held-out split is centre-cropped: `random` is set by the source).
  image_transform transform;
  /// Background threads decoding and augmenting batches ahead of the pipeline; 0 decodes on
  /// the training thread when a batch is asked for.
  std::size_t workers = 2;
  /// Batches prepared ahead of the one asked for (0: twice the workers).
  std::size_t ahead = 0;
  /// A file that fails to decode mid-run: an error naming it, or a warning naming it once and
  /// the next image of its batch in its place.
  bad_image_policy bad = bad_image_policy::fail;
  /// The longest a batch may be waited for before a timeout error.
  double deadline_seconds = 300;
};

/// A folder of images (scan_image_folder) as a batch source: distributed_order over its training
/// files, the last incomplete batch of an epoch dropped, each batch decoded, cropped at random
/// and flipped by `workers` background threads while the pipeline trains on earlier batches.
/// The draws depend on (seed, epoch, batch, rank) alone, so the images are the same for any
/// number of workers and after a resume. Evaluated on the folder's val/ (or test/) split, when
/// it has one.
class image_folder_source : public batch_source {
public:
  image_folder_source(image_folder folder, image_source_options options);
  ~image_folder_source() override;
  std::string name() const override;
  int64_t epoch_samples() const override { return static_cast<int64_t>(folder_.train.size()); }
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t epoch, int64_t index, int64_t batch,
                                                uint64_t seed, int64_t rank,
                                                int64_t replicas) const override;
  std::optional<eval_result> evaluate(pipeline& pipe, int64_t batch) const override;
  const image_folder& folder() const { return folder_; }

private:
  struct loader;
  std::vector<image_file> files_of(int64_t epoch, int64_t index, int64_t batch, uint64_t seed,
                                   int64_t rank, int64_t replicas) const;
  std::pair<torch::Tensor, torch::Tensor> make_batch(int64_t epoch, int64_t index, int64_t batch,
                                                     uint64_t seed, int64_t rank,
                                                     int64_t replicas) const;
  void report_failures() const;

  image_folder folder_;
  image_source_options options_;
  mutable std::mutex failures_mutex_;
  mutable std::vector<std::string> unreported_;
  mutable std::set<std::string> reported_;
  // Last: its threads are joined before the members they use are destroyed.
  std::unique_ptr<loader> loader_;
};

/// Continues `prompt` (text of `corpus`'s alphabet) by `length` tokens with the forward-only
/// path: each next token is drawn from the model's distribution at `temperature` (0: the
/// likeliest) with a generator seeded by `seed`, the model seeing the last `context` tokens.
/// Returns the continuation, without the prompt.
std::string generate_text(pipeline& pipe, const text_corpus& corpus, const std::string& prompt,
                          int64_t length, int64_t context, double temperature, uint64_t seed);

struct train_options {
  /// Epochs of a data set (a stream has none: max_steps says how long it runs).
  int64_t epochs = 1;
  /// Samples per step; the last incomplete batch of an epoch is dropped.
  int64_t batch = 64;
  uint64_t seed = 0;
  /// The peak learning rate, and the one the cosine schedule ends at (torch's eta_min).
  double lr = 0.05;
  double min_lr = 0;
  int64_t warmup_steps = 100;
  int64_t eval_batch = 1000;
  /// Where checkpoints go (none when empty), every `checkpoint_every` steps (0: only at the
  /// end) and at the end; the newest `keep` are kept.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  std::size_t keep = 3;
  /// A checkpoint (or a folder of them) to continue from; "nodes": the newest snapshot the nodes
  /// keep (stages on nodes with recover_lost_nodes, whose driver died: pipeline::kept_on_nodes).
  std::string resume;
  /// The run's settings (TOML, `actorpipe train --print-config`): recorded in every checkpoint;
  /// a resume whose settings differ from the checkpoint's warns, naming what differs.
  std::string settings;
  /// Per-epoch metrics: CSV when the name ends in .csv, else JSON lines.
  std::string metrics;
  /// Stop after this many steps in total, counting the steps before a resume (0: run all
  /// epochs; a stream needs it); a checkpoint is written there.
  int64_t max_steps = 0;
  /// The learning rate follows the cosine schedule with warm-up; false: `lr` throughout.
  bool cosine = true;
  /// Progress bar on stderr.
  bool progress = true;
  /// One line per step on stdout (step, loss, seconds), for runs of few, slow steps.
  bool log_steps = false;
  /// Keep every step's step_result in the report (timings, per-stage actions: traces).
  bool keep_results = false;
  /// Stragglers: a stage whose forward and backward take at least this many times as long as
  /// over its first steps (medians of its last 5 steps and of steps 2-6) is named: a log line
  /// and train_report::slow_stages. 0: not watched.
  /// A node at half its speed may slow its stage's own figure only 1.5-2.1x (its transfers and
  /// waits are not all slowed): 1.5 catches it. 2 by default, since stages of a few
  /// milliseconds on shared cores wander 1.5-1.8x by themselves.
  double slow_factor = 2.0;
  /// Stages on nodes, one pipeline, one chunk per stage: a slow stage's node gets fewer layers:
  /// the model is cut anew by the measured times (each node's slowdown against its stage's usual
  /// time) and placed again from the state after the step (pipeline::repartition): nothing is
  /// replayed (`--on-slow-node recut`).
  bool recut_slow_nodes = false;
  /// Submit each step behind the running one (train_step_async), so that a pipeline with
  /// pipeline_options::overlap_steps overlaps them; a step after which a checkpoint, a snapshot,
  /// the stop or the epoch's end comes runs alone. One pipeline only (not replicated_pipeline).
  bool overlap_steps = false;
  /// Data parallelism: this process is replica `rank` of `replicas` (its pipeline has
  /// data_parallel set accordingly). Each rank takes batch / replicas samples of every step
  /// from its distributed_order shard; only rank 0 shows progress, evaluates, writes metrics and
  /// checkpoints (all replicas hold the same parameters).
  int64_t rank = 0;
  int64_t replicas = 1;
  /// Recorded in manifests and checked on resume.
  std::string model;
  std::string dataset;
  /// Stages on nodes: what a lost node does to the run. Fail (the step's pipeline_error ends
  /// train()), or recover (pipeline::recover(): spares, else the survivors cut anew with
  /// `repartition`) and replay the data from the newest snapshot, at most `max_recoveries` times.
  bool recover_lost_nodes = false;
  std::size_t max_recoveries = 3;
  std::function<partition(std::size_t)> repartition;
  /// A snapshot (pipeline::snapshot()) every this many steps, with recover_lost_nodes; the run's
  /// start is the first.
  int64_t snapshot_every = 100;
  /// The snapshots after the first arrive while the next steps run
  /// (pipeline::snapshot_in_background); false: each step after one waits for it.
  bool snapshot_in_background = true;
};

struct epoch_result {
  int64_t epoch = 0;
  uint64_t step = 0;
  double lr = 0;
  double train_loss = 0;
  eval_result test;
  double seconds = 0;
  double samples_per_second = 0;
};

/// A stage found slow (train_options::slow_factor): after step `step`, the median of its last 5
/// steps' forward and backward (`recent_ms`) against the median of its first ones (`usual_ms`),
/// on node `node` (empty in process).
struct slow_stage {
  uint64_t step = 0;
  std::size_t stage = 0;
  std::string node;
  double usual_ms = 0;
  double recent_ms = 0;
};

struct train_report {
  /// One per epoch finished (a stream: one for the whole run, without evaluation).
  std::vector<epoch_result> epochs;
  /// (step, loss) of every step this run took, and its wall time in milliseconds.
  std::vector<std::pair<uint64_t, double>> steps;
  std::vector<double> step_ms;
  /// Every step's result, when train_options::keep_results.
  std::vector<step_result> results;
  /// Seconds the loop waited for batches over the run (step_result::data_wait_ms summed).
  double data_wait_seconds = 0;
  /// One per recovery from a lost node, in order, and the steps replayed after each (taken
  /// since its snapshot, lost with the failed step); `steps` holds each step once, as the
  /// uninterrupted run would.
  std::vector<recovery_report> recoveries;
  std::vector<uint64_t> replayed_steps;
  /// Nodes lost earlier that answered again and were taken back (pipeline::rejoin_nodes), at the
  /// step boundary after which they were.
  std::vector<recovery_report> rejoins;
  /// Stages found slow, in order (each once until it is fast again), and the cuts that moved
  /// layers off them (train_options::recut_slow_nodes).
  std::vector<slow_stage> slow_stages;
  std::vector<partition> recuts;
};

/// Trains `pipe` on the batches of `data`: epochs of a data set (evaluated after each) or
/// max_steps steps of a stream, with checkpoints, resume, metrics and progress alike. Throws
/// invalid_argument for options that do not fit the source (a stream without max_steps, a
/// checkpoint of another run), and what train_step throws. With replicas, the ranks meet
/// (pipeline::replicas_agree) after a resume, agreeing on the step every rank loaded, and at
/// each epoch's end after rank 0's evaluation; a rank that disagrees or does not arrive within
/// data_parallel_options::timeout is a pipeline_error (replica_failure) on every rank. With BMUF
/// a block also ends (pipeline::end_block) at each epoch's end and before each checkpoint.
train_report train(pipeline& pipe, const batch_source& data, const train_options& options);

/// train() on replicas in this process: one loop takes each batch of options.batch samples
/// whole and the replicas split it among themselves (options.rank 0 of 1 replicas); evaluation
/// and checkpoints use replica 0 (all hold the same parameters). With stages on nodes and
/// recover_lost_nodes, a lost node is recovered with replicated_pipeline::recover(): a spare
/// takes its stages, or its replica leaves and the others go on (options.repartition does not
/// apply: the replicas keep their cut); the state comes from a replica that kept its nodes, so
/// the failed step is the next and none is replayed, or else from the newest snapshot. Throws
/// invalid_argument for another rank or replica count in options, or a repartition; otherwise as
/// the other train().
train_report train(replicated_pipeline& pipe, const batch_source& data,
                   const train_options& options);

/// train() on dataset_source("fashion-mnist"-style `options.dataset`, train, test): a classifier
/// whose loss should be cross-entropy over class indices.
train_report train_classifier(pipeline& pipe, const dataset& train, const dataset& test,
                              const train_options& options);

} // namespace actorpipe
