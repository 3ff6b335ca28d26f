#include "training/batches_ahead.hpp"

namespace actorpipe::training {

batches_ahead::~batches_ahead() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) {
    thread_.join();
  }
}

void batches_ahead::ask(int64_t epoch, int64_t index) {
  if (made_.valid()) {
    made_.wait(); // one at a time: the one asked for before (not taken) is made first
  }
  if (!thread_.joinable()) {
    thread_ = std::thread([this] { work(); });
  }
  std::packaged_task<batch_t()> job([this, epoch, index] { return make_(epoch, index); });
  made_ = job.get_future();
  epoch_ = epoch;
  index_ = index;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    job_ = std::move(job);
  }
  wake_.notify_one();
}

std::optional<batches_ahead::batch_t> batches_ahead::take(int64_t epoch, int64_t index) {
  if (!made_.valid()) {
    return std::nullopt;
  }
  auto made = std::move(made_);
  if (epoch_ == epoch && index_ == index) {
    return made.get();
  }
  made.wait(); // a recovery went back in the data: not the batch wanted
  return std::nullopt;
}

void batches_ahead::work() {
  // The stages own the cores: a batch's tensor calls run on this thread alone.
  at::set_num_threads(1);
  for (;;) {
    std::packaged_task<batch_t()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || job_.valid(); });
      if (stopping_) {
        return;
      }
      job = std::move(job_);
    }
    job();
  }
}

} // namespace actorpipe::training
