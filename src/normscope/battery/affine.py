"""Section "affine broadcast": γ/β vary only along the contract's parameter axes (and are the target's own)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..layout import take
from ..numerics import constants as C
from ..probe.experiments import varying_axes
from ..results.check import Finding
from .context import Context
from .parameters import probe_affine


def affine(ctx: Context) -> Iterator[Finding]:
    spec = ctx.spec
    if not (spec.gamma or spec.beta):
        yield ctx.finding("affine.broadcast", "γ/β broadcast", "skip", why="the contract has no affine parameters")
        return
    pshape = ctx.layout.param_shape
    expected_axes = list(ctx.layout.param_axes)
    with ctx.target.perturbed_parameters(ctx.rng) as values:
        if values:
            source = "distinct random γ/β in a private copy"
            truth = {f: values[n].reshape(pshape) for f, n in ctx.param_names.items() if n in values}
            pm = probe_affine(ctx)
            gam, bet = pm.gamma, pm.beta
        else:
            source = "the target's own γ/β"
            truth = {}
            gam, bet = ctx.affine_maps
    for field, full in (("gamma", gam), ("beta", bet)):
        if not getattr(spec, field):
            continue
        scale = max(float(np.max(np.abs(full))), 1.0)
        tol = (C.AFFINE_FLOAT64_TOLERANCE if ctx.precise == "float64" else ctx.recovery_tolerance()) * scale
        varies = varying_axes(full, tol)
        offset = spec.gamma_offset if field == "gamma" else 0.0
        extra = sorted(set(varies) - set(expected_axes))
        ok = not extra
        measured: dict[str, Any] = {"varies_along": varies}
        if field in truth and ok:
            err = float(np.max(np.abs(take(full, expected_axes).reshape(pshape) - (truth[field] + offset))))
            measured["max_error_vs_parameter"] = err
            ok = err <= tol
        sym = "γ" if field == "gamma" else "β"
        yield ctx.finding("affine.broadcast", f"{sym} along {expected_axes}", "pass" if ok else "fail", measured,
                          {"varies_along ⊆": expected_axes}, tol,
                          f"{source}: {sym} varies along axes {varies}; the contract indexes it by {expected_axes}",
                          parameter=field, axes=expected_axes)
