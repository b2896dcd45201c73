"""Sufficient statistics of tensors, and the step's entries they accumulate into.

An activation, a gradient or an update is summarised as its sum of squares, element count, max |x| and non-finite
count (finite entries only), so micro-batches of gradient accumulation and the ranks of a distributed run combine
exactly: sums add, maxima take the max (:func:`merge`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import fused
from .fused import absmax


def act_stats(x: torch.Tensor) -> dict[str, float]:
    """Sum of squares, count, max |x| and non-finite count of a tensor (finite entries only), in float32."""
    return batch_stats([x])[0]


def batch_stats(xs: list[torch.Tensor], max_abs: bool = True, rows: bool = False) -> list[dict[str, float]]:
    """:func:`act_stats` of several tensors: one fused call for those it takes, else one norm kernel per (device,
    dtype) and one host transfer per group.

    The fast path is one read per tensor on the CPU (:mod:`.fused`), else a sum of squares and a min/max per
    tensor; a tensor whose numbers come back non-finite (or overflow) is summarised again exactly, its non-finite
    entries counted and left out. ``max_abs=False`` skips the min/max pass (no ``"max"`` in the result).
    ``rows=True`` adds ``"min_row_sumsq"`` (the smallest Σx² over the last dimension's rows) where the fused path
    gave it and every entry is finite.
    """
    out: list[dict[str, float] | None] = [None] * len(xs)
    xs = [x if x.is_floating_point() else x.detach().float() for x in xs]
    got = fused.sum_columns(xs, rows=rows)  # CPU float32 with numba: all in one read each, one call
    if got is not None:
        take, sumsq, bits, low = got
        tops = fused.max_abs_values(bits)
        fine = (bits < fused.INF_BITS) & np.isfinite(sumsq)
        for i, ss, mx, lo, ok in zip(take, sumsq.tolist(), tops.tolist(), low.tolist(), fine.tolist(), strict=True):
            if ok:  # every entry finite: the sums as they are
                st = {"sumsq": ss, "n": xs[i].numel(), "max": mx, "nonfinite": 0}
                if not max_abs:
                    del st["max"]
                if rows:
                    st["min_row_sumsq"] = lo
                out[i] = st
            else:  # the exact path, which counts and leaves out the non-finite entries
                out[i] = _finish(xs[i].detach(), ss, *((-mx, mx) if max_abs else (None, None)))
    todo: dict[tuple, list[int]] = {}
    ts: dict[int, torch.Tensor] = {}
    for i, x in enumerate(xs):
        if out[i] is not None:
            continue
        x = ts[i] = x.detach()
        if x.numel() == 0:
            out[i] = {"sumsq": 0.0, "n": 0, "max": 0.0, "nonfinite": 0}
        else:
            todo.setdefault((x.device, x.dtype), []).append(i)
    for ids in todo.values():
        group = [ts[i] for i in ids]
        sums = [_sumsq(x) for x in group]
        ends = [torch.aminmax(x) for x in group] if max_abs else []
        cols = torch.stack([*sums, *(e.min.double() for e in ends), *(e.max.double() for e in ends)]).tolist()
        n = len(group)
        for j, i in enumerate(ids):
            out[i] = _finish(ts[i], cols[j], *((cols[n + j], cols[2 * n + j]) if max_abs else (None, None)))
    return out  # type: ignore[return-value]


def _sumsq(x: torch.Tensor) -> torch.Tensor:
    """Σx² as a float64 scalar tensor: a BLAS dot for contiguous float32/float64 (a third of ``vector_norm``'s
    time on the CPU), the float32 2-norm squared otherwise."""
    if x.dtype in (torch.float32, torch.float64) and x.is_contiguous():
        flat = x.reshape(-1)
        return torch.dot(flat, flat).double()
    return torch.linalg.vector_norm(x, 2, dtype=torch.float32).double().square()


def _finish(x: torch.Tensor, ss: float, lo: float | None, hi: float | None) -> dict[str, float]:
    mx = None if lo is None else max(hi, -lo)
    bad = 0
    if not (math.isfinite(ss) and (mx is None or math.isfinite(mx))):
        fin = torch.isfinite(x)
        bad = int(x.numel() - int(fin.sum()))
        x = torch.where(fin, x, torch.zeros((), dtype=x.dtype))
        ss = float(torch.linalg.vector_norm(x, 2, dtype=torch.float64)) ** 2  # float64: no overflow of Σx²
        mx = None if mx is None else float(absmax(x))
    st = {"sumsq": ss, "n": x.numel(), "max": mx, "nonfinite": bad}
    if mx is None:
        del st["max"]
    return st


def per_sample(x: torch.Tensor) -> dict[str, list[float]]:
    """:func:`act_stats` per sample (dim 0); the non-finite entries are looked for only when the sums say so."""
    x = x.detach()
    if x.dim() == 0:
        x = x.reshape(1)
    flat = x.reshape(x.shape[0], -1)
    if not flat.is_floating_point():
        flat = flat.float()
    rows = flat.shape[0]
    ss, mx = torch.stack([torch.linalg.vector_norm(flat, 2, dim=1, dtype=torch.float32) ** 2,
                          absmax(flat, dim=1)]).tolist() if rows else ([], [])
    bad = [0] * rows
    if not all(math.isfinite(v) for v in ss + mx):
        fin = torch.isfinite(flat)
        bad = (~fin).sum(1).tolist()
        flat = torch.where(fin, flat, torch.zeros((), dtype=flat.dtype))
        ss = (torch.linalg.vector_norm(flat, 2, dim=1, dtype=torch.float32) ** 2).tolist()
        mx = absmax(flat, dim=1).tolist()
    return {"sumsq": ss, "n": [flat.shape[1]] * rows, "max": mx, "nonfinite": bad}


def _most(f, a, b):
    """``f`` (max or min) of two numbers, NaN if either is: Python's own max/min keep or drop a NaN by the order
    of their arguments."""
    if a != a:
        return a
    if b != b:
        return b
    return f(a, b)


def merge(acc: dict[str, Any], new: dict[str, Any]) -> None:
    """Fold one observation into an accumulator: sums add, maxima max, minima min (a NaN kept), per-head lists
    elementwise."""
    for k, v in new.items():
        if k not in acc:
            acc[k] = list(v) if isinstance(v, list) else v
            continue
        old = acc[k]
        if isinstance(v, list):
            if k.startswith("max") or k.startswith("min"):
                f = max if k.startswith("max") else min
                acc[k] = [_most(f, a, b) for a, b in zip(old, v, strict=False)] if len(old) == len(v) else old
            else:
                acc[k] = [a + b for a, b in zip(old, v, strict=False)] if len(old) == len(v) else old
        elif k.startswith("max"):
            acc[k] = _most(max, old, v)
        elif k.startswith("min"):
            acc[k] = _most(min, old, v)
        elif isinstance(v, int | float):
            acc[k] = old + v


class StepEntries:
    """The entries of the step being recorded, by (stage, layer, site), in the order they were first seen (chain
    order); each holds the statistics merged into it so far."""

    def __init__(self) -> None:
        self.acc: dict[tuple, dict[str, Any]] = {}

    def clear(self) -> None:
        self.acc = {}

    def add(self, stage: str, layer: int | None, site: str, stats: dict[str, Any]) -> None:
        key = (stage, layer, site)
        acc = self.acc.get(key)
        if acc is None:
            self.acc[key] = dict(stats)
        else:
            merge(acc, stats)

    def slot(self, key: tuple) -> dict[str, Any]:
        """The entry of ``key``, created empty (it keeps its place in chain order until its statistics come)."""
        return self.acc.setdefault(key, {})

    def records(self) -> list[dict[str, Any]]:
        """The entries whose statistics were taken (one left empty by a disabled probe or an in-place change is
        left out)."""
        return [{"stage": stage, "layer": layer, "site": site, **st} for (stage, layer, site), st in self.acc.items()
                if st]
