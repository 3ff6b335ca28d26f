#!/usr/bin/env bash
# A cluster of two hosts (Linux network namespaces joined by a bridge, tools/netns_hosts.sh),
# each running 2 processes of the same `actorpipe train --stages 2 --replicas 2`: once with
# Slurm's variables as srun sets them (MASTER_ADDR exported as sbatch scripts do), once started by
# PyTorch's torchrun on each host (c10d rendezvous on host 1). Losses equal one process's, each
# replica's stages on one host. Needs root and iproute2; torchrun needs a Python whose torchrun
# runs here (tests/cli/cluster_launchers.sh). Exits 77 (CTest: skipped) without them.
#   tests/nodes/cluster_netns_test.sh ACTORPIPE slurm
#   tests/nodes/cluster_netns_test.sh ACTORPIPE torchrun PYTHON
set -euo pipefail
cli=$(readlink -f "$1")
mode=$2
python=${3:-}
skip() { echo "SKIP: $*"; exit 77; }
[[ $(id -u) -eq 0 ]] || skip "network namespaces need root (this runs as uid $(id -u))"
command -v ip > /dev/null || skip "iproute2's ip is not installed"
if [[ $mode == torchrun ]]; then
  "$python" -c "from torch.distributed.elastic.multiprocessing.api import Std; assert Std.from_str('0') is not None" 2> /dev/null ||
    skip "$python has no torchrun that runs here (Debian's torch 1.13 torchrun fails under Python 3.11)"
fi

tag=apc$$
net=10.78.$(( $$ % 200 + 20 ))
br=${tag}br h1=${tag}1 h2=${tag}2
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2> /dev/null || true; done
  for n in "$h1" "$h2" "$br"; do ip netns del "$n" 2> /dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
source "$(dirname "$0")/../../tools/netns_hosts.sh"
netns_hosts "$br" "$net" "$h1" "$h2" 2> /dev/null || skip "cannot create network namespaces here (ip netns add failed)"
echo "hosts: $net.1 and $net.2, 2 processes each"
printf 'cluster secret\n' > "$work/secret"
chmod 600 "$work/secret"

# CLUSTER_LAYOUT=4x1: 4 stages of one replica (a build without Gloo: tests/cli/cluster_launchers.sh).
layout=${CLUSTER_LAYOUT:-2x2}
stages=${layout%x*} replicas=${layout#*x}
laid="replica 0 on $net.1 (ranks 0, 1), replica 1 on $net.2 (ranks 2, 3)"
[[ $layout == 4x1 ]] && laid="replica 0 on $net.1 (ranks 0, 1) and $net.2 (ranks 2, 3)"
common="--data synthetic --model mlp --batch 16 --microbatches 4 --stages $stages --replicas $replicas --threads 1 --lr 0.1 --seed 5 --steps 3 --no-progress --secret-file $work/secret"
"$cli" train $common --json "$work/local.json" > /dev/null
same_losses() {
  python3 - "$1" "$2" "$3" << 'PY'
import json, sys
run, reference = ([s["loss"] for s in json.load(open(f))["steps"]] for f in sys.argv[1:3])
assert len(run) == len(reference) == 3, (run, reference)
for a, b in zip(run, reference):
    assert abs(a - b) <= 1e-6 * abs(b), (run, reference)
print(sys.argv[3] + ":", run)
PY
}
wait_all() { # what
  for p in "${pids[@]}"; do wait "$p" || { tail -n 20 "$work"/*.log; echo "FAIL: $1"; exit 1; }; done
  pids=()
}

if [[ $mode == slurm ]]; then
  # Slurm: SLURM_PROCID 0-1 on host 1, 2-3 on host 2; the store on host 1.
  for rank in 0 1 2 3; do
    host=$(( rank / 2 + 1 )) ns=$h1
    [[ $host -eq 2 ]] && ns=$h2
    ip netns exec "$ns" env -u RANK -u WORLD_SIZE SLURM_PROCID=$rank SLURM_NTASKS=4 SLURM_LOCALID=$(( rank % 2 )) \
      SLURM_NODEID=$(( host - 1 )) SLURM_JOB_NODELIST="h[1-2]" SLURM_JOB_ID=4242 MASTER_ADDR=$net.1 \
      "$cli" train $common --json "$work/slurm.json" > "$work/slurm$rank.log" 2>&1 &
    pids+=($!)
  done
  wait_all "a Slurm task failed"
  grep -qF "$laid" "$work/slurm0.log" || { cat "$work/slurm0.log"; echo "FAIL: not laid out as $laid"; exit 1; }
  same_losses "$work/slurm.json" "$work/local.json" "2 hosts x 2 Slurm tasks: losses equal one process's"
  exit 0
fi

if "$cli" --version 2>&1 | grep -q "libtorch 1\."; then
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 # (tests/cli/cluster_launchers.sh says why)
fi
# The hosts share one hostname here, so host 1 is told that it serves the rendezvous (is_host),
# and each its own address (--local_addr), which torchrun otherwise takes from the hostname.
for host in 1 2; do
  ns=$h1 is_host=1
  [[ $host -eq 2 ]] && ns=$h2 is_host=0
  (cd "$work" && ip netns exec "$ns" "$python" -m torch.distributed.run --nnodes 2 --nproc_per_node 2 \
    --rdzv_backend c10d --rdzv_endpoint "$net.1:29400" --rdzv_id "$tag" --rdzv_conf is_host=$is_host \
    --local_addr "$net.$host" \
    --no_python "$cli" train $common --json "$work/torchrun.json" > "$work/torchrun$host.log" 2>&1) &
  pids+=($!)
done
wait_all "torchrun failed on a host"
grep -h "replicas, one stage per rank" "$work"/torchrun*.log
# torchrun numbers the hosts in the order they joined the rendezvous: either may hold rank 0.
pattern="replica 0 on 10[0-9.]* (ranks [0-9], [0-9]), replica 1 on 10[0-9.]* (ranks [0-9], [0-9])"
[[ $layout == 4x1 ]] && pattern="replica 0 on 10[0-9.]* (ranks [0-9], [0-9]) and 10[0-9.]* (ranks [0-9], [0-9])"
grep -hq "$pattern" "$work"/torchrun*.log || { echo "FAIL: under torchrun not laid out as $pattern"; exit 1; }
same_losses "$work/torchrun.json" "$work/local.json" "2 hosts x 2 torchrun ranks: losses equal one process's"
