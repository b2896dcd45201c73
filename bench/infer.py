"""Time and calls of full inference over the zoo.

Target: torch.nn.LayerNorm(64) at (2, 8, 64) in ≤ 0.5 s wall and ≤ 300 target calls on a 2-core machine.
Run: .venv/bin/python bench/infer.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import zoo  # noqa: E402

from normscope import infer  # noqa: E402

SHAPE, IMAGE = (2, 8, 64), (2, 4, 5, 5)


def cases():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    yield "torch LayerNorm(64)", torch.nn.LayerNorm(64), SHAPE, None
    yield "torch LayerNorm([8, 64])", torch.nn.LayerNorm([8, 64]), SHAPE, None
    yield "torch RMSNorm(64)", torch.nn.RMSNorm(64), SHAPE, None
    yield "torch GroupNorm(2, 4)", torch.nn.GroupNorm(2, 4), IMAGE, None
    yield "torch BatchNorm2d(4) train", torch.nn.BatchNorm2d(4), IMAGE, None
    yield "torch BatchNorm2d(4) eval", torch.nn.BatchNorm2d(4).eval(), IMAGE, None
    yield "torch InstanceNorm2d(4)", torch.nn.InstanceNorm2d(4), IMAGE, None
    yield "HF LlamaRMSNorm", LlamaRMSNorm(64), SHAPE, None
    yield "HF GemmaRMSNorm", GemmaRMSNorm(64), SHAPE, None
    yield "NumPy std+eps (primer)", zoo.seed_layer_norm, SHAPE, "numpy"
    yield "wrong: one-pass variance", zoo.one_pass_layernorm, SHAPE, "torch"
    yield "wrong: input-dtype statistics", zoo.InputDtypeStatsRMSNorm(), SHAPE, None


def main() -> None:
    print(f"{'target':32} {'seconds':>8} {'calls':>6}  contract")
    ln_seconds = ln_calls = None
    for name, target, shape, framework in cases():
        infer(target, shape=shape, framework=framework)  # warm-up: imports, first-call costs
        best = None
        for _ in range(3):
            t0 = time.perf_counter()
            r = infer(target, shape=shape, framework=framework)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        print(f"{name:32} {best:8.3f} {r.calls:6d}  {r.spec.summary()}")
        if name == "torch LayerNorm(64)":
            ln_seconds, ln_calls = best, r.calls
    print(f"\nLayerNorm(64) at {SHAPE}: {ln_seconds:.3f} s (target ≤ 0.5 s, ratio {ln_seconds / 0.5:.2f}), "
          f"{ln_calls} calls (target ≤ 300, ratio {ln_calls / 300:.2f})")


if __name__ == "__main__":
    main()
