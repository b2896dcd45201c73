"""Findings about the target itself, not fields of its contract: determinism and inputs modified in place.

``determinism`` runs first: how far identical calls disagree becomes the noise floor of every later
experiment (:class:`Determinism`, passed on to them).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...dtypes import UNIT_ROUNDOFF
from ...report.numbers import sig
from ...results.inference import Confidence, Evidence
from .probe import Probe, rel


@dataclasses.dataclass(frozen=True)
class Determinism:
    """The call-to-call spread of the target and the noise floor it sets for every experiment."""

    repeat: float  # relative difference between identical calls (0: deterministic)
    noise: float  # relative differences below this are noise: max(64·u of the probe dtype, 16·repeat)
    evidence: Evidence

    @property
    def mode_floor(self) -> float:
        """A train/eval change below this is the target's own call-to-call noise."""
        return mode_floor(self.repeat)


def mode_floor(repeat: float) -> float:
    """The train/eval change that is still call-to-call noise for a target whose identical calls differ by
    ``repeat`` (relative)."""
    return max(1e-9, 1000 * repeat)


def determinism(probe: Probe) -> Determinism:
    """The same input three times: how far identical calls disagree becomes the floor of every experiment.

    A target that reduces in a different order on each call (atomics on a GPU) moves by an ulp or so of its
    compute precision; without this floor such noise reads as a train/eval difference or as a dependency
    between positions. Uses its own random stream, so a deterministic target is probed exactly as before.
    """
    x = np.random.default_rng([probe.seed, 7]).normal(size=probe.shape) * 10
    ys = [probe.run(x) for _ in range(3)]
    finite = np.all([np.isfinite(y) for y in ys], axis=0)
    spread = max(rel(y[finite], ys[0][finite]) for y in ys[1:]) if finite.any() else 0.0
    noise = max(64 * UNIT_ROUNDOFF[probe.dtype], 16 * spread)
    floor = mode_floor(spread)
    note = ""
    if spread > 0:
        note = (f"non-deterministic: identical calls differ by up to {sig(spread)} (relative); every experiment "
                f"treats differences below {sig(noise)} as noise, and train/eval below {sig(floor)}")
    evidence = Evidence(f"the same input three times at {probe.dtype}",
                        {"max_relative_difference": spread, "noise_floor": noise}, Confidence.DECISIVE, note)
    return Determinism(spread, noise, evidence)


def input_changes(probe: Probe, before: int) -> Evidence | None:
    """A finding, not a failure: the target writes to the tensor it is given (normscope passes it a copy).

    ``before`` is the target's count of such calls when inference started; None when there were none since.
    """
    changed = probe.target.input_modifications - before
    if not changed:
        return None
    return Evidence(
        "the input array handed to the target, compared after each call", {"calls_that_modified_input": changed},
        Confidence.DECISIVE, "the target modifies its input in place: a caller that reuses its tensor gets other "
                             "values (normscope gave it a private copy on every call)")
