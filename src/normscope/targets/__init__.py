"""Adapters that turn any normalization implementation into a :class:`Target`.

``as_target(obj, framework=None)`` picks the adapter from the object's type, importing a framework only
when it is needed: torch modules, ONNX models (a ``.onnx`` path, bytes or an ``onnx.ModelProto``), MLX modules and
existing targets need no hint; a plain callable is ambiguous and needs ``framework=`` or a wrapper
(``normscope.targets.torch(fn)``, ``.numpy(fn)``, ``.jax(fn)``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from ..errors import TargetError
from .base import Capabilities, Outputs, Target

FRAMEWORKS = ("torch", "numpy", "jax", "onnx", "mlx")

__all__ = ["FRAMEWORKS", "Capabilities", "Outputs", "Target", "as_target", "jax", "mlx", "numpy", "onnx", "torch"]


def torch(fn_or_module: Callable, description: str | None = None, *, inputs: Sequence[str] = ("x",),
          outputs: Sequence[str] = ("y",), device=None) -> Target:
    """A torch module or function; its tensors are built on ``device`` (default: a module's own, else the CPU).

    ``inputs``/``outputs`` name its positional arguments and returned values, e.g. a fused residual-add + norm
    ``inputs=("x", "residual"), outputs=("y", "residual_out")``; call such a target with ``target.run``.
    """
    import torch as _t

    from .torch_target import TorchFunctionTarget, TorchModuleTarget

    if isinstance(fn_or_module, _t.nn.Module):
        return TorchModuleTarget(fn_or_module, description, inputs, outputs, device)
    return TorchFunctionTarget(fn_or_module, description, inputs, outputs, device)


def numpy(fn: Callable, description: str | None = None, *, inputs: Sequence[str] = ("x",),
          outputs: Sequence[str] = ("y",)) -> Target:
    """A function of NumPy arrays (one per name in ``inputs``)."""
    from .numpy_target import NumpyTarget

    return NumpyTarget(fn, description, inputs, outputs)


def jax(fn: Callable, description: str | None = None, *, inputs: Sequence[str] = ("x",),
        outputs: Sequence[str] = ("y",)) -> Target:
    """A function of jax arrays (one per name in ``inputs``; extra ``jax``)."""
    from .jax_target import JaxTarget

    return JaxTarget(fn, description, inputs, outputs)


def mlx(fn_or_module: Callable, description: str | None = None, *, inputs: Sequence[str] = ("x",),
        outputs: Sequence[str] = ("y",)) -> Target:
    """An ``mlx.nn.Module`` or a function of ``mx.array`` (one per name in ``inputs``; extra ``mlx``)."""
    from .mlx_target import MlxTarget

    return MlxTarget(fn_or_module, description, inputs, outputs)


def onnx(model, description: str | None = None) -> Target:
    """An ONNX model: path, bytes or onnx.ModelProto (extra ``onnx``); its inputs and outputs are the graph's."""
    from .onnx_target import OnnxTarget

    return OnnxTarget(model, description)


_WRAPPERS = {"torch": torch, "numpy": numpy, "jax": jax, "onnx": onnx, "mlx": mlx}


def as_target(obj, framework: str | None = None) -> Target:
    """The Target for ``obj``; see the module docstring for what needs a ``framework`` hint."""
    if isinstance(obj, Target):
        return obj
    if framework is not None:
        if framework not in _WRAPPERS:
            raise TargetError(f"unknown framework {framework!r}; use one of {', '.join(FRAMEWORKS)}")
        return _WRAPPERS[framework](obj)
    if "torch" in sys.modules:
        import torch as _t

        if isinstance(obj, _t.nn.Module):
            return torch(obj)
    from .mlx_target import is_mlx_module

    if is_mlx_module(obj):
        return mlx(obj)
    if isinstance(obj, str | os.PathLike) and str(obj).lower().endswith(".onnx"):
        return onnx(obj)
    if isinstance(obj, bytes | bytearray):
        return onnx(obj)
    if "onnx" in sys.modules:
        import onnx as _onnx

        if isinstance(obj, _onnx.ModelProto):
            return onnx(obj)
    if callable(obj):
        raise TargetError(
            f"{getattr(obj, '__qualname__', type(obj).__name__)} is a plain callable, which could take torch, "
            "NumPy or JAX arrays; pass framework='torch'|'numpy'|'jax' (CLI: --framework) or wrap it, e.g. "
            "normscope.targets.numpy(fn)"
        )
    raise TargetError(
        f"cannot use a {type(obj).__name__} as a target; pass a torch module, a function with framework=, "
        "or an ONNX model (path, bytes or onnx.ModelProto)"
    )
