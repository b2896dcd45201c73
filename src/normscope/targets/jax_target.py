"""JAX functions as targets (extra ``jax``). float64 runs with x64 enabled for the call only."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import MissingExtraError, TargetError
from .base import Target, dtype_of


def _jax():
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:
        raise MissingExtraError("jax", "jax") from exc
    return jax, jnp


class JaxTarget(Target):
    """A function taking one jax array and returning one array (e.g. ``lambda x: model.apply(p, x)``)."""

    framework = "jax"
    differentiable = True

    def __init__(self, fn: Callable, description: str | None = None):
        _jax()
        super().__init__(description or f"JAX function {getattr(fn, '__qualname__', repr(fn))}")
        self.fn = fn

    def _run(self, x, dtype):
        jax, jnp = _jax()
        with jax.enable_x64(dtype == "float64"):
            arr = jnp.asarray(x, dtype=getattr(jnp, dtype))
            out = self.fn(arr)
            if isinstance(out, tuple | list):
                out = out[0]
            self.output_dtype = dtype_of(out)
            if str(out.dtype) != dtype and dtype == "float64":
                raise TargetError(f"the function returned {out.dtype} for a float64 input")
            return np.asarray(jnp.asarray(out, dtype=jnp.float32 if dtype != "float64" else jnp.float64))

    def gradients(self, x, dy, dtype="float64"):
        jax, jnp = _jax()
        self.calls += 1
        with jax.enable_x64(dtype == "float64"):
            arr = jnp.asarray(np.asarray(x, dtype=np.float64), dtype=getattr(jnp, dtype))
            y, vjp = jax.vjp(self.fn, arr)
            (dx,) = vjp(jnp.asarray(np.asarray(dy, dtype=np.float64), dtype=y.dtype))
            return np.asarray(jnp.asarray(dx, dtype=jnp.float64 if dtype == "float64" else jnp.float32),
                              dtype=np.float64), {}
