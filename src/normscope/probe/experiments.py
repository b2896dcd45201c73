"""Experiments shared by inference and the acceptance battery."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ..dtypes import UNIT_ROUNDOFF
from ..groups import Groups


@dataclasses.dataclass(frozen=True)
class PlusMinus:
    """γ̂ and β̂ at every position from ±a·u (u normalized per group), with their measurement noise.

    Two patterns measure the same quantities; at each position the pattern with the larger |u| is used,
    and the patterns' disagreement (absolute) is the noise of the measurement.
    """

    gamma: np.ndarray
    beta: np.ndarray
    gamma_noise: float
    beta_noise: float


def plus_minus(run: Callable[[np.ndarray], np.ndarray], g: Groups, rng: np.random.Generator, a: float,
               normalize: Callable[[np.ndarray], np.ndarray] | None = None) -> PlusMinus:
    """γ̂ and β̂ from y± = run(±a·u).

    Without ``normalize`` (black box): γ̂ = (y₊ − y₋)/2u = γ·r and β̂ = (y₊ + y₋)/2. With ``normalize`` (the
    reference's x̂ for a known contract, e.g. with running statistics, where x̂ is not odd in x):
    γ̂ = (y₊ − y₋)/(x̂₊ − x̂₋) and β̂ = (y₊ + y₋)/2 − γ̂·(x̂₊ + x̂₋)/2.
    """
    seen = []
    for u in (g.pattern(rng), g.pattern(rng)):
        yp, ym = run(a * u), run(-a * u)
        if normalize is None:
            odd, even = u, 0.0
        else:
            xp, xm = normalize(a * u), normalize(-a * u)
            odd, even = (xp - xm) / 2, (xp + xm) / 2
        with np.errstate(all="ignore"):
            gamma = (yp - ym) / (2 * odd)
            seen.append((gamma, (yp + ym) / 2 - gamma * even, np.abs(u)))
    (g1, b1, m1), (g2, b2, m2) = seen
    first = m1 >= m2
    gamma = np.where(first, g1, g2)
    beta = np.where(first, b1, b2)
    both = (m1 > 0.3) & (m2 > 0.3)
    with np.errstate(all="ignore"):
        gamma_noise = float(np.max(np.abs(g1 - g2)[both])) if both.any() else 0.0
        beta_noise = float(np.max(np.abs(b1 - b2)[both])) if both.any() else 0.0
    return PlusMinus(gamma, beta, gamma_noise, beta_noise)


def varying_axes(v: np.ndarray, tol: float) -> list[int]:
    """The axes along which ``v`` is not constant (beyond ``tol``)."""
    return [a for a in range(v.ndim) if np.max(np.abs(v - v.mean(axis=a, keepdims=True))) > tol]


def ulps(y: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype`` at each output, floored at 1% of the outputs' RMS (near 0 an ulp means nothing)."""
    with np.errstate(all="ignore"):
        finite = y[np.isfinite(y)]
        floor = 0.01 * float(np.sqrt(np.mean(finite**2))) if finite.size else 1.0
        return np.maximum(np.abs(y), max(floor, 1e-30)) * UNIT_ROUNDOFF[dtype] * 2
