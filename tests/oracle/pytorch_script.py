#!/usr/bin/env python3
"""Models written in Python, for actorpipe's TorchScript importer (docs/from-pytorch.md) and its
tests (tests/models/torchscript_test.cpp, tests/engine/script_oracle_test.cpp).

Three commands, one intra-op thread:

    make  --model mlp|cnn|residual|gpt|tuple --out DIR [--samples N] [--seed S]
          scripts the model (torch.jit.script of an nn.Sequential) into DIR/model.pt and writes
          its data as DIR/data.pt = torch.save({"inputs": X, "targets": Y}).
    train --model FILE --data FILE --steps S --batch B [--microbatches M] [--loss mse|cross_entropy]
          [--optimizer sgd|adam] [--lr] [--momentum] [--weight-decay] [--parameters OUT]
          trains FILE as actorpipe does: batch k is rows [k B, (k + 1) B) of the data (wrapping
          around), split into M micro-batches whose sizes differ by at most one (earlier ones
          larger), each micro-batch's mean loss weighted by its share of the batch, gradients
          accumulated, then one optimizer step. Prints {"losses": [...]} and writes the trained
          parameters and buffers to OUT (torch.save of a dict named as actorpipe names them).
    run   --model FILE --data FILE --out OUT
          evaluates FILE (eval mode) on the data's inputs and saves {"outputs": Y, "inputs": X}
          to OUT.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)


class Residual(nn.Module):
    """x + f(x): a block whose forward is more than a chain of children."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(F.gelu(self.norm(x)))


class Split(nn.Module):
    """A layer that returns a tuple: (features, a mask that takes no gradient)."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        h = self.fc(x)
        return h, (x > 0)


class Join(nn.Module):
    """Takes the tuple the previous layer returned."""

    def __init__(self, width, classes):
        super().__init__()
        self.fc = nn.Linear(width, classes)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]):
        h, mask = x
        return self.fc(torch.relu(h) * mask.to(h.dtype))


class Listify(nn.Module):
    """A child that returns a list: not a layer actorpipe can run."""

    def forward(self, x) -> list[torch.Tensor]:
        return [x, 2 * x]


class Block(nn.Module):
    """A pre-LayerNorm causal self-attention block with a GELU MLP."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        n, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(n, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(n, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(n, t, self.heads, c // self.heads).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / float(c // self.heads) ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Embed(nn.Module):
    def __init__(self, vocabulary, width, context):
        super().__init__()
        self.token = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(context, width)

    def forward(self, ids):
        positions = torch.arange(ids.size(1), device=ids.device)
        return self.token(ids) + self.position(positions)


def make(args):
    torch.manual_seed(args.seed)
    n = args.samples
    if args.model == "mlp":
        model = nn.Sequential(
            nn.Flatten(), nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(),
            nn.Sequential(nn.Linear(32, 32), nn.GELU()), nn.Linear(32, 5))
        inputs, targets = torch.randn(n, 4, 4), torch.randint(5, (n,))
    elif args.model == "cnn":
        model = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))
        inputs, targets = torch.randn(n, 1, 8, 8), torch.randint(3, (n,))
    elif args.model == "residual":
        model = nn.Sequential(nn.Linear(6, 12), Residual(12), Residual(12), nn.Linear(12, 4))
        inputs, targets = torch.randn(n, 6), torch.randn(n, 4)
    elif args.model == "tuple":
        model = nn.Sequential(nn.Linear(6, 8), Split(8), Join(8, 3))
        inputs, targets = torch.randn(n, 6), torch.randint(3, (n,))
    elif args.model == "gpt":
        vocabulary, width, context = 11, 16, 8
        model = nn.Sequential(Embed(vocabulary, width, context), Block(width, 2), Block(width, 2),
                              nn.LayerNorm(width), nn.Linear(width, vocabulary, bias=False))
        model[4].weight = model[0].token.weight  # the head tied to the token embedding
        inputs = torch.randint(vocabulary, (n, context))
        targets = torch.randint(vocabulary, (n, context))
    elif args.model == "bench_mlp":
        # bench/micro/script_bench.cpp builds the same in C++.
        model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                              nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
        inputs, targets = torch.randn(n, 256), torch.randint(10, (n,))
    elif args.model == "bench_gpt":
        # The sizes of the built-in gpt in bench/micro/script_bench.cpp.
        vocabulary, width, context = 64, 128, 64
        model = nn.Sequential(Embed(vocabulary, width, context),
                              *[Block(width, 4) for _ in range(4)],
                              nn.LayerNorm(width), nn.Linear(width, vocabulary, bias=False))
        model[-1].weight = model[0].token.weight
        inputs = torch.randint(vocabulary, (n, context))
        targets = torch.randint(vocabulary, (n, context))
    elif args.model == "notseq":
        model = Residual(4)
        inputs, targets = torch.randn(n, 4), torch.randn(n, 4)
    elif args.model == "badchild":
        model = nn.Sequential(nn.Linear(4, 4), Listify())
        inputs, targets = torch.randn(n, 4), torch.randn(n, 4)
    else:
        raise SystemExit("unknown model " + args.model)
    torch.jit.save(torch.jit.script(model), f"{args.out}/model.pt")
    if args.export:
        # The same model as a torch.export program (PyTorch 2.x), its batch dimension dynamic.
        batch = torch.export.Dim("batch")
        program = torch.export.export(model, (inputs[:2],), dynamic_shapes=({0: batch},))
        torch.export.save(program, f"{args.out}/model.pt2")
    torch.save({"inputs": inputs, "targets": targets}, f"{args.out}/data.pt")
    print(json.dumps({"model": f"{args.out}/model.pt", "data": f"{args.out}/data.pt"}))


def loss_of(name, y, t):
    if name == "mse":
        return F.mse_loss(y, t)
    if y.dim() > 2:
        return F.cross_entropy(y.reshape(-1, y.size(-1)), t.reshape(-1))
    return F.cross_entropy(y, t)


def train(args):
    model = torch.jit.load(args.model)
    model.train()
    data = torch.load(args.data)
    inputs, targets = data["inputs"], data["targets"]
    parameters = list(model.parameters())
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(parameters, lr=args.lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay, nesterov=args.nesterov)
    else:
        optimizer = torch.optim.Adam(parameters, lr=args.lr, weight_decay=args.weight_decay)
    n = inputs.size(0)
    losses = []
    for step in range(args.steps):
        rows = torch.arange(step * args.batch, (step + 1) * args.batch) % n
        x, t = inputs[rows], targets[rows]
        optimizer.zero_grad()
        total = 0.0
        for xs, ts in zip(torch.tensor_split(x, args.microbatches),
                          torch.tensor_split(t, args.microbatches)):
            loss = loss_of(args.loss, model(xs), ts) * (xs.size(0) / args.batch)
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    if args.parameters:
        state = {name: p.detach() for name, p in model.named_parameters()}
        state.update({name: b for name, b in model.named_buffers()})
        torch.save(state, args.parameters)
    print(json.dumps({"losses": losses}))


def run(args):
    model = torch.jit.load(args.model)
    model.eval()
    with torch.no_grad():
        outputs = model(torch.load(args.data)["inputs"])
    # Two entries: libtorch's unpickler reads SETITEMS, not the SETITEM of a one-entry dict.
    torch.save({"outputs": outputs, "inputs": torch.load(args.data)["inputs"]}, args.out)
    # Shared Parameters count once: a tie lost on the way would show as one more.
    print(json.dumps({"shape": list(outputs.shape),
                      "parameters": len(list(model.parameters()))}))


parser = argparse.ArgumentParser()
parser.add_argument("command", choices=["make", "train", "run"])
parser.add_argument("--model", required=True)
parser.add_argument("--out", default="")
parser.add_argument("--data", default="")
parser.add_argument("--samples", type=int, default=24)
parser.add_argument("--seed", type=int, default=3)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--batch", type=int, default=12)
parser.add_argument("--microbatches", type=int, default=1)
parser.add_argument("--loss", choices=["mse", "cross_entropy"], default="cross_entropy")
parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--momentum", type=float, default=0.0)
parser.add_argument("--weight-decay", type=float, default=0.0)
parser.add_argument("--nesterov", action="store_true")
parser.add_argument("--parameters", default="")
parser.add_argument("--export", action="store_true", help="make: also write model.pt2")
args = parser.parse_args()
{"make": make, "train": train, "run": run}[args.command](args)
