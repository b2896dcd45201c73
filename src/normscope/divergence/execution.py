"""How ``diff`` runs a model and sees its module calls: the primary output of a call, casts of its arguments,
process-wide forward hooks filtered to one model, the stack of calls in flight, the autocast context with the
dtype its ops ran at, and the memo that lets teacher-forced runs reuse a leaf's output. Shared by the forward
comparison and the gradient comparison (:mod:`.gradients`)."""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ..dtypes import dtype_name
from ..errors import InputError
from ..model.streaming import weightless, weights_of

SAFE = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size)


def primary(out) -> torch.Tensor | None:
    """The first tensor of a module's output (a tensor, a tuple/list, a dict or HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, list | tuple):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
        return None
    if isinstance(out, Mapping):
        for o in out.values():
            if isinstance(o, torch.Tensor):
                return o
    return None


def floating_leaves(out, prefix: str = "", depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Every floating tensor of a module's output with its name: a dict's (or ``ModelOutput``'s) key, a tuple's
    index, dotted for nested ones (``"1.0"``); the primary output first."""
    if isinstance(out, torch.Tensor):
        return [(prefix or "0", out)] if out.is_floating_point() else []
    items = out.items() if isinstance(out, Mapping) else enumerate(out) if isinstance(out, list | tuple) else ()
    found = []
    if depth < 3:
        for k, v in items:
            found.extend(floating_leaves(v, f"{prefix}.{k}" if prefix else str(k), depth + 1))
    return found


def output_of(cand) -> Any:
    """The whole output of a candidate's last teacher-forced run, where it keeps one (torch candidates)."""
    return getattr(cand, "own_output", None)


def cast(obj, dtype: torch.dtype | None, clamp: bool = False):
    """Floating tensors to ``dtype``. ``clamp`` (keyword arguments: masks) keeps values within the dtype's finite
    range, so a float32 mask of −3.4e38 stays finite; activations are cast as they are (an overflow at fp16 is
    what the candidate would meet)."""
    if dtype is None:
        return obj
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.dtype != dtype:
            if clamp and torch.finfo(dtype).max < torch.finfo(obj.dtype).max:
                fi = torch.finfo(dtype)
                return obj.detach().clamp(fi.min, fi.max).to(dtype)
            return obj.detach().to(dtype)
        return obj
    if isinstance(obj, tuple | list):
        return type(obj)(cast(o, dtype, clamp) for o in obj)
    if isinstance(obj, dict):
        return {k: cast(v, dtype, clamp) for k, v in obj.items()}
    return obj


def stateless(obj, values: tuple[type, ...] = (torch.Tensor, *SAFE), depth: int = 0) -> bool:
    """Only tensors (arrays of another framework: ``values``) and plain values, in tuples, lists and dicts: an
    argument that can be handed to another module without sharing state (a KV cache object would be written to)."""
    if isinstance(obj, values):
        return True
    if depth < 3 and isinstance(obj, tuple | list):
        return all(stateless(o, values, depth + 1) for o in obj)
    if depth < 3 and isinstance(obj, dict):
        return all(stateless(v, values, depth + 1) for v in obj.values())
    return False


def model_dtype(model: torch.nn.Module) -> str:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return dtype_name(str(t.dtype).replace("torch.", ""))
    return "float32"


def device_type(model: torch.nn.Module) -> str:
    """The device type autocast runs on: the model's first parameter's or buffer's (cpu without any)."""
    for t in list(model.parameters()) + list(model.buffers()):
        dev = t.device.type
        if not torch.amp.is_autocast_available(dev):
            raise InputError(f"autocast is not available on {dev}; use candidate_dtype= instead")
        return dev
    return "cpu"


def input_at(args, kwargs, out: torch.Tensor | None = None) -> tuple[str, int | str] | None:
    """Where a call's main input is: ``("arg", i)``, the first floating positional tensor, or for a module called
    with keyword arguments only ``("kw", name)``, the floating keyword tensor of the output's shape (else the
    first floating one); None without a floating tensor."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return "arg", i
    floating = [k for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not floating:
        return None
    same = [k for k in floating if out is not None and tuple(kwargs[k].shape) == tuple(out.shape)]
    return "kw", (same or floating)[0]


def input_of(args, kwargs, out: torch.Tensor | None = None) -> torch.Tensor | None:
    at = input_at(args, kwargs, out)
    return None if at is None else (args if at[0] == "arg" else kwargs)[at[1]]


def versions(args) -> tuple:
    """The version counters of the positional tensors: a module that writes its input in place changes them."""
    return tuple(a._version if isinstance(a, torch.Tensor) else None for a in args)


def lowest(dtypes, default: str) -> str:
    """The least precise of ``dtypes`` (torch dtypes or names): the one with the largest unit roundoff."""
    from ..dtypes import UNIT_ROUNDOFF

    names = {str(d).replace("torch.", "") for d in dtypes} & set(UNIT_ROUNDOFF)
    return max(names, key=lambda n: UNIT_ROUNDOFF[n]) if names else default


def observer():
    """A dispatch mode that records the floating dtypes the ops of a call produced. Under autocast it sits below
    the autocast key: it sees each op after autocast cast its inputs, i.e. the dtype the op actually ran at."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Observed(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes: set[torch.dtype] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self.dtypes.add(t.dtype)
            return out

    return _Observed()


class Autocast:
    """The candidate's execution context: ``torch.autocast`` on the model's device type at one dtype, or nothing.
    ``observe()`` wraps a call and says the least precise dtype its ops ran at (None without autocast)."""

    def __init__(self, dtype: str | None, device_type: str):
        self.dtype, self.device_type = dtype, device_type

    def __bool__(self) -> bool:
        return self.dtype is not None

    def __call__(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=getattr(torch, self.dtype))

    @contextlib.contextmanager
    def observe(self):
        """Yields a list that holds, after the block, the least precise floating dtype produced inside it."""
        seen: list[str] = []
        if self.dtype is None:
            yield seen
            return
        obs = observer()
        with self(), obs:
            yield seen
        seen.append(lowest(obs.dtypes, ""))


class CallStack:
    """The module calls in flight during a hooked forward: each call's positional arguments and their version
    counters, and whether it is a leaf (called no module) or calls only leaves (attention and its projections)."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.frames)

    def enter(self, args, state: dict | None = None) -> None:
        """A call begins; ``state``: copies of its stateful arguments as they were before it (:func:`snapshot`)."""
        if self.frames:
            self.frames[-1]["children"] += 1
        self.frames.append({"args": args, "versions": versions(args), "children": 0, "leaf_children": True,
                            "child_error": 0.0, "child_unmeasured": False, "state": state, "kids": [],
                            "child_sites": []})

    def leave(self) -> tuple[dict[str, Any], bool]:
        """(the call's frame, whether it is a leaf)."""
        f = self.frames.pop()
        leaf = f["children"] == 0
        if self.frames and not leaf:
            self.frames[-1]["leaf_children"] = False
        return f, leaf


class Memo:
    """The reference's tensors as teacher-forced runs get them: one copy per reference tensor (and version), cast
    to the run's dtype (:meth:`cast`), so a module and its twin are handed the same tensor object and never the
    reference's live tensors."""

    SIZE = 8

    def __init__(self) -> None:
        self.casts: list[tuple] = []

    def cast(self, obj, dtype: torch.dtype | None, clamp: bool = False):
        """The reference's tensors as a teacher-forced module gets them: :func:`cast` to ``dtype``, or a copy at
        their own dtype — never the reference's live tensors, which a module that writes its input in place would
        change under the reference's own forward. One copy per reference tensor (and version) among the last
        few, reused only while nothing wrote it."""
        if isinstance(obj, torch.Tensor):
            if clamp and dtype is not None and obj.is_floating_point() and obj.numel() and \
                    bool(obj.detach().abs().amax() <= torch.finfo(dtype).max):
                clamp = False  # nothing to clamp: the same cast as a positional argument's
            for src, version, cl, out, out_version in self.casts:
                if src is obj and version == obj._version and cl == clamp and out._version == out_version:
                    return out
            out = cast(obj, dtype, clamp)
            if out is obj:
                out = obj.detach().clone()
            self.casts.append((obj, obj._version, clamp, out, out._version))
            del self.casts[:-self.SIZE]
            return out
        if isinstance(obj, tuple | list):
            return type(obj)(self.cast(o, dtype, clamp) for o in obj)
        if isinstance(obj, dict):
            return {k: self.cast(v, dtype, clamp) for k, v in obj.items()}
        return obj


def reduce_len(args, out: torch.Tensor) -> int:
    n = out.shape[-1] if out.dim() else 1
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim():
            n = max(n, a.shape[-1])
    return int(n)


class Hooks:
    """Process-wide forward hooks, filtered to one model's modules; ``pre(module, path, number, args)`` and
    ``post(module, path, number, args, kwargs, output)`` receive the calls. Removed on exit, also on error."""

    def __init__(self, model: torch.nn.Module, pre, post):
        self.paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
        self.pre_cb, self.post_cb = pre, post
        self.numbers: dict[int, int] = {}
        self.stack: list[tuple[torch.nn.Module, int]] = []
        self.paused = False
        self.failed_at: tuple[str, int] | None = None
        self.errors: list[str] = []

    def _pre(self, module, args):
        if self.paused or id(module) not in self.paths:
            return None
        n = self.numbers.get(id(module), 0)
        self.numbers[id(module)] = n + 1
        self.stack.append((module, n))
        self.paused = True
        try:
            self.pre_cb(module, self.paths[id(module)], n, args, call_kwargs())
        finally:
            self.paused = False
        return None

    def _post(self, module, args, kwargs, output=None):
        if self.paused or id(module) not in self.paths or not self.stack or self.stack[-1][0] is not module:
            return None
        _, n = self.stack.pop()
        if output is None and self.failed_at is None:
            self.failed_at = (self.paths[id(module)], n)  # always_call: the innermost call that raised
        self.paused = True
        try:
            self.post_cb(module, self.paths[id(module)], n, args, kwargs, output)
        except Exception as exc:  # a comparison that fails is reported, it never breaks the user's forward
            self.errors.append(f"{site_name(self.paths[id(module)], n)}: {type(exc).__name__}: {exc}")
        finally:
            self.paused = False
        return None

    @contextlib.contextmanager
    def active(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        handles = [register_module_forward_pre_hook(self._pre),
                   register_module_forward_hook(self._post, with_kwargs=True, always_call=True)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self.paused = False


def call_kwargs() -> dict | None:
    """The keyword arguments of the module call whose global forward pre-hook is running. torch hands such a hook
    the positional arguments only; the keyword ones are a local of the ``Module._call_impl`` frame that calls it
    (two frames up: this function, the hook). None where that frame does not hold them (another torch)."""
    try:
        kw = sys._getframe(2).f_locals.get("kwargs")
    except (ValueError, AttributeError):
        return None
    return kw if isinstance(kw, dict) else None


def snapshot(args, kwargs) -> dict | None:
    """Deep copies of a call's stateful arguments (a KV-cache object that the call will write to), taken before
    the call, keyed ``("arg", i)`` / ``("kw", name)``: a teacher-forced run of the same call gets a fresh copy of
    the state the reference's call started from (:func:`restored`). None when the call has none; a value that
    cannot be copied is kept as the reason (a string) instead."""
    state = {}
    for key, value in [(("arg", i), a) for i, a in enumerate(args)] + \
            [(("kw", k), v) for k, v in (kwargs or {}).items()]:
        if stateless(value):
            continue
        try:
            state[key] = copy.deepcopy(value, _detached_memo(value))
        except Exception as exc:
            state[key] = f"{type(value).__name__} could not be copied ({type(exc).__name__}: {exc})"
    return state or None


def _detached_memo(obj, depth: int = 5, memo: dict | None = None) -> dict:
    """A deepcopy memo holding a detached copy of each tensor an object holds (in its attributes, lists, tuples
    and dicts): a cache filled under autograd holds tensors with a history, which deepcopy refuses."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.detach().clone()
        return memo
    if depth <= 0 or isinstance(obj, SAFE):
        return memo
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, list | tuple):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    for item in items:
        _detached_memo(item, depth - 1, memo)
    return memo


def restored(args, kwargs, state: dict | None) -> tuple[tuple, dict] | str:
    """``args``/``kwargs`` with each stateful argument replaced by a fresh copy of its state before the call (one
    copy per run: a teacher-forced run writes to it). A reason (a string) when one cannot be restored."""
    args, kwargs = list(args), dict(kwargs)
    for where, box in (("arg", args), ("kw", kwargs)):
        keys = range(len(box)) if where == "arg" else list(box)
        for k in keys:
            if stateless(box[k]):
                continue
            saved = (state or {}).get((where, k))
            if saved is None:
                return (f"the call takes a stateful argument ({type(box[k]).__name__}) whose state before the call "
                        "was not seen")
            if isinstance(saved, str):
                return saved
            box[k] = copy.deepcopy(saved, _detached_memo(saved))
    return tuple(args), kwargs


class Unfrozen(Exception):
    """A call's output holds an object that cannot be replayed (one that cannot be copied)."""


class _Copied:
    """Another object in a frozen output (a cache object), deep-copied once more at each replay."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj


def freeze(obj, dtype: torch.dtype | None = None, depth: int = 0):
    """A private copy of a call's output (tensors detached and copied, floating ones cast to ``dtype``; tuples,
    lists, dicts and Hugging Face ``ModelOutput`` rebuilt; any other object, such as the cache a model returns,
    deep-copied), to be replayed in a parent's teacher-forced run (:class:`Replay`). Raises :class:`Unfrozen`
    for an object that cannot be copied."""
    if isinstance(obj, torch.Tensor):
        if dtype is not None and obj.is_floating_point() and obj.dtype != dtype:
            return obj.detach().to(dtype)
        return obj.detach().clone()
    if isinstance(obj, SAFE):
        return obj
    if depth < 4 and isinstance(obj, tuple | list):
        items = [freeze(o, dtype, depth + 1) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if depth < 4 and isinstance(obj, Mapping):
        items = {k: freeze(v, dtype, depth + 1) for k, v in obj.items()}
        try:
            return type(obj)(**items) if type(obj) is not dict else items
        except Exception:
            raise Unfrozen(type(obj).__name__) from None
    try:
        return _Copied(copy.deepcopy(obj, _detached_memo(obj)))
    except Exception:
        raise Unfrozen(type(obj).__name__) from None


def thawed(obj, dtype: torch.dtype | None = None):
    """A fresh copy of a frozen output for one replay (the parent may write it in place), its floating tensors at
    ``dtype`` (None: as frozen); containers rebuilt with their own types."""
    if isinstance(obj, torch.Tensor):
        if dtype is not None and obj.is_floating_point() and obj.dtype != dtype:
            return obj.to(dtype)
        return obj.clone()
    if isinstance(obj, tuple | list):
        items = [thawed(o, dtype) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, Mapping):
        items = {k: thawed(v, dtype) for k, v in obj.items()}
        return type(obj)(**items) if type(obj) is not dict else items
    if isinstance(obj, _Copied):
        return copy.deepcopy(obj.obj, _detached_memo(obj.obj))
    return obj


class Kid:
    """A judged child call of a module, as its parent's teacher-forced run replays it: the reference's output
    (frozen at the candidate's dtype) in place of the child's own, and the reference's input to it, against
    which the input the parent's code hands the child is compared."""

    __slots__ = ("path", "name", "module", "x", "out")

    def __init__(self, path: str, name: str, module, x: torch.Tensor | None, out):
        self.path, self.name, self.module, self.x, self.out = path, name, module, x, out


class Replay:
    """A module's own code, isolated: while it runs on the reference's inputs, each child call that was judged on
    its own returns the reference's output for that call (in call order, per child module) instead of running,
    and the input the parent's code handed it is compared with the reference's (``feeds``: the worst
    ‖Δ‖/‖r‖, with the child's name). A child without a replay (one not judged on its own: no counterpart, or
    no own error) runs as the candidate's module, so its error is the parent's. ``modules`` maps each kid to the
    module that stands for it on this side (the candidate's, or the twin's)."""

    def __init__(self, kids: list[Kid], module_of=lambda kid: kid.module, view=None, gathered=None):
        # a sharded candidate: ``view(kid, out)`` lays the reference's output out as the child's own was, and
        # ``gathered(kid, xc)`` maps what the parent's code handed the child back to the full tensor
        self.view, self.gathered = view, gathered
        self.queues: dict[int, list[Kid]] = {}
        self.modules: dict[int, torch.nn.Module] = {}
        for kid in kids:
            m = module_of(kid)
            if isinstance(m, torch.nn.Module):
                self.queues.setdefault(id(m), []).append(kid)
                self.modules[id(m)] = m
        self.feeds: tuple[float, str] | None = None
        self.replayed = 0

    def _replacement(self, module, forward):
        queue = self.queues[id(module)]

        def replayed_forward(*args, **kwargs):
            if not queue:  # called more often than in the reference: its own output (a streamed module's weights read)
                with weights_of(module):
                    return forward(*args, **kwargs)
            kid = queue.pop(0)
            self.replayed += 1
            if kid.x is not None:
                from .metrics import errors

                xc = input_of(args, kwargs, kid.x)
                if self.gathered is not None and isinstance(xc, torch.Tensor):
                    xc = self.gathered(kid, xc)
                e = errors(xc, kid.x).get("normalized", float("inf")) if isinstance(xc, torch.Tensor) \
                    else float("inf")
                if self.feeds is None or not e <= self.feeds[0]:
                    self.feeds = (e, kid.name)
            out = thawed(kid.out)
            return self.view(kid, out) if self.view is not None else out

        return replayed_forward

    @contextlib.contextmanager
    def installed(self):
        with forwards_replaced(self.modules.values(), self._replacement):
            yield self


@contextlib.contextmanager
def forwards_replaced(modules, replacement):
    """While the block runs, each module's ``forward`` is ``replacement(module, its forward)``; after it, what the
    module had comes back (an instance ``forward`` of its own — another wrapper — included)."""
    saved = []
    modules = list(modules)
    try:
        for m in modules:
            saved.append((m, vars(m).get("forward")))
            m.forward = replacement(m, m.forward)
        with weightless(modules):  # a streamed module replayed reads no weights
            yield
    finally:
        for m, previous in saved:
            if previous is None:
                vars(m).pop("forward", None)
            else:
                m.forward = previous


def site_name(path: str, number: int) -> str:
    return (path or "(model)") + (f"#{number}" if number else "")


class Record:
    __slots__ = ("path", "number", "module", "shape", "output", "used", "version", "alternatives", "input_dtype")

    def __init__(self, path, number, module, output, input_dtype: torch.dtype | None = None):
        self.path, self.number, self.module = path, number, module
        self.input_dtype = input_dtype  # the dtype of the call's main input in the candidate's own forward
        self.alternatives = None  # an ONNX scope's several outputs, (module key, tensor) each
        self.output = output
        self.version = output._version if output is not None else None
        self.shape = list(output.shape) if output is not None else None
        self.used = False
