"""Normalization groups: the sets of input positions that share one statistic.

Experiments are built per group (each group of one call can carry a different experiment), so every
probe works on a label array: one integer per input position naming its group.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .layout import Layout


@dataclasses.dataclass(frozen=True)
class Groups:
    """The groups of one input shape as labels: position → group, ``count`` groups of ``size`` elements.

    Groups of a spec (:meth:`of`) are the reductions of its :class:`~normscope.layout.Layout`: label ``k``
    marks the elements of one reduced slice of the grouped shape, so ``size`` equals ``Layout.count``.
    Labels number the kept axes first (in order) and the group index last.
    """

    shape: tuple[int, ...]
    axes: tuple[int, ...]  # non-negative reduced axes
    groups: int | None
    group_axis: int | None
    labels: np.ndarray  # int label per position
    count: int  # number of groups
    size: int  # elements per group

    @classmethod
    def build(cls, shape, axes, groups=None, group_axis=None) -> Groups:
        shape = tuple(shape)
        coords = np.indices(shape)
        keys, dims = [], []
        for a in range(len(shape)):
            if a not in axes:
                keys.append(coords[a])
                dims.append(shape[a])
        if groups is not None:
            block = shape[group_axis] // groups
            keys.append(coords[group_axis] // block)
            dims.append(groups)
        if keys:
            labels = np.ravel_multi_index(tuple(keys), tuple(dims))
            count = int(np.prod(dims))
        else:
            labels = np.zeros(shape, dtype=np.int64)
            count = 1
        size = int(np.prod(shape)) // count
        return cls(shape, tuple(axes), groups, group_axis, labels, count, size)

    @classmethod
    def of(cls, spec, shape) -> Groups:
        """The groups a NormSpec reduces over, for an input of ``shape`` (resolved by :class:`Layout`, so a
        channel count that does not split into the groups is an InputError)."""
        lay = Layout.of(spec, shape)
        return cls.build(lay.shape, lay.axes, lay.groups, lay.group_axis)

    def max(self, v: np.ndarray) -> np.ndarray:
        """Per-group maxima (length ``count``)."""
        out = np.full(self.count, -np.inf)
        np.maximum.at(out, self.labels.ravel(), np.asarray(v, dtype=np.float64).ravel())
        return out

    def sum(self, v: np.ndarray) -> np.ndarray:
        """Per-group sums (length ``count``)."""
        return np.bincount(self.labels.ravel(), weights=np.asarray(v, dtype=np.float64).ravel(),
                           minlength=self.count)

    def mean(self, v: np.ndarray) -> np.ndarray:
        return self.sum(v) / self.size

    def spread(self, per_group: np.ndarray) -> np.ndarray:
        """A per-group value broadcast to every position."""
        return np.asarray(per_group)[self.labels]

    @functools.cached_property
    def order(self) -> np.ndarray:
        """The flat positions sorted by group, each group's in raster order: ``x.ravel()[order]`` holds the groups
        as ``count`` consecutive runs of ``size``."""
        return np.argsort(self.labels.ravel(), kind="stable")

    def pattern(self, rng: np.random.Generator) -> np.ndarray:
        """A zero-mean, unit-variance vector per group whose entries are bounded away from 0.

        Elements are paired at random within each group with opposite signs and equal magnitudes in
        [0.5, 1.5]; with an odd group size the last three form a triple m·(1, 1, −2), so no entry is 0.
        Built as one row per group and shuffled within rows (linear time: inputs of millions of elements are
        probed as recorded).
        """
        rows = np.zeros((self.count, self.size))
        half = self.size // 2
        magnitude = rng.uniform(0.5, 1.5, size=(self.count, half + 1))
        rows[:, 0:2 * half:2] = magnitude[:, :half]
        rows[:, 1:2 * half:2] = -magnitude[:, :half]
        if self.size % 2 == 1 and self.size >= 3:
            first = self.size - 3
            rows[:, first:] = magnitude[:, first // 2, None] * np.array([1.0, 1.0, -2.0])
        rng.permuted(rows, axis=1, out=rows)
        with np.errstate(all="ignore"):
            rows /= np.sqrt(np.mean(rows * rows, axis=1, keepdims=True))
        z = np.empty(self.count * self.size)
        z[self.order] = rows.ravel()
        return z.reshape(self.shape)
