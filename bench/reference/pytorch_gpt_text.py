#!/usr/bin/env python3
"""The oracle of `actorpipe train --data text`: PyTorch itself (Debian's python3-torch, the same
kernels as libtorch) trains the same gpt on the same characters, in the same data order, with
the same hyper-parameters, and prints the validation bits per character after every epoch.

What is the same: the corpus (every file of the folder in name order, `.dat` indexes and links
skipped, the last tenth of each held out, one token per distinct byte), the windows of
context + 1 characters, each epoch's order (torch.randperm from a generator seeded with
seed * 1000003 + epoch, as actorpipe's epoch_order), the model (GPT-2's structure and
initialisation: token and position embeddings, pre-LayerNorm blocks with causal attention and a
GELU MLP, final LayerNorm, LM head tied to the token embedding), Adam, the cosine schedule with
linear warm-up, the batch, the last incomplete batch of an epoch dropped, the evaluation (mean
cross-entropy per token over the validation windows, in bits). What differs: the parameters'
initial values (drawn in another order), and that the batch is not cut into micro-batches (the
same mathematics).

    /usr/bin/python3 bench/reference/pytorch_gpt_text.py [--epochs 4] [--threads 2]
"""
import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--text", default="/usr/share/games/fortunes")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--width", type=int, default=128)
parser.add_argument("--context", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--warmup", type=int, default=100)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--eval-batch", type=int, default=1000)
args = parser.parse_args()
torch.set_num_threads(args.threads)


def read_corpus(path):
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if not f.endswith(".dat") and not os.path.islink(os.path.join(path, f))
                       and os.path.isfile(os.path.join(path, f)))
    train, validation = b"", b""
    for f in files:
        text = open(f, "rb").read()
        text.decode("utf-8")  # actorpipe refuses text that is not UTF-8
        held = len(text) // 10
        train += text[:len(text) - held]
        validation += text[len(text) - held:]
    alphabet = sorted(set(train + validation))
    index = {b: i for i, b in enumerate(alphabet)}
    encode = lambda data: torch.tensor([index[b] for b in data], dtype=torch.long)
    return encode(train), encode(validation), len(alphabet)


def windows(tokens, context):
    n = (tokens.numel() - 1) // context
    return (tokens[:n * context].view(n, context).clone(),
            tokens[1:n * context + 1].view(n, context).clone())


class Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.out = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        n, t, c = x.shape
        d = c // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(n, t, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d))
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf")).softmax(-1)
        h = x + self.proj((scores @ v).transpose(1, 2).reshape(n, t, c))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class Gpt(torch.nn.Module):
    def __init__(self, vocabulary, layers, heads, width, context):
        super().__init__()
        self.token = torch.nn.Embedding(vocabulary, width)
        self.position = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.zeros_(p)
            elif p.dim() == 2:
                residual = name.endswith("proj.weight") or name.endswith("out.weight")
                torch.nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if residual else 0.02)

    def forward(self, ids):
        x = self.token(ids) + self.position(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.token.weight)  # the tied head


train, validation, vocabulary = read_corpus(args.text)
x_train, y_train = windows(train, args.context)
x_val, y_val = windows(validation, args.context)
torch.manual_seed(args.seed)
model = Gpt(vocabulary, args.layers, args.heads, args.width, args.context)
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
steps_per_epoch = x_train.shape[0] // args.batch
total = steps_per_epoch * args.epochs
print(f"pytorch {torch.__version__}: gpt, {sum(p.numel() for p in model.parameters())} parameters, "
      f"{train.numel()} characters to train on, {validation.numel()} held out, vocabulary "
      f"{vocabulary}, {args.epochs} epochs of {steps_per_epoch} steps", flush=True)


def learning_rate(step):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return 0.5 * args.lr * (1 + math.cos(math.pi * progress))


step = 0
for epoch in range(args.epochs):
    start = time.time()
    order = torch.randperm(x_train.shape[0],
                           generator=torch.Generator().manual_seed(args.seed * 1000003 + epoch))
    model.train()
    losses = []
    for b in range(steps_per_epoch):
        index = order[b * args.batch:(b + 1) * args.batch]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        optimizer.zero_grad()
        logits = model(x_train[index])
        loss = F.cross_entropy(logits.flatten(0, 1), y_train[index].flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        step += 1
    model.eval()
    total_loss, tokens = 0.0, 0
    with torch.no_grad():
        for begin in range(0, x_val.shape[0], args.eval_batch):
            logits = model(x_val[begin:begin + args.eval_batch])
            target = y_val[begin:begin + args.eval_batch]
            total_loss += F.cross_entropy(logits.flatten(0, 1), target.flatten(),
                                          reduction="sum").item()
            tokens += target.numel()
    val = total_loss / tokens
    print(f"epoch {epoch + 1}/{args.epochs}  train loss {sum(losses) / len(losses):.5f}  "
          f"validation loss {val:.5f}  bits/char {val / math.log(2):.5f}  "
          f"{time.time() - start:.1f} s", flush=True)
