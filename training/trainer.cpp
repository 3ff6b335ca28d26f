#include <actorpipe/training.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <fstream>
#include <future>
#include <iomanip>
#include <iostream>
#include <map>

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
      out_ << "epoch,step,lr,train_loss,test_loss,top1,top5,seconds,samples_per_second,bits\n";
    }
  }

  void write(const epoch_result& e) {
    if (path_.empty()) {
      return;
    }
    if (csv_) {
      out_ << e.epoch << ',' << e.step << ',' << e.lr << ',' << e.train_loss << ',' << e.test.loss
           << ',' << e.test.top1 << ',' << e.test.top5 << ',' << e.seconds << ','
           << e.samples_per_second << ',' << e.test.bits << '\n';
    } else {
      out_ << nlohmann::json{{"epoch", e.epoch},
                             {"step", e.step},
                             {"lr", e.lr},
                             {"train_loss", e.train_loss},
                             {"test_loss", e.test.loss},
                             {"top1", e.test.top1},
                             {"top5", e.test.top5},
                             {"seconds", e.seconds},
                             {"samples_per_second", e.samples_per_second},
                             {"bits", e.test.bits}}
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
  int64_t count = 0;
  for (int64_t begin = 0; begin < n; begin += batch) {
    auto end = std::min(n, begin + batch);
    auto x = data.images.slice(0, begin, end);
    auto y = data.labels.slice(0, begin, end);
    auto logits = pipe.forward(x);
    if (logits.dim() == 3) {
      // A language model: every position predicts its next token.
      r.tokens = true;
      logits = logits.flatten(0, 1);
      y = y.flatten();
    }
    count += y.size(0);
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
  r.loss = loss_sum / static_cast<double>(count);
  r.top1 = static_cast<double>(top1) / static_cast<double>(count);
  r.top5 = static_cast<double>(top5) / static_cast<double>(count);
  r.bits = r.loss / std::log(2.0);
  return r;
}

torch::Tensor augment_images(const torch::Tensor& images, const image_augmentation& a,
                             at::Generator& generator) {
  ACTORPIPE_CHECK(images.dim() == 4, "augment_images: images must be [N, C, H, W], not ",
                  images.sizes());
  ACTORPIPE_CHECK(a.pad >= 0, "augment_images: pad (", a.pad, ") must be >= 0");
  const auto n = images.size(0);
  const auto h = images.size(2);
  const auto w = images.size(3);
  auto out = images;
  if (a.pad > 0) {
    const auto p = a.pad;
    // Each image padded with its own darkest value (Fashion-MNIST's background), then cropped.
    auto floor = images.amin({1, 2, 3}, true);
    auto padded = floor.expand({n, images.size(1), h + 2 * p, w + 2 * p}).clone();
    padded.slice(2, p, p + h).slice(3, p, p + w).copy_(images);
    auto offsets = torch::randint(2 * p + 1, {n, 2}, generator, torch::kLong);
    auto o = offsets.accessor<int64_t, 2>();
    out = torch::empty_like(images);
    for (int64_t i = 0; i < n; ++i) {
      out[i].copy_(padded[i].slice(1, o[i][0], o[i][0] + h).slice(2, o[i][1], o[i][1] + w));
    }
  }
  if (a.flip) {
    auto mirror = torch::rand({n}, generator).lt(0.5).view({n, 1, 1, 1});
    out = torch::where(mirror, out.flip({3}), out);
  }
  return out.is_same(images) ? images.clone() : out;
}

dataset_source::dataset_source(std::string name, dataset train, dataset test)
  : name_(std::move(name)), train_(std::move(train)), test_(std::move(test)) {}

void dataset_source::set_augmentation(image_augmentation augmentation) {
  ACTORPIPE_CHECK(augmentation.pad >= 0, name_, ": augmentation pad (", augmentation.pad,
                  ") must be >= 0");
  ACTORPIPE_CHECK(!augmentation.any() || train_.images.dim() == 4, name_,
                  ": only images [N, C, H, W] can be augmented, not ", train_.images.sizes());
  augmentation_ = augmentation;
}

std::pair<torch::Tensor, torch::Tensor> dataset_source::batch(int64_t epoch, int64_t index,
                                                              int64_t batch, uint64_t seed,
                                                              int64_t rank,
                                                              int64_t replicas) const {
  // The order of an epoch is drawn once and reused for its batches.
  if (order_epoch_ != epoch || !order_.defined()) {
    order_ = replicas == 1 ? epoch_order(train_.size(), seed, epoch)
                           : distributed_order(train_.size(), seed, epoch, rank, replicas);
    order_epoch_ = epoch;
  }
  auto local = batch / replicas;
  auto index_range = order_.slice(0, index * local, (index + 1) * local);
  auto x = train_.images.index_select(0, index_range);
  if (augmentation_.any()) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(
      ((seed * 1000003ULL + static_cast<uint64_t>(epoch)) * 1000003ULL +
       static_cast<uint64_t>(index)) *
        1009ULL +
      static_cast<uint64_t>(rank) + 7);
    x = augment_images(x, augmentation_, gen);
  }
  return {x, train_.labels.index_select(0, index_range)};
}

std::optional<eval_result> dataset_source::evaluate(pipeline& pipe, int64_t batch) const {
  return actorpipe::evaluate(pipe, test_, batch);
}

namespace {

// A stream's batch `index` is drawn from a generator of its own, seeded by (seed, index) alone.
at::Generator step_generator(uint64_t seed, int64_t index) {
  return at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + static_cast<uint64_t>(index) +
                                                  1);
}

// Every rank draws the whole batch and takes its part.
std::pair<torch::Tensor, torch::Tensor> rank_part(torch::Tensor x, torch::Tensor y, int64_t rank,
                                                  int64_t replicas) {
  if (replicas > 1) {
    x = torch::tensor_split(x, replicas, 0).at(static_cast<std::size_t>(rank));
    y = torch::tensor_split(y, replicas, 0).at(static_cast<std::size_t>(rank));
  }
  return {x, y};
}

} // namespace

synthetic_source::synthetic_source(int64_t channels, int64_t side, int64_t classes)
  : channels_(channels), side_(side), classes_(classes) {
  ACTORPIPE_CHECK(channels >= 1 && side >= 1 && classes >= 1, "synthetic data: channels (",
                  channels, "), side (", side, ") and classes (", classes, ") must be >= 1");
}

std::pair<torch::Tensor, torch::Tensor> synthetic_source::batch(int64_t, int64_t index,
                                                                int64_t batch, uint64_t seed,
                                                                int64_t rank,
                                                                int64_t replicas) const {
  auto gen = step_generator(seed, index);
  auto x = torch::randn({batch, channels_, side_, side_}, gen, torch::TensorOptions());
  auto labels = torch::randint(classes_, {batch}, gen, torch::kLong);
  auto y = torch::nn::functional::one_hot(labels, classes_).to(torch::kFloat);
  return rank_part(x, y, rank, replicas);
}

tensor_file_source::tensor_file_source(std::string path, dataset data, bool shuffle)
  : path_(std::move(path)), data_(std::move(data)), shuffle_(shuffle) {
  ACTORPIPE_CHECK(data_.size() > 0, "tensors:", path_, " holds no samples");
}

std::pair<torch::Tensor, torch::Tensor> tensor_file_source::batch(int64_t, int64_t index,
                                                                  int64_t batch, uint64_t seed,
                                                                  int64_t rank,
                                                                  int64_t replicas) const {
  const auto n = data_.size();
  auto positions = torch::arange(index * batch, (index + 1) * batch, torch::kLong);
  auto rows = positions.remainder(n);
  if (shuffle_) {
    // Each pass over the file in its own order; a batch may straddle two passes.
    auto passes = positions.div(n, "floor");
    const int64_t first = index * batch / n;
    const int64_t last = ((index + 1) * batch - 1) / n;
    for (int64_t pass = first; pass <= last; ++pass) {
      auto mask = passes.eq(pass);
      rows.masked_scatter_(mask, epoch_order(n, seed, pass).index({rows.masked_select(mask)}));
    }
  }
  return rank_part(data_.images.index({rows}), data_.labels.index({rows}), rank, replicas);
}

synthetic_tokens_source::synthetic_tokens_source(int64_t vocabulary, int64_t context)
  : vocabulary_(vocabulary), context_(context) {
  ACTORPIPE_CHECK(vocabulary >= 2 && context >= 1, "synthetic tokens: vocabulary (", vocabulary,
                  ") must be >= 2 and context (", context, ") >= 1");
}

std::pair<torch::Tensor, torch::Tensor> synthetic_tokens_source::batch(int64_t, int64_t index,
                                                                       int64_t batch, uint64_t seed,
                                                                       int64_t rank,
                                                                       int64_t replicas) const {
  auto gen = step_generator(seed, index);
  auto start = torch::randint(vocabulary_, {batch, 1}, gen, torch::kLong);
  auto stride = torch::randint(1, vocabulary_, {batch, 1}, gen, torch::kLong);
  auto positions = torch::arange(context_ + 1, torch::kLong).unsqueeze(0);
  auto sequence = (start + stride * positions).remainder(vocabulary_);
  return rank_part(sequence.slice(1, 0, context_).contiguous(),
                   sequence.slice(1, 1, context_ + 1).contiguous(), rank, replicas);
}

std::string generate_text(pipeline& pipe, const text_corpus& corpus, const std::string& prompt,
                          int64_t length, int64_t context, double temperature, uint64_t seed) {
  ACTORPIPE_CHECK(!prompt.empty(), "generate_text: the prompt is empty");
  ACTORPIPE_CHECK(length >= 0 && context >= 1 && temperature >= 0, "generate_text: length (",
                  length, ") and temperature (", temperature, ") must be >= 0, context (", context,
                  ") >= 1");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto ids = corpus.encode(prompt);
  std::vector<int64_t> tokens(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < length; ++i) {
    auto first = static_cast<int64_t>(tokens.size()) - std::min<int64_t>(context, tokens.size());
    auto window =
      torch::tensor(std::vector<int64_t>(tokens.begin() + first, tokens.end()), torch::kLong)
        .unsqueeze(0);
    auto logits = pipe.forward(window).select(0, 0).select(0, -1).to(torch::kFloat);
    int64_t next = 0;
    if (temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      auto p = (logits / temperature).softmax(0);
      next = torch::multinomial(p, 1, false, gen).item<int64_t>();
    }
    tokens.push_back(next);
  }
  auto all = torch::tensor(tokens, torch::kLong);
  return corpus.decode(all.slice(0, static_cast<int64_t>(ids.numel())));
}

namespace {

// Where a run starts: at the beginning, or where a checkpoint of the same run stopped.
struct start_point {
  uint64_t step = 0;
  int64_t epoch = 0;
  int64_t batch = 0;
};

// One loop trains a pipeline, or replicas in this process (replicated_pipeline) that split each
// batch among themselves: what differs between the two.
pipeline& lead_of(pipeline& pipe) {
  return pipe;
}
pipeline& lead_of(replicated_pipeline& pipe) {
  return pipe.replica(0);
}
void agree(pipeline& pipe, const std::string& what, int64_t value) {
  pipe.replicas_agree(what, value);
}
void agree(replicated_pipeline&, const std::string&, int64_t) {
  // One loop feeds every replica: nothing to agree on.
}
void load(pipeline& pipe, const std::string& dir) {
  pipe.load_state(dir);
}
void load(replicated_pipeline& pipe, const std::string& dir) {
  for (std::size_t r = 0; r < pipe.replicas(); ++r) {
    pipe.replica(r).load_state(dir);
  }
}
// Starts a step; the replicas in this process take theirs one at a time (train refuses
// overlap_steps for them).
std::future<step_result> submit(pipeline& pipe, const torch::Tensor& x, const torch::Tensor& y) {
  return pipe.train_step_async(x, y);
}
std::future<step_result> submit(replicated_pipeline& pipe, const torch::Tensor& x,
                                const torch::Tensor& y) {
  std::promise<step_result> done;
  try {
    done.set_value(pipe.train_step(x, y));
  } catch (...) {
    done.set_exception(std::current_exception());
  }
  return done.get_future();
}
recovery_report recover(pipeline& pipe, const train_options& o) {
  return pipe.recover(o.repartition);
}
recovery_report recover(replicated_pipeline& pipe, const train_options&) {
  return pipe.recover();
}
// The failures a recovery answers: a node lost or silent; with replicas also a replica whose
// partner stage went (its gradients' all-reduce failed).
bool recoverable(const pipeline&, error_kind kind) {
  return kind == error_kind::node_lost || kind == error_kind::timeout;
}
bool recoverable(const replicated_pipeline&, error_kind kind) {
  return kind == error_kind::node_lost || kind == error_kind::timeout ||
         kind == error_kind::replica_failure;
}

// A resumed run with settings other than the checkpoint's goes on (a longer run, another stage
// count and a new learning rate are legitimate), and says what differs. Keys that name the run's
// own extent and outputs are left out.
void warn_of_other_settings(const std::string& dir, const std::string& recorded,
                            const std::string& now) {
  if (recorded.empty() || now.empty()) {
    return;
  }
  auto differences = settings_differences(
    recorded, now,
    {"train.resume", "train.steps", "train.epochs", "train.json", "train.trace", "train.metrics",
     "train.checkpoint-dir", "train.no-progress", "train.sample", "train.export", "log-level"});
  if (differences.empty()) {
    return;
  }
  std::cerr << "warning: resuming from " << dir << " with other settings than it was written with ("
            << dir << "/run.toml):\n";
  for (const auto& d : differences) {
    std::cerr << "  " << d << "\n";
  }
}

template <class Pipe>
start_point resume(Pipe& pipe, const batch_source& data, const train_options& o, bool lead) {
  if (o.resume.empty()) {
    return {};
  }
  auto dir = find_checkpoint(o.resume);
  auto m = read_manifest(dir);
  ACTORPIPE_CHECK(m.model == o.model, "checkpoint '", dir, "' is of model '", m.model, "', not '",
                  o.model, "'");
  ACTORPIPE_CHECK(m.batch_size == o.batch && m.seed == o.seed && m.dataset == data.name(),
                  "checkpoint '", dir, "' was written with batch ", m.batch_size, ", seed ", m.seed,
                  ", data ", m.dataset, "; this run has batch ", o.batch, ", seed ", o.seed,
                  ", data ", data.name(), ": resuming would not continue the same run");
  load(pipe, dir);
  if (lead) {
    std::cerr << "resumed from " << dir << " at step " << m.step << " (epoch " << m.epoch + 1
              << ", batch " << m.batch_in_epoch << ")\n";
    warn_of_other_settings(dir, m.settings, o.settings);
  }
  return {m.step, m.epoch, m.batch_in_epoch};
}

// A lost node: the pipeline recovers (at most o.max_recoveries times in a run), and the run
// forgets what it did after the snapshot it goes back to. `done` steps were complete when the
// next failed.
template <class Pipe>
start_point recover_from(Pipe& pipe, const pipeline_error& failure, const train_options& o,
                         uint64_t done, const std::map<uint64_t, start_point>& snapshots,
                         train_report& report) {
  if (report.recoveries.size() >= o.max_recoveries) {
    throw pipeline_error(detail::concat(failure.what(),
                                        " (no recovery left: ", report.recoveries.size(),
                                        " of at most ", o.max_recoveries, " done)"),
                         failure.details());
  }
  std::cerr << "actorpipe: step " << done + 1 << " failed (" << to_string(failure.kind())
            << (failure.node().empty() ? std::string{} : ", node " + failure.node())
            << "): " << failure.what() << "\n"
            << std::flush;
  auto r = recover(pipe, o);
  // Where in the data the snapshot it restored was taken.
  auto at = snapshots.find(r.snapshot);
  ACTORPIPE_CHECK(at != snapshots.end(), "train: recover() restored snapshot ", r.snapshot,
                  ", which this run did not take");
  const auto& snapshot_at = at->second;
  std::size_t kept = 0;
  while (kept < report.steps.size() && report.steps[kept].first <= snapshot_at.step) {
    ++kept;
  }
  std::vector<uint64_t> replayed;
  for (std::size_t i = kept; i < report.steps.size(); ++i) {
    replayed.push_back(report.steps[i].first);
  }
  report.replayed_steps.insert(report.replayed_steps.end(), replayed.begin(), replayed.end());
  report.steps.resize(kept);
  report.step_ms.resize(std::min(kept, report.step_ms.size()));
  if (o.keep_results) {
    report.results.resize(std::min(kept, report.results.size()));
  }
  // An epoch not finished at the snapshot's position is run (and evaluated) again.
  report.epochs.erase(
    std::remove_if(report.epochs.begin(), report.epochs.end(),
                   [&](const epoch_result& e) { return e.epoch > snapshot_at.epoch; }),
    report.epochs.end());
  auto join = [](const auto& xs) {
    std::string text;
    for (const auto& x : xs) {
      text += (text.empty() ? "" : ", ") + detail::concat(x);
    }
    return text.empty() ? std::string("none") : text;
  };
  std::cerr << "actorpipe: recovery " << report.recoveries.size() + 1 << " of at most "
            << o.max_recoveries << " in " << std::setprecision(3) << r.seconds << " s: lost "
            << join(r.lost) << ", spares used " << join(r.spares_used)
            << (r.replicas_left.empty()
                  ? std::string{}
                  : detail::concat(", replicas left (no spare) ", join(r.replicas_left)))
            << "; now "
            << (r.replicas > 1 || !r.replicas_left.empty()
                  ? detail::concat(r.replicas, " replica", r.replicas == 1 ? "" : "s", " of ")
                  : std::string{})
            << r.nodes.size() / r.replicas << " stages on " << join(r.nodes) << ", cut "
            << partition{r.bounds}.to_string() << "; restored "
            << (r.snapshot == 0 ? std::string("the run's starting state")
                                : detail::concat("snapshot ", r.snapshot))
            << " (step " << snapshot_at.step << "), replaying " << replayed.size() << " step"
            << (replayed.size() == 1 ? "" : "s") << "\n"
            << std::flush;
  report.recoveries.push_back(std::move(r));
  return snapshot_at;
}

template <class Pipe>
train_report train_loop(Pipe& pipe, const batch_source& data, const train_options& o) {
  ACTORPIPE_CHECK(o.epochs >= 1, "epochs (", o.epochs, ") must be >= 1");
  ACTORPIPE_CHECK(o.batch >= 1, "batch (", o.batch, ") must be >= 1");
  ACTORPIPE_CHECK(o.lr > 0, "learning rate (", o.lr, ") must be > 0");
  ACTORPIPE_CHECK(o.min_lr >= 0 && o.min_lr <= o.lr, "min_lr (", o.min_lr,
                  ") must be between 0 and the learning rate (", o.lr, ")");
  ACTORPIPE_CHECK(o.max_steps >= 0, "max_steps (", o.max_steps, ") must be >= 0");
  ACTORPIPE_CHECK(o.replicas >= 1 && o.rank >= 0 && o.rank < o.replicas, "rank ", o.rank, " of ",
                  o.replicas, " replicas");
  ACTORPIPE_CHECK(o.batch % o.replicas == 0, "batch (", o.batch, ") must be a multiple of the ",
                  o.replicas, " replicas");
  ACTORPIPE_CHECK(!o.recover_lost_nodes || (o.snapshot_every >= 1 && o.max_recoveries >= 1),
                  "recovering lost nodes needs snapshot_every (", o.snapshot_every,
                  ") and max_recoveries (", o.max_recoveries, ") >= 1");
  const bool lead = o.rank == 0;
  const bool stream = data.epoch_samples() == 0;
  ACTORPIPE_CHECK(!stream || o.max_steps > 0, data.name(),
                  " data is an endless stream: say how many steps to train (max_steps, --steps)");
  const int64_t local_batch = o.batch / o.replicas;
  // A stream's run is one "epoch" of max_steps steps.
  const int64_t steps_per_epoch =
    stream ? o.max_steps : ((data.epoch_samples() + o.replicas - 1) / o.replicas) / local_batch;
  const int64_t epochs = stream ? 1 : o.epochs;
  ACTORPIPE_CHECK(steps_per_epoch >= 1, "the training set (", data.epoch_samples(),
                  " samples) is smaller than one batch (", o.batch, ")");
  const int64_t total_steps =
    o.max_steps > 0 ? std::min(o.max_steps, epochs * steps_per_epoch) : epochs * steps_per_epoch;
  cosine_schedule lr{o.lr, o.min_lr, o.warmup_steps, epochs * steps_per_epoch};
  auto start = resume(pipe, data, o, lead);
  // Every rank resumed from the same step, or none goes on (a rank that read another folder).
  agree(pipe, "the step to resume from", static_cast<int64_t>(start.step));
  uint64_t step = start.step;
  metrics_writer metrics(lead ? o.metrics : std::string{});
  train_report report;
  auto checkpoint = [&](int64_t epoch, int64_t next_batch) {
    if (o.checkpoint_dir.empty()) {
      return;
    }
    // BMUF: a checkpoint holds the replicas' common parameters, so a resume is exact.
    pipe.end_block();
    if (!lead) {
      return;
    }
    checkpoint_manifest m;
    m.model = o.model;
    m.bounds = lead_of(pipe).cut().bounds;
    m.step = step;
    m.epoch = epoch;
    m.batch_in_epoch = next_batch;
    m.seed = o.seed;
    m.batch_size = o.batch;
    m.dataset = data.name();
    m.settings = o.settings;
    write_checkpoint(lead_of(pipe), o.checkpoint_dir, m, o.keep);
  };
  // The ranks meet at each epoch's end (rank 0 after its evaluation), as the DDP script's barrier.
  auto end_of_epoch = [&](int64_t epoch) {
    agree(pipe, detail::concat("the end of epoch ", epoch), epoch);
  };
  // Lost nodes: the newest snapshot's position in the data, where a recovered run goes on; the
  // first is the run's start (whatever the pipeline did before train()).
  // Snapshots by number: where in the data each was taken.
  std::map<uint64_t, start_point> snapshots;
  if (o.recover_lost_nodes) {
    snapshots[pipe.snapshot()] = start;
  }
  // What the loop does after step n (counted from 1): stop, checkpoint on schedule, snapshot.
  auto stops_after = [&](uint64_t n) {
    return o.max_steps > 0 && n >= static_cast<uint64_t>(o.max_steps);
  };
  auto checkpoints_after = [&](uint64_t n) {
    return o.checkpoint_every > 0 && n % static_cast<uint64_t>(o.checkpoint_every) == 0;
  };
  auto snapshots_after = [&](uint64_t n) {
    return o.recover_lost_nodes && n % static_cast<uint64_t>(o.snapshot_every) == 0;
  };
  auto take_snapshot = [&](int64_t epoch, int64_t next_batch) {
    if (!snapshots_after(step)) {
      return;
    }
    auto number = o.snapshot_in_background ? pipe.snapshot_in_background() : pipe.snapshot();
    snapshots[number] = {step, epoch, next_batch};
  };
  auto run_from = [&](const start_point& from) {
    for (int64_t epoch = from.epoch; epoch < epochs; ++epoch) {
      auto label = stream ? std::string("steps") : detail::concat("epoch ", epoch + 1, "/", epochs);
      training::progress_bar bar(label, steps_per_epoch * o.batch);
      double loss_sum = 0;
      int64_t loss_count = 0;
      int64_t start_batch = epoch == from.epoch ? from.batch : 0;
      bool stopped = false;
      // Overlapping steps (train_options::overlap_steps): the step submitted behind the running
      // one, with its batch's index and how long its data took.
      struct in_flight {
        std::future<step_result> result;
        int64_t b;
        double waited;
      };
      std::deque<in_flight> flying;
      // Finishes the oldest step in flight (its log, checkpoint and snapshot); whether the run
      // stops there.
      auto complete = [&]() -> bool {
        auto f = std::move(flying.front());
        flying.pop_front();
        const auto b = f.b;
        auto r = f.result.get();
        r.data_wait_ms = f.waited;
        ++step;
        report.steps.emplace_back(step, r.loss);
        report.step_ms.push_back(r.wall_ms);
        loss_sum += r.loss;
        ++loss_count;
        if (o.log_steps && lead) {
          std::cout << "step " << step << "/" << total_steps << "  loss " << std::setprecision(9)
                    << r.loss << "  time " << std::setprecision(4) << r.wall_ms / 1000.0 << " s\n"
                    << std::flush;
        }
        if (o.keep_results) {
          report.results.push_back(std::move(r));
        }
        if (o.progress && lead) {
          auto done = (b + 1 - start_batch) * o.batch;
          bar.update((b + 1) * o.batch,
                     detail::concat(static_cast<int64_t>(static_cast<double>(done) /
                                                         std::max(1e-9, bar.elapsed_seconds())),
                                    " samples/s, loss ",
                                    loss_sum / static_cast<double>(loss_count)));
        }
        bool stop = stops_after(step);
        bool last = b + 1 == steps_per_epoch && epoch + 1 == epochs;
        if ((stop && !last) || checkpoints_after(step)) {
          checkpoint(epoch, b + 1);
        }
        take_snapshot(epoch, b + 1);
        return stop && !last;
      };
      for (int64_t b = start_batch; b < steps_per_epoch; ++b) {
        const auto submitted = step + flying.size();
        if (stops_after(submitted)) {
          stopped = true;
          break;
        }
        auto asked = std::chrono::steady_clock::now();
        auto [x, y] = data.batch(epoch, b, o.batch, o.seed, o.rank, o.replicas);
        const double waited =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - asked)
            .count();
        report.data_wait_seconds += waited / 1000.0;
        auto current_lr = o.cosine ? lr.at(static_cast<int64_t>(submitted)) : o.lr;
        pipe.set_learning_rate(current_lr);
        flying.push_back({submit(pipe, x, y), b, waited});
        // A step after which the loop checkpoints, snapshots, stops or ends the epoch finishes
        // before the next is submitted (which would run before the checkpoint).
        const auto after = submitted + 1;
        bool alone = !o.overlap_steps || b + 1 == steps_per_epoch || stops_after(after) ||
                     checkpoints_after(after) || snapshots_after(after);
        bool stop = false;
        while (!stop && flying.size() > (alone ? 0U : 1U)) {
          stop = complete();
        }
        if (stop) {
          stopped = true;
          break;
        }
      }
      if (stopped && !stream) {
        // Stopped inside an epoch: no epoch result, the checkpoint holds the position.
        return;
      }
      epoch_result e;
      e.epoch = epoch + 1;
      e.step = step;
      e.lr = o.cosine ? lr.at(static_cast<int64_t>(step) - 1) : o.lr;
      e.train_loss = loss_count > 0 ? loss_sum / static_cast<double>(loss_count) : 0;
      e.seconds = bar.elapsed_seconds();
      e.samples_per_second = static_cast<double>(loss_count * o.batch) / std::max(1e-9, e.seconds);
      // BMUF: rank 0 evaluates the replicas' common parameters.
      pipe.end_block();
      if (!lead) {
        report.epochs.push_back(e);
        end_of_epoch(e.epoch);
        continue;
      }
      if (auto test = data.evaluate(lead_of(pipe), o.eval_batch)) {
        e.test = *test;
        std::cout << "epoch " << e.epoch << "/" << epochs << "  train loss " << e.train_loss;
        if (e.test.tokens) {
          std::cout << "  validation loss " << e.test.loss << "  bits/char " << e.test.bits
                    << "  top-1 " << e.test.top1;
        } else {
          std::cout << "  test loss " << e.test.loss << "  top-1 " << e.test.top1 << "  top-5 "
                    << e.test.top5;
        }
        std::cout << "  " << static_cast<int64_t>(e.samples_per_second) << " samples/s\n"
                  << std::flush;
      }
      metrics.write(e);
      report.epochs.push_back(e);
      end_of_epoch(e.epoch);
      if (epoch + 1 == epochs) {
        // The end of the run: a stream's position is its step.
        checkpoint(stream ? 0 : epoch + 1, stream ? static_cast<int64_t>(step) : 0);
      }
    }
  };
  for (;;) {
    try {
      run_from(start);
      return report;
    } catch (const pipeline_error& e) {
      if (!o.recover_lost_nodes || !recoverable(pipe, e.kind())) {
        throw;
      }
      // Replay from the snapshot: the steps taken since it are forgotten, as in a resumed run.
      start = recover_from(pipe, e, o, step, snapshots, report);
    }
    step = start.step;
  }
}

} // namespace

train_report train(pipeline& pipe, const batch_source& data, const train_options& o) {
  return train_loop(pipe, data, o);
}

train_report train(replicated_pipeline& pipe, const batch_source& data, const train_options& o) {
  ACTORPIPE_CHECK(o.rank == 0 && o.replicas == 1,
                  "train: replicas in this process take each "
                  "batch whole and split it themselves; train_options rank (",
                  o.rank, ") and replicas (", o.replicas, ") are for one replica per process");
  ACTORPIPE_CHECK(!o.repartition,
                  "train: replicas keep their cut when a node is lost (a spare "
                  "takes its stages, or its replica leaves); train_options::repartition is for "
                  "one pipeline");
  ACTORPIPE_CHECK(!o.overlap_steps, "train: replicas in this process take one step at a time; "
                                    "train_options::overlap_steps is for one pipeline");
  return train_loop(pipe, data, o);
}

train_report train_classifier(pipeline& pipe, const dataset& train_set, const dataset& test_set,
                              const train_options& options) {
  return train(pipe, dataset_source(options.dataset, train_set, test_set), options);
}

} // namespace actorpipe
