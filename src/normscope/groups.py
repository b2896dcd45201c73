"""Normalization groups: the sets of input positions that share one statistic.

Experiments are built per group (each group of one call can carry a different experiment), so every
probe works on a label array: one integer per input position naming its group.
"""

from __future__ import annotations

import dataclasses

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

    def pattern(self, rng: np.random.Generator) -> np.ndarray:
        """A zero-mean, unit-variance vector per group whose entries are bounded away from 0.

        Elements are paired at random within each group with opposite signs and equal magnitudes in
        [0.5, 1.5]; with an odd group size the last three form a triple m·(1, 1, −2), so no entry is 0.
        """
        flat = self.labels.ravel()
        order = np.lexsort((rng.random(flat.size), flat))
        starts = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=self.count))[:-1]])
        rank = np.empty(flat.size, dtype=np.int64)
        rank[order] = np.arange(flat.size) - starts[flat[order]]
        pair = rank // 2
        magnitude = rng.uniform(0.5, 1.5, size=(self.count, self.size // 2 + 1))
        z = magnitude[flat, pair] * np.where(rank % 2 == 0, 1.0, -1.0)
        if self.size % 2 == 1 and self.size >= 3:
            first = self.size - 3
            in_triple = rank >= first
            triple = magnitude[flat, first // 2] * np.array([1.0, 1.0, -2.0])[np.clip(rank - first, 0, 2)]
            z = np.where(in_triple, triple, z)
        elif self.size == 1:
            z = np.zeros_like(z)
        z = z.reshape(self.shape)
        scale = np.sqrt(self.mean(z * z))
        with np.errstate(all="ignore"):
            return z / self.spread(scale)
