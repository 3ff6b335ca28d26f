#!/usr/bin/env bash
# One command on every process a cluster's launcher starts, on this host (loopback): 2 stages x
# 2 replicas over 4 processes (CLUSTER_LAYOUT=4x1: 4 stages of one replica, for a build without
# Gloo, whose replicas cannot meet on the CPU), losses equal to the same command in one process.
#   tests/cli/cluster_launchers.sh ACTORPIPE slurm
#     the 4 processes as srun starts them (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
#     SLURM_JOB_NODELIST), as `actorpipe launch` starts them (torchrun's variables), and a world
#     that cannot hold the layout refused
#   tests/cli/cluster_launchers.sh ACTORPIPE python PYTHON
#     the user's script through actorpipe.Pipeline (tests/cli/cluster_script.py) on 4 processes
#     with torchrun's variables: rank 0's losses equal the script's alone, every rank exits 0
#   tests/cli/cluster_launchers.sh ACTORPIPE torchrun PYTHON
#     PyTorch's own torchrun (PYTHON -m torch.distributed.run, c10d rendezvous), then a rank
#     killed mid-run: torchrun restarts the group, which resumes from the newest checkpoint, every
#     later loss the fault-free run's. Exits 77 (CTest: skipped) when PYTHON has no torchrun that
#     runs here.
set -euo pipefail
cli=$(readlink -f "$1")
mode=$2
skip() { echo "SKIP: $*"; exit 77; }
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2> /dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

layout=${CLUSTER_LAYOUT:-2x2}
stages=${layout%x*} replicas=${layout#*x}
common="--data synthetic --model mlp --microbatches 4 --stages $stages --replicas $replicas --threads 1 --lr 0.1 --seed 5 --no-progress"
# The losses of the steps both --json files hold agree within 1e-6 (relative); $3 says what.
same_losses() {
  python3 - "$1" "$2" "$3" << 'PY'
import json, sys
run, reference = ({s["step"]: s["loss"] for s in json.load(open(f))["steps"]} for f in sys.argv[1:3])
assert run and set(run) <= set(reference), (sorted(run), sorted(reference))
for step, loss in run.items():
    assert abs(loss - reference[step]) <= 1e-6 * abs(reference[step]), (step, loss, reference[step])
print(f"{sys.argv[3]}: steps {min(run)}-{max(run)} equal")
PY
}

if [[ $mode == slurm ]]; then
  "$cli" train $common --batch 16 --steps 3 --json "$work/local.json" > /dev/null
  # srun's variables, one task per process; the store on the node list's first host.
  port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  for rank in 3 2 1 0; do
    env -u RANK -u WORLD_SIZE SLURM_PROCID=$rank SLURM_NTASKS=4 SLURM_LOCALID=$rank \
      SLURM_JOB_NODELIST=localhost SLURM_JOB_ID=77 MASTER_PORT=$port \
      "$cli" train $common --batch 16 --steps 3 --json "$work/slurm$rank.json" > "$work/slurm$rank.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { cat "$work"/slurm*.log; echo "FAIL: a Slurm task failed"; exit 1; }; done
  pids=()
  grep -q "4 ranks (slurm): $stages stages x $replicas replicas, one stage per rank" "$work/slurm0.log"
  same_losses "$work/slurm0.json" "$work/local.json" "Slurm's variables, 4 tasks"
  "$cli" launch --nproc 4 -- train $common --batch 16 --steps 3 --json "$work/launch.json" > "$work/launch.log" 2>&1 ||
    { cat "$work/launch.log"; echo "FAIL: launch"; exit 1; }
  same_losses "$work/launch.json" "$work/local.json" "torchrun's variables (actorpipe launch), 4 ranks"
  code=0
  "$cli" launch --nproc 3 -- train $common --batch 16 --steps 3 > "$work/bad.log" 2>&1 || code=$?
  [[ $code -eq 2 ]] || { cat "$work/bad.log"; echo "FAIL: 3 ranks for $layout stages exited $code, not 2"; exit 1; }
  grep -q "the 3 processes torchrun started (WORLD_SIZE=3) cannot hold --stages $stages x --replicas $replicas = 4 stages" "$work/bad.log" ||
    { cat "$work/bad.log"; echo "FAIL: the refusal does not name both numbers"; exit 1; }
  echo "3 ranks for $stages x $replicas stages: refused, naming both numbers"
  exit 0
fi

python=$3
if [[ $mode == python ]]; then
  script=$(dirname "$(readlink -f "$0")")/cluster_script.py
  "$python" "$script" "$stages" "$replicas" "$work/alone.json" > /dev/null
  port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  for rank in 0 1 2 3; do
    RANK=$rank WORLD_SIZE=4 LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$python" "$script" "$stages" "$replicas" "$work/rank$rank.json" > "$work/py$rank.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { cat "$work"/py*.log; echo "FAIL: a rank of the script failed"; exit 1; }; done
  pids=()
  [[ ! -e $work/rank1.json ]] || { echo "FAIL: rank 1 ran the script past Pipeline(...)"; exit 1; }
  grep -q "rank 1 of 4 (torchrun, pid [0-9]*) hosts a stage" "$work/py1.log"
  same_losses "$work/rank0.json" "$work/alone.json" "the script on 4 ranks (actorpipe.Pipeline)"
  exit 0
fi
"$python" -c "from torch.distributed.elastic.multiprocessing.api import Std; assert Std.from_str('0') is not None" 2> /dev/null ||
  skip "$python has no torchrun that runs here (Debian's torch 1.13 torchrun fails under Python 3.11: its Std.from_str returns None)"
torchrun() { "$python" -m torch.distributed.run "$@"; }
# A libtorch 1.x build cannot speak torch 2.x's store, which torchrun's agent serves: rank 0
# then serves one (the message of a run without this says so).
if "$cli" --version 2>&1 | grep -q "libtorch 1\."; then
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
cd "$work"
"$cli" train $common --batch 16 --steps 3 --json "$work/local.json" > /dev/null
torchrun --standalone --nproc_per_node 4 --no_python "$cli" train $common --batch 16 --steps 3 \
  --json "$work/torchrun.json" > "$work/torchrun.log" 2>&1 || { cat "$work/torchrun.log"; echo "FAIL: torchrun"; exit 1; }
same_losses "$work/torchrun.json" "$work/local.json" "torchrun --standalone, 4 ranks"

# A node's rank killed after the checkpoint of step 20, then the driver (rank 0) after step 50's:
# torchrun restarts the group each time, which resumes from the newest checkpoint.
long="$common --batch 256 --steps 100 --checkpoint-every 5"
"$cli" train $long --checkpoint-dir "$work/ck-local" --json "$work/long.json" > /dev/null
torchrun --standalone --nproc_per_node 4 --max_restarts 2 --monitor_interval 0.2 --no_python "$cli" train $long \
  --checkpoint-dir "$work/ck" --json "$work/restarted.json" > "$work/restart.log" 2>&1 &
run=$!
pids+=($run)
kill_after() { # checkpoint pattern-naming-the-pid
  for _ in $(seq 600); do [[ -d $work/ck/$1 ]] && break; sleep 0.05; done
  local victim
  victim=$(grep -o "$2 [0-9]*" "$work/restart.log" | tail -n 1 | grep -o "[0-9]*$" || true)
  [[ -d $work/ck/$1 && -n $victim ]] || { cat "$work/restart.log"; echo "FAIL: no $1, or no pid in '$2'"; exit 1; }
  kill -9 "$victim"
}
kill_after step-20 "rank 2 of 4 (torchrun, pid"
kill_after step-50 "rank 0 (pid"
wait "$run" || { cat "$work/restart.log"; echo "FAIL: torchrun did not finish the job after the restarts"; exit 1; }
grep -q "restart 2 of the group (torchrun): resuming from .*/ck/step-" "$work/restart.log" ||
  { cat "$work/restart.log"; echo "FAIL: the restarted group did not resume from a checkpoint"; exit 1; }
same_losses "$work/restarted.json" "$work/long.json" "rank 2, then rank 0 killed, the group restarted by torchrun"
if pgrep -f "$work/ck" > /dev/null; then echo "FAIL: processes of the job are still running"; exit 1; fi
echo "no process of the job is left"
