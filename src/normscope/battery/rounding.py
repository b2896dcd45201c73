"""Section "rounding order": at bf16/fp16 the target sits nearer its contract's rounding than any other's.

Where two contracts are both within the forward bounds but still differ — the cast order and the statistics
dtype — the target must be nearer its own contract's emulation than the alternatives', each contract
represented by the nearest of its faithful formulas (x/σ, x·(1/σ), folded affine): the contract does not fix
that choice, so neither does the rule. A target nearer another contract fails only when the two separate beyond
the noise of the measurement (:func:`normscope.probe.precision_experiment.separates`). Where they do not, the
experiment escalates before it gives up: ``ESCALATION`` more draws of inputs and γ/β, and a decision on the sign
test alone (at ``2 × SEPARATION_Z``) over all their elements — a consistent per-element advantage decides even
when the mean distances are close. Still undecided, the finding is inconclusive (never a pass), with both
distances and what would decide it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ..dtypes import UNIT_ROUNDOFF
from ..numerics import constants as C
from ..precision import Precision
from ..probe import precision_experiment as pe
from ..report.numbers import sig
from ..results.check import Finding
from .context import Context, useless_emulation
from .parameters import perturbed

ESCALATION = 16  # more draws of inputs and γ/β before an ambiguous rounding finding gives up


def _measure(ctx: Context, d: str) -> tuple[pe.Distance, dict[str, pe.Distance], dict | None]:
    """One draw: the distance of the target's outputs at ``d`` to its contract and to each alternative."""
    spec = ctx.spec
    # half the groups sit at an offset of 30σ: there statistics held in the input dtype visibly lose
    # the mean, while cast-order differences show everywhere
    draw = ctx.rng.normal(size=ctx.shape)
    x = Precision(d).round((draw + pe.offset_groups(ctx.groups)) * 3).astype(np.float64)
    with perturbed(ctx) as (values, inner):  # distinct γ/β make the order observable
        if _chaotic(inner, x, d):
            x = Precision(d).round(draw * 3).astype(np.float64)
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
            if spec.affine_order == "scale_then_cast" and d != "float32":  # × γ in fp32: where γ is stored shows
                kept = "input" if spec.param_dtype == "float32" else "float32"
                others[f"γ/β stored {'in fp32' if kept == 'float32' else 'at the input dtype'}"] = \
                    nearest(spec.replace(param_dtype=kept))
    return mine, others, values


def _chaotic(ctx: Context, x: np.ndarray, d: str) -> bool:
    """Whether the contract's own emulation at ``d`` errs by more than half its output's scale on ``x`` (a one-pass
    variance in the input dtype at a 30σ offset cancels to noise): there two faithful implementations agree on
    nothing, so distances in ulps measure their operation order, not their contract — the offset is then left
    out (as the offset finding skips such inputs)."""
    with np.errstate(all="ignore"):
        return useless_emulation(ctx.ref(x), ctx.emulate(x, d)) is not None


def _escalate(ctx: Context, d: str, closest: str, first: tuple[pe.Distance, pe.Distance], repeat: float) -> dict:
    """``ESCALATION`` more draws: the per-element distances to the contract and to ``closest`` pooled, and decided
    by :func:`~normscope.probe.precision_experiment.separates`' rule on the pool, or by its sign test alone at
    twice its threshold (a consistent per-element advantage decides even when the mean distances are close)."""
    mine_e, near_e = [first[0].elements], [first[1].elements]
    for _ in range(ESCALATION):
        mine, others, _ = _measure(ctx, d)
        if closest not in others:
            break
        mine_e.append(mine.elements)
        near_e.append(others[closest].elements)
    mine_all, near_all = np.concatenate(mine_e), np.concatenate(near_e)
    diff = mine_all - near_all
    diff = diff[np.isfinite(diff)]
    n_near, n_mine = int(np.sum(diff >= 0.5)), int(np.sum(diff <= -0.5))  # elements nearer the other / the contract
    z = (n_near - n_mine) / math.sqrt(max(n_near + n_mine, 1))
    floor = max(C.SEPARATION_FLOOR_ULPS, 2 * repeat)
    gap = float(np.nanmean(mine_all) - np.nanmean(near_all))
    strict = 2 * C.SEPARATION_Z
    m_mine, m_near = float(np.nanmean(mine_all)), float(np.nanmean(near_all))

    def beyond(far: float, close: float, sign: float) -> bool:  # the pooled rule of ``separates``, or the sign test
        ratio = (far + floor) / (close + floor)
        return far - close > floor and (sign >= strict or (ratio >= C.SEPARATION_RATIO and sign >= C.SEPARATION_Z))

    verdict = "fail" if beyond(m_mine, m_near, z) else ("pass" if beyond(m_near, m_mine, -z) else None)
    apart = m_mine - m_near > floor and (m_mine + floor) / (m_near + floor) >= C.SEPARATION_RATIO
    return {"verdict": verdict, "apart": apart, "z": z, "draws": len(mine_e), "elements": int(diff.size), "gap": gap,
            "closer": [n_near, n_mine], "mine": float(np.nanmean(mine_all)), "near": float(np.nanmean(near_all)),
            "strict": strict, "floor": floor}


def rounding_order(ctx: Context) -> Iterator[Finding]:
    for d in ("bfloat16", "float16"):
        if d not in ctx.accepted:
            continue
        mine, others, values = _measure(ctx, d)
        mean = {k: (v.mean if not math.isnan(v.mean) else math.inf) for k, v in others.items()}
        mine_mean = mine.mean if not math.isnan(mine.mean) else math.inf
        closest = min(mean, key=mean.get)
        nearest_mean = mean[closest]
        # nearer its own contract than any other, and within a couple of ulps of it on average
        limit = min(nearest_mean + C.ROUNDING_MARGIN_ULPS, C.ROUNDING_MAX_ULPS)
        own_words = "" if values or not (ctx.spec.gamma or ctx.spec.beta) else " (the target's own γ/β)"
        if mine_mean <= limit:
            yield ctx.finding("reference.rounding", f"rounding at {d}", "pass", mine_mean, mean, limit,
                              f"mean distance (ulps) to the contract's {d} rounding {sig(mine_mean)}, to the nearest "
                              f"other contract's {sig(nearest_mean)}; the limit is the smaller of that + "
                              f"{C.ROUNDING_MARGIN_ULPS:g} and {C.ROUNDING_MAX_ULPS:g} ulps" + own_words, dtype=d)
            continue
        repeat = ctx.call_noise / (2 * UNIT_ROUNDOFF[d])  # call-to-call variation, in ulps of d
        near = others[closest]
        sep = pe.separates(near, mine, repeat)
        if mine_mean <= C.ROUNDING_MAX_ULPS and not sep["beyond_noise"]:
            # nearer another contract, but not beyond the noise of one draw: more draws before any verdict
            e = _escalate(ctx, d, closest, (mine, near), repeat)
            first = (f"one draw: mean distance (ulps) to the contract's rounding {sig(mine_mean)}, to {closest} "
                     f"{sig(nearest_mean)}, not separated beyond noise ({pe.not_separated_because(sep)}, over "
                     f"{near.elements.size} elements); escalated to {e['draws']} draws of inputs and γ/β "
                     f"({e['elements']} elements): mean distance {sig(e['mine'])} vs {sig(e['near'])}, nearer "
                     f"{closest} at {e['closer'][0]} elements and the contract at {e['closer'][1]} (sign test z = "
                     f"{sig(e['z'])}; decisive at ±{e['strict']:g}, or at ±{C.SEPARATION_Z:g} with the mean distances "
                     f"{C.SEPARATION_RATIO:g}× apart)")
            if e["verdict"] == "fail" and ctx.spec.stats_dtype == "input" and not e["apart"]:
                # statistics in the input dtype may accumulate in it or wider: a target whose own sums round on
                # the way sits a fraction of an ulp from either emulation, and a per-element lean alone is that
                yield ctx.finding("reference.rounding", f"rounding at {d}", "inconclusive", e["mine"], mean, limit,
                                  f"{first}: the target leans towards {closest} element by element, but its mean "
                                  f"distances are within ×{C.SEPARATION_RATIO:g} of each other, and statistics in "
                                  f"the input dtype may accumulate in it (each partial sum rounded) or wider, which "
                                  "the contract does not state; what would decide it: how the target accumulates "
                                  "its statistics, read from its source" + own_words, dtype=d)
            elif e["verdict"] == "fail":
                yield ctx.finding("reference.rounding", f"rounding at {d}", "fail", e["mine"], mean, limit,
                                  f"{first}: the target rounds as {closest}" + own_words, dtype=d)
            elif e["verdict"] == "pass":
                yield ctx.finding("reference.rounding", f"rounding at {d}", "pass", e["mine"], mean, limit,
                                  f"{first}: the target rounds as its contract" + own_words, dtype=d)
            else:
                yield ctx.finding("reference.rounding", f"rounding at {d}", "inconclusive", e["mine"], mean, limit,
                                  f"{first}: still undecided; what would decide it: a larger shape (more rows "
                                  f"per draw), or the contract's cast order and statistics dtype checked on the "
                                  f"target's source" + own_words, dtype=d)
            continue
        if ctx.spec.stats_dtype == "input" and not sep["beyond_noise"]:
            # as far from every contract's rounding as from its own: not a rounding order but statistics that lose
            # more than the contract's emulation (accumulated in the input dtype, say), which the contract, silent
            # on how statistics accumulate, neither states nor rules out
            yield ctx.finding("reference.rounding", f"rounding at {d}", "inconclusive", mine_mean, mean, limit,
                              f"mean distance (ulps) to the contract's {d} rounding {sig(mine_mean)}, to {closest} "
                              f"{sig(nearest_mean)}: as far from every contract as from its own "
                              f"({pe.not_separated_because(sep)}), on inputs where half the groups sit "
                              f"{pe.GROUP_OFFSET:g}σ off zero — the target's statistics lose more than rounding the "
                              f"exact ones to {d} does (accumulated in {d}?), which the contract does not state; what "
                              "would decide it: how the target accumulates its statistics, read from its source"
                              + own_words, dtype=d)
            continue
        yield ctx.finding("reference.rounding", f"rounding at {d}", "fail", mine_mean, mean, limit,
                          f"mean distance (ulps) to the contract's {d} rounding {sig(mine_mean)}, to {closest} "
                          f"{sig(nearest_mean)}" + (f" (separated: ratio {sig(sep['ratio'])}, sign test z = "
                                                    f"{sig(sep['sign_z'])})" if sep["beyond_noise"] else "")
                          + f"; the limit is the smaller of that + {C.ROUNDING_MARGIN_ULPS:g} and "
                          f"{C.ROUNDING_MAX_ULPS:g} ulps" + own_words, dtype=d)
