"""A nanoGPT-style decoder for the trace tests: SDPA (or eager softmax) attention, pre-norm blocks in a
ModuleList, token ids or float embeddings as input, an optional attention mask."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from normscope.tracing import trace


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, eager: bool = False):
        super().__init__()
        self.heads, self.eager = heads, eager
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = self.c_attn(x).split(D, dim=2)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.eager:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            keep = torch.ones(T, T, dtype=torch.bool).tril() if mask is None else mask
            att = att.masked_fill(~keep, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, D))


class Mlp(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.fault = None  # a callable applied to the hidden activation (fault injection)

    def forward(self, x):
        h = F.gelu(self.fc(x))
        if self.fault is not None:
            h = self.fault(h)
        return self.proj(h)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, eager: bool = False):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), Attention(d, heads, eager)
        self.ln_2, self.mlp = nn.LayerNorm(d), Mlp(d)

    def forward(self, x, mask=None):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 3, t: int = 16,
                 eager: bool = False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.h = nn.ModuleList(Block(d, heads, eager) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx=None, embeds=None, mask=None):
        x = self.wte(idx) if embeds is None else embeds
        x = x + self.wpe(torch.arange(x.shape[1]))
        for b in self.h:
            x = b(x, mask)
        return self.lm_head(self.ln_f(x))


def layer_groups(model: GPT, lr: float) -> list[dict]:
    """One optimizer param group per block (and one for the rest): what a per-layer learning rate needs."""
    inner = {id(p) for b in model.h for p in b.parameters()}
    return ([{"params": list(b.parameters()), "lr": lr} for b in model.h]
            + [{"params": [p for p in model.parameters() if id(p) not in inner], "lr": lr}])


STEPS, FAULT, B, T, V = 24, 16, 4, 16, 64


def train(run_dir, fault=None, steps=STEPS, every=1, eager=False, accumulate=1, embeds=False, **kw):
    """A small AdamW training run on random tokens; ``fault(model, opt, step, batch)`` may change the step."""
    torch.manual_seed(0)
    model = GPT(vocab=V, t=T, eager=eager)
    opt = torch.optim.AdamW(layer_groups(model, 3e-3))
    g = torch.Generator().manual_seed(1)
    with trace(model, run_dir, every=every, **kw) as tr:
        for step in range(steps):
            for _ in range(accumulate):
                targets = torch.randint(0, V, (B, T), generator=g)
                batch = {"embeds": torch.randn(B, T, 32, generator=g)} if embeds else {"idx": targets}
                undo = fault(model, opt, step, batch) if fault else None
                logits = model(**batch)
                losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
                (losses.mean() / accumulate).backward()
            opt.step()
            opt.zero_grad()
            tr.step(step, loss=losses.mean().item(), sample_ids=[f"s{step}-{i}" for i in range(B)], losses=losses)
            if undo:
                undo()
    return model, tr


def nan_gradient_at(fault_step: int, block: int = 1):
    """A ``train`` fault: at ``fault_step`` the gradient behind block ``block``'s MLP hidden activation turns NaN."""
    def fault(model, opt, step, batch):
        if step == fault_step:
            def poison(h):
                h.register_hook(lambda g: g * float("nan"))
                return h
            model.h[block].mlp.fault = poison

            def undo():
                model.h[block].mlp.fault = None
            return undo
    return fault
