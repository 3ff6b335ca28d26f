#!/usr/bin/env bash
# Schedules over two nodes joined by a slow link: a driver and two `actorpipe node` processes in
# three network namespaces on a bridge, each node's outgoing traffic shaped to RATE (tc tbf; a
# fixed delay instead with "delay:4ms", tc netem; none with "off"; "share:0.33" sets the rate so
# that one transfer takes that share of a stage's compute per micro-batch, measured by an
# unshaped 1F1B run first), the same gpt trained with each schedule; median ms per step (steps
# after the first two) and against the first schedule, with the stages' compute per micro-batch
# and the bytes of one transfer. Needs root and iproute2 (tc); docs/schedules.md#choosing.
# MODEL, MICROBATCHES (8), PARTITION (time), THREADS (1 per stage) and RUNS (1: the schedules
# run in turn, RUNS times over) change the run.
#
#   bench/slow_link.sh RATE [SCHEDULES] [STEPS]     e.g. bench/slow_link.sh 200mbit 1f1b,zb-v,dualpipe-v 12
set -euo pipefail
cd "$(dirname "$0")/.."
cli=$(readlink -f "${ACTORPIPE:-build/cli/actorpipe}")
rate=${1:?"RATE, e.g. 200mbit, delay:4ms or off"}
schedules=${2:-1f1b,zb-h1,interleaved-zb,zb-v,dualpipe-v}
steps=${3:-12}
model=${MODEL:-"--model gpt --layers 4 --width 128 --heads 4 --context 64 --classes 64 --batch 32"}
microbatches=${MICROBATCHES:-8}
partition=${PARTITION:-time}
[[ $(id -u) -eq 0 ]] || { echo "network namespaces need root"; exit 1; }

tag=sl$$
net=10.78.$(( $$ % 200 + 20 ))
br=${tag}br s=${tag}s a=${tag}a b=${tag}b
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2> /dev/null || true; done
  for n in "$s" "$a" "$b" "$br"; do ip netns del "$n" 2> /dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
source tools/netns_hosts.sh
netns_hosts "$br" "$net" "$s" "$a" "$b"
shape() {
  for host in "$a" "$b"; do
    case $1 in
    off) ;;
    delay:*) ip netns exec "$host" tc qdisc add dev "v$host" root netem delay "${1#delay:}" limit 100000 ;;
    *) ip netns exec "$host" tc qdisc add dev "v$host" root tbf rate "$1" burst 64kb latency 2s ;;
    esac
  done
}
[[ $rate == share:* ]] || shape "$rate"
printf 'slow link\n' > "$work/secret"
chmod 600 "$work/secret"
for host in "$a" "$b"; do
  addr=$net.$([[ $host == "$a" ]] && echo 2 || echo 3)
  ip netns exec "$host" "$cli" node --listen "$addr:7000" --secret-file "$work/secret" \
    > "$work/$host.log" 2>&1 &
  pids+=($!)
  disown
  timeout 30 bash -c "until grep -qs 'listening on' $work/$host.log; do sleep 0.1; done"
done

threads=${THREADS:-1}
runs=${RUNS:-1}
# train SCHEDULE: one run over the two nodes, its --json in $work/SCHEDULE.json.
train() {
  local extra=
  [[ $1 == interleaved* ]] && extra="--chunks 2"
  ip netns exec "$s" timeout 600 "$cli" train --data synthetic $model --microbatches "$microbatches" \
    --stages 2 --threads "$threads" --steps "$steps" --schedule "$1" $extra --seed 3 --no-progress \
    --partition "$partition" \
    --nodes "$net.2:7000,$net.3:7000" --secret-file "$work/secret" --json "$work/$1.json" \
    > "$work/$1.log" 2>&1
}
# figures JSON M FIRST: median ms per step, against FIRST, each stage's compute per micro-batch.
figures() {
  python3 - "$@" << 'PY'
import json, statistics, sys
j = json.load(open(sys.argv[1]))
m, first = int(sys.argv[2]), float(sys.argv[3])
steps = j["steps"][2:]
wall = statistics.median(s["wall_ms"] for s in steps)
compute = [statistics.median(s["stages"][k]["forward_ms"] + s["stages"][k]["backward_ms"]
                             for s in steps) / m for k in range(2)]
print(f"{wall:.1f} {first / wall if first else 1.0:.3f} {compute[0]:.2f} {compute[1]:.2f}")
PY
}
bytes=$(python3 -c "
m='''$model'''.split(); g=lambda k, d: int(m[m.index(k) + 1]) if k in m else d
print(round(g('--batch', 32) // $microbatches * g('--context', 64) * g('--width', 128) * 4 / 1e6, 3))")
if [[ $rate == share:* ]]; then
  train 1f1b || { echo "the unshaped 1F1B run failed: $(tail -1 "$work/1f1b.log")"; exit 1; }
  read -r _ _ c0 c1 <<< "$(figures "$work/1f1b.json" "$microbatches" 0)"
  # the bits of one transfer over the share of the slower stage's compute
  kbit=$(python3 -c "print(round($bytes * 8e6 / (${rate#share:} * max($c0, $c1))))")
  echo "unshaped 1F1B: compute $c0, $c1 ms per micro-batch; $bytes MB per transfer: ${kbit}kbit"
  rate="${kbit}kbit (${rate#share:} of the compute)"
  shape "${kbit}kbit"
fi

echo "link: $rate each way; model: $model; $microbatches micro-batches, 2 stages, $threads thread(s) each, partition $partition"
echo "| schedule | ms/step (median) | vs first | compute ms per micro-batch (stage 0, 1) | MB per transfer |"
echo "| --- | --- | --- | --- | --- |"
IFS=, read -ra list <<< "$schedules"
for ((run = 1; run <= runs; run++)); do
  first=
  for schedule in "${list[@]}"; do
    train "$schedule" || { echo "| $schedule | failed: $(tail -1 "$work/$schedule.log") |"; continue; }
    read -r wall ratio c0 c1 <<< "$(figures "$work/$schedule.json" "$microbatches" "${first:-0}")"
    first=${first:-$wall}
    echo "| $schedule | $wall | ${ratio}x | $c0, $c1 | $bytes |"
  done
done
