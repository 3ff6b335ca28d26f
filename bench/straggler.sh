#!/usr/bin/env bash
# A straggler: two `actorpipe node` processes on loopback, each pinned to a core of its own, and
# the second slowed after step 30: SLOW=stop (the default) stops it half of the time (SIGSTOP and
# SIGCONT every 50 ms: its transfers stop too), SLOW=hog starts another process on its core (a
# busy loop pinned there: the kernel gives each half the core). Compares the median step time
# over steps 70-150 of
#   fault-free:  the node never slowed
#   named:       slowed, --on-slow-node name (the stage is named, nothing moves)
#   recut:       the same, --on-slow-node recut (layers move off the slow node)
#   planned:     slowed from the start, with the cut recut chose (--partition cut:B) and, with
#                SLOW=hog, the cuts one layer either side of it: the best of them is the layout
#                planned for that speed, and recut / best the throughput recut recovers
# and prints when the stage was named. Needs 2 cores and taskset.
# The fault-free cut is PARTITION's (uniform by default; time balances the stages as profiled).
#   [SLOW=stop|hog] [PARTITION=uniform|time|params] bench/straggler.sh [extra train flags...]
set -uo pipefail
cd "$(dirname "$0")/.."
program=${ACTORPIPE:-build/cli/actorpipe}
work=$(mktemp -d)
main=$BASHPID
trap '[[ $BASHPID == "$main" ]] && { kill $(jobs -p) 2>/dev/null; [[ -n ${KEEP:-} ]] || rm -rf "$work"; }' EXIT
flags=(--data synthetic --model gpt --layers 8 --batch 32 --microbatches 4 --stages 2
  --threads 1 --seed 3 --steps 150 "$@")

wait_for() { timeout "$3" bash -c "until grep -q -- '$2' '$1' 2>/dev/null; do sleep 0.01; done"; }

# Stops process PID half of the time, in 50 ms slices, until killed.
half_stopped() {
  trap 'kill -CONT "$1"; exit 0' TERM
  while :; do
    kill -STOP "$1"
    sleep 0.05
    kill -CONT "$1"
    sleep 0.05
  done
}

slow=${SLOW:-stop}
partition=${PARTITION:-uniform}
[[ $slow == stop || $slow == hog ]] || { echo "SLOW is stop or hog, not $slow"; exit 2; }

# Slows node PID from now until killed: stopped half of the time, or a busy loop on core 1.
slow_down() {
  if [[ $slow == stop ]]; then
    half_stopped "$1"
  else
    exec taskset -c 1 bash -c 'while :; do :; done'
  fi
}

# run LABEL HOG(none|30|0) [train flags...]: prints the median step over steps 70-150.
run() {
  [[ -d $work ]] || { echo "work dir $work gone"; exit 1; }
  local label=$1 hog=$2
  shift 2
  local base=$((20000 + RANDOM % 12000))
  taskset -c 0 "$program" node --listen "127.0.0.1:$base" >"$work/a.log" 2>&1 &
  local a=$!
  taskset -c 1 "$program" node --listen "127.0.0.1:$((base + 1))" >"$work/b.log" 2>&1 &
  local b=$!
  wait_for "$work/a.log" 'listening on' 20
  wait_for "$work/b.log" 'listening on' 20
  b=$(pgrep -f -- "^$program node --listen 127.0.0.1:$((base + 1))") # the node, not a shell
  local busy=""
  if [[ $hog == 0 ]]; then
    slow_down $b &
    busy=$!
  fi
  "$program" train "${flags[@]}" --nodes "127.0.0.1:$base,127.0.0.1:$((base + 1))" \
    --json "$work/$label.json" "$@" >"$work/$label.log" 2>&1 &
  local train=$!
  if [[ $hog == 30 ]]; then
    wait_for "$work/$label.log" 'step 30/' 120
    slow_down $b &
    busy=$!
  fi
  wait $train
  [[ -n $busy ]] && kill "$busy" && wait "$busy" 2>/dev/null
  kill -CONT $b 2>/dev/null
  kill $a $b 2>/dev/null
  wait 2>/dev/null
  python3 - "$work/$label.json" "$label" <<'PY'
import json, statistics, sys
j = json.load(open(sys.argv[1]))
ms = [s["wall_ms"] for s in j["steps"] if 70 <= s["step"] <= 150 and "wall_ms" in s]
named = [(s["step"], s["stage"], round(s["recent_ms"] / s["usual_ms"], 2)) for s in j["slow_stages"]]
print(f"{sys.argv[2]:>10}: median step {statistics.median(ms):.1f} ms over steps 70-150;"
      f" named (step, stage, x) {named}; recuts {j['recuts']}")
PY
  grep -h 'cut anew' "$work/$label.log" | head -1
}

run fault-free none --partition "$partition"
run named 30 --partition "$partition" --on-slow-node name --slow-factor 1.5
run recut 30 --partition "$partition" --on-slow-node recut --slow-factor 1.5
cut=$(python3 -c "import json,sys; r=json.load(open('$work/recut.json'))['recuts']; print(','.join(map(str, r[-1][1:-1])) if r else '')")
if [[ -n $cut ]]; then
  run planned 0 --partition "cut:$cut" --slow-factor 0
  if [[ $slow == hog && $cut != *,* ]]; then # two stages: the cuts either side too
    run planned-below 0 --partition "cut:$((cut - 1))" --slow-factor 0
    run planned-above 0 --partition "cut:$((cut + 1))" --slow-factor 0
  fi
fi
