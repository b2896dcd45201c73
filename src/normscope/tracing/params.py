"""The model's parameters as one table: each parameter's group as an index, so a recorded step reads all of their
gradients (or updates) in one kernel call and sums them per group with NumPy, instead of a Python pass per
parameter (a pass over 77 parameters cost about a millisecond per step on a small model, whatever their size).

Per group the sums add and the maxima take the max, in parameter order: the same numbers, bit for bit, as folding the
parameters one by one with :func:`.statistics.merge`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import fused
from .discovery import Layout
from .statistics import batch_stats


class Columns:
    """Per-tensor statistics as columns: Σx² (float64), element count, max |x| (float64; NaN or inf where the
    tensor held one) and non-finite count."""

    __slots__ = ("sumsq", "n", "max", "nonfinite")

    def __init__(self, m: int):
        self.sumsq, self.max = np.zeros(m), np.zeros(m)
        self.n, self.nonfinite = np.zeros(m, np.int64), np.zeros(m, np.int64)


def columns(xs: Sequence[torch.Tensor]) -> Columns:
    """:func:`.statistics.batch_stats` of ``xs`` as :class:`Columns`: one kernel call for the CPU float32 tensors
    with finite entries, torch's exact path for the others."""
    out = Columns(len(xs))
    got = fused.sum_columns(xs)
    rest = set(range(len(xs)))
    if got is not None:
        take, sumsq, bits, _ = got
        if take:
            idx = np.array(take, np.int64)
            fine = (bits < fused.INF_BITS) & np.isfinite(sumsq)
            out.sumsq[idx[fine]] = sumsq[fine]
            out.max[idx[fine]] = fused.max_abs_values(bits[fine])
            out.n[idx] = [xs[i].numel() for i in take]
            rest.difference_update(idx[fine].tolist())
    if rest:
        order = sorted(rest)
        for i, st in zip(order, batch_stats([xs[i] for i in order]), strict=True):
            out.sumsq[i], out.n[i], out.max[i], out.nonfinite[i] = st["sumsq"], st["n"], st["max"], st["nonfinite"]
    return out


class ParamTable:
    """``layout``'s parameters in model order, each with the index of its group in ``layout.param_order``."""

    def __init__(self, layout: Layout):
        self.params = layout.params
        self.groups = list(layout.param_order)
        where = {g: j for j, g in enumerate(self.groups)}
        self.group = np.array([where[layout.param_group[id(p)]] for p in self.params], np.int64)
        self.index = {id(p): i for i, p in enumerate(self.params)}

    def by_group(self, rows: np.ndarray, cols: Columns, start_max: float = -np.inf) -> dict[int, dict]:
        """The statistics of the parameters at ``rows`` (ascending) summed per group: {group index: {sumsq, n,
        max, nonfinite}} for the groups they cover; each group's max starts at ``start_max``."""
        g = self.group[rows]
        m = len(self.groups)
        count = np.bincount(g, minlength=m)
        sumsq = np.bincount(g, weights=cols.sumsq, minlength=m)
        n = np.bincount(g, weights=cols.n, minlength=m)
        bad = np.bincount(g, weights=cols.nonfinite, minlength=m)
        top = np.full(m, start_max)
        np.maximum.at(top, g, cols.max)
        return {j: {"sumsq": s, "n": int(k), "max": t, "nonfinite": int(b)}
                for j, c, s, k, t, b in zip(range(m), count.tolist(), sumsq.tolist(), n.tolist(), top.tolist(),
                                            bad.tolist(), strict=True) if c}
