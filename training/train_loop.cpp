// train(): the training loop over a pipeline or in-process replicas (training_run), with what
// it does around steps: resuming from a checkpoint, checkpoints and snapshots on schedule,
// per-epoch metrics; what it does about a failed step is run_faults.hpp's.
#include <actorpipe/training.hpp>

#include <algorithm>
#include <chrono>
#include <deque>
#include <fstream>
#include <future>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <type_traits>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "training/batches_ahead.hpp"
#include "training/progress.hpp"
#include "training/run_faults.hpp"
#include "training/stragglers.hpp"

namespace actorpipe {
namespace {

using training::failed_at;
using training::join;
using training::print_step_line;
using training::recover_from;
using training::start_point;

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
     "train.checkpoint-dir", "train.no-progress", "train.sample", "train.export",
     "train.save-safetensors", "train.max-shard-size", "log-level"});
  if (differences.empty()) {
    return;
  }
  std::cerr << "warning: resuming from " << dir << " with other settings than it was written with ("
            << dir << "/run.toml):\n";
  for (const auto& d : differences) {
    std::cerr << "  " << d << "\n";
  }
}

// The note a snapshot is kept with on the nodes: where in the data it was taken, and the run.
std::string snapshot_note(const start_point& at, const train_options& o, const batch_source& data) {
  return nlohmann::json{{"step", at.step},       {"epoch", at.epoch},     {"batch", at.batch},
                        {"model", o.model},      {"batch_size", o.batch}, {"seed", o.seed},
                        {"dataset", data.name()}}
    .dump();
}

// --resume nodes: the run goes on from the snapshot its nodes keep (its driver died).
start_point resume_from_nodes(pipeline& pipe, const batch_source& data, const train_options& o) {
  auto kept = pipe.kept_on_nodes();
  auto note = nlohmann::json::parse(kept.note, nullptr, false);
  ACTORPIPE_CHECK(note.is_object() && note.contains("step") && note.contains("epoch") &&
                    note.contains("batch"),
                  "--resume nodes: the nodes keep snapshot ", kept.number,
                  ", which train() did not take (its note: '", kept.note, "')");
  start_point at{note["step"].get<uint64_t>(), note["epoch"].get<int64_t>(),
                 note["batch"].get<int64_t>()};
  ACTORPIPE_CHECK(note.value("model", std::string{}) == o.model &&
                    note.value("batch_size", int64_t{0}) == o.batch &&
                    note.value("seed", uint64_t{0}) == o.seed &&
                    note.value("dataset", std::string{}) == data.name(),
                  "--resume nodes: the nodes keep snapshot ", kept.number, " of another run (",
                  kept.note, "); this run has model '", o.model, "', batch ", o.batch, ", seed ",
                  o.seed, ", data ", data.name());
  pipe.restore_from_nodes(kept);
  std::cerr << "resumed from the nodes' snapshot " << kept.number << " at step " << at.step
            << " (epoch " << at.epoch + 1 << ", batch " << at.batch << "), " << kept.nodes.size()
            << " stages on " << join(kept.nodes) << ", cut " << partition{kept.bounds}.to_string()
            << "\n";
  return at;
}
start_point resume_from_nodes(replicated_pipeline&, const batch_source&, const train_options&) {
  throw invalid_argument("--resume nodes: replicas do not resume from their nodes' snapshots "
                         "yet; resume them from a checkpoint folder (--checkpoint-dir)");
}

template <class Pipe>
start_point resume(Pipe& pipe, const batch_source& data, const train_options& o, bool lead) {
  if (o.resume.empty()) {
    return {};
  }
  if (o.resume == "nodes") {
    return resume_from_nodes(pipe, data, o);
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

// The training loop of one pipeline, or of replicas in this process: epochs of steps (or a
// stream's steps), the learning-rate schedule, checkpoints, snapshots, evaluation at each
// epoch's end, and recovery from a lost node, in named steps.
template <class Pipe>
class training_run {
public:
  training_run(Pipe& pipe, const batch_source& data, const train_options& o)
    : pipe_(pipe), data_(data), o_(o), lead_(o.rank == 0), stream_(data.epoch_samples() == 0) {
    check(o, data);
    // A stream's run is one "epoch" of max_steps steps.
    const int64_t local_batch = o.batch / o.replicas;
    steps_per_epoch_ =
      stream_ ? o.max_steps : ((data.epoch_samples() + o.replicas - 1) / o.replicas) / local_batch;
    epochs_ = stream_ ? 1 : o.epochs;
    ACTORPIPE_CHECK(steps_per_epoch_ >= 1, "the training set (", data.epoch_samples(),
                    " samples) is smaller than one batch (", o.batch, ")");
    total_steps_ = o.max_steps > 0 ? std::min(o.max_steps, epochs_ * steps_per_epoch_)
                                   : epochs_ * steps_per_epoch_;
    lr_ = cosine_schedule{o.lr, o.min_lr, o.warmup_steps, epochs_ * steps_per_epoch_};
  }

  train_report run() {
    auto start = resume(pipe_, data_, o_, lead_);
    // Every rank resumed from the same step, or none goes on (a rank that read another folder).
    agree(pipe_, "the step to resume from", static_cast<int64_t>(start.step));
    step_ = start.step;
    metrics_ = std::make_unique<metrics_writer>(lead_ ? o_.metrics : std::string{});
    // Lost nodes: the newest snapshot's position in the data, where a recovered run goes on; the
    // first is the run's start (whatever the pipeline did before train()).
    if (o_.recover_lost_nodes) {
      snapshots_[pipe_.snapshot(snapshot_note(start, o_, data_))] = start;
    }
    position_ = start;
    for (;;) {
      try {
        run_from(start);
        if (o_.recover_lost_nodes) {
          // The last snapshot arrives, and the nodes keep it (--resume nodes).
          pipe_.newest_snapshot();
        }
        return std::move(report_);
      } catch (const pipeline_error& e) {
        if (!training::recovers_from(o_, e, std::is_same_v<Pipe, replicated_pipeline>)) {
          throw;
        }
        // Replay from the snapshot: the steps taken since it are forgotten, as in a resumed run.
        start =
          recover_from(pipe_, e, o_, {step_, position_, next_position(position_), total_steps_},
                       snapshots_, report_);
        position_ = start;
      }
      step_ = start.step;
    }
  }

private:
  static void check(const train_options& o, const batch_source& data) {
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
    ACTORPIPE_CHECK(data.epoch_samples() != 0 || o.max_steps > 0, data.name(),
                    " data is an endless stream: say how many steps to train (max_steps, --steps)");
  }

  // What the loop does after step n (counted from 1): stop, checkpoint on schedule, snapshot.
  bool stops_after(uint64_t n) const {
    return o_.max_steps > 0 && n >= static_cast<uint64_t>(o_.max_steps);
  }
  bool checkpoints_after(uint64_t n) const {
    return o_.checkpoint_every > 0 && n % static_cast<uint64_t>(o_.checkpoint_every) == 0;
  }
  bool snapshots_after(uint64_t n) const {
    return o_.recover_lost_nodes && n % static_cast<uint64_t>(o_.snapshot_every) == 0;
  }

  void checkpoint(int64_t epoch, int64_t next_batch) {
    if (o_.checkpoint_dir.empty()) {
      return;
    }
    // BMUF: a checkpoint holds the replicas' common parameters, so a resume is exact.
    pipe_.end_block();
    if (!lead_) {
      return;
    }
    checkpoint_manifest m;
    m.model = o_.model;
    m.bounds = lead_of(pipe_).cut().bounds;
    m.step = step_;
    m.epoch = epoch;
    m.batch_in_epoch = next_batch;
    m.seed = o_.seed;
    m.batch_size = o_.batch;
    m.dataset = data_.name();
    m.settings = o_.settings;
    write_checkpoint(lead_of(pipe_), o_.checkpoint_dir, m, o_.keep);
  }

  // Snapshots by number: where in the data each was taken.
  void take_snapshot(const start_point& at) {
    if (!snapshots_after(step_)) {
      return;
    }
    auto note = snapshot_note(at, o_, data_);
    auto number =
      o_.snapshot_in_background ? pipe_.snapshot_in_background(note) : pipe_.snapshot(note);
    snapshots_[number] = at;
  }

  // The ranks meet at each epoch's end (rank 0 after its evaluation), as the DDP script's barrier.
  void end_of_epoch(int64_t epoch) {
    agree(pipe_, detail::concat("the end of epoch ", epoch), epoch);
  }

  // One epoch's running state. Overlapping steps (train_options::overlap_steps): the step
  // submitted behind the running one, with its batch's index and how long its data took.
  struct in_flight {
    std::future<step_result> result;
    int64_t b;
    double waited;
  };
  struct epoch_state {
    epoch_state(int64_t epoch_, int64_t start_batch_, const std::string& label, int64_t samples)
      : epoch(epoch_), start_batch(start_batch_), bar(label, samples) {}
    int64_t epoch;
    int64_t start_batch;
    training::progress_bar bar;
    double loss_sum = 0;
    int64_t loss_count = 0;
    std::deque<in_flight> flying;
  };

  void run_from(const start_point& from) {
    for (int64_t epoch = from.epoch; epoch < epochs_; ++epoch) {
      auto label =
        stream_ ? std::string("steps") : detail::concat("epoch ", epoch + 1, "/", epochs_);
      epoch_state e(epoch, epoch == from.epoch ? from.batch : 0, label,
                    steps_per_epoch_ * o_.batch);
      bool stopped = run_epoch(e);
      if (stopped && !stream_) {
        // Stopped inside an epoch: no epoch result, the checkpoint holds the position.
        return;
      }
      finish_epoch(e);
    }
  }

  // Submits the epoch's batches from e.start_batch; true when the run stopped inside it.
  bool run_epoch(epoch_state& e) {
    for (int64_t b = e.start_batch; b < steps_per_epoch_; ++b) {
      const auto submitted = step_ + e.flying.size();
      if (stops_after(submitted)) {
        return true;
      }
      auto asked = std::chrono::steady_clock::now();
      auto [x, y] = batch_at(e.epoch, b);
      const double waited =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - asked).count();
      report_.data_wait_seconds += waited / 1000.0;
      auto current_lr = o_.cosine ? lr_.at(static_cast<int64_t>(submitted)) : o_.lr;
      pipe_.set_learning_rate(current_lr);
      e.flying.push_back({submit(pipe_, x, y), b, waited});
      // A step after which the loop checkpoints, snapshots, stops or ends the epoch finishes
      // before the next is submitted (which would run before the checkpoint).
      const auto after = submitted + 1;
      if (b + 1 < steps_per_epoch_ && !stops_after(after)) {
        ask_ahead(e.epoch, b + 1);
      }
      bool alone = !o_.overlap_steps || b + 1 == steps_per_epoch_ || stops_after(after) ||
                   checkpoints_after(after) || snapshots_after(after);
      while (e.flying.size() > (alone ? 0U : 1U)) {
        if (complete(e)) {
          return true;
        }
      }
    }
    return false;
  }

  // Batch `b` of `epoch`: the one asked for ahead when it is that one, else asked for now.
  std::pair<torch::Tensor, torch::Tensor> batch_at(int64_t epoch, int64_t b) {
    if (auto made = ahead_.take(epoch, b)) {
      return std::move(*made);
    }
    return data_.batch(epoch, b, o_.batch, o_.seed, o_.rank, o_.replicas);
  }

  // Asks a source that allows it (batch_source::prefetch) for batch `b` of `epoch` on a thread
  // of its own while the step before it runs: its making then costs the stages no time between
  // steps (a synthetic batch's random draws are milliseconds).
  void ask_ahead(int64_t epoch, int64_t b) {
    if (data_.prefetch()) {
      ahead_.ask(epoch, b);
    }
  }

  // Finishes the oldest step in flight (its log, checkpoint and snapshot); whether the run
  // stops there.
  bool complete(epoch_state& e) {
    auto f = std::move(e.flying.front());
    e.flying.pop_front();
    const auto b = f.b;
    auto r = f.result.get();
    r.data_wait_ms = f.waited;
    ++step_;
    report_.steps.emplace_back(step_, r.loss);
    report_.step_ms.push_back(r.wall_ms);
    e.loss_sum += r.loss;
    ++e.loss_count;
    if (o_.log_steps && lead_) {
      print_step_line(step_, total_steps_, r);
    }
    auto slow = watch_.observe(step_, r.stages);
    if (o_.keep_results) {
      report_.results.push_back(std::move(r));
    }
    if (o_.progress && lead_) {
      auto done = (b + 1 - e.start_batch) * o_.batch;
      e.bar.update(
        (b + 1) * o_.batch,
        detail::concat(
          static_cast<int64_t>(static_cast<double>(done) / std::max(1e-9, e.bar.elapsed_seconds())),
          " samples/s, loss ", e.loss_sum / static_cast<double>(e.loss_count)));
    }
    bool stop = stops_after(step_);
    bool last = b + 1 == steps_per_epoch_ && e.epoch + 1 == epochs_;
    if ((stop && !last) || checkpoints_after(step_)) {
      checkpoint(e.epoch, b + 1);
    }
    // Where the next step starts in the data.
    position_ = next_position({step_ - 1, e.epoch, b});
    take_snapshot(position_);
    take_back_nodes();
    name_stragglers(std::move(slow));
    return stop && !last;
  }

  // Stages found much slower than they used to be are named; with recut_slow_nodes their nodes
  // get fewer layers, from the state after this step (nothing replayed).
  void name_stragglers(std::vector<slow_stage> found) {
    if (found.empty()) {
      return;
    }
    const auto& nodes = lead_of(pipe_).nodes();
    for (auto& f : found) {
      f.node = f.stage < nodes.size() ? nodes[f.stage] : std::string{};
      // Said once, and again only when the slowdown changes by a quarter or more.
      auto ratio = f.recent_ms / f.usual_ms;
      auto said = said_slow_.find(f.stage);
      bool changed =
        said == said_slow_.end() || ratio > said->second * 1.25 || ratio < said->second / 1.25;
      if (changed) {
        said_slow_[f.stage] = ratio;
      }
      if (lead_ && changed) {
        std::cerr << "actorpipe: stage " << f.stage
                  << (f.node.empty() ? std::string{} : " on node " + f.node) << " runs "
                  << std::setprecision(3) << f.recent_ms / f.usual_ms
                  << "x slower than over its first steps (" << f.recent_ms
                  << " ms of forward and backward per step against " << f.usual_ms
                  << ") after step " << f.step << "\n"
                  << std::flush;
      }
      report_.slow_stages.push_back(f);
    }
    if (o_.recut_slow_nodes) {
      recut_slow(pipe_);
    }
  }

  void recut_slow(replicated_pipeline&) {} // refused before the run (replicas keep one cut)
  void recut_slow(pipeline& pipe) {
    const auto usual = watch_.usual_ms();
    const auto recent = watch_.recent_ms();
    if (pipe.nodes().empty() || pipe.cut().stages() != usual.size()) {
      return; // in process, or stages of several chunks: named only
    }
    std::vector<double> slowdown;
    for (std::size_t k = 0; k < usual.size(); ++k) {
      slowdown.push_back(usual[k] > 0 && recent[k] > 0 ? recent[k] / usual[k] : 1.0);
    }
    auto cut = training::cut_for_speeds(pipe.cut(), usual, slowdown,
                                        std::vector<double>(pipe.cut().bounds.back(), 0.0));
    if (cut.bounds == pipe.cut().bounds) {
      return;
    }
    snapshots_[pipe.repartition(cut)] = position_;
    report_.recuts.push_back(cut);
    if (lead_) {
      std::cerr << "actorpipe: after step " << step_
                << ", cut anew by the measured speeds: " << cut.to_string() << " on "
                << join(pipe.nodes()) << "\n"
                << std::flush;
    }
    watch_.reset(); // the new layout's own usual times
  }

  // The position after the step at `p` (p.step steps done before it): after an epoch's last
  // step, the next epoch's start (a recovery from there does not finish that epoch a second time).
  start_point next_position(const start_point& p) const {
    return p.batch + 1 == steps_per_epoch_ && !stream_
             ? start_point{p.step + 1, p.epoch + 1, 0}
             : start_point{p.step + 1, p.epoch, p.batch + 1};
  }

  // Nodes lost earlier that answer again take stages back (or stand by as spares), from the state
  // after this step: nothing is replayed.
  void take_back_nodes() {
    if (!o_.recover_lost_nodes) {
      return;
    }
    if (auto r = training::take_back_nodes(pipe_, o_, step_, lead_)) {
      snapshots_[r->snapshot] = position_;
      report_.rejoins.push_back(std::move(*r));
    }
  }

  // An epoch's result: its mean loss, the evaluation (rank 0), metrics, the ranks' barrier and,
  // at the run's end, the last checkpoint.
  void finish_epoch(epoch_state& s) {
    epoch_result e;
    e.epoch = s.epoch + 1;
    e.step = step_;
    e.lr = o_.cosine ? lr_.at(static_cast<int64_t>(step_) - 1) : o_.lr;
    e.train_loss = s.loss_count > 0 ? s.loss_sum / static_cast<double>(s.loss_count) : 0;
    e.seconds = s.bar.elapsed_seconds();
    e.samples_per_second = static_cast<double>(s.loss_count * o_.batch) / std::max(1e-9, e.seconds);
    // BMUF: rank 0 evaluates the replicas' common parameters.
    pipe_.end_block();
    if (!lead_) {
      report_.epochs.push_back(e);
      end_of_epoch(e.epoch);
      return;
    }
    if (auto test = data_.evaluate(lead_of(pipe_), o_.eval_batch)) {
      e.test = *test;
      print_epoch(e);
    }
    metrics_->write(e);
    report_.epochs.push_back(e);
    end_of_epoch(e.epoch);
    if (s.epoch + 1 == epochs_) {
      // The end of the run: a stream's position is its step.
      checkpoint(stream_ ? 0 : s.epoch + 1, stream_ ? static_cast<int64_t>(step_) : 0);
    }
  }

  void print_epoch(const epoch_result& e) const {
    std::cout << "epoch " << e.epoch << "/" << epochs_ << "  train loss " << e.train_loss;
    if (e.test.tokens) {
      std::cout << "  validation loss " << e.test.loss << "  bits/char " << e.test.bits
                << "  top-1 " << e.test.top1;
    } else if (e.test.classes) {
      std::cout << "  test loss " << e.test.loss << "  top-1 " << e.test.top1 << "  top-5 "
                << e.test.top5;
    } else {
      std::cout << "  test loss " << e.test.loss;
    }
    std::cout << "  " << static_cast<int64_t>(e.samples_per_second) << " samples/s\n" << std::flush;
  }

  Pipe& pipe_;
  const batch_source& data_;
  const train_options& o_;
  const bool lead_;
  const bool stream_;
  int64_t steps_per_epoch_ = 0;
  int64_t epochs_ = 1;
  int64_t total_steps_ = 0;
  cosine_schedule lr_;
  uint64_t step_ = 0;
  std::unique_ptr<metrics_writer> metrics_;
  train_report report_;
  // The slowdown last said per stage (name_stragglers).
  std::map<std::size_t, double> said_slow_;
  std::map<uint64_t, start_point> snapshots_;
  // Where the step after the last completed one starts.
  start_point position_;
  training::straggler_watch watch_{o_.slow_factor};
  // The next batch, asked for while a step runs (ask_ahead). Last: destroyed first, waiting for
  // a batch still being made with the members above.
  training::batches_ahead ahead_{[this](int64_t epoch, int64_t b) {
    return data_.batch(epoch, b, o_.batch, o_.seed, o_.rank, o_.replicas);
  }};
};

template <class Pipe>
train_report train_loop(Pipe& pipe, const batch_source& data, const train_options& o) {
  return training_run<Pipe>(pipe, data, o).run();
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

} // namespace actorpipe
