"""JAX functions as targets (extra ``jax``). float64 runs with x64 enabled for the call only."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..errors import TargetError
from ..extras import require
from .base import Capabilities, Target


def _jax():
    return require("jax", "jax"), require("jax.numpy", "jax")


class JaxTarget(Target):
    """A function taking jax arrays (one per declared input) and returning its outputs
    (e.g. ``lambda x: model.apply(p, x)``)."""

    framework = "jax"
    capabilities = Capabilities(differentiable=True)

    def __init__(self, fn: Callable, description: str | None = None, inputs: Sequence[str] = ("x",),
                 outputs: Sequence[str] = ("y",)):
        _jax()
        super().__init__(description or f"JAX function {getattr(fn, '__qualname__', repr(fn))}", inputs, outputs)
        self.fn = fn

    def _run(self, inputs, dtype):
        jax, jnp = _jax()
        with jax.enable_x64(dtype == "float64"):
            out = self.fn(*[jnp.asarray(inputs[n], dtype=getattr(jnp, dtype)) for n in self.inputs])
            return self.outputs_from(out, lambda v: self._to_numpy(jnp, v, dtype))

    @staticmethod
    def _to_numpy(jnp, value, dtype: str) -> np.ndarray:
        if dtype == "float64" and str(value.dtype) != dtype:
            raise TargetError(f"the function returned {value.dtype} for a float64 input")
        return np.asarray(jnp.asarray(value, dtype=jnp.float32 if dtype != "float64" else jnp.float64))

    def gradients(self, x, dy, dtype="float64"):
        jax, jnp = _jax()
        self.calls += 1
        with jax.enable_x64(dtype == "float64"):
            arr = jnp.asarray(np.asarray(x, dtype=np.float64), dtype=getattr(jnp, dtype))
            y, vjp = jax.vjp(self.fn, arr)
            (dx,) = vjp(jnp.asarray(np.asarray(dy, dtype=np.float64), dtype=y.dtype))
            return np.asarray(jnp.asarray(dx, dtype=jnp.float64 if dtype == "float64" else jnp.float32),
                              dtype=np.float64), {}
