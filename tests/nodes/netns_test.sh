#!/usr/bin/env bash
# Multi-host: a scheduler and two nodes on three network "hosts" (Linux network namespaces
# joined by veth pairs on a bridge, addresses 10.77.x.1-5), two more nodes for 2 replicas x 2
# stages (pipeline x data across hosts), then a cut link mid-run. Needs root
# and iproute2; exits 77 (CTest: skipped) with the reason where that is not possible.
#   tests/nodes/netns_test.sh path/to/actorpipe
set -euo pipefail
cli=$(readlink -f "$1")
skip() { echo "SKIP: $*"; exit 77; }
[[ $(id -u) -eq 0 ]] || skip "network namespaces need root (this runs as uid $(id -u))"
command -v ip > /dev/null || skip "iproute2's ip is not installed"
command -v python3 > /dev/null || skip "python3 (to compare the JSON reports) is not installed"

tag=ap$$
net=10.77.$(( $$ % 200 + 20 ))
br=${tag}br s=${tag}s a=${tag}a b=${tag}b c=${tag}c d=${tag}d
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2> /dev/null || true; done
  for n in "$s" "$a" "$b" "$c" "$d" "$br"; do ip netns del "$n" 2> /dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
source "$(dirname "$0")/../../tools/netns_hosts.sh"
netns_hosts "$br" "$net" "$s" "$a" "$b" "$c" "$d" 2> /dev/null ||
  skip "cannot create network namespaces here (ip netns add failed)"
echo "hosts: scheduler $net.1, nodes a-d $net.2-5"

printf 'multi-host secret\n' > "$work/secret"
chmod 600 "$work/secret"
start_node() { # namespace address log
  # Gloo (replicas) binds to the host's own link.
  ip netns exec "$1" env ACTORPIPE_GLOO_IFNAME="v$1" "$cli" node --listen "$2:7000" --secret-file "$work/secret" > "$3" 2>&1 &
  pids+=($!)
  for _ in $(seq 300); do grep -q "listening on" "$3" && return 0; sleep 0.1; done
  echo "FAIL: node $2 did not start"; cat "$3"; exit 1
}
start_node "$a" "$net.2" "$work/a.log"
start_node "$b" "$net.3" "$work/b.log"

# Three steps' losses of two --json files agree within 1e-6 (relative); $3 says what agreed.
same_losses() {
  python3 - "$1" "$2" "$3" << 'PY'
import json, sys
remote, local = ([s["loss"] for s in json.load(open(f))["steps"]] for f in sys.argv[1:3])
assert len(remote) == len(local) == 3, (remote, local)
for r, l in zip(remote, local):
    assert abs(r - l) <= 1e-6 * abs(l), (remote, local)
print(sys.argv[3] + ":", remote)
PY
}

common="--data synthetic --model mlp --batch 16 --microbatches 4 --stages 2 --threads 1 --lr 0.1 --seed 5"
ip netns exec "$s" "$cli" train $common --steps 3 --nodes "$net.2:7000,$net.3:7000" \
  --secret-file "$work/secret" --json "$work/remote.json"
"$cli" train $common --steps 3 --json "$work/local.json" > /dev/null
same_losses "$work/remote.json" "$work/local.json" "across hosts: losses equal the in-process run"

# 2 replicas x 2 stages: replica 0 on a and b, replica 1 on c and d; the stages' gradients are
# averaged between a and c, and between b and d; the scheduler's host serves the store.
start_node "$c" "$net.4" "$work/c.log"
start_node "$d" "$net.5" "$work/d.log"
ip netns exec "$s" env ACTORPIPE_GLOO_IFNAME="v$s" "$cli" train $common --steps 3 --replicas 2 \
  --nodes "$net.2:7000,$net.3:7000,$net.4:7000,$net.5:7000" --master-addr "$net.1" \
  --secret-file "$work/secret" --json "$work/remote2d.json"
"$cli" train $common --steps 3 --replicas 2 --json "$work/local2d.json" > /dev/null
same_losses "$work/remote2d.json" "$work/local2d.json" \
  "2 replicas x 2 stages across hosts: losses equal the in-process replicas"

# Cut node b's link while a long run is under way: the run must end with an error within the
# stage wait deadline (5 s), naming what waited for what.
ip netns exec "$s" "$cli" train --data synthetic --model mlp --batch 256 --microbatches 8 \
  --stages 2 --threads 1 --steps 100000 --wait-timeout 5000 --connect-timeout 5000 \
  --nodes "$net.2:7000,$net.3:7000" --secret-file "$work/secret" > "$work/cut.log" 2>&1 &
train=$!
pids+=($train)
for _ in $(seq 300); do grep -q "step 5/" "$work/cut.log" && break; sleep 0.1; done
grep -q "step 5/" "$work/cut.log" || { echo "FAIL: the long run did not start"; cat "$work/cut.log"; exit 1; }
ip -n "$br" link set "p$b" down
cut_at=$(date +%s.%N)
code=0
for _ in $(seq 300); do kill -0 "$train" 2> /dev/null || break; sleep 0.1; done
if kill -0 "$train" 2> /dev/null; then echo "FAIL: the run still hangs 30 s after the cut"; exit 1; fi
wait "$train" || code=$?
took=$(python3 -c "import time; print(round(time.time() - $cut_at, 1))")
tail -2 "$work/cut.log"
[[ $code -eq 1 ]] || { echo "FAIL: exit code $code after the cut, expected 1"; exit 1; }
grep -q "stage 1" "$work/cut.log" || { echo "FAIL: the error does not name stage 1"; exit 1; }
grep -qE "waits for the (gradient|activation)|did not answer (a heartbeat )?within|did not finish within|sending step [0-9]+'s data|lost" "$work/cut.log" ||
  { echo "FAIL: the error does not say what waited"; exit 1; }
python3 -c "import sys; sys.exit(0 if $took < 20 else 1)" ||
  { echo "FAIL: the run took $took s to fail after the cut"; exit 1; }
echo "cut link: the run failed after $took s with the error above"
