"""The parameters a normalization is evaluated with: γ, β and running statistics, as one value.

:class:`NormParams` replaces the ``{"gamma": …, "beta": …, "running_mean": …, "running_var": …}`` dict that
was unpacked field by field wherever the reference was called. Its fields are fixed (``replace`` returns a new
one), holds float64 arrays in their own shapes (γ/β along the parameter axes, running statistics along the
kept axes; see :mod:`normscope.layout`) and hands them to the reference as keyword arguments
(:meth:`NormParams.kwargs`). Absent fields are ``None``: γ = None is the identity scale, β = None is 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..errors import InputError
from ..layout import Layout

__all__ = ["NormParams", "FIELDS"]

#: The fields of :class:`NormParams`, in the order the reference takes them.
FIELDS = ("gamma", "beta", "running_mean", "running_var")
_SYMBOLS = {"gamma": "γ", "beta": "β", "running_mean": "running_mean", "running_var": "running_var"}


def _array(v) -> np.ndarray | None:
    if v is None:
        return None
    return np.array(v, dtype=np.float64)  # a copy: nothing the caller holds is shared or modified


@dataclasses.dataclass(frozen=True, eq=False)
class NormParams:
    """γ, β, running mean and running variance (each a float64 array or None)."""

    gamma: np.ndarray | None = None
    beta: np.ndarray | None = None
    running_mean: np.ndarray | None = None
    running_var: np.ndarray | None = None

    def __post_init__(self):
        for f in FIELDS:
            object.__setattr__(self, f, _array(getattr(self, f)))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> NormParams:
        """From a mapping of field names to arrays or nested lists (a saved result's ``params``); None values
        and missing fields are absent. An unknown field is an :class:`InputError`."""
        data = dict(data or {})
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise InputError(f"unknown parameter field(s) {unknown}; NormParams holds {', '.join(FIELDS)}")
        return cls(**data)

    def replace(self, **changes) -> NormParams:
        """A copy with ``changes`` (field=array, or None to drop a field)."""
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise InputError(f"unknown parameter field(s) {unknown}; NormParams holds {', '.join(FIELDS)}")
        return dataclasses.replace(self, **changes)

    def merged(self, other: NormParams | Mapping[str, Any]) -> NormParams:
        """These parameters with the fields ``other`` holds replacing them."""
        other = other if isinstance(other, NormParams) else NormParams.from_dict(other)
        return self.replace(**other.to_dict())

    # ------------------------------------------------------------------ reading
    def to_dict(self) -> dict[str, np.ndarray]:
        """The fields present, as arrays (the order of :data:`FIELDS`)."""
        return {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        return iter(self.to_dict().items())

    def __contains__(self, field: object) -> bool:
        return field in FIELDS and getattr(self, str(field)) is not None

    def get(self, field: str, default=None):
        return getattr(self, field) if field in self else default

    def __bool__(self) -> bool:
        return bool(self.to_dict())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NormParams):
            return NotImplemented
        a, b = self.to_dict(), other.to_dict()
        return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    __hash__ = None  # type: ignore[assignment]  # arrays: not hashable

    def to_json(self) -> dict[str, Any]:
        """JSON-ready nested lists of the fields present."""
        return {f: v.tolist() for f, v in self.to_dict().items()}

    # ------------------------------------------------------------------ for the reference and the error model
    def kwargs(self) -> dict[str, np.ndarray | None]:
        """Keyword arguments of :func:`normscope.reference.forward` / ``backward`` / ``statistics``."""
        return {f: getattr(self, f) for f in FIELDS}

    def running(self) -> dict[str, np.ndarray | None]:
        """Keyword arguments for the running statistics only (``reference.statistics``)."""
        return {"running_mean": self.running_mean, "running_var": self.running_var}

    def affine(self) -> NormParams:
        """γ and β only (running statistics dropped)."""
        return NormParams(self.gamma, self.beta)

    def effective_gamma(self, spec, shape) -> np.ndarray | float:
        """|γ + gamma_offset| broadcast against an input of ``shape`` (1.0 without a γ)."""
        if not spec.gamma or self.gamma is None:
            return 1.0
        lay = Layout.of(spec, shape)
        return np.abs(lay.expand(self.gamma, lay.param_axes, "gamma") + spec.gamma_offset)

    def abs_beta(self, spec, shape) -> np.ndarray | float:
        """|β| broadcast against an input of ``shape`` (0.0 without a β)."""
        if not spec.beta or self.beta is None:
            return 0.0
        lay = Layout.of(spec, shape)
        return np.abs(lay.expand(self.beta, lay.param_axes, "beta"))

    def check_shapes(self, spec, shape) -> NormParams:
        """Self, after checking that every field fits ``spec`` at an input of ``shape`` (an :class:`InputError`
        naming the field and the shape it needs otherwise)."""
        lay = Layout.of(spec, shape)
        for f in ("gamma", "beta"):
            if getattr(self, f) is not None:
                if not getattr(spec, f):
                    raise InputError(f"{f} was given but the spec has {f}=False")
                lay.expand(getattr(self, f), lay.param_axes, _SYMBOLS[f])
        for f in ("running_mean", "running_var"):
            if getattr(self, f) is not None:
                lay.expand(getattr(self, f), lay.stats_axes, f)
        return self

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={tuple(v.shape)}" for f, v in self.to_dict().items())
        return f"NormParams({inner})"
