#!/usr/bin/env bash
# What a training run spends between its steps: three `actorpipe node` processes on loopback and
# the chaos soak's run (bench/chaos.py: the mlp on synthetic data, batch 256, 8 micro-batches,
# 3 stages of one thread), STEPS steps; wall seconds against the sum of the step lines' own times,
# less a 10-step run's wall and steps (the process's start, the stages' placing). Each binary
# given runs in turn, RUNS times over, with its own nodes; the last loss of each is printed, so
# that two builds can be seen to train alike. docs/api.md#training-runs
#
#   bench/between_steps.sh [STEPS] [BINARY ...]     e.g. bench/between_steps.sh 1500 old/actorpipe build/cli/actorpipe
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-1500}
shift || true
binaries=("$@")
[ ${#binaries[@]} -gt 0 ] || binaries=(build/cli/actorpipe)
runs=${RUNS:-3}
work=$(mktemp -d)
nodes=()
stop_nodes() {
  for pid in "${nodes[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${nodes[@]}"; do wait "$pid" 2>/dev/null || true; done
  nodes=()
}
trap 'stop_nodes; rm -rf "$work"' EXIT

# run BINARY STEPS LOG: prints "wall step_sum steps last_loss"
run() {
  local bin=$1 n=$2 log=$3 ports=()
  for _ in 1 2 3; do
    local port
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    ports+=("127.0.0.1:$port")
    "$bin" node --listen "127.0.0.1:$port" > "$work/node$port.log" 2>&1 &
    nodes+=($!)
  done
  sleep 1.5
  local t0 t1
  t0=$(date +%s.%N)
  "$bin" train --data synthetic --model mlp --batch 256 --microbatches 8 --threads 1 --lr 0.1 \
    --seed 3 --stages 3 --steps "$n" --nodes "$(IFS=,; echo "${ports[*]}")" > "$log" 2>&1
  t1=$(date +%s.%N)
  stop_nodes
  python3 - "$log" "$t0" "$t1" <<'PY'
import re, sys
log, t0, t1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
found = re.findall(r"^step \d+/\d+\s+loss ([0-9.eE+-]+)\s+time ([0-9.eE+-]+) s", open(log).read(), re.M)
if not found:
    sys.exit(f"no step lines in {log}")
print(f"{t1 - t0:.4f} {sum(float(t) for _, t in found):.4f} {len(found)} {found[-1][0]}")
PY
}

echo "| binary | run | wall s | steps' own s | between steps, ms a step | last loss |"
echo "| --- | --- | --- | --- | --- | --- |"
for r in $(seq 1 "$runs"); do
  for bin in "${binaries[@]}"; do
    read -r w0 s0 _ _ < <(run "$bin" 10 "$work/short.log")
    read -r w s n loss < <(run "$bin" "$steps" "$work/long.log")
    python3 -c "import sys; w,s,w0,s0,n=map(float,sys.argv[1:6]); print(f'| {sys.argv[6]} | $r | {w:.2f} | {s:.2f} | {1000*((w-w0)-(s-s0))/(n-10):.2f} | {sys.argv[7]} |')" \
      "$w" "$s" "$w0" "$s0" "$n" "$bin" "$loss"
  done
done
