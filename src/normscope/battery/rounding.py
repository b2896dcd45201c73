"""Section "rounding order": at bf16/fp16 the target sits nearer its contract's rounding than any other's.

Where two contracts are both within the forward bounds but still differ — the cast order and the statistics
dtype — the target must be nearer its own contract's emulation than the alternatives', each contract
represented by the nearest of its faithful formulas (x/σ, x·(1/σ), folded affine): the contract does not fix
that choice, so neither does the rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from .. import reference
from ..numerics import constants as C
from ..precision import Precision
from ..probe.experiments import ulps
from ..results.check import Finding
from ..spec import NormSpec
from .context import Context
from .parameters import perturbed


def variants(spec: NormSpec) -> tuple[str, ...]:
    """The formulas a faithful kernel of ``spec`` may use: x/σ or x·(1/σ), and a folded affine x·a + b where
    the contract applies γ/β before the one cast (or has none)."""
    folded = spec.affine_order == "scale_then_cast" or not (spec.gamma or spec.beta)
    return reference.FORMULAS if folded else tuple(f for f in reference.FORMULAS if f != "folded")


def nearest_variant(ctx: Context, y, x, d: str, spec: NormSpec) -> float:
    """Mean distance (ulps of ``d``) from ``y`` to the nearest faithful formula of ``spec`` at ``d``."""
    ulp = ulps(y, d)
    best = math.inf
    for formula in variants(spec):
        with np.errstate(all="ignore"):
            emul = ctx.ref(x, d, spec=spec, formula=formula)
            best = min(best, float(np.nanmean(np.abs(y - emul) / ulp)))
    return best


def rounding_order(ctx: Context) -> Iterator[Finding]:
    spec = ctx.spec
    for d in ("bfloat16", "float16"):
        if d not in ctx.accepted:
            continue
        # half the groups sit at an offset of 30σ: there statistics held in the input dtype visibly lose
        # the mean, while cast-order differences show everywhere
        g = ctx.groups
        offset = g.spread(np.where(np.arange(g.count) % 2 == 0, 0.0, 30.0))
        x = Precision(d).round((ctx.rng.normal(size=ctx.shape) + offset) * 3).astype(np.float64)
        with perturbed(ctx) as (values, inner):  # distinct γ/β make the order observable
            y = inner.target(x, d)
            mine = nearest_variant(inner, y, x, d, spec)
            other_stats = "input" if spec.stats_dtype == "float32" else "float32"
            others = {f"statistics in {'the input dtype' if other_stats == 'input' else 'fp32'}":
                      nearest_variant(inner, y, x, d, spec.replace(stats_dtype=other_stats))}
            w = inner.params.gamma
            identity = w is None or np.allclose(w + spec.gamma_offset, 1.0)
            no_beta = inner.params.beta is None or not np.any(inner.params.beta)
            if spec.stats_dtype == "float32" and (spec.gamma or spec.beta) and not (identity and no_beta):
                flip = "scale_then_cast" if spec.affine_order == "cast_then_scale" else "cast_then_scale"
                others[flip.replace("_", " ")] = nearest_variant(inner, y, x, d, spec.replace(affine_order=flip))
        nearest = min(others.values())
        # nearer its own contract than any other, and within a couple of ulps of it on average
        limit = min(nearest + C.ROUNDING_MARGIN_ULPS, C.ROUNDING_MAX_ULPS)
        ok = mine <= limit
        yield ctx.finding("reference.rounding", f"rounding at {d}", "pass" if ok else "fail", mine, others, limit,
                          f"mean distance (ulps) to the contract's {d} rounding {mine:.3g}, to the nearest other "
                          f"contract's {nearest:.3g}; the limit is the smaller of that + "
                          f"{C.ROUNDING_MARGIN_ULPS:g} and {C.ROUNDING_MAX_ULPS:g} ulps"
                          + ("" if values else " (the target's own γ/β)"), dtype=d)
