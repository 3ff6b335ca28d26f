// The next batch of a training run, made on a thread of its own while a step runs (train() with
// a source whose batch_source::prefetch() is true). Private to training/.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include <torch/torch.h>

namespace actorpipe::training {

/// One batch ahead: ask() starts making a batch on the maker's thread (started at the first ask,
/// kept for the run: its tensor calls start no intra-op threads, as an image loader's workers);
/// take() gives it when it is the one wanted. One batch is made at a time, in the order asked.
class batches_ahead {
public:
  using batch_t = std::pair<torch::Tensor, torch::Tensor>;
  using maker = std::function<batch_t(int64_t epoch, int64_t index)>;

  explicit batches_ahead(maker make) : make_(std::move(make)) {}
  /// Waits for a batch being made (the maker reads what the caller's members hold).
  ~batches_ahead();
  batches_ahead(const batches_ahead&) = delete;
  batches_ahead& operator=(const batches_ahead&) = delete;

  /// Starts making batch `index` of `epoch`, after the one asked for before is made (taken or
  /// not).
  void ask(int64_t epoch, int64_t index);

  /// Batch `index` of `epoch` when that is the one asked for (once it is made; its maker's
  /// exception, if it threw); otherwise nothing, once the one asked for (not taken) is made, so
  /// that the caller may make it itself without two makers at once.
  std::optional<batch_t> take(int64_t epoch, int64_t index);

private:
  void work();

  maker make_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::packaged_task<batch_t()> job_; // asked for, not yet started
  int64_t epoch_ = -1;
  int64_t index_ = -1;
  std::future<batch_t> made_;
  std::thread thread_; // last: joined first
};

} // namespace actorpipe::training
