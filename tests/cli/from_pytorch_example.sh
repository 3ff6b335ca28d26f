#!/usr/bin/env bash
# examples/from_pytorch as docs/from-pytorch.md runs it: Python scripts a model and its data,
# actorpipe trains it over 2 stages and exports it, Python measures the trained model.
#   from_pytorch_example.sh ACTORPIPE SOURCE_DIR
set -euo pipefail
actorpipe=$1
source_dir=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3=/usr/bin/python3
"$python3" "$source_dir/examples/from_pytorch/make_model.py" "$dir"
"$actorpipe" train --model "$dir/model.pt" --data "tensors:$dir/data.pt" \
  --stages 2 --microbatches 4 --batch 64 --steps 150 --optimizer adam --lr 1e-2 \
  --export "$dir/trained.pt" --no-progress
out=$("$python3" "$source_dir/examples/from_pytorch/make_model.py" "$dir" --check)
echo "$out"
# Eight spirals: chance is 0.125; the trained model must have learnt them.
accuracy=$(echo "$out" | sed -n 's/.*: \([0-9.]*\)$/\1/p')
"$python3" -c "import sys; sys.exit(0 if float('$accuracy') >= 0.8 else 1)" ||
  { echo "accuracy $accuracy is below 0.8"; exit 1; }
