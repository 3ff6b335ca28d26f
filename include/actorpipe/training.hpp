/// \file
/// Training a classifier end to end: epochs over a shuffled dataset, a cosine learning-rate
/// schedule with warm-up, evaluation, metrics, and checkpoints that resume exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <actorpipe/data.hpp>
#include <actorpipe/pipeline.hpp>

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

/// Accuracy of a forward-only pass.
struct eval_result {
  /// Mean cross-entropy.
  double loss = 0;
  double top1 = 0;
  double top5 = 0;
};

/// Runs `data` through `pipe` forward-only in batches of `batch` samples.
eval_result evaluate(pipeline& pipe, const dataset& data, int64_t batch);

struct train_options {
  int64_t epochs = 1;
  /// Samples per step; the last incomplete batch of an epoch is dropped.
  int64_t batch = 64;
  uint64_t seed = 0;
  double lr = 0.05;
  double min_lr = 0;
  int64_t warmup_steps = 100;
  int64_t eval_batch = 1000;
  /// Where checkpoints go (none when empty), every `checkpoint_every` steps (0: only at the
  /// end) and at the end; the newest `keep` are kept.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  std::size_t keep = 3;
  /// A checkpoint (or a folder of them) to continue from.
  std::string resume;
  /// Per-epoch metrics: CSV when the name ends in .csv, else JSON lines.
  std::string metrics;
  /// Stop after this many steps in total (0: run all epochs); a checkpoint is written there.
  int64_t max_steps = 0;
  /// Progress bar on stderr.
  bool progress = true;
  /// Data parallelism: this process is replica `rank` of `replicas` (its pipeline has
  /// data_parallel set accordingly). Each rank takes batch / replicas samples of every step
  /// from its distributed_order shard; only rank 0 shows progress, evaluates, writes metrics and
  /// checkpoints (all replicas hold the same parameters).
  int64_t rank = 0;
  int64_t replicas = 1;
  /// Recorded in manifests and checked on resume.
  std::string model;
  std::string dataset;
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

struct train_report {
  std::vector<epoch_result> epochs;
  /// (step, loss) of every step this run took.
  std::vector<std::pair<uint64_t, double>> steps;
};

/// Trains `pipe` (whose loss should be cross-entropy over class indices) on `train`, evaluating
/// on `test` after every epoch.
train_report train_classifier(pipeline& pipe, const dataset& train, const dataset& test,
                              const train_options& options);

} // namespace actorpipe
