"""``eps`` and ``eps_placement``: the ε placement experiment.

The gain ρ(v) of u·√v (u normalized per group, one variance per group, so one call carries many) for
v = 10⁴ … 10⁻⁶⁰ (float64; 10⁻³⁶ at float32) is compared with the three placement models — inside the root
ρ = √(v/(v+ε)), outside it ρ = √v/(√v+ε), a clamp ρ = min(1, √v/ε) — each point giving an ε estimate; the
model whose estimates agree (smallest log-residual) wins. Points below the floor where β's rounding swamps
the signal are dropped. With float64 and float32 both accepted ε is measured in both; a disagreement is
reported as dtype-dependent (e.g. ε = finfo(dtype).eps) and the float32 value kept. :func:`fit_eps` is also
the fit of a frozen BatchNorm's gains (:mod:`.frozen`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ...dtypes import UNIT_ROUNDOFF
from ...errors import NotANormalization
from ...groups import Groups
from ...report.numbers import sig
from ...results.inference import Confidence, Evidence
from .affine import Affine
from .probe import Probe

#: How each placement turns a measured gain r at variance v into ε, and predicts r from v and ε.
MODELS = {
    "inside_sqrt": (lambda v, r: v * (1 / r**2 - 1), lambda v, e: np.sqrt(v / (v + e))),
    "outside_sqrt": (lambda v, r: np.sqrt(v) * (1 / r - 1), lambda v, e: np.sqrt(v) / (np.sqrt(v) + e)),
    "clamp": (lambda v, r: np.sqrt(v) / r, lambda v, e: np.minimum(1.0, np.sqrt(v) / e)),
}


@dataclasses.dataclass(frozen=True)
class Eps:
    placement: str
    eps: float
    measured_at: str  # the dtype whose ε is reported (float32 when it differs from float64's)
    evidence: dict[str, Evidence]  # eps, eps_placement


def variances(dtype: str) -> np.ndarray:
    """The variances scanned at ``dtype``: 10⁴ down to 10⁻⁶⁰ at float64, 10⁻³⁶ otherwise (the underflow range)."""
    lo = -60 if dtype == "float64" else -36
    return 10.0 ** np.arange(4, lo - 1, -1, dtype=np.float64)


def gain_scan(probe: Probe, g: Groups, gamma_hat, beta_hat, dtype: str, scanned: np.ndarray) -> np.ndarray:
    """ρ(v) = r(v)/r(V) for each variance v, measured per group by least squares."""
    rho = []
    u = g.pattern(probe.rng)
    gu = gamma_hat * u
    denom = g.sum(gu * gu)
    for start in range(0, len(scanned), g.count):
        chunk = scanned[start:start + g.count]
        scales = np.sqrt(np.resize(chunk, g.count))
        y = probe.run(g.spread(scales) * u, dtype)
        with np.errstate(all="ignore"):
            r = g.sum((y - beta_hat) * gu) / denom
        rho.extend(r[: len(chunk)].tolist())
    return np.array(rho)


def fit_eps(scanned, rho, noise, floor) -> tuple[str, float, dict[str, Any], Confidence]:
    """Fit each ε placement to the measured gains; ``floor`` is the smallest gain still measurable.

    Returns the placement, its ε, the measured numbers and the confidence (decisive when the runner-up's
    residual is 10× the winner's).
    """
    finite = np.isfinite(rho) & (rho > floor)
    v, r = scanned[finite], rho[finite]
    if v.size == 0:
        raise NotANormalization(
            f"the gain of u·√v was unmeasurable at every variance from {scanned.max():g} to {scanned.min():g}")
    informative = (1 - r > max(100 * noise, 1e-12)) & (r > 1e-7)
    out: dict[str, Any] = {"variances_scanned": [float(v.max()), float(v.min())], "points": int(len(v)),
                           "informative_points": int(informative.sum())}
    if informative.sum() == 0:
        out["gain_range"] = [float(r.min()), float(r.max())]
        return "none", 0.0, out, Confidence.DECISIVE
    residuals, estimates = {}, {}
    for name, (estimate, model) in MODELS.items():
        with np.errstate(all="ignore"):
            e_i = estimate(v[informative], r[informative])
        e_i = e_i[np.isfinite(e_i) & (e_i > 0)]
        if e_i.size == 0:
            residuals[name] = math.inf
            continue
        sensitive = (r[informative] > 0.05) & (r[informative] < 0.95)
        e_s = estimate(v[informative][sensitive], r[informative][sensitive]) if sensitive.any() else e_i
        e_s = e_s[np.isfinite(e_s) & (e_s > 0)]
        eps = float(np.median(e_s if e_s.size else e_i))
        with np.errstate(all="ignore"):
            pred = model(v, eps)
            res = float(np.max(np.abs(np.log(np.maximum(r, 1e-300)) - np.log(np.maximum(pred, 1e-300)))))
        residuals[name], estimates[name] = res, eps
    best = min(residuals, key=residuals.get)
    ordered = sorted(residuals.values())
    out["model_residuals"] = residuals
    out["eps_by_model"] = estimates
    decisive = len(ordered) < 2 or ordered[1] > 10 * max(ordered[0], 1e-12)
    return best, estimates[best], out, Confidence.DECISIVE if decisive else Confidence.WEAK


def placement_evidence(measured: dict[str, Any], placement: str, confidence: Confidence) -> Evidence:
    """The evidence for ``eps_placement`` from :func:`fit_eps`'s numbers."""
    return Evidence("the placement whose ε estimates agree across v (log-residual)",
                    {"residuals": measured.get("model_residuals", {}), "chosen": placement}, confidence)


def eps(probe: Probe, g: Groups, aff: Affine) -> Eps:
    """ε and its placement from the gain of u·√v, cross-checked at float32 where the probe dtype is float64."""
    probe.progress("ε: gain of u·√v for v down to the underflow range")
    scanned = variances(probe.dtype)
    rho = gain_scan(probe, g, aff.gamma_hat, aff.beta_hat, probe.dtype, scanned)
    # Below this gain the signal γ·r·u drowns in the rounding of β (and of the output itself).
    floor = 1e3 * aff.noise * (1 + float(np.max(np.abs(aff.beta_hat)))
                               / max(float(np.mean(np.abs(aff.gamma_hat))), 1e-300))
    placement, eps_fit, measured, confidence = fit_eps(scanned, rho, aff.noise, floor)
    eps_dtype = probe.dtype
    if probe.dtype == "float64" and "float32" in probe.accepted and placement != "none":
        v32 = variances("float32")
        rho32 = gain_scan(probe, g, aff.gamma_hat, aff.beta_hat, "float32", v32)
        n32 = 64 * UNIT_ROUNDOFF["float32"]
        p32, e32, _, _ = fit_eps(v32, rho32, n32, floor * n32 / aff.noise)
        measured["float32_check"] = {"placement": p32, "eps": e32}
        if p32 == placement and e32 > 0 and abs(e32 / eps_fit - 1) > 0.02 and e32 > 1e-10:
            measured["dtype_dependent"] = {"float64": eps_fit, "float32": e32}
            eps_fit, eps_dtype = e32, "float32"
    # an unbiased estimator scales the variance by d/(d−1): the measured ε is ε/k inside, ε/√k outside
    k = g.size / (g.size - 1) if aff.variance == "unbiased" else 1.0
    correction = math.sqrt(k) if placement in ("outside_sqrt", "clamp") else k
    value = float(f"{eps_fit * correction:.6g}") if placement != "none" else 0.0
    note = ""
    if "dtype_dependent" in measured:
        dep = measured["dtype_dependent"]
        note = (f"ε depends on the input dtype ({sig(dep['float64'], 4)} at float64, {sig(dep['float32'], 4)} at float32, "
                "e.g. finfo(dtype).eps); reported at float32")
    evidence = {
        "eps": Evidence("gain r(v) of u·√v: inside ε = v(1/r²−1), outside ε = √v(1/r−1), clamp ε = √v/r",
                        {**measured, "eps": value, "measured_at": eps_dtype}, confidence, note),
        "eps_placement": placement_evidence(measured, placement, confidence),
    }
    return Eps(placement, value, eps_dtype, evidence)
