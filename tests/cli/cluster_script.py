"""The user's script under a cluster's launcher (tests/cli/cluster_launchers.sh python): every rank
runs it; rank 0 trains and writes its losses, the others host a stage inside Pipeline(...).
    cluster_script.py STAGES REPLICAS OUT.json
"""
import json
import sys

import torch

import actorpipe

stages, replicas, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(3)
model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24),
                            torch.nn.Tanh(), torch.nn.Linear(24, 6), torch.nn.Tanh(),
                            torch.nn.Linear(6, 3))
pipe = actorpipe.Pipeline(model, stages=stages, replicas=replicas, microbatches=2,
                          optimizer=("sgd", {"lr": 0.1}), loss="mse", threads=1)
generator = torch.Generator().manual_seed(7)
losses = []
for _ in range(4):
    x = torch.randn(8, 12, generator=generator)
    y = torch.randn(8, 3, generator=generator)
    losses.append(pipe.train_step(x, y))
pipe.close()
with open(out, "w") as f:
    json.dump({"steps": [{"step": i + 1, "loss": loss} for i, loss in enumerate(losses)]}, f)
