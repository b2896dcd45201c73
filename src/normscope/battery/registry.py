"""The battery's sections, in the order the acceptance procedure runs them.

Each :class:`Section` is a function of the :class:`~normscope.battery.context.Context` yielding findings.
Order matters in two places only, both through documented context fields: ``determinism`` sets the call-to-call
noise that later two-call comparisons allow, and ``parameters`` sets the γ/β every comparison uses. The rng
is shared, so the order also fixes every random input (a seed reproduces a report exactly).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from ..results.check import Finding
from . import (
    affine,
    backward,
    dependency,
    determinism,
    extremes,
    forward,
    hand,
    invariances,
    modes,
    parameters,
    rounding,
)
from .context import Context


@dataclasses.dataclass(frozen=True)
class Section:
    """``id``: the findings' id prefix it mostly produces; ``label``: the progress message (None: silent);
    ``in_mode``: run in the train/eval mode the contract implies (the modes section switches itself)."""

    id: str
    label: str | None
    run: Callable[[Context], Iterator[Finding]]
    in_mode: bool = True


SECTIONS: list[Section] = [
    Section("dtypes", None, determinism.dtypes, in_mode=False),
    Section("determinism", "determinism", determinism.determinism),
    Section("parameters", "parameters", parameters.resolve),
    Section("hand", "hand case", hand.hand_case),
    Section("invariance", "invariances", invariances.invariances),
    Section("extreme", "degenerate and extreme inputs", extremes.extremes),
    Section("dependency", "dependency", dependency.dependency),
    Section("affine", "affine broadcast", affine.affine),
    Section("reference", "forward vs reference", forward.forward),
    Section("reference", "rounding order", rounding.rounding_order),
    Section("reference", "backward vs reference", backward.backward),
    Section("modes", "train/eval rules", modes.modes, in_mode=False),
]
