"""Section "train/eval rules": training uses batch statistics, the running statistics move by the target's own
momentum (unbiased variance), evaluation uses the running statistics."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ..numerics import constants as C
from ..report.numbers import sig
from ..results.check import Finding
from .context import Context


def modes(ctx: Context) -> Iterator[Finding]:
    spec, t = ctx.spec, ctx.target
    if spec.batch_stats is None:
        return
    if not t.has_modes:
        yield ctx.finding("modes.available", "train/eval rules", "skip", why="the target has no train/eval modes")
        return
    x = ctx.rng.normal(size=ctx.shape) * 2 + 1
    if spec.batch_stats == "frozen":
        yield from _frozen(ctx, x)
        return
    with t.mode(True):
        yield ctx.compare("modes.training_batch_statistics", "training uses batch statistics", x, ctx.dtype,
                          "train mode", spec=spec.replace(batch_stats="batch"))
    before = t.buffers()
    after = t.buffers_after_training_step(x)
    if not after or "running_mean" not in after:
        yield ctx.finding("modes.running_update", "running statistics update", "skip",
                          why="the target exposes no running buffers")
    else:
        yield running_update(ctx, x, before, after)
    if "running_var" in ctx.params or "running_var" in before:
        running = {k: before[k] for k in ("running_mean", "running_var") if k in before}
        with t.mode(False):
            yield ctx.with_params(ctx.params.merged(running)).compare(
                "modes.evaluation_running_statistics", "evaluation uses running statistics", x, ctx.dtype,
                "eval mode", spec=spec.replace(batch_stats="running"))


def _frozen(ctx: Context, x) -> Iterator[Finding]:
    """A frozen BatchNorm: the running statistics in both modes, and a training step leaves them as they were."""
    t = ctx.target
    before = t.buffers()
    running = {k: before[k] for k in ("running_mean", "running_var") if k in before}
    inner = ctx.with_params(ctx.params.merged(running)) if running else ctx
    for training, label in ((True, "train mode"), (False, "eval mode")):
        with t.mode(training):
            yield inner.compare(f"modes.frozen_{'training' if training else 'evaluation'}",
                                f"{label} uses the running statistics", x, ctx.dtype, label)
    after = t.buffers_after_training_step(x)
    if not after or "running_mean" not in after:
        yield ctx.finding("modes.frozen_unchanged", "running statistics never updated", "skip",
                          why="the target exposes no running buffers")
        return
    moved = {k: float(np.max(np.abs(after[k] - before[k]))) for k in ("running_mean", "running_var")
             if k in after and k in before}
    ok = all(v == 0.0 for v in moved.values())
    yield ctx.finding("modes.frozen_unchanged", "running statistics never updated", "pass" if ok else "fail",
                      moved, 0.0, 0.0, "the running statistics stayed as they were after a training step" if ok else
                      f"a training step moved the running statistics (largest change {sig(max(moved.values()))}); "
                      "a frozen contract never updates them")


def running_update(ctx: Context, x, before, after) -> Finding:
    """running_mean and running_var move by the target's stated momentum (else one common one), the variance
    unbiased, and they move at all."""
    axes = ctx.layout.axes
    mean = x.mean(axis=axes)
    var_u = x.var(axis=axes, ddof=1)
    var_b = x.var(axis=axes)
    rm0, rv0 = before["running_mean"].ravel(), before["running_var"].ravel()
    rm1, rv1 = after["running_mean"].ravel(), after["running_var"].ravel()
    with np.errstate(all="ignore"):
        m_mean = np.median((rm1 - rm0) / (mean.ravel() - rm0))
        m_var_u = np.median((rv1 - rv0) / (var_u.ravel() - rv0))
        m_var_b = np.median((rv1 - rv0) / (var_b.ravel() - rv0))
    # the update is checked against the momentum the target states (torch: .momentum), else the mean's
    stated = ctx.target.momentum
    want = stated if stated is not None else m_mean
    with np.errstate(invalid="ignore"):
        off = float(max(abs(m_mean - want), abs(m_var_u - want)))
    tol = C.MOMENTUM_ATOL + C.MOMENTUM_RTOL * abs(want) if np.isfinite(want) else 0.0
    moved = bool(want > C.MIN_MOMENTUM)
    ok = bool(off <= tol) and moved
    if not np.isfinite(off):
        off = math.inf
    source = f"the target's momentum {stated:g}" if stated is not None else "one common momentum"
    why = ("running_mean and running_var must move by " + source + ", the variance unbiased (÷(n−1))"
           f"; measured {sig(m_mean, 4)} (mean), {sig(m_var_u, 4)} (unbiased variance), {sig(m_var_b, 4)} (biased)")
    if not moved:
        why = f"the running statistics did not move in a training step (momentum {sig(m_mean)}); " + why
    return ctx.finding("modes.running_update", "running statistics update", "pass" if ok else "fail",
                       {"momentum_from_mean": m_mean, "momentum_from_var_unbiased": m_var_u,
                        "momentum_from_var_biased": m_var_b, "largest_departure": off},
                       {"momentum": stated if stated is not None else "equal for mean and unbiased variance"}, tol,
                       why)
