"""The precision experiment: a target's bfloat16/float16 outputs against the reference's emulation of contracts.

At bfloat16/float16 contracts that compute the same function in exact arithmetic round differently: the
statistics dtype (float32 or the input dtype) and the affine order (× γ before or after the cast back). The
reference emulates each faithfully (:func:`normscope.reference.forward` with ``dtype=``); this module scores a
target's outputs against those emulations in ulps of the dtype. It is pure (no target calls, no random
draws): inference (:mod:`normscope.probe.fields.low_precision`) uses it to *choose* the contract, the acceptance
battery to *check* that a target sits nearer its contract than any alternative.

- :func:`distance`: the mean distance (ulps) from outputs to the nearest faithful emulation of one contract,
  over the formulas (x/σ, x·(1/σ), folded affine) and the dtypes γ/β may be stored in;
- :func:`score`: :func:`distance` for each (stats dtype, affine order) candidate of a contract;
- :func:`separates`: whether outputs sit nearer one contract than another beyond noise;
- :func:`separation`: whether float32 and input-dtype statistics separate beyond noise at one dtype;
- :func:`faithful_formulas`, :func:`offset_groups`: the formulas a faithful kernel may use, and the input
  layout that makes statistics held in the input dtype visible.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .. import reference
from ..groups import Groups
from ..numerics import constants as C
from ..report.numbers import sig
from ..results.params import NormParams
from ..spec import NormSpec
from .experiments import ulps

__all__ = ["STATS_DTYPES", "AFFINE_ORDERS", "CANDIDATES", "Distance", "distance", "score", "separates", "separation",
           "faithful_formulas", "offset_groups"]

STATS_DTYPES = ("float32", "input")
AFFINE_ORDERS = ("cast_then_scale", "scale_then_cast")
#: Every (stats_dtype, affine_order) a contract may have at bfloat16/float16.
CANDIDATES = tuple((s, o) for s in STATS_DTYPES for o in AFFINE_ORDERS)

#: Half the groups sit this many σ from 0: there statistics held in the input dtype visibly lose the mean.
GROUP_OFFSET = 30.0


@dataclasses.dataclass(frozen=True)
class Distance:
    """How far outputs are from one contract's nearest emulation: mean and per-element, in ulps of the dtype."""

    mean: float
    elements: np.ndarray
    formula: str
    param_dtype: str | None


def faithful_formulas(spec: NormSpec) -> tuple[str, ...]:
    """The formulas a faithful kernel of ``spec`` may use: x/σ or x·(1/σ), and a folded affine x·a + b where the
    contract applies γ/β before the one cast (or has none)."""
    folded = spec.affine_order == "scale_then_cast" or not (spec.gamma or spec.beta)
    return reference.FORMULAS if folded else tuple(f for f in reference.FORMULAS if f != "folded")


def offset_groups(g: Groups) -> np.ndarray:
    """0 for even-numbered groups and :data:`GROUP_OFFSET` for odd ones, at every position (multiply by σ)."""
    return g.spread(np.where(np.arange(g.count) % 2 == 0, 0.0, GROUP_OFFSET))


def distance(y: np.ndarray, x: np.ndarray, dtype: str, spec: NormSpec, params: NormParams | Mapping[str, Any],
             *, formulas: Iterable[str] = ("divide",), param_dtypes: Iterable[str | None] = (None,),
             unit: str | None = None) -> Distance:
    """The distance (ulps of ``dtype``, floored near 0 by :func:`~normscope.probe.experiments.ulps`) from the
    outputs ``y`` on input ``x`` to ``spec`` emulated at ``dtype`` with ``params`` (γ, β, running statistics: a
    :class:`~normscope.results.params.NormParams` or a mapping of its fields).

    ``spec``'s nearest emulation is taken over ``formulas`` × ``param_dtypes`` (where γ/β are stored: ``None``
    for the input dtype, ``"float32"``); the first of equal ones wins, and an emulation whose mean is NaN (every
    element non-finite) only where all are. ``unit``: the dtype whose ulps measure (default ``dtype``; fp32 for
    an output the contract promotes, where differences below one ulp of ``dtype`` still count).
    """
    kwargs = (params if isinstance(params, NormParams) else NormParams.from_dict(params)).kwargs()
    ulp = ulps(y, unit or dtype)
    best = None
    for formula in formulas:
        for pdt in param_dtypes:
            with np.errstate(all="ignore"):
                yr = reference.forward(x, spec, dtype=dtype, param_dtype=pdt, formula=formula, **kwargs)
                e = np.abs(y - yr) / ulp
                err = float(np.nanmean(e))
            if best is None or err < best.mean or (math.isnan(best.mean) and not math.isnan(err)):
                best = Distance(err, e, formula, pdt)
    if best is None:
        raise ValueError("distance needs at least one formula and one parameter dtype")
    return best


def score(y: np.ndarray, x: np.ndarray, dtype: str, spec: NormSpec, params: NormParams | Mapping[str, Any],
          candidates: Iterable[tuple[str, str]] = CANDIDATES, *, formulas: Iterable[str] | None = ("divide",),
          param_dtypes: Iterable[str | None] = (None,)) -> dict[tuple[str, str], Distance]:
    """:func:`distance` to ``spec`` with each candidate (stats_dtype, affine_order) in turn.

    ``formulas=None`` takes each candidate's :func:`faithful_formulas` (the nearest formula represents it).
    """
    out = {}
    for stats, order in candidates:
        cand = spec.replace(stats_dtype=stats, affine_order=order)
        out[(stats, order)] = distance(y, x, dtype, cand, params, param_dtypes=param_dtypes,
                                       formulas=faithful_formulas(cand) if formulas is None else formulas)
    return out


def separates(near: Distance, far: Distance, repeat: float) -> dict[str, Any]:
    """Whether outputs sit nearer one contract's emulation (``near``) than another's (``far``) beyond noise.

    ``repeat`` is the target's call-to-call difference in ulps. Beyond noise: the farther mean error is 1.5× the
    nearer one (both floored at 0.05 ulps and twice the call-to-call noise), their difference exceeds that
    floor, and the nearer one is closer by ½ ulp or more at clearly more elements (sign test, z ≥ SEPARATION_Z = 4: a few
    outlying elements cannot decide).
    """
    diff = far.elements - near.elements
    diff = diff[np.isfinite(diff)]
    n_near, n_far = int(np.sum(diff >= 0.5)), int(np.sum(diff <= -0.5))
    sign_z = (n_near - n_far) / math.sqrt(max(n_near + n_far, 1))
    lo, hi = near.mean, far.mean
    floor = max(C.SEPARATION_FLOOR_ULPS, 2 * repeat)
    ratio = (hi + floor) / (lo + floor) if math.isfinite(hi) else math.inf
    return {"near": lo, "far": hi, "floor": floor, "ratio": ratio, "closer_elements": [n_near, n_far],
            "sign_z": sign_z,
            "beyond_noise": bool(ratio >= C.SEPARATION_RATIO and hi - lo > floor and sign_z >= C.SEPARATION_Z)}


def not_separated_because(sep: dict[str, Any]) -> str:
    """The conditions of :func:`separates` that failed, in words (only those: a passing one is not listed)."""
    why = []
    if sep["ratio"] < C.SEPARATION_RATIO:
        why.append(f"ratio {sig(sep['ratio'])} < {C.SEPARATION_RATIO:g}")
    if not sep["far"] - sep["near"] > sep["floor"]:
        why.append(f"difference {sig(sep['far'] - sep['near'])} ≤ the floor {sig(sep['floor'])} ulps")
    if sep["sign_z"] < C.SEPARATION_Z:
        why.append(f"sign test z = {sig(sep['sign_z'])} < {C.SEPARATION_Z:g}")
    return " and ".join(why) or "separated"


def separation(scores: Mapping[tuple[str, str], Distance], repeat: float) -> dict[str, Any]:
    """How far float32 and input-dtype statistics separate at one dtype, and whether beyond noise.

    ``scores`` are :func:`score`'s for every candidate; ``repeat`` is the target's call-to-call difference in
    ulps; "beyond noise" is :func:`separates` between the best candidate of each statistics dtype. The winner
    reproduces the target when it is within 2 ulps (mean) plus that noise.
    """
    best = {st: min((c for c in scores if c[0] == st), key=lambda c: scores[c].mean) for st in STATS_DTYPES}
    s_f, s_i = scores[best["float32"]].mean, scores[best["input"]].mean
    winner = "float32" if s_f <= s_i else "input"
    loser = "input" if winner == "float32" else "float32"
    sep = separates(scores[best[winner]], scores[best[loser]], repeat)
    n_win, n_lose = sep["closer_elements"]
    closer = {winner: n_win, loser: n_lose}
    sign_z = sep["sign_z"] if winner == "float32" else -sep["sign_z"]
    return {"float32": s_f, "input": s_i, "winner": winner, "floor": sep["floor"], "ratio": sep["ratio"],
            "closer_elements": {"float32": closer["float32"], "input": closer["input"]}, "sign_z": sign_z,
            "repeat_noise_ulps": repeat, "beyond_noise": sep["beyond_noise"],
            "reproduces": bool(min(s_f, s_i) <= 2.0 + repeat)}
