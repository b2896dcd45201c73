"""``batch_stats``: does the target behave differently in training and evaluation mode (BatchNorm-style)?

:func:`modes` runs before the structure is probed (a module whose modes differ is probed in training mode, where
it reduces over the batch); :func:`batch_stats` states the field once the rest is known. Running statistics
themselves are recovered in :mod:`.running`.
"""

from __future__ import annotations

import dataclasses

from ...results.inference import Confidence, Evidence
from .probe import Probe, rel
from .target import Determinism


@dataclasses.dataclass(frozen=True)
class Modes:
    """Whether train and eval outputs differ beyond the target's own noise, and by how much."""

    differ: bool
    change: float  # relative max difference between train- and eval-mode outputs (0 without modes)


def modes(probe: Probe, det: Determinism) -> Modes:
    """The same input in train and eval mode (targets with modes: torch modules)."""
    if not probe.target.has_modes:
        return Modes(False, 0.0)
    x = probe.rng.normal(size=probe.shape) * 10
    with probe.target.mode(True):
        y_train = probe.run(x)
    with probe.target.mode(False):
        y_eval = probe.run(x)
    change = rel(y_train, y_eval)
    return Modes(change > det.mode_floor, change)


def batch_stats(probe: Probe, found: Modes, module_training: bool | None) -> tuple[str | None, Evidence]:
    """``batch_stats`` of the training-mode contract (``"batch"`` for a BatchNorm-style target) and its evidence."""
    if found.differ:
        return "batch", Evidence(
            "outputs in train and eval mode differ; train mode reduces over the batch, eval is per-channel affine",
            {"train_vs_eval_relative_change": found.change, "module_mode": "train" if module_training else "eval"})
    return None, Evidence("train and eval modes give the same output" if probe.target.has_modes else
                          "no train/eval modes", {}, Confidence.DECISIVE)
