"""Overhead of ``normscope.trace`` on a training step, as same-run ratios traced / untraced.

A 6-layer, 256-wide pre-norm decoder (8 heads, MLP 4×, vocabulary 4096, SDPA causal attention), batch 8 × 128,
AdamW, on the CPU. Targets: ≤ 10 % at ``every=1``, ≤ 2 % at ``every=10``. For comparison, a naive forward-hook
cache (every module's output cloned, as an activation cache does) in the same run. The configurations are
interleaved in blocks of 10 steps over several rounds, and each is summarised by the median of its per-block
mean step time, so drift of a shared machine's load hits them alike.
Run: .venv/bin/python bench/trace.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from normscope.tracing import diagnose, trace

V, D, H, L, B, T = 4096, 256, 8, 6, 8, 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in self.qkv(self.ln_1(x)).split(D, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class HookCache:
    """The naive alternative: every module's output kept (detached clone) by forward hooks."""

    def __init__(self, model):
        self.model, self.cache, self.handles = model, {}, []

    def __enter__(self):
        for name, m in self.model.named_modules():
            self.handles.append(m.register_forward_hook(
                lambda mod, args, out, name=name: self.cache.__setitem__(name, out.detach().clone())
                if isinstance(out, torch.Tensor) else None))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.cache.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Decoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, V, (B, T), generator=g) for _ in range(4)]

    def steps(n, tr=None):
        t0 = time.perf_counter()
        for s in range(n):
            idx = batches[s % len(batches)]
            loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if tr is not None:
                tr.step(s, loss=loss.item())
        return (time.perf_counter() - t0) / n

    tmp = tempfile.mkdtemp(prefix="normscope-bench-trace-")
    steps(3)  # warm-up
    times: dict[str, list[float]] = {"untraced": [], "every=1": [], "every=10": [], "hook cache": []}
    for r in range(args.rounds):
        times["untraced"].append(steps(args.block))
        with trace(model, f"{tmp}/e1") as tr:
            times["every=1"].append(steps(args.block, tr))
        with trace(model, f"{tmp}/e10", every=10) as tr:
            times["every=10"].append(steps(args.block, tr))
        with HookCache(model):
            times["hook cache"].append(steps(args.block))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()),
              flush=True)
    base = statistics.median(times["untraced"])
    print(f"\n{L}-layer {D}-wide decoder, batch {B}×{T}, vocabulary {V}, AdamW, {torch.get_num_threads()} threads; "
          f"median of {args.rounds} blocks of {args.block} steps")
    targets = {"every=1": 0.10, "every=10": 0.02}
    for k, v in times.items():
        med = statistics.median(v)
        spread = (min(v) / base - 1) * 100, (max(v) / base - 1) * 100
        line = f"  {k:>10}: {med * 1e3:7.1f} ms/step  ratio {med / base:.3f}"
        if k != "untraced":
            line += f"  (blocks: {spread[0]:+.1f}% … {spread[1]:+.1f}%)"
        if k in targets:
            ok = med / base - 1 <= targets[k]
            line += f"  target ≤ {targets[k]:.0%}: {'met' if ok else 'MISSED'}"
        print(line)
    d = diagnose(f"{tmp}/e1")
    print(f"\ntrace of the every=1 run: {len(d.steps)} records "
          f"(header lines from {args.rounds} tracer sessions), anomalies: {len(d.anomalies)}")
    assert not math.isnan(base)


if __name__ == "__main__":
    main()
