"""``stats_dtype`` and ``affine_order``: how the target rounds at bfloat16/float16.

Inputs with a per-group spread of 10⁻¹ … 10² and half the groups at an offset of 30σ (there statistics held in
the input dtype lose the mean) run at each half-precision dtype the target accepts; the outputs are scored
against the reference's emulation of every (stats dtype × affine order) candidate, γ/β stored in the input
dtype or in float32, by the precision experiment (:mod:`normscope.probe.precision_experiment`). The statistics
dtype is decided on the dtype where the two separate most among those where a candidate reproduces the target,
and is *ambiguous* (both numbers shown) unless they separate beyond noise there; the affine order where the two
orders separate most. Identity γ/β hide the order, so distinct random ones are written into a private copy
where the target has one (:func:`with_random_parameters`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...groups import Groups
from ...layout import Layout
from ...precision import Precision
from ...report.numbers import sig
from ...results.inference import Confidence, Evidence
from ...results.params import NormParams
from ...spec import NormSpec
from .. import precision_experiment as pe
from ..experiments import ulps
from .affine import Affine
from .probe import Probe

ORDERS = pe.AFFINE_ORDERS


@dataclasses.dataclass(frozen=True)
class LowPrecision:
    spec: NormSpec  # the input spec with stats_dtype and affine_order decided
    evidence: dict[str, Evidence]  # stats_dtype, affine_order


def with_random_parameters(probe: Probe, spec: NormSpec, params: NormParams, aff: Affine,
                           mode: str = "") -> LowPrecision:
    """:func:`low_precision` with distinct random γ/β in a private copy where the affine experiment found the
    target's parameters, else with the γ/β recovered by probing. ``mode`` is appended to the source."""
    if aff.fitted is None:
        return low_precision(probe, spec, params, "as recovered" + mode)
    with probe.target.perturbed_parameters(probe.rng) as values:
        pshape = Layout.of(spec, probe.shape).param_shape
        known = NormParams(**{field: np.asarray(values[fit.name], dtype=np.float64).reshape(pshape)
                              for field, fit in aff.fitted.items() if fit is not None},
                           running_mean=params.running_mean, running_var=params.running_var)
        return low_precision(probe, spec, known, "random, in a private copy" + mode)


def low_precision(probe: Probe, spec: NormSpec, params: NormParams, source: str) -> LowPrecision:
    """``stats_dtype`` and ``affine_order`` of ``spec`` from the target's bfloat16/float16 outputs.

    ``params`` are the γ/β (and running statistics) the target applies during the experiment; ``source`` says
    where they come from, for the evidence.
    """
    low = [d for d in ("bfloat16", "float16") if d in probe.accepted]
    if not low:
        note = f"the target accepts only {', '.join(probe.accepted)}; fp32 statistics assumed"
        return LowPrecision(spec, {
            "stats_dtype": Evidence("needs bfloat16/float16 inputs", {}, Confidence.NOT_PROBED, note),
            "affine_order": Evidence("needs bfloat16/float16 inputs", {}, Confidence.NOT_PROBED, note),
            "param_dtype": Evidence("needs bfloat16/float16 inputs", {}, Confidence.NOT_PROBED,
                                    f"the target accepts only {', '.join(probe.accepted)}; γ/β at the input dtype "
                                    "assumed")})
    probe.progress("precision: low-precision outputs against the reference's emulations")
    g = Groups.of(spec, probe.shape)
    per_dtype: dict[str, dict] = {}
    separation: dict[str, dict] = {}
    runs: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}
    for d in low:
        sigma = g.spread(10.0 ** probe.rng.uniform(-1, 2, size=g.count))
        if d == "float16":  # stay where every candidate is finite: a group's sum of squares below 2¹⁴
            sigma = sigma * min(1.0, math.sqrt(2.0**14 / g.size) / 34 / 100)
        x = Precision(d).round(probe.rng.normal(size=probe.shape) * sigma + pe.offset_groups(g) * sigma)
        x = x.astype(np.float64)
        y = probe.run(x, d)
        with np.errstate(all="ignore"):  # the same call again: a non-deterministic target's own noise, in ulps
            repeat = float(np.nanmean(np.abs(probe.run(x, d) - y) / ulps(y, d)))
        # parameters stored in the input dtype (torch .to(dtype)) or kept in fp32 (flax): the closer
        scores = pe.score(y, x, d, spec, params, pe.CANDIDATES, param_dtypes=(None, "float32"))
        per_dtype[d] = {c: s.mean for c, s in scores.items()}
        separation[d] = pe.separation(scores, repeat)
        runs[d] = (x, y, repeat)
    stats_dtype, stats_evidence = _stats_dtype(low, per_dtype, separation, source)
    order, order_evidence = _affine_order(spec, low, per_dtype, stats_dtype)
    found = spec.replace(stats_dtype=stats_dtype, affine_order=order)
    param_dtype, param_evidence = _param_dtype(found, params, runs)
    return LowPrecision(found.replace(param_dtype=param_dtype),
                        {"stats_dtype": stats_evidence, "affine_order": order_evidence,
                         "param_dtype": param_evidence})


def _param_dtype(spec: NormSpec, params: NormParams, runs: dict) -> tuple[str, Evidence]:
    """Where γ/β are stored: at the input dtype (a module cast whole) or kept in fp32 (× γ rounds once). Seen only
    where γ is applied in fp32 before the cast back, with γ/β that the input dtype cannot hold exactly; decided
    where the two separate most, and only beyond noise."""
    if not (spec.gamma or spec.beta) or spec.stats_dtype != "float32" or spec.affine_order != "scale_then_cast":
        return "input", Evidence("not applicable (no affine, statistics in the input dtype, or × γ after the cast)",
                                 {}, Confidence.DECISIVE)
    best = None
    unit = "float32" if spec.output_dtype == "float32" else None  # a promoted output is not rounded to d
    for d, (x, y, repeat) in runs.items():
        dist = {p: pe.distance(y, x, d, spec.replace(param_dtype=p), params, formulas=pe.faithful_formulas(spec),
                               unit=unit) for p in ("input", "float32")}
        near = min(dist, key=lambda p: dist[p].mean)
        sep = pe.separates(dist[near], dist["float32" if near == "input" else "input"], repeat)
        if best is None or sep["ratio"] > best[2]["ratio"]:
            best = (d, near, sep, {p: v.mean for p, v in dist.items()})
    d, near, sep, means = best
    measured = {"mean_error_ulps": means, "decided_at": d, "chosen": near,
                "separation": {k: v for k, v in sep.items() if k != "closer_elements"}}
    experiment = (f"{d} outputs vs the emulation with γ/β stored at the input dtype and kept in fp32 (ulps of "
                  f"{unit or d})")
    if not sep["beyond_noise"]:
        return "input", Evidence(experiment, measured, Confidence.AMBIGUOUS,
                                 f"the two do not separate beyond noise ({pe.not_separated_because(sep)}): γ/β at "
                                 "the input dtype (a module cast whole) is reported")
    return near, Evidence(experiment, measured, Confidence.DECISIVE)


def _stats_dtype(low: list[str], per_dtype: dict[str, dict], separation: dict[str, dict],
                 source: str) -> tuple[str, Evidence]:
    """Decide where the two statistics dtypes separate most, among the dtypes where the winner reproduces the
    target; decisive only when they separate beyond noise there and no other such dtype says otherwise."""
    measured = {f"{d}: {c[0]} statistics, {c[1].replace('_', ' ')}": v
                for d, sc in per_dtype.items() for c, v in sc.items()}
    informative = [d for d in low if separation[d]["beyond_noise"] and separation[d]["reproduces"]]
    pool = informative or [d for d in low if separation[d]["reproduces"]] or low
    decider = max(pool, key=lambda d: separation[d]["ratio"])
    chosen = separation[decider]["winner"]
    disagree = [d for d in informative if separation[d]["winner"] != chosen]
    scores = per_dtype[decider]
    best = min((c for c in pe.CANDIDATES if c[0] == chosen), key=scores.get)
    quality, note = Confidence.DECISIVE, ""
    both = "; ".join(f"{d}: fp32 statistics {sig(separation[d]['float32'])} vs input-dtype {sig(separation[d]['input'])} "
                     f"ulps, sign test z={sig(separation[d]['sign_z'], 2)}" for d in low)
    if not informative:
        quality = Confidence.AMBIGUOUS
        note = f"the candidates do not separate beyond noise ({both}); the closer one is reported"
        if not separation[decider]["reproduces"]:
            note += (f"; no candidate reproduces the {decider} output (best {sig(scores[best], 2)} ulps mean): the "
                     "target rounds differently from every emulated contract")
    elif disagree:
        quality = Confidence.AMBIGUOUS
        note = f"the dtypes disagree ({both}); the larger separation, at {decider}, is reported"
    return best[0], Evidence(
        f"{'/'.join(low)} outputs vs the reference emulating each candidate (mean error in ulps; γ/β {source}), "
        "decided where the two statistics dtypes separate most",
        {"mean_error_ulps": measured, "decided_at": decider, "chosen": best[0],
         "separation": {d: {k: v for k, v in sep.items() if k not in ("closer_elements", "floor", "reproduces")}
                        for d, sep in separation.items()}},
        quality, note)


def _affine_order(spec: NormSpec, low: list[str], per_dtype: dict[str, dict], stats_dtype: str) -> tuple[str, Evidence]:
    """× γ before or after the cast back, decided at the dtype where the two orders (fp32 statistics) separate
    most; not applicable without an affine or with statistics in the input dtype."""

    def order_ratio(d: str) -> float:  # how far the two cast orders (fp32 statistics) separate at d
        a, b = sorted(per_dtype[d][("float32", o)] for o in ORDERS)
        return (b + 0.02) / (a + 0.02)

    order_at = max(low, key=order_ratio)
    sc = per_dtype[order_at]
    order = min(ORDERS, key=lambda o: sc[("float32", o)])
    mine, other = sc[("float32", order)], sc[("float32", ORDERS[1 - ORDERS.index(order)])]
    if (spec.gamma or spec.beta) and stats_dtype == "float32" and other == mine:
        return "scale_then_cast", Evidence("× γ before or after the cast back", {"error_ulps": mine},
                                           Confidence.NOT_PROBED, "γ ≡ 1 and β ≡ 0 here: the order is not observable")
    if (spec.gamma or spec.beta) and stats_dtype == "float32":
        conf = Confidence.DECISIVE if other > 1.5 * max(mine, 0.02) and mine < 1.0 else Confidence.WEAK
        return order, Evidence(
            f"same experiment, at {order_at} where the two orders separate most: × γ before or after the cast "
            "back", {"chosen": order, "error_chosen_ulps": mine, "error_other_ulps": other}, conf)
    return "scale_then_cast", Evidence("not applicable (no affine, or statistics in the input dtype)", {},
                                       Confidence.DECISIVE)
