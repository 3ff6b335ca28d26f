#!/usr/bin/env bash
# The two libtorch lines train alike: the main job's first steps (Fashion-MNIST, 2 stages, 1F1B)
# with Debian's libtorch 1.13 and with PyTorch 2.11's, compared loss by loss. Their CPU kernels
# are not the same builds (OpenBLAS and oneDNN versions), so the losses agree to a relative
# 1e-4 after 20 steps (2.9e-8 measured on an AMD EPYC), not bit for bit.
# Usage: torch_lines_agree.sh ACTORPIPE_1_13 ACTORPIPE_2_11; exits 77 (skipped) without the first.
set -euo pipefail
old=$1 new=$2
if [[ ! -x $old ]]; then
  echo "skipped: no build of the 1.13 line at $old (./setup.sh build)"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags=(train --steps 20 --train-samples 1280 --no-progress --threads 1)
"$old" "${flags[@]}" --json "$work/old.json" >"$work/old.log" 2>&1 || { cat "$work/old.log"; exit 1; }
"$new" "${flags[@]}" --json "$work/new.json" >"$work/new.log" 2>&1 || { cat "$work/new.log"; exit 1; }
python3 - "$work/old.json" "$work/new.json" <<'PY'
import json, sys
old, new = (json.load(open(p))["steps"] for p in sys.argv[1:3])
assert len(old) == len(new) == 20, (len(old), len(new))
worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(old, new))
print(f"20 steps: largest relative difference of the losses {worst:.2e}")
print("first losses:", [round(s["loss"], 6) for s in old[:3]], [round(s["loss"], 6) for s in new[:3]])
sys.exit(0 if worst < 1e-4 else 1)
PY
