#!/usr/bin/env python3
"""Plain PyTorch (Debian's python3-torch, the same kernels as libtorch) on the bench's default
scenario, in its own process: ResNet-50, batch 120 of 3x128x128 random images, one-hot targets,
MSE, SGD lr 0.05; one warm-up step, then timed steps. A cross-check that `actorpipe bench`'s
in-process baselines are not handicapped by sharing a process with the pipelines.

    /usr/bin/python3 bench/reference/pytorch_resnet50.py [--threads 2] [--steps 3]
"""
import argparse
import statistics
import time

import torch
import torchvision

parser = argparse.ArgumentParser()
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--batch", type=int, default=120)
parser.add_argument("--splits", type=int, default=1,
                    help="accumulate gradients over this many micro-batches (same math as a pipeline)")
args = parser.parse_args()

torch.set_num_threads(args.threads)
torch.manual_seed(0)
model = torchvision.models.resnet50(num_classes=1000)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loss_fn = torch.nn.MSELoss()
times, losses = [], []
for step in range(args.steps + 1):
    x = torch.randn(args.batch, 3, 128, 128)
    y = torch.zeros(args.batch, 1000).scatter_(1, torch.randint(0, 1000, (args.batch, 1)), 1)
    start = time.perf_counter()
    optimizer.zero_grad()
    total = 0.0
    for xs, ys in zip(x.chunk(args.splits), y.chunk(args.splits)):
        loss = loss_fn(model(xs), ys) * xs.size(0) / args.batch
        loss.backward()
        total += loss.item()
    optimizer.step()
    elapsed = time.perf_counter() - start
    losses.append(total)
    if step > 0:
        times.append(elapsed)
    print(f"step {step}{' (warm-up)' if step == 0 else ''}: {elapsed:.2f} s, loss {total:.6f}",
          flush=True)
print(f"median {statistics.median(times):.2f} s/step over {args.steps} steps, "
      f"{args.threads} threads, {args.splits} micro-batches")
