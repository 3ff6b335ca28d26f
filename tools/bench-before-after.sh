#!/bin/bash
# The benches a change to the engine's house is measured by, before and after, alternately in one
# sitting (docs/benchmarks/restructuring.md): per hop in process, steps and recovery over
# `actorpipe node` processes, and the seed scenario reduced, side by side in `actorpipe bench` and
# as one run of `actorpipe train` (planned, built and trained through training::plan_run and
# start_run). Build the base in a worktree first:
#   git worktree add /tmp/base <commit> && (cd /tmp/base && ./setup.sh build)
#   tools/bench-before-after.sh /tmp/base/build build out/
# Writes micro_{base,after}_N.json, rec_{base,after}_N.{json,log}, seed_{base,after}_N.log and
# train_{base,after}_N.{json,log}.
set -euo pipefail
if [ $# -ne 3 ]; then
  echo "usage: $0 BASE_BUILD AFTER_BUILD OUT_DIR" >&2
  exit 2
fi
declare -A dir=([base]=$(realpath "$1") [after]=$(realpath "$2"))
out=$3
for b in "${dir[@]}"; do
  for exe in bench/actorpipe_micro_bench bench/actorpipe_recovery_bench cli/actorpipe; do
    [ -x "$b/$exe" ] || { echo "$0: no $b/$exe (build it first)" >&2; exit 1; }
  done
done
mkdir -p "$out" && cd "$out"
filter='BM_forward_hop/[0-9]+/[0-9]+/50/real_time|BM_scheduler_step/(1|8)/50/real_time'
for r in 1 2; do
  for side in base after; do
    b=${dir[$side]}
    echo "== $side, per hop and recovery, run $r ($(date +%T))"
    "$b/bench/actorpipe_micro_bench" --benchmark_filter="$filter" --benchmark_min_time=0.5 \
      --benchmark_format=json > "micro_${side}_$r.json"
    timeout 600 "$b/bench/actorpipe_recovery_bench" --steps 300 --kill-every 150 \
      --snapshot-every 50 --json "rec_${side}_$r.json" > "rec_${side}_$r.log" 2>&1
  done
done
for r in 1 2; do
  for side in base after; do
    b=${dir[$side]}
    echo "== $side, seed scenario, run $r ($(date +%T))"
    timeout 900 "$b/cli/actorpipe" bench --data synthetic --batch 48 --image 96 --stage-counts 2 \
      --splits 4 --partition time --schedules 1f1b --resnet-blocks --steps 5 > "seed_${side}_$r.log" 2>&1
    timeout 900 "$b/cli/actorpipe" train --data synthetic --batch 48 --image 96 --stages 2 \
      --microbatches 4 --partition time --resnet-blocks --steps 6 --json "train_${side}_$r.json" \
      > "train_${side}_$r.log" 2>&1
  done
done
