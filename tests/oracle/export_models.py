"""Models written as PyTorch users write them (not nn.Sequentials), for the torch.export tests:
a Llama-style decoder, a ResNet with batch norm and a U-Net whose skips cross stage boundaries.
Each `make_*` returns (model, example inputs, targets, loss name) drawn from `seed`."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings under a boolean mask."""

    def __init__(self, width, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.wq = nn.Linear(width, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, width, bias=False)

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        repeat = self.heads // self.kv_heads
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, width, heads, kv_heads, hidden):
        super().__init__()
        self.attn_norm = RMSNorm(width)
        self.attn = Attention(width, heads, kv_heads)
        self.mlp_norm = RMSNorm(width)
        self.mlp = SwiGLU(width, hidden)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Rotary(nn.Module):
    """The rotary tables for positions 0..t-1 (buffers, sliced per call)."""

    def __init__(self, head_dim, context, base=10000.0):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.outer(torch.arange(context).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, t):
        return self.cos[:t], self.sin[:t]


class Llama(nn.Module):
    def __init__(self, vocabulary=32, width=32, heads=4, kv_heads=2, hidden=64, layers=4,
                 context=16):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.rotary = Rotary(width // heads, context)
        self.layers = nn.ModuleList(Block(width, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens):
        x = self.embed(tokens)
        t = tokens.shape[1]
        cos, sin = self.rotary(t)
        # Causal, and no query attends to padding (token 0; the first token never is one).
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        mask = causal & (tokens != 0)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.head(self.norm(x))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)), inplace=True)
        y = self.bn2(self.conv2(y))
        skip = x if self.down is None else self.down(x)
        return F.relu(y + skip)


class ResNet(nn.Module):
    def __init__(self, classes=10, width=8):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.block1 = BasicBlock(width, width, 1)
        self.block2 = BasicBlock(width, 2 * width, 2)
        self.block3 = BasicBlock(2 * width, 2 * width, 1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.block3(self.block2(self.block1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """Two levels down and up; each decoder level takes the encoder's tensor of its size."""

    def __init__(self, channels=1, width=4):
        super().__init__()
        self.enc1 = conv_block(channels, width)
        self.enc2 = conv_block(width, 2 * width)
        self.bottom = conv_block(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = conv_block(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = conv_block(2 * width, width)
        self.out = nn.Conv2d(width, channels, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        b = self.bottom(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(b), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.out(d1)


def make(name, seed=0, batch=8):
    """(model, inputs, targets, loss) for `name`: llama, resnet or unet."""
    torch.manual_seed(seed)
    if name == "llama":
        model = Llama()
        tokens = torch.randint(0, 32, (batch, 16))
        tokens[:, 0] = torch.randint(1, 32, (batch,))
        return model, tokens, torch.randint(0, 32, (batch, 16)), "cross_entropy"
    if name == "resnet":
        model = ResNet()
        return model, torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,)), \
            "cross_entropy"
    if name == "unet":
        model = UNet()
        return model, torch.randn(batch, 1, 16, 16), torch.randn(batch, 1, 16, 16), "mse"
    raise ValueError(f"unknown model {name}")
