#!/usr/bin/env bash
# How long a frozen node takes to end a run: `actorpipe node` processes on loopback, a training
# run over them (--on-node-loss fail), SIGSTOP of the last node after step 20, and the seconds
# until the training process exits; RUNS times. With --replicas: 2 replicas x 2 stages on four
# nodes, the last being replica 1's stage 1, while replica 0's stage 1 waits for it in an
# all-reduce (the default --dp-timeout of 60 s; the announced failure ends it first).
#
#   bench/frozen_node.sh [--replicas] [RUNS] [extra train flags...]
#   e.g. bench/frozen_node.sh 3 --heartbeat-timeout 0
set -uo pipefail
cd "$(dirname "$0")/.."
program=${ACTORPIPE:-build/cli/actorpipe}
count=2
replicas=()
if [[ ${1:-} == --replicas ]]; then
  count=4
  shift
fi
runs=${1:-5}
shift || true
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
for ((i = 1; i <= runs; i++)); do
  base=$((20000 + RANDOM % 20000))
  pids=()
  nodes=""
  for ((k = 0; k < count; k++)); do
    "$program" node --listen 127.0.0.1:$((base + k)) >"$work/n$k.log" 2>&1 &
    pids+=($!)
    nodes+="${nodes:+,}127.0.0.1:$((base + k))"
  done
  for ((k = 0; k < count; k++)); do
    timeout 20 bash -c "until grep -q 'listening on' $work/n$k.log; do sleep 0.1; done"
  done
  if ((count == 4)); then
    replicas=(--replicas 2 --master-port $((base + 10)))
  fi
  "$program" train --data synthetic --model mlp --batch 256 --microbatches 8 --stages 2 \
    --threads 1 --steps 100000 --nodes "$nodes" "${replicas[@]}" "$@" >"$work/train.log" 2>&1 &
  train=$!
  timeout 60 bash -c "until grep -q 'step 20/' $work/train.log; do sleep 0.1; done"
  start=$(date +%s.%N)
  kill -STOP "${pids[-1]}"
  (sleep 300 && kill $train 2>/dev/null) & # a deadline: a run that never ends is killed
  guard=$!
  wait $train
  pkill -P $guard 2>/dev/null
  kill $guard 2>/dev/null # and its sleep
  end=$(date +%s.%N)
  echo "run $i: $(echo "$end - $start" | bc) s"
  kill -CONT "${pids[-1]}"
  kill "${pids[@]}" 2>/dev/null
  wait 2>/dev/null
done
grep "fails:" "$work/train.log" | cut -c1-300
