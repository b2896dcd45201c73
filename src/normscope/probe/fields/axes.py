"""``axes``, ``groups``, ``group_axis``: which inputs each output depends on.

On an input of distinct values one apart, scaling by 4 must not move the output (else it is not a
normalization); then three positions are perturbed by ±10³·max|x| in turn and the outputs that move must be
the product set of some axes, with at most one partial, aligned block (GroupNorm's channel groups).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ...errors import NotANormalization
from ...groups import Groups
from ...report.numbers import sig
from ...results.inference import Confidence, Evidence
from .probe import Probe, channel_affine, natural, rel
from .target import Determinism


@dataclasses.dataclass(frozen=True)
class Dependency:
    """The groups the target reduces over, with the base input/output later steps reuse."""

    groups: Groups
    x0: np.ndarray  # distinct values one apart
    y0: np.ndarray  # the target's output on x0
    scale_change: float  # relative change of the output when x0 is scaled by 4
    records: list[dict[str, Any]]  # per perturbed position: the number of outputs that moved


def dependency(probe: Probe, det: Determinism) -> Dependency:
    """Scale invariance, then the reduced axes (and groups) from single-position perturbations."""
    probe.progress("dependency: which inputs each output depends on")
    shape, ndim = probe.shape, probe.ndim
    # Distinct values one apart: any two positions differ, so no group (even of two) has a variance
    # small enough for ε to matter, and scale invariance is a fair test.
    n = int(np.prod(shape))
    x0 = (probe.rng.permutation(n) - (n - 1) / 2).reshape(shape).astype(np.float64)
    y0 = probe.run(x0)
    if not np.all(np.isfinite(y0)):
        raise NotANormalization(
            f"the output has {int((~np.isfinite(y0)).sum())} non-finite values on a plain input")
    scale_change = rel(probe.run(x0 * 4.0), y0)
    if scale_change > 1e-2:
        _refuse_affine_map(probe, x0, scale_change, det.noise)
        raise NotANormalization(
            f"scaling the input by 4 changed the output by {sig(scale_change)} (relative max); a "
            "normalization is invariant to positive scale (softmax, elementwise maps and plain linear "
            "layers are not)")
    thr = max(1e-6, 100 * det.repeat) * float(np.sqrt(np.mean(y0**2))) + 1e-300
    delta = 1e3 * (float(np.abs(x0).max()) + 1)
    probes = [tuple(0 for _ in shape), tuple(s - 1 for s in shape), tuple(s // 2 for s in shape)]
    found = None
    records = []
    for p in probes:
        moved = np.zeros(shape, dtype=bool)
        for sign in (1.0, -1.0):  # both signs: in a group of two only a change of order shows
            x = x0.copy()
            x[p] += sign * delta
            moved |= np.abs(probe.run(x) - y0) > thr
        moved[p] = True
        n_moved = int(moved.sum())
        coords = np.nonzero(moved)
        axes, blocks = [], {}
        for a in range(ndim):
            values = np.unique(coords[a])
            if len(values) > 1:
                axes.append(a)
                if len(values) < shape[a]:
                    blocks[a] = values
        records.append({"position": list(p), "outputs_moved": n_moved})
        if len(blocks) > 1:
            raise NotANormalization(
                f"perturbing x{list(p)} moved outputs in partial blocks along axes {sorted(blocks)}: "
                "no reduction axes with groups explain it")
        groups = group_axis = None
        if blocks:
            (a, values), = blocks.items()
            b = len(values)
            start = (p[a] // b) * b
            if shape[a] % b or not np.array_equal(values, np.arange(start, start + b)):
                raise NotANormalization(
                    f"perturbing x{list(p)} moved {b} of {shape[a]} positions along axis {a} "
                    f"({', '.join(map(str, values[:8].tolist()))}{', …' if b > 8 else ''}): not a "
                    "contiguous channel group, so no axes/groups explain it")
            groups, group_axis = shape[a] // b, a
        candidate = Groups.build(shape, tuple(axes), groups, group_axis)
        expected = candidate.labels == candidate.labels[p]
        if not np.array_equal(expected, moved):
            raise NotANormalization(
                f"perturbing x{list(p)} moved {n_moved} outputs, but reducing over axes {axes} would move "
                f"{int(expected.sum())}: the dependency pattern (e.g. causal or windowed) is not a reduction")
        key = (tuple(axes), groups, group_axis)
        if found is not None and key != found:
            raise NotANormalization(
                f"different positions depend on different axes ({records}); no single set of reduced axes "
                "explains the target")
        found = key
    axes, groups, group_axis = found
    return Dependency(Groups.build(shape, axes, groups, group_axis), x0, y0, scale_change, records)


def _refuse_affine_map(probe: Probe, x0: np.ndarray, scale_change: float, noise: float) -> None:
    """Not scale invariant: say so plainly when the output is a fixed affine map of each input on its own."""
    for axis in range(probe.ndim):
        affine = channel_affine(probe, axis, x0 + 0.25, noise)  # x0 + ¼ has no zero entry
        if affine is not None and all(np.ptp(v) <= 1e-9 * max(float(np.max(np.abs(v))), 1.0) for v in affine):
            raise NotANormalization(
                f"scaling the input by 4 changed the output by {sig(scale_change)} (relative max): the "
                f"output is the same elementwise affine map y = {sig(float(affine[0][0]), 4)}·x + "
                f"{sig(float(affine[1][0]), 4)} at every position, not a normalization")
        if affine is not None:
            raise NotANormalization(
                f"scaling the input by 4 changed the output by {sig(scale_change)} (relative max), and "
                f"the output is a fixed affine map y = A·x + B of each input on its own, with A and B set by "
                f"axis {axis} alone: no statistics of the input are used (a frozen BatchNorm whose "
                "statistics live in buffers normscope does not recognise — it reads running_mean/running_var "
                "— or a per-channel scale), so this is not a normalization of its input")


def axes_evidence(dep: Dependency, shape: tuple[int, ...], channel_style: bool) -> Evidence:
    """The evidence for ``axes``: weak where an axis of size 1 hides whether it is reduced."""
    g = dep.groups
    unit_axes = natural(tuple(a for a in range(len(shape)) if shape[a] == 1), len(shape), channel_style)
    return Evidence("perturb one input by ±1e3·max|x| and see which outputs move",
                    {"probes": dep.records, "group_size": g.size, "groups_per_call": g.count},
                    Confidence.WEAK if unit_axes else Confidence.DECISIVE,
                    f"axes {unit_axes} have size 1 at this shape, so whether they are reduced cannot be "
                    "seen: probe a shape with at least 2 along them" if unit_axes else "")
