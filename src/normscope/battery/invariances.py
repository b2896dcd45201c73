"""Section "invariances": scale and common shift; measured is how far the output's change departs from the
contract's change."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..numerics import constants as C
from ..numerics.tolerance import atol
from ..report.numbers import sig
from ..results.check import Finding
from .context import Context

SCALE_FACTORS = (5.0,)


def invariances(ctx: Context) -> Iterator[Finding]:
    x = ctx.pattern() * 10 + ctx.rng.normal(size=ctx.shape)
    d = ctx.dtype
    y = ctx.target(x, d)
    floor = ctx.noise_floor(float(np.max(np.abs(y))))
    for a in SCALE_FACTORS:
        ys = ctx.target(a * x, d)
        ref_change = float(np.max(np.abs(ctx.ref(a * x) - ctx.ref(x))))
        change = float(np.max(np.abs(ys - y)))
        tol = ref_change + atol(d, float(np.max(np.abs(y)))) + floor
        dev = abs(change - ref_change)
        yield ctx.finding("invariance.scale", f"scale × {a:g}", "pass" if dev <= tol else "fail", dev, 0.0, tol,
                          f"multiplying the input by {a:g} moved the output by {sig(change)}; the contract moves it "
                          f"by {sig(ref_change)} (only ε breaks exact invariance)", factor=a, dtype=d)
    shift = 3 * float(np.std(x))
    ys = ctx.target(x + shift, d)
    ref_change = float(np.max(np.abs(ctx.ref(x + shift) - ctx.ref(x))))
    change = float(np.max(np.abs(ys - y)))
    scale = float(np.max(np.abs(y)))
    if ctx.spec.center:
        tol = atol(d, scale) * C.SHIFT_ATOL_FACTOR + floor
        dev = max(change - ref_change, 0.0)
        why = f"adding {sig(shift)} to every input moved the output by {sig(change)}; a centred norm must not move"
    else:
        tol = C.CHANGE_RTOL * ref_change + atol(d, scale) + floor
        dev = abs(change - ref_change)
        why = (f"adding {sig(shift)} to every input moved the output by {sig(change)}; an RMS norm must move by "
               f"{sig(ref_change)}")
    yield ctx.finding("invariance.shift", "common shift", "pass" if dev <= tol else "fail", dev, 0.0, tol,
                      why + f" (contract: {sig(ref_change)})", dtype=d)
