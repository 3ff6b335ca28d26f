#!/usr/bin/env bash
# What each fault costs a run of `actorpipe node` processes on loopback (docs/distributed.md's
# fault table): the small mlp, --on-node-loss continue, --snapshot-every 10; each fault after
# step 25. Prints one line per fault: the seconds from the fault to the next completed step and
# the steps taken again.
#   replicas-kill: 2 replicas x 2 stages, replica 1's stage-1 node killed (-9), a spare takes it
#                  and replica 0's state; replicas-kill-snapshot: the same with replica 0's node
#                  killed under --buffers none (only rank 0's state would do): the snapshot path
#   spare-kill:    2 stages and a spare, stage 1's node killed (-9): the spare loads the copy
#                  that stage 0's node keeps (spare-kill-driver: the same with nodes that keep
#                  nothing, --keep-snapshots 0: the driver's snapshot)
#   driver-kill:   2 stages, the training process killed (-9) and started again, --resume nodes
#   node-back:     3 stages, a node killed (-9), the model cut onto 2, the node started again
#
#   bench/faults.sh [RUNS]          (ONLY=replicas-kill or ONLY=spare-kill: those rows alone)
set -uo pipefail
cd "$(dirname "$0")/.."
program=${ACTORPIPE:-build/cli/actorpipe}
runs=${1:-3}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; [[ -n ${KEEP:-} ]] || rm -rf "$work"' EXIT
common=(--data synthetic --model mlp --batch 256 --microbatches 8 --threads 1 --lr 0.1 --seed 3
  --on-node-loss continue --snapshot-every 10)

now() { date +%s.%N; }
wait_for() { # FILE TEXT SECONDS
  timeout "$3" bash -c "until grep -q -- '$2' '$1' 2>/dev/null; do sleep 0.01; done"
}
start_node() { # PORT [node flags] -> pid in $node_pid
  "$program" node --listen "127.0.0.1:$1" "${@:2}" >"$work/node$1.log" 2>&1 &
  node_pid=$!
  wait_for "$work/node$1.log" 'listening on' 20
}
# kill -9, and the shell's report of it silenced.
kill9() { { kill -9 "$1" && wait "$1"; } 2>/dev/null; }
# The last "step N/" line's N in FILE.
last_step() { grep -o 'step [0-9]*/' "$1" | tail -1 | tr -dc 0-9; }

# After step 25 of the training process TRAIN (its log $work/t.log), kills node VICTIM (-9) and
# prints LABEL: the seconds from the kill to step 27 and what was restored; then stops the nodes.
kill_node_at_25() { # TRAIN VICTIM LABEL NODE_PIDS...
  local train=$1 victim=$2 label=$3 t0 t1
  shift 3
  wait_for "$work/t.log" 'step 25/' 60
  t0=$(now)
  kill9 "$victim"
  wait_for "$work/t.log" 'step 27/' 60
  t1=$(now)
  wait "$train"
  echo "$label: $(echo "$t1 - $t0" | bc) s to step 27; $(grep -o 'restored .*replaying [0-9]* step' "$work/t.log")"
  kill "$@" 2>/dev/null
}

replicas_kill() { # BASE VICTIM LABEL [flags]
  local base=$1 victim=$2 label=$3 pids=() nodes=""
  shift 3
  for k in 0 1 2 3 4; do
    start_node $((base + k))
    pids+=("$node_pid")
    ((k < 4)) && nodes+="${nodes:+,}127.0.0.1:$((base + k))"
  done
  "$program" train "${common[@]}" --stages 2 --replicas 2 --master-port $((base + 10)) \
    --steps 60 --nodes "$nodes" --spare-nodes "127.0.0.1:$((base + 4))" "$@" >"$work/t.log" 2>&1 &
  kill_node_at_25 $! "${pids[$victim]}" "$label" "${pids[@]}"
}

spare_kill() { # BASE LABEL [node flags]
  local base=$1 label=$2 pids=()
  shift 2
  for k in 0 1 2; do
    start_node $((base + k)) "$@"
    pids+=("$node_pid")
  done
  "$program" train "${common[@]}" --stages 2 --steps 60 \
    --nodes "127.0.0.1:$base,127.0.0.1:$((base + 1))" --spare-nodes "127.0.0.1:$((base + 2))" \
    >"$work/t.log" 2>&1 &
  kill_node_at_25 $! "${pids[1]}" "$label" "${pids[@]}"
}

driver_kill() {
  local base=$1 pids=()
  start_node "$base"
  pids+=("$node_pid")
  start_node $((base + 1))
  pids+=("$node_pid")
  local nodes="127.0.0.1:$base,127.0.0.1:$((base + 1))"
  "$program" train "${common[@]}" --stages 2 --steps 60 --nodes "$nodes" >"$work/t.log" 2>&1 &
  local train=$!
  wait_for "$work/t.log" 'step 25/' 60
  kill9 $train
  local reached t0 t1
  reached=$(last_step "$work/t.log")
  t0=$(now)
  "$program" train "${common[@]}" --stages 2 --steps 60 --nodes "$nodes" --resume nodes \
    >"$work/r.log" 2>&1 &
  train=$!
  wait_for "$work/r.log" 'step [0-9]*/' 60
  t1=$(now)
  wait $train
  local resumed
  resumed=$(grep -o 'at step [0-9]*' "$work/r.log" | tr -dc 0-9)
  echo "driver-kill: $(echo "$t1 - $t0" | bc) s from the restart to a step; reached step $reached, resumed at $resumed: $((reached - resumed)) steps taken again"
  kill "${pids[@]}" 2>/dev/null
}

node_back() {
  local base=$1 pids=()
  for k in 0 1 2; do
    start_node $((base + k))
    pids+=("$node_pid")
  done
  "$program" train "${common[@]}" --stages 3 --steps 80 --connect-timeout 2000 \
    --nodes "127.0.0.1:$base,127.0.0.1:$((base + 1)),127.0.0.1:$((base + 2))" >"$work/t.log" 2>&1 &
  local train=$!
  wait_for "$work/t.log" 'step 25/' 60
  kill9 "${pids[2]}"
  wait_for "$work/t.log" 'recovery 1 of' 60
  local t0 t1
  t0=$(now)
  start_node $((base + 2))
  pids+=("$node_pid")
  wait_for "$work/t.log" 'answered again' 60
  t1=$(now)
  wait $train
  echo "node-back: $(echo "$t1 - $t0" | bc) s from the restart to its stages back (node start included); $(grep -o 'replaying [0-9]* step' "$work/t.log") at the loss; $(grep -o 'answered again: now [0-9]* stages' "$work/t.log")"
  kill "${pids[@]}" 2>/dev/null
}

only=${ONLY:-}
for ((i = 1; i <= runs; i++)); do
  base=$((20000 + RANDOM % 12000)) # below the ephemeral ports (32768-), which a restart may meet
  if [[ $only == replicas-kill ]]; then
    replicas_kill "$base" 3 replicas-kill
    cp "$work/t.log" "/tmp/faults-$i.log"
    continue
  fi
  if [[ $only == spare-kill ]]; then
    spare_kill $((base + 80)) spare-kill
    spare_kill $((base + 90)) spare-kill-driver --keep-snapshots 0
    continue
  fi
  replicas_kill "$base" 3 replicas-kill
  replicas_kill $((base + 60)) 1 replicas-kill-snapshot --buffers none
  spare_kill $((base + 80)) spare-kill
  spare_kill $((base + 90)) spare-kill-driver --keep-snapshots 0
  driver_kill $((base + 20))
  node_back $((base + 40))
  wait 2>/dev/null
done
