"""NumPy functions as targets (bfloat16 through ml_dtypes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..dtypes import numpy_dtype
from .base import Target


class NumpyTarget(Target):
    """A function taking NumPy arrays (one per declared input, in order) and returning its outputs."""

    framework = "numpy"

    def __init__(self, fn: Callable, description: str | None = None, inputs: Sequence[str] = ("x",),
                 outputs: Sequence[str] = ("y",)):
        super().__init__(description or f"NumPy function {getattr(fn, '__qualname__', repr(fn))}", inputs, outputs)
        self.fn = fn

    def _run(self, inputs, dtype):
        given = [inputs[n].astype(numpy_dtype(dtype)) for n in self.inputs]
        before = [g.copy() for g in given]
        with np.errstate(all="ignore"):
            out = self.fn(*given)
        self.note_input(before, given)
        if isinstance(out, list):  # a list of numbers is an array here (a tuple holds several outputs)
            out = np.asarray(out)
        return self.outputs_from(out, lambda v: np.asarray(v).astype(np.float64))
