#!/usr/bin/env bash
# How long a frozen node takes to end a run: two `actorpipe node` processes on loopback, a
# training run over them (--on-node-loss fail), SIGSTOP of the node of stage 1 after step 20, and
# the seconds until the training process exits; RUNS times.
#
#   bench/frozen_node.sh [RUNS] [extra train flags...]     e.g. bench/frozen_node.sh 3 --heartbeat-timeout 0
set -uo pipefail
cd "$(dirname "$0")/.."
program=${ACTORPIPE:-build/cli/actorpipe}
runs=${1:-5}
shift || true
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
for ((i = 1; i <= runs; i++)); do
  a=$((20000 + RANDOM % 20000)) b=$((a + 1))
  "$program" node --listen 127.0.0.1:$a >"$work/a.log" 2>&1 &
  node_a=$!
  "$program" node --listen 127.0.0.1:$b >"$work/b.log" 2>&1 &
  node_b=$!
  for log in a b; do
    timeout 20 bash -c "until grep -q 'listening on' $work/$log.log; do sleep 0.1; done"
  done
  "$program" train --data synthetic --model mlp --batch 256 --microbatches 8 --stages 2 \
    --threads 1 --steps 100000 --nodes 127.0.0.1:$a,127.0.0.1:$b "$@" >"$work/train.log" 2>&1 &
  train=$!
  timeout 60 bash -c "until grep -q 'step 20/' $work/train.log; do sleep 0.1; done"
  start=$(date +%s.%N)
  kill -STOP $node_b
  (sleep 300 && kill $train 2>/dev/null) & # a deadline: a run that never ends is killed
  guard=$!
  wait $train
  kill $guard 2>/dev/null
  end=$(date +%s.%N)
  echo "run $i: $(echo "$end - $start" | bc) s"
  kill -CONT $node_b
  kill $node_a $node_b 2>/dev/null
  wait 2>/dev/null
done
grep -m1 "fails:" "$work/train.log" | cut -c1-240
