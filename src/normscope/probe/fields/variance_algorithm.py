"""``variance_algorithm``: two-pass (Σ(x−μ)²) or one-pass (E[x²] − E[x]²) variance.

A large common offset M with unit spread: E[x²] − E[x]² loses ~M²·u of the variance, two-pass only ~M·u.
The offset is set for the target's *effective* precision u (the ±u noise, at least the probe dtype's), so a
target that computes in float32 behind a float64 interface is not mistaken for a one-pass one.
"""

from __future__ import annotations

import numpy as np

from ...dtypes import UNIT_ROUNDOFF
from ...groups import Groups
from ...precision import Precision
from ...results.inference import Confidence, Evidence
from .probe import Probe, rel


def variance_algorithm(probe: Probe, g: Groups, noise: float, centred: bool) -> tuple[str, Evidence]:
    """The variance algorithm of a centred norm (an uncentred one has none: ``two_pass`` by convention).

    ``noise`` is the affine experiment's relative noise; M = u^-0.65 keeps the two-pass error M·u ≲ 1% while
    the one-pass error M²·u ≫ 1.
    """
    if not centred:
        return "two_pass", Evidence("not applicable without centring", {}, Confidence.DECISIVE)
    u_eff = max(noise / 4, UNIT_ROUNDOFF[probe.dtype])
    offset = float(f"{u_eff ** -0.65:.1g}")
    u = g.pattern(probe.rng)
    x = offset + u
    with np.errstate(all="ignore"):
        rounded = Precision(probe.dtype).round(x).astype(np.float64) - offset
    y_off, y_dev = probe.run(x), probe.run(rounded)
    change = rel(y_off, y_dev)
    return "one_pass" if change > 0.05 else "two_pass", Evidence(
        f"input {offset:g} + u (σ = 1) vs the same deviations without the offset: E[x²]−E[x]² cancels",
        {"offset": offset, "effective_precision": u_eff, "relative_change": change},
        Confidence.DECISIVE if (change < 0.01 or change > 0.2) else Confidence.WEAK,
    )
