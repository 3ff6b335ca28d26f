// Background threads for a training run's data: an image folder's loader workers and the batch
// asked for ahead (batches_ahead). Private to training/.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>

namespace actorpipe::training {

/// `count` threads that run the jobs posted to them, in the order posted, until destroyed:
/// jobs not started then are dropped, and the running ones finish first. A job's tensor calls
/// start no intra-op threads of their own (the stage threads own the cores' pools).
class job_threads {
public:
  explicit job_threads(std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
      threads_.emplace_back([this] { work(); });
    }
  }

  ~job_threads() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      jobs_.clear();
    }
    wake_.notify_all();
    for (auto& t : threads_) {
      t.join();
    }
  }

  job_threads(const job_threads&) = delete;
  job_threads& operator=(const job_threads&) = delete;

  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    wake_.notify_one();
  }

private:
  void work() {
    at::set_num_threads(1);
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (stopping_) {
          return;
        }
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> threads_; // last: started once the rest is
};

} // namespace actorpipe::training
