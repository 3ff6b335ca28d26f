// The next batch of a training run, made on a thread of its own while a step runs (train() with
// a source whose batch_source::prefetch() is true). Private to training/.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <utility>

#include <torch/torch.h>

#include "training/job_threads.hpp"

namespace actorpipe::training {

/// One batch ahead: ask() starts making a batch on the maker's thread (started at the first ask,
/// kept for the run, as an image loader's workers: job_threads); take() gives it when it is the
/// one wanted. One batch is made at a time, in the order asked.
class batches_ahead {
public:
  using batch_t = std::pair<torch::Tensor, torch::Tensor>;
  using maker = std::function<batch_t(int64_t epoch, int64_t index)>;

  explicit batches_ahead(maker make) : make_(std::move(make)) {}

  /// Starts making batch `index` of `epoch`, after the one asked for before is made (taken or
  /// not).
  void ask(int64_t epoch, int64_t index);

  /// Batch `index` of `epoch` when that is the one asked for (once it is made; its maker's
  /// exception, if it threw); otherwise nothing, once the one asked for (not taken) is made, so
  /// that the caller may make it itself without two makers at once.
  std::optional<batch_t> take(int64_t epoch, int64_t index);

private:
  maker make_;
  int64_t epoch_ = -1;
  int64_t index_ = -1;
  std::future<batch_t> made_;
  // Last: destroyed first, waiting for a batch being made (the maker reads what the caller's
  // members hold).
  std::unique_ptr<job_threads> thread_;
};

} // namespace actorpipe::training
