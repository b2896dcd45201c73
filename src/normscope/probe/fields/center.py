"""``center``: is the mean subtracted? A common shift of every input leaves a centred norm's output unchanged."""

from __future__ import annotations

import numpy as np

from ...results.inference import Confidence, Evidence
from .axes import Dependency
from .probe import Probe, rel


def center(probe: Probe, dep: Dependency) -> tuple[bool, Evidence]:
    """Add 3σ to the dependency experiment's input and compare with its output."""
    probe.progress("invariances: common shift")
    shift = 3 * float(np.std(dep.x0))
    shift_change = rel(probe.run(dep.x0 + shift), dep.y0)
    centred = shift_change < 1e-3
    return centred, Evidence(
        "add 3σ to every input: a centred norm does not move",
        {"shift": shift, "relative_change": shift_change, "relative_change_scale_4": dep.scale_change},
        Confidence.DECISIVE if (shift_change < 1e-5 or shift_change > 1e-2) else Confidence.WEAK,
    )
