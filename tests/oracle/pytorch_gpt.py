#!/usr/bin/env python3
"""PyTorch itself (Debian's python3-torch 1.13.1, the kernels of actorpipe's libtorch) trains
actorpipe's built-in gpt, for tests/engine/pytorch_oracle_test.cpp.

Everything is drawn as actorpipe draws it, so that both start from the same parameters and see
the same tokens: torch.manual_seed(seed), then the modules are built and initialised in
models/models.cpp's order (token and position embeddings, GPT-2's normal init of the
embedding; each block's LayerNorm, qkv, proj, LayerNorm, fc, out, then their normal init, the
residual projections scaled by 1 / sqrt(2 * layers); the final LayerNorm; the head, whose
weight is then the token embedding's). Step k's batch is torch.randint(vocabulary, (batch,
context)) for inputs and again for targets after torch.manual_seed(100 + k). The forward is
the same sequence of operations as GptBlockImpl::forward. One intra-op thread.

Prints one JSON object: the loss of every step (full precision) and, with --parameters FILE,
writes the trained parameters there (torch.save of a dict, named as actorpipe names them).

    /usr/bin/python3 tests/oracle/pytorch_gpt.py --steps 6 --optimizer adam --lr 3e-3
"""
import argparse
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=5)
parser.add_argument("--vocabulary", type=int, default=11)
parser.add_argument("--layers", type=int, default=3)
parser.add_argument("--heads", type=int, default=2)
parser.add_argument("--width", type=int, default=16)
parser.add_argument("--context", type=int, default=8)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--momentum", type=float, default=0.0)
parser.add_argument("--parameters", default="")
args = parser.parse_args()

torch.set_num_threads(1)


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.token = nn.Embedding(args.vocabulary, args.width)
        self.position = nn.Embedding(args.context, args.width)

    def forward(self, ids):
        return self.token(ids) + self.position(torch.arange(ids.size(1)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        c = args.width
        self.ln1 = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c)
        self.fc = nn.Linear(c, 4 * c)
        self.out = nn.Linear(4 * c, c)

    def forward(self, x):
        n, t, c = x.shape
        heads = args.heads
        d = c // heads
        parts = self.qkv(self.ln1(x)).view(n, t, 3, heads, d).permute(2, 0, 3, 1, 4)
        scores = parts[0].matmul(parts[1].transpose(-2, -1)) * (1.0 / math.sqrt(d))
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf")).softmax(-1)
        y = self.proj(scores.matmul(parts[2]).transpose(1, 2).reshape(n, t, c))
        h = x + y
        m = self.out(F.gelu(self.fc(self.ln2(h))))
        return h + m


@torch.no_grad()
def init_gpt(module):
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            residual = name in ("proj", "out")
            m.weight.normal_(0.0, 0.02 / math.sqrt(2.0 * args.layers) if residual else 0.02)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(0.0, 0.02)


torch.manual_seed(args.seed)
named = []  # (actorpipe's layer name, module)
embed = Embed()
init_gpt(embed)
named.append(("embed", embed))
for i in range(args.layers):
    block = Block()
    init_gpt(block)
    named.append((f"block{i}", block))
named.append(("ln_f", nn.LayerNorm(args.width)))
head = nn.Linear(args.width, args.vocabulary, bias=False)
head.weight = embed.token.weight
named.append(("head", head))
model = nn.Sequential(*[m for _, m in named])

if args.optimizer == "adam":
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

losses = []
for step in range(args.steps):
    torch.manual_seed(100 + step)
    x = torch.randint(args.vocabulary, (args.batch, args.context))
    t = torch.randint(args.vocabulary, (args.batch, args.context))
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x).flatten(0, 1), t.flatten())
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

if args.parameters:
    parameters = {}
    for layer, m in named:
        for name, p in m.named_parameters():
            parameters[f"{layer}.{name}"] = p.detach().clone()
    torch.save(parameters, args.parameters)
print(json.dumps({"losses": losses, "torch": torch.__version__}))
