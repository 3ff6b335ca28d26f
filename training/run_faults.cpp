#include "training/run_faults.hpp"

#include <iomanip>
#include <iostream>

namespace actorpipe::training {
namespace {

// The recovery itself, as each kind of pipeline takes it.
recovery_report recover(pipeline& pipe, const train_options& o, const pipeline_error& failure) {
  // The node the step found lost is not asked again (a frozen one would cost another timeout).
  auto found = failure.kind() == error_kind::node_lost && !failure.node().empty()
                 ? std::vector<std::string>{failure.node()}
                 : std::vector<std::string>{};
  return pipe.recover(o.repartition, found);
}
recovery_report recover(replicated_pipeline& pipe, const train_options&, const pipeline_error&) {
  return pipe.recover();
}
std::optional<recovery_report> rejoin(pipeline& pipe, const train_options& o) {
  return pipe.rejoin_nodes(o.repartition);
}
std::optional<recovery_report> rejoin(replicated_pipeline& pipe, const train_options&) {
  return pipe.rejoin_nodes(); // a replica that left comes back, or its nodes stand by
}

// A recovery from a surviving replica's live state goes on where the data is (that state becomes
// a snapshot there): before the failed step, or after it when it had completed on that replica
// (its loss is then reported).
void take_live_state(const recovery_report& r, const train_options& o, const failed_at& where,
                     std::map<uint64_t, start_point>& snapshots, train_report& report) {
  if (r.from_replica < 0) {
    return;
  }
  snapshots[r.snapshot] = r.failed_step ? where.after : where.now;
  if (!r.failed_step) {
    return;
  }
  report.steps.emplace_back(where.done + 1, r.failed_step->loss);
  report.step_ms.push_back(r.failed_step->wall_ms);
  if (o.log_steps && o.rank == 0) { // its line, as every completed step's (the lead's)
    print_step_line(where.done + 1, where.total, *r.failed_step);
  }
  if (o.keep_results) {
    report.results.push_back(*r.failed_step);
  }
}

// The report back at the restored snapshot: the steps after it, to be replayed, and the epochs
// it had not finished leave it. Returns the steps replayed.
std::vector<uint64_t> rewind_report(train_report& report, const start_point& snapshot_at,
                                    const train_options& o) {
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
  return replayed;
}

// One line on the recovery: what was lost and used, where the stages are now, what was restored.
void say_recovered(const recovery_report& r, std::size_t number, const train_options& o,
                   const start_point& snapshot_at, std::size_t replayed) {
  std::cerr << "actorpipe: recovery " << number << " of at most " << o.max_recoveries << " in "
            << std::setprecision(3) << r.seconds << " s: lost " << join(r.lost) << ", spares used "
            << join(r.spares_used)
            << (r.replicas_left.empty()
                  ? std::string{}
                  : detail::concat(", replicas left (no spare) ", join(r.replicas_left)))
            << "; now "
            << (r.replicas > 1 || !r.replicas_left.empty()
                  ? detail::concat(r.replicas, " replica", r.replicas == 1 ? "" : "s", " of ")
                  : std::string{})
            << r.nodes.size() / r.replicas << " stages on " << join(r.nodes) << ", cut "
            << partition{r.bounds}.to_string() << "; restored "
            << (r.from_replica >= 0 ? detail::concat("the live state of replica ", r.from_replica)
                : r.snapshot == 0
                  ? std::string("the run's starting state")
                  : detail::concat("snapshot ", r.snapshot, r.from_nodes ? " from the nodes" : ""))
            << " (step " << snapshot_at.step << "), replaying " << replayed << " step"
            << (replayed == 1 ? "" : "s") << "\n"
            << std::flush;
}

// Recovers `pipe` from `failure` (at most o.max_recoveries times a run) and returns where in the
// data the run goes on: the restored snapshot's position.
template <class Pipe>
start_point recover_run(Pipe& pipe, const pipeline_error& failure, const train_options& o,
                        const failed_at& where, std::map<uint64_t, start_point>& snapshots,
                        train_report& report) {
  if (report.recoveries.size() >= o.max_recoveries) {
    throw pipeline_error(detail::concat(failure.what(),
                                        " (no recovery left: ", report.recoveries.size(),
                                        " of at most ", o.max_recoveries, " done)"),
                         failure.details());
  }
  std::cerr << "actorpipe: step " << where.done + 1 << " failed (" << to_string(failure.kind())
            << (failure.node().empty() ? std::string{} : ", node " + failure.node())
            << "): " << failure.what() << "\n"
            << std::flush;
  auto r = recover(pipe, o, failure);
  take_live_state(r, o, where, snapshots, report);
  // Where in the data the snapshot it restored was taken.
  auto at = snapshots.find(r.snapshot);
  ACTORPIPE_CHECK(at != snapshots.end(), "train: recover() restored snapshot ", r.snapshot,
                  ", which this run did not take");
  const auto snapshot_at = at->second;
  auto replayed = rewind_report(report, snapshot_at, o);
  say_recovered(r, report.recoveries.size() + 1, o, snapshot_at, replayed.size());
  report.recoveries.push_back(std::move(r));
  return snapshot_at;
}

template <class Pipe>
std::optional<recovery_report> take_back(Pipe& pipe, const train_options& o, uint64_t step,
                                         bool lead) {
  auto r = rejoin(pipe, o);
  if (!r || !lead) {
    return r;
  }
  auto who = (r->rejoined.empty() ? std::string{} : join(r->rejoined) + " answered again") +
             (r->rejoined.empty() || r->joined.empty() ? "" : ", ") +
             (r->joined.empty() ? std::string{} : join(r->joined) + " joined");
  std::cerr << "actorpipe: after step " << step << ", " << who << ": now "
            << (r->replicas > 1 ? std::to_string(r->replicas) + " replicas, " : std::string{})
            << r->nodes.size() << " stages on " << join(r->nodes) << ", cut "
            << partition{r->bounds}.to_string() << " (" << std::setprecision(3) << r->seconds
            << " s)"
            << (r->spares_used.empty() ? std::string{}
                                       : "; standing by as spares: " + join(r->spares_used))
            << "\n"
            << std::flush;
  return r;
}

} // namespace

void print_step_line(uint64_t step, int64_t total, const step_result& r) {
  std::cout << "step " << step << "/" << total << "  loss " << std::setprecision(9) << r.loss
            << "  time " << std::setprecision(4) << r.wall_ms / 1000.0 << " s\n"
            << std::flush;
}

start_point recover_from(pipeline& pipe, const pipeline_error& failure, const train_options& o,
                         const failed_at& where, std::map<uint64_t, start_point>& snapshots,
                         train_report& report) {
  return recover_run(pipe, failure, o, where, snapshots, report);
}
start_point recover_from(replicated_pipeline& pipe, const pipeline_error& failure,
                         const train_options& o, const failed_at& where,
                         std::map<uint64_t, start_point>& snapshots, train_report& report) {
  return recover_run(pipe, failure, o, where, snapshots, report);
}

std::optional<recovery_report> take_back_nodes(pipeline& pipe, const train_options& o,
                                               uint64_t step, bool lead) {
  return take_back(pipe, o, step, lead);
}
std::optional<recovery_report> take_back_nodes(replicated_pipeline& pipe, const train_options& o,
                                               uint64_t step, bool lead) {
  return take_back(pipe, o, step, lead);
}

} // namespace actorpipe::training
