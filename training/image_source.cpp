// Batches of an image folder, decoded and augmented by background workers ahead of the pipeline.
#include <actorpipe/training.hpp>

#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <tuple>

#include <torch/torch.h>

#include "training/job_threads.hpp"

namespace actorpipe {

// The loader's threads and the batches they prepare, keyed by (epoch, index).
struct image_folder_source::loader {
  using batch_t = std::pair<torch::Tensor, torch::Tensor>;
  using key_t = std::pair<int64_t, int64_t>;

  std::mutex mutex;
  std::map<key_t, std::shared_future<batch_t>> pending;
  // What the pending batches were asked with: (batch, seed, rank, replicas).
  std::tuple<int64_t, uint64_t, int64_t, int64_t> asked{-1, 0, -1, -1};
  // Epoch orders in use, by (epoch, seed, rank, replicas): the newest two.
  std::mutex orders_mutex;
  std::map<std::tuple<int64_t, uint64_t, int64_t, int64_t>, torch::Tensor> orders;
  // Files that failed to decode, not yet reported (bad_image_policy::skip).
  std::vector<std::string> failures;
  // Last: joined first, before what the jobs read. A worker decodes with plain loops.
  training::job_threads workers;

  explicit loader(std::size_t count) : workers(count) {}

  // Queues `make` for `key` unless it is queued already (caller holds no lock).
  void submit(key_t key, std::function<batch_t()> make) {
    std::lock_guard<std::mutex> lock(mutex);
    if (pending.count(key) != 0) {
      return;
    }
    auto promise = std::make_shared<std::promise<batch_t>>();
    pending.emplace(key, promise->get_future().share());
    workers.post([promise, make = std::move(make)] {
      try {
        promise->set_value(make());
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    });
  }
};

image_folder_source::image_folder_source(image_folder folder, image_source_options options)
  : folder_(std::move(folder)), options_(std::move(options)) {
  ACTORPIPE_CHECK(!folder_.train.empty(), "images:", folder_.root, ": no training images");
  ACTORPIPE_CHECK(options_.deadline_seconds > 0, "images:", folder_.root,
                  ": the loader's deadline (", options_.deadline_seconds, " s) must be > 0");
  ACTORPIPE_CHECK(options_.workers <= 64, "--workers (", options_.workers, ") must be <= 64");
  if (options_.workers > 0) {
    loader_ = std::make_unique<loader>(options_.workers);
  }
}

image_folder_source::~image_folder_source() = default;

std::string image_folder_source::name() const {
  return "images:" + folder_.root;
}

std::vector<image_file> image_folder_source::files_of(int64_t epoch, int64_t index, int64_t batch,
                                                      uint64_t seed, int64_t rank,
                                                      int64_t replicas) const {
  const auto n = static_cast<int64_t>(folder_.train.size());
  auto draw_order = [&] {
    return replicas == 1 ? epoch_order(n, seed, epoch)
                         : distributed_order(n, seed, epoch, rank, replicas);
  };
  torch::Tensor order;
  if (!loader_) {
    order = draw_order();
  } else {
    // One draw of an epoch's order serves all its batches and workers.
    std::lock_guard<std::mutex> lock(loader_->orders_mutex);
    auto& orders = loader_->orders;
    auto key = std::make_tuple(epoch, seed, rank, replicas);
    auto it = orders.find(key);
    if (it == orders.end()) {
      if (orders.size() >= 2) {
        orders.erase(orders.begin());
      }
      it = orders.emplace(key, draw_order()).first;
    }
    order = it->second;
  }
  const auto local = batch / replicas;
  auto at = order.accessor<int64_t, 1>();
  std::vector<image_file> files;
  for (int64_t i = index * local; i < (index + 1) * local && i < order.size(0); ++i) {
    files.push_back(folder_.train[static_cast<std::size_t>(at[i])]);
  }
  return files;
}

std::pair<torch::Tensor, torch::Tensor>
image_folder_source::make_batch(int64_t epoch, int64_t index, int64_t batch, uint64_t seed,
                                int64_t rank, int64_t replicas) const {
  auto files = files_of(epoch, index, batch, seed, rank, replicas);
  auto transform = options_.transform;
  transform.random = true;
  // The crops and flips depend on (seed, epoch, batch, rank) alone: a resumed run, or one with
  // another number of workers, sees the same images.
  auto draw = mix(mix(mix(seed, static_cast<uint64_t>(epoch)), static_cast<uint64_t>(index)),
                  static_cast<uint64_t>(rank));
  std::vector<std::string> failures;
  auto out = load_images(files, transform, draw,
                         options_.bad == bad_image_policy::skip ? &failures : nullptr);
  if (!failures.empty()) {
    std::lock_guard<std::mutex> lock(failures_mutex_);
    unreported_.insert(unreported_.end(), failures.begin(), failures.end());
  }
  return out;
}

void image_folder_source::report_failures() const {
  std::vector<std::string> failures;
  {
    std::lock_guard<std::mutex> lock(failures_mutex_);
    failures.swap(unreported_);
  }
  for (const auto& f : failures) {
    if (reported_.insert(f).second) {
      std::cerr << "warning: " << f << " (left out: the next image of its batch stands in)\n";
    }
  }
}

std::pair<torch::Tensor, torch::Tensor> image_folder_source::batch(int64_t epoch, int64_t index,
                                                                   int64_t batch, uint64_t seed,
                                                                   int64_t rank,
                                                                   int64_t replicas) const {
  ACTORPIPE_CHECK(replicas >= 1 && batch % replicas == 0 && batch >= replicas, name(), ": batch (",
                  batch, ") must be a positive multiple of the ", replicas, " replicas");
  if (!loader_) {
    auto out = make_batch(epoch, index, batch, seed, rank, replicas);
    report_failures();
    return out;
  }
  const auto local = batch / replicas;
  const auto n = static_cast<int64_t>(folder_.train.size());
  const auto per_epoch = std::max<int64_t>(1, ((n + replicas - 1) / replicas) / local);
  const std::size_t ahead = options_.ahead > 0 ? options_.ahead : 2 * options_.workers;
  // This batch and the next `ahead` (into the next epoch at an epoch's end) are queued; batches
  // before this one (a resume, an epoch cut short) are dropped.
  {
    std::lock_guard<std::mutex> lock(loader_->mutex);
    auto& pending = loader_->pending;
    auto asked = std::make_tuple(batch, seed, rank, replicas);
    if (asked != loader_->asked) {
      pending.clear(); // prepared for other settings
      loader_->asked = asked;
    }
    pending.erase(pending.begin(), pending.lower_bound({epoch, index}));
  }
  int64_t e = epoch;
  int64_t i = index;
  for (std::size_t k = 0; k <= ahead; ++k) {
    loader_->submit({e, i}, [this, e, i, batch, seed, rank, replicas] {
      return make_batch(e, i, batch, seed, rank, replicas);
    });
    if (++i >= per_epoch) {
      ++e;
      i = 0;
    }
  }
  std::shared_future<loader::batch_t> ready;
  {
    std::lock_guard<std::mutex> lock(loader_->mutex);
    auto it = loader_->pending.find({epoch, index});
    ready = it->second;
    loader_->pending.erase(it);
  }
  auto deadline = std::chrono::duration<double>(options_.deadline_seconds);
  if (ready.wait_for(deadline) != std::future_status::ready) {
    throw pipeline_error(detail::concat(name(), ": the loader's ", options_.workers,
                                        " workers did not deliver batch ", index, " of epoch ",
                                        epoch + 1, " within ", options_.deadline_seconds, " s"),
                         error_details{error_kind::timeout});
  }
  auto out = ready.get();
  report_failures();
  return out;
}

std::optional<eval_result> image_folder_source::evaluate(pipeline& pipe, int64_t batch) const {
  if (folder_.validation.empty()) {
    return std::nullopt;
  }
  ACTORPIPE_CHECK(batch >= 1, "evaluation batch (", batch, ") must be >= 1");
  auto transform = options_.transform;
  transform.random = false;
  // Decoded a chunk at a time (a large validation split need not fit in memory), chunks
  // scored as evaluate() scores a data set and combined by their sizes.
  const auto n = static_cast<int64_t>(folder_.validation.size());
  const int64_t chunk = std::max<int64_t>(batch, 1024 / batch * batch);
  eval_result total;
  for (int64_t begin = 0; begin < n; begin += chunk) {
    auto end = std::min(n, begin + chunk);
    std::vector<image_file> files(folder_.validation.begin() + begin,
                                  folder_.validation.begin() + end);
    std::vector<std::string> failures;
    auto [x, y] = load_images(files, transform, 0,
                              options_.bad == bad_image_policy::skip ? &failures : nullptr);
    {
      std::lock_guard<std::mutex> lock(failures_mutex_);
      unreported_.insert(unreported_.end(), failures.begin(), failures.end());
    }
    report_failures();
    dataset part{x, y};
    auto r = actorpipe::evaluate(pipe, part, batch);
    auto w = static_cast<double>(end - begin) / static_cast<double>(n);
    total.loss += w * r.loss;
    total.top1 += w * r.top1;
    total.top5 += w * r.top5;
  }
  total.bits = total.loss / std::log(2.0);
  return total;
}

} // namespace actorpipe
