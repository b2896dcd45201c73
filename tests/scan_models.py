"""Hand-written models for the scan tests, written the ways people write them: functional norms, norms with
uninformative class names, every residual placement, attention by matmul + softmax, and non-norms that
look like one (max-abs scaling is scale-invariant but no normalization).

Factories taking no argument are importable as CLI targets (``scan_models:pre_model``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D = 32


class Thing(nn.Module):
    """An RMSNorm under a name that says nothing (x · rsqrt(mean x² + ε) · w, decomposed)."""

    def __init__(self, d: int = D, eps: float = 1e-6):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w


class Helper(nn.Module):
    """A LayerNorm by division by the standard deviation + ε, under another uninformative name."""

    def __init__(self, d: int = D, eps: float = 1e-5):
        super().__init__()
        self.a = nn.Parameter(torch.linspace(0.8, 1.2, d))
        self.b = nn.Parameter(torch.linspace(-0.1, 0.1, d))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        sd = (x - mu).pow(2).mean(-1, keepdim=True).sqrt()
        return self.a * (x - mu) / (sd + self.eps) + self.b


class MaxAbs(nn.Module):
    """Scale-invariant, but not a normalization: divides by the max |x| of the row."""

    def forward(self, x):
        return x / x.abs().amax(-1, keepdim=True)


class Double(nn.Module):
    def forward(self, x):
        return 2 * x


class Attention(nn.Module):
    """Attention by matmul + softmax; optional norms on queries and keys."""

    def __init__(self, d: int = D, heads: int = 4, qk_norm=None):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.q_norm = qk_norm() if qk_norm else None
        self.k_norm = qk_norm() if qk_norm else None
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        w = self.softmax(q @ k.transpose(-1, -2) / (d // self.h) ** 0.5)
        return self.out((w @ v).transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, d: int = D, inner=None):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.mid = inner(2 * d) if inner else None
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.act(self.fc1(x))
        if self.mid is not None:
            h = self.mid(h)
        return self.fc2(h)


class Block(nn.Module):
    """One residual block; ``style`` is the placement: pre, post, sandwich, reordered, parallel."""

    def __init__(self, style: str, norm=lambda: nn.LayerNorm(D), qk_norm=None, mlp_inner=None):
        super().__init__()
        self.style = style
        self.attn = Attention(qk_norm=qk_norm)
        self.mlp = Mlp(inner=mlp_inner)
        self.n1, self.n2 = norm(), norm()
        if style == "sandwich":
            self.n3, self.n4 = norm(), norm()

    def forward(self, x):
        s = self.style
        if s == "pre":
            x = x + self.attn(self.n1(x))
            return x + self.mlp(self.n2(x))
        if s == "post":
            x = self.n1(x + self.attn(x))
            return self.n2(x + self.mlp(x))
        if s == "sandwich":
            x = x + self.n3(self.attn(self.n1(x)))
            return x + self.n4(self.mlp(self.n2(x)))
        if s == "reordered":
            x = x + self.n1(self.attn(x))
            return x + self.n2(self.mlp(x))
        if s == "parallel":  # two norms on the same stream, GPT-NeoX style
            return x + self.attn(self.n1(x)) + self.mlp(self.n2(x))
        raise ValueError(s)


class Stack(nn.Module):
    """Embedding → optional embedding norm → blocks → optional final norm → head."""

    def __init__(self, styles, norm=lambda: nn.LayerNorm(D), embed_norm=False, final_norm=True, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, D)
        self.embed_norm = norm() if embed_norm else None
        self.blocks = nn.ModuleList(Block(s, norm=norm, **kw) for s in styles)
        self.final = norm() if final_norm else None
        self.head = nn.Linear(D, 50)

    def forward(self, ids):
        x = self.embed(ids)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        for b in self.blocks:
            x = b(x)
        if self.final is not None:
            x = self.final(x)
        return self.head(x)


class FunctionalBlock(nn.Module):
    """Norms as functional calls on parameters the block owns; a q/k RMSNorm by F.rms_norm."""

    def __init__(self, d: int = D, heads: int = 4):
        super().__init__()
        self.h = heads
        self.g1 = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.b1 = nn.Parameter(torch.linspace(-0.2, 0.2, d))
        self.g2 = nn.Parameter(torch.linspace(1.5, 0.5, d))
        self.qg = nn.Parameter(torch.linspace(0.9, 1.1, d // heads))
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = F.layer_norm(x, (d,), self.g1, self.b1, 1e-5)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        q = F.rms_norm(q, (d // self.h,), self.qg, 1e-6)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc(F.gelu(F.rms_norm(x, (d,), self.g2, 1e-5)))


class FunctionalModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(16, D)
        self.blocks = nn.ModuleList([FunctionalBlock(), FunctionalBlock()])
        self.gf = nn.Parameter(torch.ones(D))

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return F.layer_norm(x, (D,), self.gf, None, 1e-6)


class ResBlock(nn.Module):
    """A ResNet basic block: conv-bn-relu-conv-bn, + identity."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.c2(F.relu(self.bn1(self.c1(x))))))


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.layers = nn.Sequential(ResBlock(), ResBlock())
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5)
                    m.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return self.layers(self.gn(self.stem(x)))


def pre_model():
    return Stack(["pre", "pre"])


def odd_model():
    """Oddly named norms (Thing, Helper) around non-norms that look like them (MaxAbs, Double, GELU)."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, D), Thing(), Double(), MaxAbs(), nn.GELU(), Helper(), nn.Linear(D, 4))


def llama_with_wrong_eps():
    """A tiny HF Llama whose last norm uses ε = 1e-5 while its config states 1e-6."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)
    model = transformers.LlamaForCausalLM(config)
    model.model.norm.variance_epsilon = 1e-5
    return model
