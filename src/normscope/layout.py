"""The one shape layer: how an input of one shape is reduced, and where parameters and statistics sit.

For a NormSpec and an input shape, :meth:`Layout.of` resolves everything that depends on both:

- the reduced axes (non-negative, sorted) and, for GroupNorm, the *grouped shape* — the group axis of C
  channels split into (G, C/G), so that one statistic is a plain reduction over ``reduce_axes`` of the input
  reshaped to ``grouped_shape`` (:meth:`Layout.group` / :meth:`Layout.ungroup`);
- ``count``, the number of elements behind one statistic;
- the parameter axes (γ and β have the input's sizes there: :attr:`Layout.param_shape`) and the kept axes
  (not reduced); running statistics (BatchNorm) are indexed by the kept axes other than the batch axis 0
  (:attr:`Layout.stats_axes`, :attr:`Layout.stats_shape`).

Parameters move between their own shape and the input's through two inverse operations, written once here
for every array type that has ``reshape``: :func:`view_shape` (the sizes along the parameter axes, 1 elsewhere:
reshape a parameter to it and it broadcasts against the input) with :func:`broadcast`, its validated NumPy
form; and :func:`take`, which reads a parameter back out of a map of the input's shape.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from .errors import InputError

__all__ = ["Layout", "sizes", "view_shape", "broadcast", "take", "param_shape", "stats_shape"]


def sizes(shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """The sizes of ``shape`` along ``axes`` (non-negative), in the order of ``axes``."""
    return tuple(int(shape[a]) for a in axes)


def view_shape(shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """The shape that lines values indexed by ``axes`` up with an input of ``shape``: its sizes there, 1 elsewhere.

    ``values.reshape(view_shape(x.shape, axes))`` broadcasts against ``x`` (NumPy arrays and torch tensors).
    """
    full = [1] * len(shape)
    for a in axes:
        full[a] = int(shape[a])
    return tuple(full)


def broadcast(values, shape: Sequence[int], axes: Sequence[int], what: str = "the parameter") -> np.ndarray | None:
    """Values indexed by ``axes`` as a float64 array that broadcasts against an input of ``shape``.

    ``values`` may have the sizes along ``axes`` (e.g. ``(H,)``) or any shape with as many elements (a
    flattened ``(C·H·W,)``); anything else is an :class:`InputError` naming ``what`` and the shape it needs.
    ``None`` stays ``None`` (no parameter).
    """
    if values is None:
        return None
    shape = tuple(shape)
    values = np.asarray(values, dtype=np.float64)
    want = sizes(shape, axes)
    if values.shape != want:
        if values.size != math.prod(want):
            raise InputError(
                f"{what} has shape {values.shape}, but for an input of shape {shape} it must have "
                f"shape {want} (the input's sizes along axes {list(axes)})"
            )
        values = values.reshape(want)
    return values.reshape(view_shape(shape, axes))


def take(full, axes: Sequence[int]):
    """The values of a map of the input's shape along ``axes``, read at index 0 on every other axis.

    The inverse of :func:`broadcast` for a map that is constant along the other axes (a recovered γ or β, the
    slope of an evaluation-mode BatchNorm): the result has the input's sizes along ``axes`` (sorted), i.e.
    the parameter's shape.
    """
    arr = full if hasattr(full, "ndim") else np.asarray(full)
    axes = set(axes)
    return arr[tuple(slice(None) if a in axes else 0 for a in range(arr.ndim))]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an input of one shape is reduced under one spec: grouping, reduction axes, parameter axes.

    All axes are non-negative. ``axes``, ``param_axes`` and ``kept_axes`` index the input's shape;
    ``reduce_axes`` index ``grouped_shape`` (equal to ``shape`` without groups).
    """

    shape: tuple[int, ...]
    axes: tuple[int, ...]  # the reduced axes of the input
    grouped_shape: tuple[int, ...]
    reduce_axes: tuple[int, ...]  # in the grouped shape
    count: int  # elements per statistic
    param_axes: tuple[int, ...]  # () when the spec has neither γ nor β
    kept_axes: tuple[int, ...]  # axes of the input not reduced
    groups: int | None = None
    group_axis: int | None = None  # non-negative
    running_stats: bool = False  # the spec has BatchNorm-style running statistics

    @classmethod
    def of(cls, spec, shape: Sequence[int]) -> Layout:
        """The layout of ``spec`` for an input of ``shape``; an :class:`InputError` where they do not fit."""
        shape = tuple(int(s) for s in shape)
        ndim = len(shape)
        if ndim == 0:
            raise InputError("cannot normalize a 0-d input; give an array with at least the reduced axes")
        axes = spec.resolve_axes(ndim)
        param_axes = spec.resolve_param_axes(ndim) if (spec.gamma or spec.beta) else ()
        kept = tuple(a for a in range(ndim) if a not in axes)
        running = spec.batch_stats is not None
        if spec.groups is None:
            count = math.prod(shape[a] for a in axes)
            return cls(shape, axes, shape, axes, count, param_axes, kept, running_stats=running)
        ga = spec.resolve_group_axis(ndim)
        channels, groups = shape[ga], spec.groups
        if channels % groups:
            raise InputError(
                f"axis {ga} has {channels} channels, which do not split into {groups} groups; "
                "the channel count must be a multiple of groups"
            )
        grouped = (*shape[:ga], groups, channels // groups, *shape[ga + 1 :])
        reduce = tuple(sorted(a if a < ga else a + 1 for a in axes))  # ga itself maps to the within-group axis
        count = math.prod(grouped[a] for a in reduce)
        return cls(shape, axes, grouped, reduce, count, param_axes, kept, groups, ga, running)

    # ------------------------------------------------------------------ derived shapes
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def param_shape(self) -> tuple[int, ...]:
        """The shape γ and β have: the input's sizes along the parameter axes."""
        return sizes(self.shape, self.param_axes)

    @property
    def param_grad_axes(self) -> tuple[int, ...]:
        """The axes a parameter's gradient sums over (dγ = Σ dy·x̂ over them): every axis but the parameter axes."""
        return tuple(a for a in range(self.ndim) if a not in self.param_axes)

    @property
    def stats_axes(self) -> tuple[int, ...]:
        """The axes running statistics are indexed by: the kept axes other than the batch axis 0."""
        return tuple(a for a in self.kept_axes if a != 0)

    @property
    def stats_shape(self) -> tuple[int, ...]:
        """The shape of running statistics, ``()`` for a spec without them."""
        return sizes(self.shape, self.stats_axes) if self.running_stats else ()

    # ------------------------------------------------------------------ moving arrays
    def group(self, a):
        """An array of the input's shape in the grouped shape (a reshape; NumPy or torch)."""
        return a.reshape(self.grouped_shape)

    def ungroup(self, a):
        """An array of the grouped shape back in the input's shape."""
        return a.reshape(self.shape)

    def view_shape(self, axes: Sequence[int]) -> tuple[int, ...]:
        """:func:`view_shape` for this input."""
        return view_shape(self.shape, axes)

    def expand(self, values, axes: Sequence[int], what: str) -> np.ndarray | None:
        """:func:`broadcast` for this input: values of the sizes along ``axes``, ready to broadcast."""
        return broadcast(values, self.shape, axes, what)


def param_shape(shape: Sequence[int], spec) -> tuple[int, ...]:
    """The shape γ and β must have for an input of ``shape``."""
    return Layout.of(spec, shape).param_shape


def stats_shape(shape: Sequence[int], spec) -> tuple[int, ...]:
    """The shape of running statistics (BatchNorm) for an input of ``shape``; ``()`` without them."""
    return Layout.of(spec, shape).stats_shape
