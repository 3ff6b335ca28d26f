#!/usr/bin/env python3
"""A model written in Python, trained by actorpipe, and back (docs/from-pytorch.md).

    python3 make_model.py OUT_DIR            # OUT_DIR/model.pt2 and OUT_DIR/data.pt
    actorpipe train --model OUT_DIR/model.pt2 --data tensors:OUT_DIR/data.pt \
        --stages 2 --microbatches 4 --batch 64 --steps 150 --optimizer adamw --lr 1e-2 \
        --export OUT_DIR/trained.pt2
    python3 make_model.py OUT_DIR --check     # accuracy of OUT_DIR/trained.pt2 in PyTorch

The model classifies points of eight interleaved spirals: an MLP with LayerNorm and GELU whose
middle is three residual blocks, written as an nn.Module with its own forward. On PyTorch 2.x
it is exported (torch.export, model.pt2) and actorpipe cuts the graph between its submodules;
on PyTorch 1.13 (Debian's python3-torch, no torch.export) the same layers are scripted as an
nn.Sequential (TorchScript, model.pt), cut between its children. --format pt forces the latter.
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


class Spirals(nn.Module):
    def __init__(self, width=64, classes=8):
        super().__init__()
        self.stem = nn.Linear(2, width)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(3))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = F.gelu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main():
    out = sys.argv[1]
    export = hasattr(torch, "export") and "--format" not in sys.argv
    name = "model.pt2" if export else "model.pt"
    if "--check" in sys.argv:
        trained = f"{out}/trained.{name.split('.')[1]}"
        model = torch.export.load(trained).module() if export else torch.jit.load(trained).eval()
        points, labels = spirals(2000, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            accuracy = (model(points).argmax(1) == labels).float().mean().item()
        print(f"accuracy of {trained} on fresh points: {accuracy:.3f}")
        return
    torch.manual_seed(0)
    model = Spirals()
    points, labels = spirals(9600, generator=torch.Generator().manual_seed(0))
    if export:
        batch = torch.export.Dim("batch")
        program = torch.export.export(model, (points[:64],), dynamic_shapes=({0: batch},))
        torch.export.save(program, f"{out}/{name}")
    else:
        layers = nn.Sequential(model.stem, nn.GELU(), *model.blocks, model.norm, model.head)
        torch.jit.save(torch.jit.script(layers), f"{out}/{name}")
    torch.save({"inputs": points, "targets": labels}, f"{out}/data.pt")
    print(f"wrote {out}/{name} ({sum(p.numel() for p in model.parameters())} parameters) and "
          f"{out}/data.pt ({len(labels)} points)")


main()
