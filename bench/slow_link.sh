#!/usr/bin/env bash
# Schedules over two nodes joined by a slow link: a driver and two `actorpipe node` processes in
# three network namespaces on a bridge, each node's outgoing traffic shaped to RATE (tc tbf; a
# fixed delay instead with "delay:4ms", tc netem; none with "off"), the same gpt trained with each schedule; median ms per step (steps after the
# first two) and against the first schedule, with the stages' compute per micro-batch and the
# bytes of one transfer, to set RATE so that a transfer takes a given share of that compute.
# Needs root and iproute2 (tc); docs/schedules.md#choosing. MODEL, MICROBATCHES (8) and
# PARTITION (time) change the run.
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
for host in "$a" "$b"; do
  case $rate in
  off) ;;
  delay:*) ip netns exec "$host" tc qdisc add dev "v$host" root netem delay "${rate#delay:}" limit 100000 ;;
  *) ip netns exec "$host" tc qdisc add dev "v$host" root tbf rate "$rate" burst 64kb latency 2s ;;
  esac
done
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

echo "link: $rate each way; model: $model; $microbatches micro-batches, 2 stages, 1 thread each, partition $partition"
echo "| schedule | ms/step (median) | vs first | compute ms per micro-batch (stage 0, 1) | MB per transfer |"
echo "| --- | --- | --- | --- | --- |"
first=
IFS=, read -ra list <<< "$schedules"
for schedule in "${list[@]}"; do
  extra=
  [[ $schedule == interleaved* ]] && extra="--chunks 2"
  ip netns exec "$s" timeout 600 "$cli" train --data synthetic $model --microbatches "$microbatches" \
    --stages 2 --threads 1 --steps "$steps" --schedule "$schedule" $extra --seed 3 --no-progress \
    --partition "$partition" \
    --nodes "$net.2:7000,$net.3:7000" --secret-file "$work/secret" --json "$work/$schedule.json" \
    > "$work/$schedule.log" 2>&1 || { echo "| $schedule | failed: $(tail -1 "$work/$schedule.log") |"; continue; }
  line=$(python3 - "$work/$schedule.json" "$microbatches" "${first:-0}" << 'PY'
import json, statistics, sys
j = json.load(open(sys.argv[1]))
m, first = int(sys.argv[2]), float(sys.argv[3])
steps = j["steps"][2:]
wall = statistics.median(s["wall_ms"] for s in steps)
compute = [statistics.median(s["stages"][k]["forward_ms"] + s["stages"][k]["backward_ms"]
                             for s in steps) / m for k in range(2)]
cfg = j["config"]
print(f"{wall:.1f} {first / wall if first else 1.0:.3f} {compute[0]:.2f} {compute[1]:.2f}")
PY
)
  read -r wall ratio c0 c1 <<< "$line"
  first=${first:-$wall}
  bytes=$(python3 -c "
m='''$model'''.split(); g=lambda k, d: int(m[m.index(k) + 1]) if k in m else d
print(round(g('--batch', 32) // $microbatches * g('--context', 64) * g('--width', 128) * 4 / 1e6, 3))")
  echo "| $schedule | $wall | ${ratio}x | $c0, $c1 | $bytes |"
done
