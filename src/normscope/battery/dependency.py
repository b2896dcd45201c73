"""Section "dependency": changing other batch items or other tokens moves a fixed position's group only as
the contract says."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..numerics import constants as C
from ..numerics.tolerance import atol
from ..report.numbers import sig
from ..results.check import Finding
from .context import Context


def dependency(ctx: Context) -> Iterator[Finding]:
    g, d = ctx.groups, ctx.dtype
    p = tuple(0 for _ in ctx.shape)
    own = g.labels == g.labels[p]
    x = ctx.pattern() * 3
    for axis, label, fid in ((0, "other batch items", "dependency.other_batch_items"),
                             (ctx.ndim - 2, "other tokens", "dependency.other_tokens")):
        if axis < 0 or ctx.shape[axis] < 2 or (axis == 0 and label == "other tokens"):
            yield ctx.finding(fid, f"{label} changed", "skip", why=f"axis {axis} has size 1 at this shape", axis=axis)
            continue
        x2 = x.copy()
        idx = np.indices(ctx.shape)[axis]
        change_mask = idx != 0
        x2[change_mask] = ctx.rng.normal(size=int(change_mask.sum())) * 3
        moved = float(np.max(np.abs(ctx.target(x2, d)[own] - ctx.target(x, d)[own])))
        ref_moved = float(np.max(np.abs(ctx.ref(x2)[own] - ctx.ref(x)[own])))
        scale = float(np.max(np.abs(ctx.ref(x))))
        tol = C.CHANGE_RTOL * ref_moved + atol(d, scale) + ctx.noise_floor(scale)
        dev = abs(moved - ref_moved)
        yield ctx.finding(fid, f"{label} changed", "pass" if dev <= tol else "fail", dev, 0.0, tol,
                          f"changing {label} (axis {axis}) moved the fixed position's group by {sig(moved)}; the "
                          f"contract moves it by {sig(ref_moved)}", axis=axis, dtype=d)
