"""``gamma``, ``beta``, ``param_axes``, ``gamma_offset`` (and the gain that decides ``variance``).

±a·u with u normalized per group (paired entries, |u| bounded away from 0, two patterns) at a variance where
ε is negligible: β̂ = (y₊ + y₋)/2 and γ̂ = (y₊ − y₋)/2u = γ·r at every position; the two patterns'
disagreement is the noise floor, and a large one means the output depends on more than mean and variance.
Where a private copy with parameters exists, random parameters are written into it and the same experiment
fits γ̂ = c₀ + c₁·w: c₁ is the large-variance gain (the estimator, :mod:`.variance`), c₀/c₁ γ's offset.
:func:`parameter_values` turns γ̂/β̂ into γ and β at the parameter shape once the contract is known.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ... import layout, reference
from ...dtypes import UNIT_ROUNDOFF
from ...errors import NotANormalization
from ...groups import Groups
from ...layout import Layout
from ...report.numbers import sig
from ...results.inference import Confidence, Evidence
from ...results.params import NormParams
from ...spec import NormSpec
from ..experiments import plus_minus, varying_axes
from . import variance as variance_field
from .probe import Probe
from .target import Determinism

BIG = 1e6  # ±u is scaled to variance 1e12: ε is negligible for every placement (ε/√V ≤ 1e-8 for ε ≤ 1e-2)


@dataclasses.dataclass(frozen=True)
class Fit:
    """One parameter of a private copy explained as γ (slope, intercept) or β (offset) of the output."""

    name: str
    intercept: float
    slope: float
    residual: float
    axes: list[int]


@dataclasses.dataclass(frozen=True)
class Affine:
    """What the ±u experiments found: γ̂ = γ·r(V) and β̂ at every position, and the fields they decide."""

    gamma_hat: np.ndarray
    beta_hat: np.ndarray
    noise: float  # relative noise of the measurement, at least the determinism floor
    gamma: bool
    beta: bool
    param_axes: list[int]
    variance: str
    gamma_offset: float
    fitted: dict[str, Fit | None] | None  # the target's parameters acting as γ/β (None: none found)
    evidence: dict[str, Evidence]  # gamma, variance, beta, gamma_offset, param_axes


def measure(probe: Probe, g: Groups, a: float):
    """β̂ and γ̂ = γ·r(a²) at every position from ±a·u, and the measurement's relative noise."""
    pm = plus_minus(probe.run, g, probe.rng, a)
    if not np.all(np.isfinite(pm.gamma)) or not np.all(np.isfinite(pm.beta)):
        raise NotANormalization("±u inputs (u already normalized) produced non-finite outputs")
    scale = max(float(np.max(np.abs(pm.gamma))), 1e-300)
    return pm.gamma, pm.beta, max(pm.gamma_noise, pm.beta_noise) / scale


def affine(probe: Probe, g: Groups, det: Determinism) -> Affine:
    """β, γ (up to scale) and param_axes; with a private copy, γ's scale, the estimator and γ's offset."""
    probe.progress("affine: ±u with u already normalized")
    ev: dict[str, Evidence] = {}
    gamma_hat, beta_hat, noise = measure(probe, g, BIG)
    if noise > max(1e-3, 16 * UNIT_ROUNDOFF[probe.dtype]):
        raise NotANormalization(
            f"two different inputs with identical statistics (±u, u normalized per group) gave γ/β estimates "
            f"that differ by {sig(noise)} (relative): the output depends on more than the mean and variance "
            "(e.g. max-abs scaling)")
    noise = max(noise, det.noise)
    tol = max(1000 * noise, 1e-7) * max(float(np.max(np.abs(gamma_hat))), 1.0)
    g_axes = varying_axes(gamma_hat, tol)
    b_axes = varying_axes(beta_hat, tol)
    fitted, distrusted = _fit_parameters(probe, g, tol)

    if fitted is not None:
        gamma, beta = fitted["gamma"] is not None, fitted["beta"] is not None
        param_axes = sorted(set((fitted["gamma"] or fitted["beta"]).axes))
        variance, gamma_offset = "biased", 0.0
        if gamma:
            fit = fitted["gamma"]
            gamma_offset = round(fit.intercept / fit.slope, 6) + 0.0  # no −0.0
            ev["gamma"] = Evidence(
                f"a private copy with random parameters: output slope follows parameter {fit.name!r}",
                {"parameter": fit.name, "fit_intercept": fit.intercept, "fit_slope": fit.slope,
                 "fit_residual": fit.residual}, Confidence.FROM_PARAMETERS)
            variance, ev["variance"] = variance_field.from_known_gamma(abs(fit.slope), g.size)
        else:
            variance, ev["variance"] = variance_field.without_gamma(float(np.mean(gamma_hat)), g.size)
        if beta:
            ev["beta"] = Evidence(
                f"a private copy with random parameters: output offset equals parameter {fitted['beta'].name!r}",
                {"parameter": fitted["beta"].name, "fit_residual": fitted["beta"].residual},
                Confidence.FROM_PARAMETERS)
        ev["gamma_offset"] = Evidence("intercept/slope of the output scale against the weight",
                                      {"gamma_offset": gamma_offset}, Confidence.FROM_PARAMETERS)
    else:
        param_axes = sorted(set(g_axes) | set(b_axes))
        beta = float(np.max(np.abs(beta_hat))) > tol
        const = float(np.mean(gamma_hat))
        gamma, gamma_offset = bool(g_axes), 0.0
        if not g_axes:
            gamma, variance, ev["variance"] = variance_field.from_constant_gain(const, g.size, tol)
        else:
            variance, ev["variance"] = variance_field.with_learned_gamma(g.size)
        ev["gamma"] = Evidence(
            "±a·u (u normalized): γ·r = (y₊ − y₋)/2u per coordinate",
            {"varies_along_axes": g_axes, "mean": const, "min": float(gamma_hat.min()),
             "max": float(gamma_hat.max())},
            Confidence.DECISIVE if g_axes or not gamma else Confidence.WEAK)
        ev["gamma_offset"] = Evidence("not inferable from behaviour", {}, Confidence.NOT_PROBED,
                                      "(1+w) and γ=1+w are the same function; known only from weights"
                                      + (f"; {distrusted}" if distrusted else ""))
        if distrusted:
            ev["gamma"] = dataclasses.replace(ev["gamma"], note=distrusted)
    if not (gamma or beta):
        param_axes = []
    ev.setdefault("beta", Evidence(
        "±a·u: β = (y₊ + y₋)/2 per coordinate",
        {"varies_along_axes": b_axes, "max_abs": float(np.max(np.abs(beta_hat)))}))
    ev["param_axes"] = Evidence(
        "axes along which the recovered γ/β vary",
        {"gamma_axes": g_axes, "beta_axes": b_axes, "param_axes": param_axes},
        Confidence.FROM_PARAMETERS if fitted else (Confidence.DECISIVE if param_axes else Confidence.WEAK))
    return Affine(gamma_hat, beta_hat, noise, gamma, beta, param_axes, variance, gamma_offset, fitted, ev)


def fit_linear(obs: np.ndarray, p: np.ndarray):
    """Least squares obs ≈ c0 + c1·p; returns c0, c1 and the max residual relative to |obs|."""
    A = np.stack([np.ones(p.size), p.ravel()], axis=1)
    coef, *_ = np.linalg.lstsq(A, obs.ravel(), rcond=None)
    resid = np.abs(A @ coef - obs.ravel()).max() / max(np.abs(obs).max(), 1e-300)
    return float(coef[0]), float(coef[1]), float(resid)


def _expand(values: np.ndarray, shape: tuple[int, ...], axes: list[int]) -> np.ndarray | None:
    """A parameter of the sizes along ``axes`` as a map of the input's shape; None when its size does not fit
    (or it is a scalar, which cannot tell γ from β)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size != int(np.prod(layout.sizes(shape, axes))) or v.size < 2:
        return None
    return np.broadcast_to(layout.broadcast(v, shape, axes), shape)


def _fit_parameters(probe: Probe, g: Groups, tol: float) -> tuple[dict[str, Fit | None] | None, str]:
    """In a private copy with random parameters, find the parameter acting as γ (y ∝ c₀ + c₁·w) and as β.

    The fit is trusted only when it explains the whole output under those random parameters: a shift that no
    parameter equals (``(x̂ + b)·w`` applies b·w) or a scale that varies where no parameter does leaves the
    parameters untrusted, and γ/β are recovered from behaviour alone. Returns the fit (None: not trusted or
    none found) and, when parameters were fitted but not trusted, why."""
    with probe.target.perturbed_parameters(probe.rng) as values:
        if not values:
            return None, ""
        gp, bp, _ = measure(probe, g, BIG)
    pg_axes, pb_axes = varying_axes(gp, tol), varying_axes(bp, tol)
    fitted: dict[str, Fit | None] = {"gamma": None, "beta": None}
    for name, v in values.items():
        if fitted["gamma"] is None and (full := _expand(v, probe.shape, pg_axes)) is not None:
            c0, c1, res = fit_linear(gp, full)
            if res < 1e-4 and abs(c1) > 1e-3:
                fitted["gamma"] = Fit(name, c0, c1, res, pg_axes)
                continue
        if fitted["beta"] is None and (full := _expand(v, probe.shape, pb_axes)) is not None:
            b0, b1, res = fit_linear(bp, full)
            if res < 1e-4 and abs(b1 - 1) < 1e-3:
                fitted["beta"] = Fit(name, b0, b1, res, pb_axes)
    if not (fitted["gamma"] or fitted["beta"]):
        return None, ""
    shift = float(np.max(np.abs(bp)))
    names = ", ".join(repr(f.name) for f in fitted.values() if f is not None)
    if fitted["beta"] is None and shift > tol:
        return None, (f"the parameters {names} do not explain the output: with random parameters it is shifted by "
                      f"up to {sig(shift)}, which no parameter equals (e.g. (x̂ + b)·w applies b·w); γ and β are "
                      "recovered from behaviour, not read from parameters")
    if fitted["gamma"] is None and pg_axes:
        return None, (f"the parameters {names} do not explain the output: with random parameters its scale varies "
                      f"along axes {pg_axes}, which no parameter follows; γ and β are recovered from behaviour")
    return fitted, ""


def parameter_values(probe: Probe, g: Groups, spec: NormSpec, aff: Affine) -> NormParams:
    """γ = γ̂ / r(V) with r(V) from the reference for the inferred spec, and β = β̂, at the parameter shape."""
    u = g.pattern(probe.rng)
    xhat = reference.forward(BIG * u, spec.without_affine())
    r_v = g.spread(g.sum(xhat * u) / g.sum(u * u))
    param_axes = Layout.of(spec, probe.shape).param_axes
    return NormParams(
        gamma=layout.take(aff.gamma_hat / r_v, param_axes) - spec.gamma_offset if aff.gamma else None,
        beta=layout.take(aff.beta_hat, param_axes) if aff.beta else None)


def own_affine(probe: Probe, spec: NormSpec, params: NormParams, calls: int = 4) -> NormParams:
    """γ and β of the target as it is, its contract known: y = γ·x̂ + β at each parameter position, fitted by
    least squares over ``calls`` random inputs, x̂ from the reference (with ``params``' running statistics). What
    :func:`parameter_values` recovers, for a target whose experiments ran on other parameters (a re-drawn copy):
    it needs no output to move, so a γ of zero comes back as zero."""
    if not (spec.gamma or spec.beta):
        return params
    lay = Layout.of(spec, probe.shape)
    over = (0,) + tuple(a + 1 for a in lay.param_grad_axes)  # the calls, and every axis but the parameter axes
    x = probe.rng.normal(size=(calls, *probe.shape)) * 3.0
    y = np.stack([probe.run(xi) for xi in x])
    xhat = np.stack([reference.forward(xi, spec.without_affine(), **params.running()) for xi in x])
    n = x.size // int(np.prod(lay.param_shape, dtype=np.int64))
    sx, sy = xhat.sum(axis=over), y.sum(axis=over)
    sxx, sxy = (xhat * xhat).sum(axis=over), (xhat * y).sum(axis=over)
    with np.errstate(all="ignore"):
        if spec.gamma and spec.beta:
            slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
            offset = (sy - slope * sx) / n
        elif spec.gamma:
            slope, offset = sxy / sxx, None
        else:
            slope, offset = None, (sy - sx) / n
    shape = lay.param_shape
    return params.replace(
        gamma=None if slope is None else np.reshape(slope, shape) - spec.gamma_offset,
        beta=None if offset is None else np.reshape(offset, shape))
