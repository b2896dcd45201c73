"""Section "rounding order": at bf16/fp16 the target sits nearer its contract's rounding than any other's.

Where two contracts are both within the forward bounds but still differ — the cast order and the statistics
dtype — the target must be nearer its own contract's emulation than the alternatives', each contract
represented by the nearest of its faithful formulas (x/σ, x·(1/σ), folded affine): the contract does not fix
that choice, so neither does the rule. A target nearer another contract fails only when the two separate beyond
the noise of the measurement (:func:`normscope.probe.precision_experiment.separates`); otherwise the finding is
an explicit skip that shows both distances.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ..dtypes import UNIT_ROUNDOFF
from ..numerics import constants as C
from ..precision import Precision
from ..probe import precision_experiment as pe
from ..results.check import Finding
from .context import Context
from .parameters import perturbed


def rounding_order(ctx: Context) -> Iterator[Finding]:
    spec = ctx.spec
    for d in ("bfloat16", "float16"):
        if d not in ctx.accepted:
            continue
        # half the groups sit at an offset of 30σ: there statistics held in the input dtype visibly lose
        # the mean, while cast-order differences show everywhere
        x = Precision(d).round((ctx.rng.normal(size=ctx.shape) + pe.offset_groups(ctx.groups)) * 3).astype(np.float64)
        with perturbed(ctx) as (values, inner):  # distinct γ/β make the order observable
            y = inner.target(x, d)

            def nearest(s, y=y, x=x, d=d, params=inner.params):  # each contract by its nearest faithful formula
                return pe.distance(y, x, d, s, params, formulas=pe.faithful_formulas(s))

            mine = nearest(spec)
            other_stats = "input" if spec.stats_dtype == "float32" else "float32"
            others = {f"statistics in {'the input dtype' if other_stats == 'input' else 'fp32'}":
                      nearest(spec.replace(stats_dtype=other_stats))}
            w = inner.params.gamma
            identity = w is None or np.allclose(w + spec.gamma_offset, 1.0)
            no_beta = inner.params.beta is None or not np.any(inner.params.beta)
            if spec.stats_dtype == "float32" and (spec.gamma or spec.beta) and not (identity and no_beta):
                flip = "scale_then_cast" if spec.affine_order == "cast_then_scale" else "cast_then_scale"
                others[flip.replace("_", " ")] = nearest(spec.replace(affine_order=flip))
        mean = {k: (v.mean if not math.isnan(v.mean) else math.inf) for k, v in others.items()}
        mine_mean = mine.mean if not math.isnan(mine.mean) else math.inf
        closest = min(mean, key=mean.get)
        nearest_mean = mean[closest]
        # nearer its own contract than any other, and within a couple of ulps of it on average
        limit = min(nearest_mean + C.ROUNDING_MARGIN_ULPS, C.ROUNDING_MAX_ULPS)
        own_words = ("" if values else " (the target's own γ/β)")
        if mine_mean <= limit:
            yield ctx.finding("reference.rounding", f"rounding at {d}", "pass", mine_mean, mean, limit,
                              f"mean distance (ulps) to the contract's {d} rounding {mine_mean:.3g}, to the nearest "
                              f"other contract's {nearest_mean:.3g}; the limit is the smaller of that + "
                              f"{C.ROUNDING_MARGIN_ULPS:g} and {C.ROUNDING_MAX_ULPS:g} ulps" + own_words, dtype=d)
            continue
        repeat = ctx.call_noise / (2 * UNIT_ROUNDOFF[d])  # call-to-call variation, in ulps of d
        near = others[closest]
        sep = pe.separates(near, mine, repeat)
        if mine_mean <= C.ROUNDING_MAX_ULPS and not sep["beyond_noise"]:
            # nearer another contract, but not beyond the noise of this measurement: no verdict either way
            yield ctx.finding("reference.rounding", f"rounding at {d}", "skip", mine_mean, mean, limit,
                              f"ambiguous at {d}: mean distance (ulps) to the contract's rounding {mine_mean:.3g}, to "
                              f"{closest} {nearest_mean:.3g}; they do not separate beyond noise (ratio "
                              f"{sep['ratio']:.3g} < {C.SEPARATION_RATIO:g} or sign test z = {sep['sign_z']:.3g} < "
                              f"{C.SEPARATION_Z:g} over "
                              f"{near.elements.size} elements)" + own_words, dtype=d)
            continue
        yield ctx.finding("reference.rounding", f"rounding at {d}", "fail", mine_mean, mean, limit,
                          f"mean distance (ulps) to the contract's {d} rounding {mine_mean:.3g}, to {closest} "
                          f"{nearest_mean:.3g}" + (f" (separated: ratio {sep['ratio']:.3g}, sign test z = "
                                                    f"{sep['sign_z']:.3g})" if sep["beyond_noise"] else "")
                          + f"; the limit is the smaller of that + {C.ROUNDING_MARGIN_ULPS:g} and "
                          f"{C.ROUNDING_MAX_ULPS:g} ulps" + own_words, dtype=d)
