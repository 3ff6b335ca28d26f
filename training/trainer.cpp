#include <actorpipe/training.hpp>

#include <cmath>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "training/progress.hpp"

namespace actorpipe {
namespace {

constexpr double pi = 3.14159265358979323846;

// Appends one row per epoch: CSV (with a header when the file is new) or JSON lines.
class metrics_writer {
public:
  explicit metrics_writer(const std::string& path) : path_(path) {
    if (path_.empty()) {
      return;
    }
    csv_ = path_.size() > 4 && path_.substr(path_.size() - 4) == ".csv";
    bool fresh = !std::ifstream(path_).good();
    out_.open(path_, std::ios::app);
    ACTORPIPE_CHECK(out_.good(), "--metrics: cannot write '", path_, "'");
    if (csv_ && fresh) {
      out_ << "epoch,step,lr,train_loss,test_loss,top1,top5,seconds,samples_per_second\n";
    }
  }

  void write(const epoch_result& e) {
    if (path_.empty()) {
      return;
    }
    if (csv_) {
      out_ << e.epoch << ',' << e.step << ',' << e.lr << ',' << e.train_loss << ',' << e.test.loss
           << ',' << e.test.top1 << ',' << e.test.top5 << ',' << e.seconds << ','
           << e.samples_per_second << '\n';
    } else {
      out_ << nlohmann::json{{"epoch", e.epoch},
                             {"step", e.step},
                             {"lr", e.lr},
                             {"train_loss", e.train_loss},
                             {"test_loss", e.test.loss},
                             {"top1", e.test.top1},
                             {"top5", e.test.top5},
                             {"seconds", e.seconds},
                             {"samples_per_second", e.samples_per_second}}
                .dump()
           << '\n';
    }
    out_.flush();
  }

private:
  std::string path_;
  bool csv_ = false;
  std::ofstream out_;
};

} // namespace

double cosine_schedule::at(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) {
    return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  }
  auto span = std::max<int64_t>(1, total_steps - warmup_steps);
  auto progress =
    std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(span));
  return min_lr + 0.5 * (base_lr - min_lr) * (1 + std::cos(pi * progress));
}

eval_result evaluate(pipeline& pipe, const dataset& data, int64_t batch) {
  ACTORPIPE_CHECK(batch >= 1, "evaluation batch (", batch, ") must be >= 1");
  eval_result r;
  int64_t n = data.size();
  if (n == 0) {
    return r;
  }
  double loss_sum = 0;
  int64_t top1 = 0;
  int64_t top5 = 0;
  for (int64_t begin = 0; begin < n; begin += batch) {
    auto end = std::min(n, begin + batch);
    auto x = data.images.slice(0, begin, end);
    auto y = data.labels.slice(0, begin, end);
    auto logits = pipe.forward(x);
    loss_sum +=
      torch::nn::functional::cross_entropy(
        logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
        .item<double>();
    auto k = std::min<int64_t>(5, logits.size(1));
    auto best = std::get<1>(logits.topk(k, 1));
    auto hits = best.eq(y.unsqueeze(1));
    top1 += hits.select(1, 0).sum().item<int64_t>();
    top5 += hits.any(1).sum().item<int64_t>();
  }
  r.loss = loss_sum / static_cast<double>(n);
  r.top1 = static_cast<double>(top1) / static_cast<double>(n);
  r.top5 = static_cast<double>(top5) / static_cast<double>(n);
  return r;
}

train_report train_classifier(pipeline& pipe, const dataset& train, const dataset& test,
                              const train_options& o) {
  ACTORPIPE_CHECK(o.epochs >= 1, "epochs (", o.epochs, ") must be >= 1");
  ACTORPIPE_CHECK(o.batch >= 1, "batch (", o.batch, ") must be >= 1");
  ACTORPIPE_CHECK(o.lr > 0, "learning rate (", o.lr, ") must be > 0");
  ACTORPIPE_CHECK(o.replicas >= 1 && o.rank >= 0 && o.rank < o.replicas, "rank ", o.rank, " of ",
                  o.replicas, " replicas");
  ACTORPIPE_CHECK(o.batch % o.replicas == 0, "batch (", o.batch, ") must be a multiple of the ",
                  o.replicas, " replicas");
  const bool lead = o.rank == 0;
  const int64_t local_batch = o.batch / o.replicas;
  const int64_t shard = (train.size() + o.replicas - 1) / o.replicas;
  const int64_t steps_per_epoch = shard / local_batch;
  ACTORPIPE_CHECK(steps_per_epoch >= 1, "the training set (", train.size(),
                  " samples) is smaller than one batch (", o.batch, ")");
  cosine_schedule lr{o.lr, o.min_lr, o.warmup_steps, o.epochs * steps_per_epoch};

  uint64_t step = 0;
  int64_t first_epoch = 0;
  int64_t first_batch = 0;
  if (!o.resume.empty()) {
    auto dir = find_checkpoint(o.resume);
    auto m = read_manifest(dir);
    ACTORPIPE_CHECK(m.model == o.model, "checkpoint '", dir, "' is of model '", m.model, "', not '",
                    o.model, "'");
    ACTORPIPE_CHECK(m.batch_size == o.batch && m.seed == o.seed && m.dataset == o.dataset,
                    "checkpoint '", dir, "' was written with batch ", m.batch_size, ", seed ",
                    m.seed, ", data ", m.dataset, "; this run has batch ", o.batch, ", seed ",
                    o.seed, ", data ", o.dataset, ": resuming would not continue the same run");
    pipe.load_state(dir);
    step = m.step;
    first_epoch = m.epoch;
    first_batch = m.batch_in_epoch;
    if (lead)
      std::cerr << "resumed from " << dir << " at step " << step << " (epoch " << m.epoch + 1
                << ", batch " << m.batch_in_epoch << ")\n";
  }

  metrics_writer metrics(lead ? o.metrics : std::string{});
  train_report report;
  auto manifest_at = [&](int64_t epoch, int64_t next_batch) {
    checkpoint_manifest m;
    m.model = o.model;
    m.bounds = pipe.cut().bounds;
    m.step = step;
    m.epoch = epoch;
    m.batch_in_epoch = next_batch;
    m.seed = o.seed;
    m.batch_size = o.batch;
    m.dataset = o.dataset;
    return m;
  };
  auto checkpoint = [&](int64_t epoch, int64_t next_batch) {
    if (lead && !o.checkpoint_dir.empty()) {
      write_checkpoint(pipe, o.checkpoint_dir, manifest_at(epoch, next_batch), o.keep);
    }
  };

  for (int64_t epoch = first_epoch; epoch < o.epochs; ++epoch) {
    auto order = o.replicas == 1
                   ? epoch_order(train.size(), o.seed, epoch)
                   : distributed_order(train.size(), o.seed, epoch, o.rank, o.replicas);
    training::progress_bar bar(detail::concat("epoch ", epoch + 1, "/", o.epochs),
                               steps_per_epoch * o.batch);
    double loss_sum = 0;
    int64_t loss_count = 0;
    int64_t start_batch = epoch == first_epoch ? first_batch : 0;
    for (int64_t b = start_batch; b < steps_per_epoch; ++b) {
      auto index = order.slice(0, b * local_batch, (b + 1) * local_batch);
      auto current_lr = lr.at(static_cast<int64_t>(step));
      pipe.set_learning_rate(current_lr);
      auto r =
        pipe.train_step(train.images.index_select(0, index), train.labels.index_select(0, index));
      ++step;
      report.steps.emplace_back(step, r.loss);
      loss_sum += r.loss;
      ++loss_count;
      if (o.progress && lead) {
        auto done = (b + 1 - start_batch) * o.batch;
        bar.update((b + 1) * o.batch,
                   detail::concat(static_cast<int64_t>(static_cast<double>(done) /
                                                       std::max(1e-9, bar.elapsed_seconds())),
                                  " samples/s, loss ", loss_sum / static_cast<double>(loss_count)));
      }
      bool stop = o.max_steps > 0 && step >= static_cast<uint64_t>(o.max_steps);
      if (stop ||
          (o.checkpoint_every > 0 && step % static_cast<uint64_t>(o.checkpoint_every) == 0)) {
        checkpoint(epoch, b + 1);
      }
      if (stop) {
        return report;
      }
    }
    epoch_result e;
    e.epoch = epoch + 1;
    e.step = step;
    e.lr = lr.at(static_cast<int64_t>(step) - 1);
    e.train_loss = loss_count > 0 ? loss_sum / static_cast<double>(loss_count) : 0;
    e.seconds = bar.elapsed_seconds();
    e.samples_per_second = static_cast<double>(loss_count * o.batch) / std::max(1e-9, e.seconds);
    if (!lead) {
      report.epochs.push_back(e);
      continue;
    }
    e.test = evaluate(pipe, test, o.eval_batch);
    std::cout << "epoch " << e.epoch << "/" << o.epochs << "  train loss " << e.train_loss
              << "  test loss " << e.test.loss << "  top-1 " << e.test.top1 << "  top-5 "
              << e.test.top5 << "  " << static_cast<int64_t>(e.samples_per_second) << " samples/s\n"
              << std::flush;
    metrics.write(e);
    report.epochs.push_back(e);
    if (epoch + 1 == o.epochs) {
      checkpoint(epoch + 1, 0);
    }
  }
  return report;
}

} // namespace actorpipe
