"""Private copies of a user's model and the promise to leave the model as it was.

``private_copy`` — a deep copy on the CPU without the user's hooks (a module on the meta device is materialized
with drawn values: see :func:`on_meta`); ``untouched`` — modes, ``requires_grad``
flags, parameters and buffers restored on exit; ``redrawn`` — a copy whose vector parameters are drawn away from
zero (a γ of ones hides the order of γ and the cast); ``stored_params`` — γ/β as a module stores them.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..errors import TargetError
from ..targets.torch_target import redraw_vectors
from .draws import in_shared_block

BIG_MODEL_BYTES = 1 << 30  # larger models' parameters are not copied by untouched(); writes to them are detected


def on_meta(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (shapes without values)."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def offloaded(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs under accelerate's offload hooks (``device_map`` with ``"disk"``/``"cpu"``
    offload): its parameters sit on the meta device and each module's hook loads them for its own call."""
    return any(getattr(m, "_hf_hook", None) is not None for m in module.modules())


def _from_offload(original: torch.nn.Module, m: torch.nn.Module) -> None:
    """The copy ``m`` of an offloaded module: accelerate's hooks removed and each meta parameter or buffer
    loaded from the weights map the original's hook reads (this module's tensors only)."""
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(m, recurse=True)
    for (_, sub), (_, copied) in zip(original.named_modules(), m.named_modules(), strict=True):
        hook = getattr(sub, "_hf_hook", None)
        weights = getattr(hook, "weights_map", None)
        if weights is None:
            continue
        for key, t in list(copied.named_parameters(recurse=False)) + list(copied.named_buffers(recurse=False)):
            if t.is_meta and key in weights:
                value = weights[key].detach().to("cpu").clone()
                if isinstance(t, torch.nn.Parameter):
                    setattr(copied, key, torch.nn.Parameter(value, requires_grad=t.requires_grad))
                else:
                    copied._buffers[key] = value


def _materialized(m: torch.nn.Module) -> torch.nn.Module:
    """``m`` (a copy) moved off the meta device with drawn values: floating parameters and buffers uniform in
    ±[0.5, 1.5] — positive for buffers, so a running variance is one — and integer ones zero. A contract does
    not depend on the values, and values away from zero and one hide no field (as :func:`redrawn`)."""
    rng = np.random.default_rng(0)
    m = m.to_empty(device="cpu")
    with torch.no_grad():
        for kind, tensors in (("param", list(m.parameters())), ("buffer", list(m.buffers()))):
            for t in tensors:
                if not t.is_floating_point():
                    t.zero_()
                    continue
                v = rng.uniform(0.5, 1.5, size=tuple(t.shape))
                if kind == "param":
                    v = v * rng.choice([-1.0, 1.0], size=tuple(t.shape))
                t.copy_(torch.from_numpy(v))
    return m


def _cast_memo(module: torch.nn.Module, dtype: torch.dtype) -> dict[int, Any]:
    """A deepcopy memo holding each floating parameter and buffer already cast to ``dtype`` on the CPU, so the
    copy is made at the target precision tensor by tensor: never a second full-precision copy of the model."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) in memo or not t.is_floating_point() or t.is_meta:
            continue
        cast = t.detach().to(device="cpu", dtype=dtype, copy=True)
        memo[id(t)] = torch.nn.Parameter(cast, requires_grad=t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else cast
    return memo


_MODULE_STATE = {"_parameters", "_buffers", "_modules"}


def plain_state(module: torch.nn.Module, depth: int = 3) -> list[tuple[str, Any, Any]]:
    """The floating tensors a model keeps outside its parameters and buffers, in plain attributes (a cache of
    attention biases filled on its first call), as ``(name, container, key)``: ``.to(dtype)`` leaves them at
    their dtype. Tensors in dicts, lists and tuples are found down to ``depth``; a tuple is replaced whole."""
    found: list[tuple[str, Any, Any]] = []

    def visit(name, container, key, value, d):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and not isinstance(value, torch.nn.Parameter):
                found.append((name, container, key))
        elif d > 0 and isinstance(value, dict):
            for k, v in list(value.items()):
                visit(f"{name}[{k!r}]", value, k, v, d - 1)
        elif d > 0 and isinstance(value, list | tuple):
            if any(isinstance(v, torch.Tensor) for v in value):
                found.append((name, container, key))  # cast element-wise, the sequence rebuilt

    for path, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if attr not in _MODULE_STATE and not attr.startswith("__"):
                visit(f"{path + '.' if path else ''}{attr}", sub, attr, value, depth)
    return found


def _cast_plain_state(module: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Cast the floating tensors of :func:`plain_state` to ``dtype`` in a private copy, so the copy at a dtype is
    the model at that dtype, not a mix that raises on its first mixed operation; the names cast."""
    names = []
    for name, container, key in plain_state(module):
        value = container[key] if isinstance(container, dict) else getattr(container, key)
        if isinstance(value, torch.Tensor):
            new = value.detach().to(dtype)
        else:
            new = type(value)(v.detach().to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                              for v in value)
        if isinstance(container, dict):
            container[key] = new
        else:
            setattr(container, key, new)
        names.append(name)
    return names


def private_copy(module: torch.nn.Module, training: bool = False, dtype: torch.dtype | None = None
                 ) -> torch.nn.Module:
    """A deep copy on the CPU, in the given mode, with no hooks (the user's hooks never run on it); with
    ``dtype``, its floating parameters and buffers at that dtype (as ``.to(dtype)``), cast one tensor at a time;
    a module on the meta device is materialized with drawn values."""
    try:
        m = copy.deepcopy(module, _cast_memo(module, dtype) if dtype is not None else None)
    except Exception as exc:
        raise TargetError(f"could not copy {type(module).__name__} ({exc}); scan probes private copies") from exc
    from .streaming import settle_copy

    still_streamed = settle_copy(m, dtype)  # a streamed model's copy: read whole when small, else streamed
    if offloaded(module) and on_meta(m):
        _from_offload(module, m)
    if on_meta(m) and not still_streamed:
        m = _materialized(m)
    if dtype is not None:
        m._normscope_cast_state = _cast_plain_state(m, dtype)
    for sub in m.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            d = getattr(sub, attr, None)
            if d is not None:
                d.clear()
    return (m if still_streamed else m.cpu()).train(training)  # meta parameters cannot move: streamed on the CPU


@contextlib.contextmanager
def untouched(model: torch.nn.Module) -> Iterator[None]:
    """Restore modes, ``requires_grad`` flags, parameters and buffers (values and objects) on exit."""
    modules = list(model.modules())
    modes = [m.training for m in modules]
    slots = [(dict(m._parameters), dict(m._buffers)) for m in modules]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    stored = _storages(p for p in model.parameters() if not p.is_meta)
    size = sum(b.numel() * b.element_size() for b in stored)
    copied = size <= BIG_MODEL_BYTES
    params = [(b, b.clone()) for b in stored] if copied else []
    versions = [(n, p, p._version) for n, p in model.named_parameters()
                if not p.is_meta and not in_shared_block(p)]  # meta: no values
    buffers = [(b, b.detach().clone()) for b in model.buffers() if not b.is_meta]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (ps, bs) in zip(modules, slots, strict=True):
                if not _same_objects(m._parameters, ps):
                    m._parameters.clear()
                    m._parameters.update(ps)
                if not _same_objects(m._buffers, bs):
                    m._buffers.clear()
                    m._buffers.update(bs)
            for m, was in zip(modules, modes, strict=True):
                m.training = was
            for p, req in grads:
                p.requires_grad_(req)
            for p, saved in params:
                _restore(p, saved)
            for b, saved in buffers:
                if b.shape == saved.shape and not torch.equal(b, saved):
                    b.copy_(saved)
        if not copied:
            changed = [n for n, p, v in versions if p._version != v]
            if changed:
                raise TargetError(f"the model's forward wrote to its parameters {', '.join(changed[:5])}; they are "
                                  "too large to have been copied, so the scan could not undo it")


def _restore(t: torch.Tensor, saved: torch.Tensor) -> None:
    """``t`` given back the values of ``saved`` (its clone) where they differ; a tensor subclass that wraps plain
    tensors (a torchao quantized weight: its ``qdata``, ``scale``…) through each of them, since such a type
    implements neither ``equal`` nor ``copy_`` as a whole."""
    if type(t).__name__ == "DTensor":  # a shard of a parameter (tensor parallelism, FSDP2): this rank's piece
        _restore(t.to_local(), saved.to_local())
        return
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            inner, kept = getattr(t, name), getattr(saved, name)
            if isinstance(inner, torch.Tensor):
                _restore(inner, kept)
        return
    if not torch.equal(t, saved):
        t.copy_(saved)


def _storages(tensors) -> list[torch.Tensor]:
    """The memory the tensors hold, each storage once, as bytes (tied weights once); a tensor of a subclass as
    itself; none of a block of draws that views share (a model built only to be read: no one's values)."""
    seen: dict[tuple, torch.Tensor] = {}
    for t in tensors:
        if in_shared_block(t):
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            seen[("tensor", id(t))] = t.detach()
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            seen.setdefault((storage.device, storage.data_ptr()),
                            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
    return list(seen.values())


def _same_objects(now: dict, saved: dict) -> bool:
    """The same keys holding the same tensor objects (``!=`` on the dicts would compare tensors' values)."""
    return now.keys() == saved.keys() and all(now[k] is saved[k] for k in saved)


def redrawn(module: torch.nn.Module) -> torch.nn.Module | None:
    """A copy whose vector parameters are re-drawn away from zero (scalars, such as a learned ε, are kept): the
    values ``infer`` re-draws its own copy with (:func:`normscope.targets.torch_target.redraw_vectors`); None when
    the module holds no vector parameter."""
    m = copy.deepcopy(module)
    return m if redraw_vectors(m) else None


def stored_params(module: torch.nn.Module, result, sized: bool = False) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """γ/β as the module stores them, where inference named the parameter; else the recovered values. ``sized``:
    ``result`` was inferred on a module of another size, so its recovered values do not apply here: the module's
    own parameter (of the recovered values' rank), else a ``ValueError``."""
    params = result.params.to_dict()
    named = dict(module.named_parameters())
    sources = {}
    for field in ("gamma", "beta"):
        ev = result.evidence.get(field)
        name = ev.measured.get("parameter") if ev is not None else None
        if field not in params:
            continue
        sources[field] = "recovered by probing"
        shape = np.asarray(params[field]).shape
        if isinstance(name, str) and name in named:
            w = named[name].detach().double().cpu().numpy()
            if w.size == np.asarray(params[field]).size:
                params[field] = w.reshape(shape)
                sources[field] = f"the module's parameter {name!r}"
            elif sized and (w.ndim == len(shape) or len(shape) == 1):
                params[field] = w if w.ndim == len(shape) else w.reshape(-1)
                sources[field] = f"the module's parameter {name!r}"
        if sized and sources[field] == "recovered by probing":
            raise ValueError(f"{field} was recovered by probing a module of another size")
    return params, sources
