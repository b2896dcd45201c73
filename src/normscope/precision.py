"""Rounding arithmetic that emulates how a low-precision kernel computes.

Real bfloat16/float16 kernels load their operands into float32 registers, compute, and round the result
back; float32 and float64 kernels compute in their own type. Reductions (the sums behind a mean) are
modelled as accumulated exactly in the kernel's accumulator (float32 for bfloat16/float16/float32, float64
for float64) and rounded once to the dtype, which is what a careful (pairwise or tree) kernel approaches; or,
with ``summation="sequential"``, added one term after another in the accumulator, each partial sum rounded —
the other end of what a faithful kernel may do (a plain loop), whose error grows with the row length. Values are
carried in a *work* array type (float64 for float64, float32 otherwise) whose values are always
representable in the emulated dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# The dtype table (names, aliases, unit roundoff, ranges) lives in dtypes.py; these names stay importable here.
from .dtypes import ACCUMULATOR, DTYPES, MAX_FINITE, UNIT_ROUNDOFF, dtype_name, wider

__all__ = ["Precision", "ACCUMULATOR", "DTYPES", "MAX_FINITE", "UNIT_ROUNDOFF", "dtype_name", "wider"]


SUMMATIONS = ("exact", "sequential")


class Precision:
    """Arithmetic of one dtype: ``op`` rounds a result computed in the work type to the dtype; ``summation``
    is how its means accumulate (:meth:`mean`)."""

    def __init__(self, name: str, summation: str = "exact"):
        if summation not in SUMMATIONS:
            raise ValueError(f"summation must be one of {', '.join(SUMMATIONS)}; got {summation!r}")
        self.name = dtype_name(name)
        self.work = np.float64 if self.name == "float64" else np.float32
        self.summation = summation

    def __repr__(self) -> str:
        return f"Precision({self.name!r}" + (f", summation={self.summation!r})" if self.summation != "exact" else ")")

    def round(self, a: np.ndarray | float) -> np.ndarray:
        """Round values (any float array) to this dtype, returned in the work type.

        float64 → bfloat16/float16 goes through float32, as torch and most runtimes convert.
        """
        a = np.asarray(a)
        if self.name == "float64":
            return a.astype(np.float64)
        with np.errstate(over="ignore"):
            a32 = a.astype(np.float32)
        if self.name == "float32":
            return a32
        narrow = ml_dtypes.bfloat16 if self.name == "bfloat16" else np.float16
        with np.errstate(over="ignore"):  # beyond the dtype's range is ±inf, as the hardware rounds
            return a32.astype(narrow).astype(np.float32)

    op = round  # an elementwise result computed in the work type, rounded to the dtype

    def scalar(self, value: float) -> np.ndarray:
        """A Python scalar as a kernel sees it: converted to the work (register) type."""
        return np.asarray(value, dtype=self.work)

    def mean(self, a: np.ndarray, axes: tuple[int, ...], count: float) -> np.ndarray:
        """Sum accumulated exactly over ``axes`` (kept), divided by ``count``, rounded once to this dtype.

        The accumulator is float32 for bfloat16/float16/float32 (kernels load half-precision values into
        float32 registers and accumulate there) and float64 for float64, so a total beyond the accumulator's
        range overflows to ±inf (for float32 statistics, e.g. the sum of squares of a thousand values near
        1e18), as it would in a kernel; a half-precision total beyond 65504 does not, only a mean beyond it.
        """
        if self.summation == "sequential":
            total = self._sequential_sum(a, axes)
        else:
            total = np.asarray(a, dtype=np.float64).sum(axis=axes, keepdims=True)
        limit = MAX_FINITE[ACCUMULATOR[self.name]]
        total = np.where(np.abs(total) > limit, np.copysign(np.inf, total), total)
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.round(total / count)

    def _sequential_sum(self, a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        """The sum over ``axes`` (kept) as a loop adds it: term after term in the accumulator's dtype, in
        row-major order over the reduced axes."""
        acc = np.float64 if ACCUMULATOR[self.name] == "float64" else np.float32
        a = np.asarray(a)
        axes = tuple(ax % a.ndim for ax in axes)
        kept = [ax for ax in range(a.ndim) if ax not in axes]
        moved = np.transpose(a, kept + list(axes))
        flat = moved.reshape(moved.shape[:len(kept)] + (-1,)).astype(acc)
        with np.errstate(over="ignore", invalid="ignore"):
            total = np.cumsum(flat, axis=-1, dtype=acc)[..., -1] if flat.shape[-1] else np.zeros(flat.shape[:-1])
        shape = [1 if ax in axes else a.shape[ax] for ax in range(a.ndim)]
        return np.asarray(total, dtype=np.float64).reshape(shape)
