"""MLX modules and functions as targets (extra ``mlx``): an ``mlx.nn.Module`` (an mlx-lm norm, ``mlx.nn.RMSNorm``)
or a function of ``mx.array``. MLX computes float64 on the CPU device, which is where normscope calls it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import TargetError
from ..extras import require
from .base import Capabilities, Target


def _mx():
    return require("mlx.core", "mlx")


_streams = threading.local()


def cpu_stream():
    """A CPU stream of the calling thread (MLX's streams belong to the thread that made them; a target's calls run
    on its worker thread): float64 exists on MLX's CPU device only."""
    mx = _mx()
    if getattr(_streams, "cpu", None) is None:
        _streams.cpu = mx.new_stream(mx.cpu)
    return _streams.cpu


def is_mlx_module(obj) -> bool:
    """Whether ``obj`` is an ``mlx.nn.Module`` (without importing mlx when it was never imported)."""
    import sys

    if "mlx.nn" not in sys.modules:
        return False
    return isinstance(obj, sys.modules["mlx.nn"].Module)


def to_numpy(value) -> np.ndarray:
    """An ``mx.array`` as NumPy (16-bit floats through float32, which holds them exactly)."""
    mx = _mx()
    if value.dtype in (mx.bfloat16, mx.float16):
        value = value.astype(mx.float32)
    return np.array(value)


class MlxTarget(Target):
    """A function (or module) taking ``mx.array`` inputs, one per declared input, run on MLX's CPU device."""

    framework = "mlx"
    capabilities = Capabilities(differentiable=True)

    def __init__(self, fn: Callable, description: str | None = None, inputs: Sequence[str] = ("x",),
                 outputs: Sequence[str] = ("y",)):
        _mx()
        name = type(fn).__name__ if is_mlx_module(fn) else getattr(fn, "__qualname__", repr(fn))
        super().__init__(description or f"MLX {'module' if is_mlx_module(fn) else 'function'} {name}", inputs,
                         outputs)
        if is_mlx_module(fn):
            _mx().eval(fn.parameters())  # computed here: a lazy array is bound to the stream of the thread that made it
        self.fn = fn

    def _arrays(self, inputs, dtype):
        mx = _mx()
        return [mx.array(np.asarray(inputs[n], dtype=np.float64)).astype(getattr(mx, dtype)) for n in self.inputs]

    def _run(self, inputs, dtype):
        mx = _mx()
        with mx.stream(cpu_stream()):
            out = self.fn(*self._arrays(inputs, dtype))
            return self.outputs_from(out, lambda v: to_numpy(v).astype(np.float64))

    def gradients(self, x, dy, dtype="float64"):
        mx = _mx()
        self.calls += 1
        if len(self.inputs) != 1:
            raise TargetError(f"{self.description}: gradients are probed for a single-input target")
        with mx.stream(cpu_stream()):
            (arr,) = self._arrays({self.inputs[0]: x}, dtype)
            _, (dx,) = mx.vjp(lambda a: self.fn(a), [arr], [mx.array(np.asarray(dy, np.float64)).astype(arr.dtype)])
            return to_numpy(dx).astype(np.float64), {}
