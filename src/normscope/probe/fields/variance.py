"""``variance``: the estimator, ÷d (biased) or ÷(d−1) (unbiased), from the gain at a large variance.

At variance V ≫ ε the output of ±a·u (u normalized per group of d elements) is γ·r·u with r = 1 for ÷d and
r = √((d−1)/d) for ÷(d−1). The gain is measured by the affine experiment (:mod:`.affine`); against a γ known
from the target's own parameters it decides the estimator, while with a learned γ of unknown scale the two are
the same function up to γ's scale and ÷d is assumed.
"""

from __future__ import annotations

import math

from ...results.inference import Confidence, Evidence


def unbiased_gain(d: int) -> float:
    """The large-variance gain of the unbiased estimator over a group of ``d`` elements: √((d−1)/d)."""
    return math.sqrt((d - 1) / d)


def _measured(gain: float, d: int) -> dict[str, float]:
    return {"gain": gain, "biased_expects": 1.0, "unbiased_expects": unbiased_gain(d), "d": d}


def _nearest(gain: float, d: int) -> str:
    return "unbiased" if abs(gain - unbiased_gain(d)) < abs(gain - 1) else "biased"


def from_known_gamma(gain: float, d: int) -> tuple[str, Evidence]:
    """The gain against γ read from the target's parameters (a private copy): the nearer estimator."""
    return _nearest(gain, d), Evidence(
        "large-variance gain against the known γ: 1 means ÷d, √((d−1)/d) means ÷(d−1)", _measured(gain, d))


def without_gamma(gain: float, d: int) -> tuple[str, Evidence]:
    """The gain of a target whose parameters have no γ (the output scale is the estimator's alone)."""
    return _nearest(gain, d), Evidence(
        "large-variance gain (no γ): 1 means ÷d, √((d−1)/d) means ÷(d−1)", _measured(gain, d))


def from_constant_gain(gain: float, d: int, tol: float) -> tuple[bool, str, Evidence]:
    """A gain constant across positions, with no parameters to read: (γ present, estimator, evidence).

    1 is ÷d without γ, √((d−1)/d) is ÷(d−1) without γ; any other constant is a γ, and ÷d is assumed (a constant
    γ ≠ 1 and the estimator are confounded).
    """
    if abs(gain - 1) <= tol:
        gamma, variance = False, "biased"
    elif abs(gain - unbiased_gain(d)) <= tol:
        gamma, variance = False, "unbiased"
    else:
        gamma, variance = True, "biased"
    return gamma, variance, Evidence(
        "large-variance gain (no learned γ varies): 1 means ÷d, √((d−1)/d) means ÷(d−1)", _measured(gain, d),
        Confidence.ASSUMED if gamma else Confidence.DECISIVE,
        "a constant γ≠1 and ÷d vs ÷(d−1) are confounded; assumed ÷d" if gamma else "")


def with_learned_gamma(d: int) -> tuple[str, Evidence]:
    """A γ that varies and whose scale is unknown: ÷d and ÷(d−1) are the same function up to γ's scale."""
    return "biased", Evidence(
        "large-variance gain", {"d": d}, Confidence.ASSUMED,
        "with a learned γ of unknown scale, ÷d and ÷(d−1) are behaviourally identical up to γ's "
        "scale; assumed ÷d (pass a module or ONNX model to pin it)")
