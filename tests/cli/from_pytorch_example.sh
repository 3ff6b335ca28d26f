#!/usr/bin/env bash
# examples/from_pytorch as docs/from-pytorch.md runs it: Python exports a model (torch.export on
# PyTorch 2.x; TorchScript on 1.13) and its data, actorpipe trains it over 2 stages and writes it
# back, Python measures the trained model.
#   from_pytorch_example.sh ACTORPIPE SOURCE_DIR [PYTHON]
set -euo pipefail
actorpipe=$1
source_dir=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3=${3:-/usr/bin/python3}
"$python3" "$source_dir/examples/from_pytorch/make_model.py" "$dir"
model=model.pt optimizer=adam
[[ -f $dir/model.pt2 ]] && model=model.pt2 optimizer=adamw
"$actorpipe" train --model "$dir/$model" --data "tensors:$dir/data.pt" \
  --stages 2 --microbatches 4 --batch 64 --steps 150 --optimizer $optimizer --lr 1e-2 \
  --export "$dir/trained.${model#model.}" --no-progress
out=$("$python3" "$source_dir/examples/from_pytorch/make_model.py" "$dir" --check)
echo "$out"
# Eight spirals: chance is 0.125; the trained model must have learnt them.
accuracy=$(echo "$out" | sed -n 's/.*: \([0-9.]*\)$/\1/p')
"$python3" -c "import sys; sys.exit(0 if float('$accuracy') >= 0.8 else 1)" ||
  { echo "accuracy $accuracy is below 0.8"; exit 1; }
