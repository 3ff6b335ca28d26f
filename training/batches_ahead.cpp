#include "training/batches_ahead.hpp"

namespace actorpipe::training {

void batches_ahead::ask(int64_t epoch, int64_t index) {
  if (made_.valid()) {
    made_.wait(); // one at a time: the one asked for before (not taken) is made first
  }
  if (!thread_) {
    thread_ = std::make_unique<job_threads>(1);
  }
  auto job = std::make_shared<std::packaged_task<batch_t()>>(
    [this, epoch, index] { return make_(epoch, index); });
  made_ = job->get_future();
  epoch_ = epoch;
  index_ = index;
  thread_->post([job] { (*job)(); });
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

} // namespace actorpipe::training
