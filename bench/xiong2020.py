"""Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture", Fig. 3 and the warm-up result,
on the CPU with normscope.nn.blocks and normscope.gradflow.

Part 1, at initialisation: the gradient norm of each layer's FFN W2 (``blocks.i.mlp.w2.weight``) for Post-LN
and Pre-LN decoders of 6, 12 and 24 layers, several seeds (the paper: Post-LN's grows with the layer index,
Pre-LN's stays flat and shrinks with depth as 1/√L).
Part 2, training: Adam at a high learning rate with no warm-up, Post-LN vs Pre-LN, on a synthesised corpus
(a first-order Markov chain over 256 tokens, 8 successors per token with Zipf weights, whose entropy rate is the
best loss any model can reach). The paper: Post-LN without warm-up trains badly or not at all; Pre-LN trains.

Run: PYTHONPATH=src .venv/bin/python bench/xiong2020.py [--quick] [--out docs/img]
Writes xiong2020_init.png, xiong2020_train.png and xiong2020.json in --out; prints the measured ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from normscope.gradient_flow import gradflow
from normscope.nn.blocks import TinyLM

VOCAB, SUCCESSORS = 256, 8


def markov_corpus(n_tokens: int, seed: int = 0) -> tuple[torch.Tensor, float]:
    """A token stream from a fixed random Markov chain, and the chain's entropy rate in nats (the loss floor)."""
    rng = np.random.default_rng(seed)
    succ = np.stack([rng.choice(VOCAB, SUCCESSORS, replace=False) for _ in range(VOCAB)])
    w = 1.0 / np.arange(1, SUCCESSORS + 1)
    w /= w.sum()
    out = np.empty(n_tokens, dtype=np.int64)
    out[0] = 0
    picks = rng.choice(SUCCESSORS, n_tokens, p=w)
    for i in range(1, n_tokens):
        out[i] = succ[out[i - 1], picks[i]]
    entropy = float(-(w * np.log(w)).sum())  # every state has the same successor distribution up to labels
    return torch.from_numpy(out), entropy


def batch(stream: torch.Tensor, b: int, t: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - t - 1, (b,), generator=g)
    return torch.stack([stream[s:s + t + 1] for s in starts.tolist()])


def init_gradients(depths, seeds, d, stream) -> dict:
    out: dict = {}
    g = torch.Generator().manual_seed(1234)
    ids = batch(stream, 16, 64, g)
    for placement in ("post", "pre"):
        for L in depths:
            per_seed = []
            for seed in seeds:
                torch.manual_seed(seed)
                model = TinyLM(VOCAB, d, L, heads=4, placement=placement, max_len=128)
                flow = gradflow(model, lambda m: m.loss(ids))
                per_seed.append([flow.grad_norms[f"blocks.{i}.mlp.w2.weight"] for i in range(L)])
            a = np.array(per_seed)
            out[f"{placement}{L}"] = {"placement": placement, "layers": L, "mean": a.mean(0).tolist(),
                                      "std": a.std(0).tolist(), "per_seed": a.tolist(),
                                      "last_over_first": float((a[:, -1] / a[:, 0]).mean()),
                                      "last_over_first_min_max": [float((a[:, -1] / a[:, 0]).min()),
                                                                  float((a[:, -1] / a[:, 0]).max())]}
    return out


def train(placement, L, d, lr, steps, stream, seed=0, warmup=0) -> list[float]:
    torch.manual_seed(seed)
    model = TinyLM(VOCAB, d, L, heads=4, placement=placement, max_len=128)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    # constant lr (no warm-up) unless warmup > 0: then linear from lr/warmup to lr over the first steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    g = torch.Generator().manual_seed(seed + 99)
    losses = []
    for _ in range(steps):
        loss = model.loss(batch(stream, 16, 64, g))
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer seeds and steps (a smoke run)")
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--train-layers", type=int, default=12)
    ap.add_argument("--lrs", default="1e-3,3e-3")
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stream, floor = markov_corpus(200_000)
    seeds = range(2) if a.quick else range(5)
    started = time.perf_counter()
    init = init_gradients((6, 12, 24), seeds, a.d, stream)
    t_init = time.perf_counter() - started
    print(f"part 1 ({t_init:.0f} s): FFN W2 gradient norm, last layer / first layer (mean over {len(seeds)} seeds)")
    for v in init.values():
        lo, hi = v["last_over_first_min_max"]
        print(f"  {v['placement']:>4}-LN L={v['layers']:>2}: first {v['mean'][0]:.4f}  last {v['mean'][-1]:.4f}  "
              f"last/first {v['last_over_first']:.2f} (seeds {lo:.2f}–{hi:.2f})")
    pre_scale = {L: float(np.mean(init[f"pre{L}"]["mean"])) for L in (6, 12, 24)}
    print("  Pre-LN mean W2 gradient over layers by depth: "
          + ", ".join(f"L={L}: {v:.4f}" for L, v in pre_scale.items())
          + f"; L=6 / L=24 = {pre_scale[6] / pre_scale[24]:.2f} (1/√L predicts 2.00)")
    post_over_pre = {L: float(np.mean(np.array(init[f"post{L}"]["per_seed"])[:, -1])
                              / np.mean(np.array(init[f"pre{L}"]["per_seed"])[:, -1])) for L in (6, 12, 24)}
    print("  last layer's W2 gradient, Post-LN / Pre-LN: "
          + ", ".join(f"L={L}: {v:.2f}" for L, v in post_over_pre.items()))

    steps = 60 if a.quick else a.steps
    lrs = [float(x) for x in a.lrs.split(",")]
    runs = {}
    started = time.perf_counter()
    for lr in lrs:
        for placement in ("post", "pre"):
            losses = train(placement, a.train_layers, a.d, lr, steps, stream)
            runs[f"{placement} lr={lr:g}"] = losses
            tail = losses[-20:]
            print(f"  train {placement:>4}-LN L={a.train_layers} lr={lr:g}: loss {losses[0]:.3f} → "
                  f"{float(np.mean(tail)):.3f} (mean of the last 20 of {len(losses)} steps; floor {floor:.3f})")
    warm = max(1, steps // 3)
    losses = train("post", a.train_layers, a.d, lrs[-1], steps, stream, warmup=warm)
    runs[f"post lr={lrs[-1]:g}, warm-up {warm}"] = losses
    print(f"  train post-LN L={a.train_layers} lr={lrs[-1]:g} with {warm} warm-up steps: loss {losses[0]:.3f} → "
          f"{float(np.mean(losses[-20:])):.3f}")
    t_train = time.perf_counter() - started
    print(f"part 2 took {t_train:.0f} s")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3, sharey=True)
    for ax, L in zip(axes, (6, 12, 24), strict=True):
        for placement, color in (("post", "C3"), ("pre", "C0")):
            v = init[f"{placement}{L}"]
            x = np.arange(1, L + 1)
            m, s = np.array(v["mean"]), np.array(v["std"])
            ax.plot(x, m, color=color, marker="o", markersize=3, label=f"{placement.capitalize()}-LN")
            ax.fill_between(x, m - s, m + s, color=color, alpha=0.2)
        ax.set_title(f"{L} layers")
        ax.set_xlabel("layer")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("‖∂L/∂W2‖ at initialisation")
    axes[0].legend()
    fig.suptitle(f"FFN W2 gradient norm per layer at init (d={a.d}, mean ± std over {len(seeds)} seeds)")
    fig.savefig(out / "xiong2020_init.png", dpi=110)

    fig = Figure(figsize=(6.5, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, losses in runs.items():
        color = "C2" if "warm-up" in name else "C3" if name.startswith("post") else "C0"
        last_lr = name.split(",")[0].endswith(f"lr={lrs[-1]:g}")
        ax.plot(losses, color=color, alpha=1.0 if last_lr else 0.5, linestyle="-" if last_lr else ":", label=name)
    ax.axhline(floor, color="gray", linewidth=0.8, label=f"entropy rate {floor:.2f}")
    ax.set_xlabel("step (Adam; constant learning rate unless warm-up)")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(f"{a.train_layers}-layer decoder, d={a.d}, Markov corpus")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.savefig(out / "xiong2020_train.png", dpi=110)
    (out / "xiong2020.json").write_text(json.dumps({
        "init": init, "pre_ln_mean_by_depth": pre_scale, "last_layer_post_over_pre": post_over_pre,
        "train": runs, "entropy_floor": floor,
        "settings": {"d": a.d, "heads": 4, "seeds": list(seeds), "train_layers": a.train_layers, "lrs": lrs,
                     "steps": steps, "batch": [16, 64]},
        "seconds": {"init": t_init, "train": t_train}}, indent=1))
    print(f"wrote {out}/xiong2020_init.png, xiong2020_train.png, xiong2020.json")


if __name__ == "__main__":
    main()
