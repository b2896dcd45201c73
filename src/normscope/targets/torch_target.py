"""torch modules and functions as targets.

A module is probed through a private deep copy, so the caller's module (its parameters, running
buffers, mode and ``requires_grad`` flags) is never touched, whether inference succeeds or fails.
Tensors are built on the target's device (a module's: where its parameters live) and brought back with
``.cpu()`` before NumPy sees them, so a CUDA module is checked where it runs.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ..dtypes import torch_dtype
from ..errors import TargetError
from .base import Capabilities, Target, redraw


def _torch():
    import torch

    return torch


def _to_numpy(t) -> np.ndarray:
    """A float64 NumPy copy of a tensor on any device (``.cpu()`` first: a CUDA tensor has no ``.numpy()``)."""
    torch = _torch()
    if isinstance(t, tuple | list) and t:
        t = t[0]
    if not isinstance(t, torch.Tensor):
        raise TargetError(f"expected the target to return a tensor; got {type(t).__name__}")
    return t.detach().cpu().to(torch.float64).numpy().copy()  # never a view of the target's own tensor


def module_device(module):
    """The device a module's parameters (else buffers) live on; the CPU for a module without any."""
    torch = _torch()
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return torch.device("cpu")


def _without_user_hooks(module) -> None:
    """Drop the hooks a user registered on (a copy of) a module, so they never fire on normscope's copies.

    Hook objects that torch itself installs to compute a parameter (weight_norm, spectral_norm) are kept:
    they are part of what the module computes.
    """
    for m in module.modules():
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            hooks = getattr(m, name, None)
            if not hooks:
                continue
            for key, hook in list(hooks.items()):
                if not type(hook).__module__.startswith("torch."):
                    del hooks[key]
                    for extra in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                                  "_forward_pre_hooks_with_kwargs"):
                        getattr(m, extra, {}).pop(key, None)


@contextlib.contextmanager
def _global_hooks_suspended() -> Iterator[None]:
    """Hooks registered for every module (``register_module_forward_hook`` …) stay silent on private copies."""
    from torch.nn.modules import module as mm

    stores = [getattr(mm, n) for n in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                       "_global_backward_hooks", "_global_backward_pre_hooks",
                                       "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs")
              if isinstance(getattr(mm, n, None), dict)]
    saved = [dict(d) for d in stores]
    for d in stores:
        d.clear()
    try:
        yield
    finally:
        for d, items in zip(stores, saved, strict=True):
            d.clear()
            d.update(items)


def redraw_vectors(module) -> dict[str, np.ndarray]:
    """Re-draw ``module``'s floating vector parameters (two or more elements) in place with :func:`~.base.redraw`'s
    values; scalars (a learned ε) are kept. Returns the values by name ({} when it holds no vector parameter)."""
    torch = _torch()
    vectors = [(n, p) for n, p in module.named_parameters() if p.is_floating_point() and p.numel() >= 2]
    values = redraw({n: tuple(p.shape) for n, p in vectors})
    with torch.no_grad():
        for n, p in vectors:
            p.copy_(torch.from_numpy(values[n]))
    return values


class TorchFunctionTarget(Target):
    """A function taking torch tensors (one per declared input, in order) and returning its outputs."""

    framework = "torch"
    capabilities = Capabilities(differentiable=True, noncontiguous=True)

    def __init__(self, fn: Callable, description: str | None = None, inputs: Sequence[str] = ("x",),
                 outputs: Sequence[str] = ("y",), device: object = None):
        torch = _torch()
        super().__init__(description or f"torch function {getattr(fn, '__qualname__', repr(fn))}", inputs, outputs,
                         torch.device(device if device is not None else "cpu"))
        self.fn = fn

    def _place(self, t):
        """A CPU tensor moved to the target's device (a no-op on the CPU)."""
        return t.to(self.device)

    def _tensor(self, x: np.ndarray, dtype: str, grad: bool = False, contiguous: bool = True):
        torch = _torch()
        if contiguous or x.ndim < 2:
            t = self._place(torch.from_numpy(np.ascontiguousarray(x)).to(torch_dtype(dtype)))
            return t.requires_grad_(grad)
        order = tuple(reversed(range(x.ndim)))  # store transposed, view back: same values, other strides
        t = self._place(torch.from_numpy(np.ascontiguousarray(x.transpose(order))).to(torch_dtype(dtype)))
        t = t.permute(order)
        if t.is_contiguous():  # axes of size 1 make the transposed view contiguous: take every other element
            axis = max((a for a in range(x.ndim) if x.shape[a] > 1), default=x.ndim - 1)
            wide = list(x.shape)
            wide[axis] *= 2
            store = self._place(torch.zeros(wide, dtype=torch_dtype(dtype)))
            t = store[tuple(slice(None, None, 2) if a == axis else slice(None) for a in range(x.ndim))]
            t.copy_(self._place(torch.from_numpy(np.ascontiguousarray(x)).to(torch_dtype(dtype))))
        return t.requires_grad_(grad)

    def _run(self, inputs, dtype, contiguous: bool = True):
        torch = _torch()
        ts = [self._tensor(inputs[n], dtype, contiguous=contiguous) for n in self.inputs]
        before = [t.detach().clone() for t in ts]
        with torch.no_grad():
            out = self._apply(ts, dtype)
        self.note_input([_to_numpy(b) for b in before], [_to_numpy(t) for t in ts])
        return self.outputs_from(out, _to_numpy)

    def _apply(self, ts, dtype):
        return self.fn(*ts)

    def call_noncontiguous(self, x, dtype="float64"):
        from ..dtypes import dtype_name

        if len(self.inputs) != 1:
            raise TargetError(f"{self.description} takes {len(self.inputs)} inputs; strided calls take one")
        x = np.array(x, dtype=np.float64)
        self.calls += 1
        with self.running_code(f"a strided {dtype} input of shape {x.shape}"):
            out = self._run({self.inputs[0]: x}, dtype_name(dtype), contiguous=False)
        self._last_dtype = out.dtype
        return out.value

    def _backward(self, call, x, dy, dtype: str):
        """x.grad of sum(dy · call(x)); the call gets a copy of the leaf, so it may write to its input."""
        torch = _torch()
        self.calls += 1
        leaf = self._tensor(np.asarray(x, dtype=np.float64), dtype, grad=True)
        with torch.enable_grad(), self.running_code(f"the backward of a {dtype} input of shape {leaf.shape}"):
            y = call(leaf.clone())
            if isinstance(y, tuple | list):
                y = y[0]
            y.backward(torch.from_numpy(np.array(dy, dtype=np.float64)).to(device=y.device, dtype=y.dtype))
        if leaf.grad is None:
            raise TargetError("no gradient reached the input (is the output detached from it?)")
        return _to_numpy(leaf.grad)

    def gradients(self, x, dy, dtype="float64"):
        if len(self.inputs) != 1:
            raise TargetError(f"{self.description} takes {len(self.inputs)} inputs; gradients take one")
        return self._backward(self.fn, x, dy, dtype), {}


def _takes(module, given: int) -> None:
    """A TargetError naming the fix when ``module.forward`` needs more arguments than the target gives it (a gated
    norm's ``gate``): called with one, it fails at every dtype with only Python's "missing argument"."""
    import inspect

    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    needed = [p.name for p in params if p.kind in positional and p.default is inspect.Parameter.empty]
    if len(needed) > given:
        cls = type(module).__name__
        extra = ", ".join(needed[given:])
        raise TargetError(
            f"{cls}.forward needs {len(needed)} arguments ({', '.join(needed)}) and is given {given}: hold the "
            f"others fixed in a function and pass that, e.g. normscope.infer(lambda x: module(x, {extra}), "
            f"shape=..., framework='torch') with {extra} a tensor of the right shape")


class TorchModuleTarget(TorchFunctionTarget):
    """A torch ``nn.Module``, probed through a private copy."""

    capabilities = Capabilities(differentiable=True, noncontiguous=True, modes=True, parameters=True,
                                whole_state=True)

    def __init__(self, module, description: str | None = None, inputs: Sequence[str] = ("x",),
                 outputs: Sequence[str] = ("y",), device: object = None):
        torch = _torch()
        if not isinstance(module, torch.nn.Module):
            raise TargetError(f"expected a torch.nn.Module; got {type(module).__name__}")
        try:
            master = copy.deepcopy(module)
        except Exception as exc:
            raise TargetError(
                f"could not copy {type(module).__name__} ({exc}); normscope probes a private copy so the "
                "module you pass is never modified — wrap it in a function with framework='torch' instead"
            ) from exc
        _without_user_hooks(master)
        self._master = master.to(torch.float64)
        self._training = bool(module.training)
        self._copies: dict[str, object] = {}
        device = torch.device(device) if device is not None else module_device(master)
        self._master = self._master.to(device)
        Target.__init__(self, description or f"torch module {type(module).__name__}", inputs, outputs, device)
        self.module_class = type(module).__name__
        _takes(module, len(self.inputs))

    def _copy(self, dtype: str):
        if dtype not in self._copies:
            self._copies[dtype] = copy.deepcopy(self._master).to(torch_dtype(dtype))
        m = self._copies[dtype]
        m.train(self._training)
        return m

    @property
    def training(self) -> bool:
        return self._training

    @contextlib.contextmanager
    def mode(self, training: bool) -> Iterator[None]:
        before = self._training
        self._training = training
        try:
            yield
        finally:
            self._training = before

    def _call_module(self, m, *ts):
        # Training-mode calls update running statistics; keep the copy's state fixed between probes.
        saved = [b.detach().clone() for b in m.buffers()] if self._training else None
        try:
            with _global_hooks_suspended():
                return m(*ts)
        finally:
            if saved is not None:
                for b, s in zip(m.buffers(), saved, strict=True):
                    b.data.copy_(s)

    def _apply(self, ts, dtype):
        return self._call_module(self._copy(dtype), *ts)

    def buffers_after_training_step(self, x):
        torch = _torch()
        m = self._copy("float64")
        floating = [(n, b) for n, b in m.named_buffers() if torch.is_floating_point(b)]
        if not floating:
            return None
        saved = {n: b.detach().clone() for n, b in m.named_buffers()}
        was = m.training
        self.calls += 1
        try:
            m.train(True)
            with torch.no_grad(), _global_hooks_suspended(), self.running_code("a training step"):
                m(self._tensor(np.array(x, dtype=np.float64), "float64"))
            return {n: _to_numpy(b) for n, b in floating}
        finally:
            m.train(was)
            with torch.no_grad():
                for n, b in m.named_buffers():
                    b.copy_(saved[n])

    @property
    def momentum(self) -> float | None:
        """torch's running-statistics momentum; ``None`` (cumulative average) is 1/(batches tracked + 1)."""
        m = getattr(self._master, "momentum", "absent")
        if isinstance(m, int | float) and not isinstance(m, bool):
            return float(m)
        tracked = getattr(self._master, "num_batches_tracked", None)
        if m is None and tracked is not None:
            return 1.0 / (int(tracked) + 1)
        return None

    def parameters(self) -> dict[str, np.ndarray]:
        return {n: _to_numpy(p) for n, p in self._master.named_parameters()}

    def buffers(self) -> dict[str, np.ndarray]:
        torch = _torch()
        return {n: _to_numpy(b) for n, b in self._master.named_buffers() if torch.is_floating_point(b)}

    @contextlib.contextmanager
    def perturbed_parameters(self, rng):
        torch = _torch()
        params = [(n, p) for n, p in self._master.named_parameters() if torch.is_floating_point(p)]
        if not params:
            yield None
            return
        saved = [p.detach().clone() for _, p in params]
        values = {}
        with torch.no_grad():
            for n, p in params:
                v = rng.uniform(0.5, 1.5, size=tuple(p.shape)) * rng.choice([-1.0, 1.0], size=tuple(p.shape))
                p.copy_(torch.from_numpy(v))
                values[n] = v
        self._copies.clear()
        try:
            yield values
        finally:
            with torch.no_grad():
                for (_, p), s in zip(params, saved, strict=True):
                    p.copy_(s)
            self._copies.clear()

    @contextlib.contextmanager
    def redrawn_parameters(self):
        torch = _torch()
        params = list(self._master.named_parameters())
        saved = [p.detach().clone() for _, p in params]
        values = redraw_vectors(self._master)
        if not values:
            yield None
            return
        self._copies.clear()
        try:
            yield values
        finally:
            with torch.no_grad():
                for (_, p), s in zip(params, saved, strict=True):
                    p.copy_(s)
            self._copies.clear()

    @contextlib.contextmanager
    def with_buffers(self, values):
        torch = _torch()
        named = dict(self._master.named_buffers())
        if any(n not in named or tuple(named[n].shape) != np.shape(v) for n, v in values.items()):
            yield False
            return
        saved = {n: named[n].detach().clone() for n in values}
        with torch.no_grad():
            for n, v in values.items():
                named[n].copy_(torch.from_numpy(np.asarray(v, dtype=np.float64)))
        self._copies.clear()
        try:
            yield True
        finally:
            with torch.no_grad():
                for n, s in saved.items():
                    named[n].copy_(s)
            self._copies.clear()

    def gradients(self, x, dy, dtype="float64"):
        if len(self.inputs) != 1:
            raise TargetError(f"{self.description} takes {len(self.inputs)} inputs; gradients take one")
        m = self._copy(dtype)
        for p in m.parameters():
            p.grad = None
            p.requires_grad_(True)
        dx = self._backward(lambda t: self._call_module(m, t), x, dy, dtype)
        grads = {n: _to_numpy(p.grad) for n, p in m.named_parameters() if p.grad is not None}
        return dx, grads
