"""NumPy functions as targets (bfloat16 through ml_dtypes)."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

from .base import Target, dtype_of

_NUMPY_DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16,
                 "bfloat16": ml_dtypes.bfloat16}


class NumpyTarget(Target):
    """A function taking one NumPy array and returning one array."""

    framework = "numpy"

    def __init__(self, fn: Callable, description: str | None = None):
        super().__init__(description or f"NumPy function {getattr(fn, '__qualname__', repr(fn))}")
        self.fn = fn

    def _run(self, x, dtype):
        given = x.astype(_NUMPY_DTYPES[dtype])
        before = given.copy()
        with np.errstate(all="ignore"):
            out = self.fn(given)
        self.note_input(before, given)
        out = np.asarray(out)
        self.output_dtype = dtype_of(out)
        return out.astype(np.float64)
