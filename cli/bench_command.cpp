#include "cli/bench_command.hpp"

#include <CLI/CLI.hpp>

#include "cli/flags.hpp"

namespace actorpipe::cli {
namespace {

// What the sweep measures side by side: splits, partitions, memory, precision, recomputation,
// updates and schedules.
void add_side_by_side_flags(CLI::App* cmd, bench::sweep_options& o) {
  cmd->add_option("--splits", o.splits, "Micro-batch counts to sweep, e.g. 1,2,4,8,16,32")
    ->delimiter(',')
    ->capture_default_str();
  cmd
    ->add_option("--partitions", o.partitions,
                 "Partitions to measure side by side, e.g. uniform,params,time (default: "
                 "--partition)")
    ->delimiter(',');
  cmd
    ->add_option("--memory", o.memory,
                 "Stage threads' memory, side by side: warm (the cache), cold (libtorch's "
                 "allocator), or warm,cold; --cold-memory means cold")
    ->delimiter(',')
    ->check(CLI::IsMember({"warm", "cold"}));
  cmd
    ->add_option("--precision", o.precisions,
                 "Precisions side by side: fp32, bf16 or fp32,bf16 (pipelines and plain "
                 "libtorch; bf16 under CPU autocast)")
    ->delimiter(',')
    ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd
    ->add_option("--recompute", o.recompute,
                 "Pipelines' activation recomputation side by side: never, except_last, always, "
                 "e.g. never,always (the stash MB column shows what it saves)")
    ->delimiter(',')
    ->check(CLI::IsMember({"never", "except_last", "always"}));
  cmd
    ->add_option("--updates", o.updates,
                 "Pipelines' optimizer updates side by side: early (a stage steps as soon as its "
                 "program has run, undone if clipping or a failure says so), wait, overlap (each "
                 "stage starts the next step when done with the one before; every configuration "
                 "then trains twice per batch), e.g. early,wait,overlap")
    ->delimiter(',')
    ->check(CLI::IsMember({"early", "wait", "overlap"}));
  cmd
    ->add_option("--schedules", o.schedules,
                 "Pipelines' schedules side by side, e.g. 1f1b,zb-h1 (default: --schedule)")
    ->delimiter(',')
    ->excludes("--schedule");
}

// --replicas: the replicas x stages grid instead of the split sweep.
void add_replica_flags(CLI::App* cmd, bench::sweep_options& o) {
  cmd
    ->add_option("--replicas", o.replicas,
                 "Data parallelism: measure replicas x stages instead of the split sweep, e.g. "
                 "1,2 (each replica on batch/replicas samples, gradients all-reduced per stage)")
    ->delimiter(',');
  cmd
    ->add_option(
      "--stage-counts", o.stage_counts,
      "Stage counts side by side, e.g. 1,2,4: of the pipelines swept, or with --replicas "
      "of the grid (default: --stages)")
    ->delimiter(',');
  cmd
    ->add_option("--shard", o.shards,
                 "With --replicas: the optimizer state's sharding side by side, e.g. "
                 "none,optimizer,gradients (ZeRO-1, ZeRO-2; docs/memory.md)")
    ->delimiter(',')
    ->check(CLI::IsMember({"none", "optimizer", "gradients"}));
  cmd
    ->add_option("--optimizer", o.optimizer,
                 "With --replicas: sgd (plain, no state) or adam (state twice the parameters)")
    ->check(CLI::IsMember({"sgd", "adam"}))
    ->capture_default_str();
  cmd->add_option("--trace", o.trace,
                  "With --replicas: Chrome trace of the largest configuration's last step");
}

} // namespace

CLI::App* add_bench_command(CLI::App& app, bench::sweep_options& o) {
  auto* cmd = app.add_subcommand(
    "bench", "Sweep the number of micro-batches (splits) on the PyTorch RPC pipeline tutorial's "
             "scenario (ResNet-50 in two stages, batch 120 of 3x128x128 random images, MSE, SGD) "
             "and compare with the ideal pipeline and with plain libtorch in the same process");
  o.model.data = "synthetic";
  o.plan.schedule = "1f1b";
  add_model_flags(cmd, o.model);
  add_plan_flags(cmd, o.plan, training::bench_front);
  add_side_by_side_flags(cmd, o);
  cmd->add_option("--steps", o.steps, "Timed steps (batches) per configuration")
    ->capture_default_str();
  cmd->add_option("--lr", o.lr, "SGD learning rate")->capture_default_str();
  cmd->add_flag("!--no-baselines", o.baselines, "Skip plain libtorch");
  cmd->add_flag("!--no-accumulated", o.accumulated,
                "Skip plain libtorch accumulating gradients over each split's micro-batches");
  cmd->add_flag("!--no-progress", o.progress, "No progress bar");
  cmd->add_option("--json", o.json, "Write the rows as JSON");
  cmd->add_option("--csv", o.csv, "Write the rows as CSV");
  cmd->add_option("--plot", o.plot, "Plot step time and efficiency against splits (SVG)");
  add_replica_flags(cmd, o);
  return cmd;
}

} // namespace actorpipe::cli
