#!/usr/bin/env python3
"""A model written in Python, trained by actorpipe, and back (docs/from-pytorch.md).

    python3 make_model.py OUT_DIR            # OUT_DIR/model.pt and OUT_DIR/data.pt
    actorpipe train --model OUT_DIR/model.pt --data tensors:OUT_DIR/data.pt \
        --stages 2 --microbatches 4 --batch 64 --steps 150 --optimizer adam --lr 1e-2 \
        --export OUT_DIR/trained.pt
    python3 make_model.py OUT_DIR --check     # accuracy of OUT_DIR/trained.pt in PyTorch

The model classifies points of eight interleaved spirals: an MLP with LayerNorm and GELU whose
middle is a residual block (a forward that is more than a chain of children). actorpipe cuts
the Sequential between its children; each child keeps its scripted forward.
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Residual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(F.gelu(self.norm(x)))


def spirals(n, classes=8, generator=None):
    labels = torch.randint(classes, (n,), generator=generator)
    radius = torch.rand(n, generator=generator)
    angle = labels * (2 * math.pi / classes) + 3.0 * radius
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return points + 0.02 * torch.randn(n, 2, generator=generator), labels


def main():
    out = sys.argv[1]
    if "--check" in sys.argv:
        model = torch.jit.load(f"{out}/trained.pt").eval()
        points, labels = spirals(2000, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            accuracy = (model(points).argmax(1) == labels).float().mean().item()
        print(f"accuracy of {out}/trained.pt on fresh points: {accuracy:.3f}")
        return
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2, 64), nn.GELU(),
        Residual(64), Residual(64), Residual(64),
        nn.LayerNorm(64), nn.Linear(64, 8))
    torch.jit.save(torch.jit.script(model), f"{out}/model.pt")
    points, labels = spirals(9600, generator=torch.Generator().manual_seed(0))
    torch.save({"inputs": points, "targets": labels}, f"{out}/data.pt")
    print(f"wrote {out}/model.pt ({sum(p.numel() for p in model.parameters())} parameters) and "
          f"{out}/data.pt ({len(labels)} points)")


main()
