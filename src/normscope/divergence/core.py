"""``diff(reference, candidate, inputs)``: two executions of one model compared site by site, down to the first
site whose *own* error is beyond what a faithful execution at the candidate's dtype is allowed.

How it runs (streaming: never two full activation caches):

1. the candidate runs once; the primary output of each of its module calls is kept (at the candidate's dtype)
   — or, for an ONNX candidate, onnxruntime returns every intermediate value, mapped to the torch sites by the
   exporter's node-name scopes;
2. the reference runs once; at the end of each module call (children before parents) its output is compared
   with the candidate's (the *propagated* error, then the candidate's copy is dropped), and the candidate's
   counterpart module is run on the reference's own inputs (teacher forcing: the site's *own* error; for an
   ONNX candidate the site's nodes extracted as a subgraph, :mod:`.onnxsites`), as is the reference's module at
   the candidate's dtype (the *twin*: the error precision alone makes there). Under ``autocast`` each
   teacher-forced call is observed below the autocast key and the site judged at the dtype its ops ran at;
3. a site diverges when its own error exceeds :func:`.metrics.bound`; the first one is the culprit. At a norm
   site both contracts are inferred (``normscope.infer``) and their differences printed in the contract's words.

Module calls are seen through process-wide forward hooks filtered to the model's modules (nothing is
registered on the user's models); both models are left as they were (modes, parameters, buffers, flags).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..dtypes import dtype_name
from ..errors import InputError, NormscopeError, NotANormalization, TargetError
from ..sites.core import _arguments, _describe, _progress, _redrawn, known_class, private_copy, untouched
from ..sites.dataflow import block_modules
from . import contracts, metrics, onnxsites
from .onnxsites import is_onnx as _is_onnx
from .result import Diff, SiteDiff

_LOW = ("bfloat16", "float16", "float32", "float64")
_AUTOCAST = ("bfloat16", "float16")
_WINDOW = 16  # order alignment: how far ahead in the candidate's calls a counterpart is looked for
_SAFE = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size)
MIN_OWN_SHARE = 0.5  # "no divergence" needs at least this share of the sites with an own error compared with one
COMPOSITION = 10.0  # a module whose output errs this many times more than all its children's: its own code diverged


# ---------------------------------------------------------------------------------------------- helpers
def _primary(out) -> torch.Tensor | None:
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


def _cast(obj, dtype: torch.dtype | None, clamp: bool = False):
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
        return type(obj)(_cast(o, dtype, clamp) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype, clamp) for k, v in obj.items()}
    return obj


def _stateless(obj, depth: int = 0) -> bool:
    """Only tensors and plain values: an argument that can be handed to another module without sharing state
    (a KV cache object would be written to)."""
    if isinstance(obj, (torch.Tensor, *_SAFE)):
        return True
    if depth < 3 and isinstance(obj, tuple | list):
        return all(_stateless(o, depth + 1) for o in obj)
    if depth < 3 and isinstance(obj, dict):
        return all(_stateless(v, depth + 1) for v in obj.values())
    return False


def _model_dtype(model: torch.nn.Module) -> str:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return dtype_name(str(t.dtype).replace("torch.", ""))
    return "float32"


def _device_type(model: torch.nn.Module) -> str:
    """The device type autocast runs on: the model's first parameter's or buffer's (cpu without any)."""
    for t in list(model.parameters()) + list(model.buffers()):
        dev = t.device.type
        if not torch.amp.is_autocast_available(dev):
            raise InputError(f"autocast is not available on {dev}; use candidate_dtype= instead")
        return dev
    return "cpu"


def _input_at(args, kwargs, out: torch.Tensor | None = None) -> tuple[str, int | str] | None:
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


def _input(args, kwargs, out: torch.Tensor | None = None) -> torch.Tensor | None:
    at = _input_at(args, kwargs, out)
    return None if at is None else (args if at[0] == "arg" else kwargs)[at[1]]


def _versions(args) -> tuple:
    """The version counters of the positional tensors: a module that writes its input in place changes them."""
    return tuple(a._version if isinstance(a, torch.Tensor) else None for a in args)


def _lowest(dtypes, default: str) -> str:
    """The least precise of ``dtypes`` (torch dtypes or names): the one with the largest unit roundoff."""
    from ..dtypes import UNIT_ROUNDOFF

    names = {str(d).replace("torch.", "") for d in dtypes} & set(UNIT_ROUNDOFF)
    return max(names, key=lambda n: UNIT_ROUNDOFF[n]) if names else default


def _observer():
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


class _Autocast:
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
        obs = _observer()
        with self(), obs:
            yield seen
        seen.append(_lowest(obs.dtypes, ""))


class _CallStack:
    """The module calls in flight during a hooked forward: each call's positional arguments and their version
    counters, and whether it is a leaf (called no module) or calls only leaves (attention and its projections)."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.frames)

    def enter(self, args) -> None:
        if self.frames:
            self.frames[-1]["children"] += 1
        self.frames.append({"args": args, "versions": _versions(args), "children": 0, "leaf_children": True,
                            "child_error": 0.0, "child_unmeasured": False})

    def leave(self) -> tuple[dict[str, Any], bool]:
        """(the call's frame, whether it is a leaf)."""
        f = self.frames.pop()
        leaf = f["children"] == 0
        if self.frames and not leaf:
            self.frames[-1]["leaf_children"] = False
        return f, leaf


class _Memo:
    """Teacher forcing reuses what it has just run. On a private copy (a candidate or twin that ``diff`` made
    itself, never the user's modules) each leaf remembers its last output by the identity and version counter of
    its input tensors; a parent's teacher-forced run that calls the leaf on the very same tensor (an attention
    module's query/key/value projections, an MLP's first linear) gets that output back instead of running the
    leaf again. Inputs are cast once per reference tensor (:meth:`cast`), so a leaf's and its parent's
    teacher-forced runs hand the leaf the same tensor object. A few entries only (children complete just before
    their parent); an output changed in place since is run again. Active only inside teacher-forced calls, and
    the copies' ``forward`` is restored on exit."""

    SIZE = 8

    def __init__(self) -> None:
        self.entries: dict[int, tuple] = {}
        self.casts: list[tuple] = []
        self.active = False
        self.hits = 0
        self.patched: list[torch.nn.Module] = []

    @contextlib.contextmanager
    def installed(self, *models):
        try:
            for model in {id(m): m for m in models if m is not None}.values():
                for m in model.modules():
                    if next(m.children(), None) is None and "forward" not in vars(m):
                        m.forward = self._wrap(m, m.forward)
                        self.patched.append(m)
            yield self
        finally:
            for m in self.patched:
                vars(m).pop("forward", None)
            self.patched.clear()
            self.entries.clear()
            self.casts.clear()

    @contextlib.contextmanager
    def on(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False

    @staticmethod
    def _key(args, kwargs):
        key = []
        for v in list(args) + [v for _, v in sorted(kwargs.items())]:
            if isinstance(v, torch.Tensor):
                key.append((id(v), v._version))
            elif isinstance(v, _SAFE):
                key.append(v)
            else:
                return None
        return tuple(key) + tuple(sorted(kwargs))

    def _wrap(self, module, forward):
        def memo_forward(*args, **kwargs):
            key = self._key(args, kwargs) if self.active else None
            if key is None:
                return forward(*args, **kwargs)
            hit = self.entries.get(id(module))
            if hit is not None and hit[0] == key and hit[2]._version == hit[3]:
                self.hits += 1
                return hit[2].clone()  # each caller its own tensor: one may write it in place
            out = forward(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                self.entries.pop(id(module), None)
                self.entries[id(module)] = (key, (args, kwargs), out, out._version)  # holds its inputs: ids stay
                while len(self.entries) > self.SIZE:
                    self.entries.pop(next(iter(self.entries)))
            return out

        return memo_forward

    def cast(self, obj, dtype: torch.dtype | None, clamp: bool = False):
        """The reference's tensors as a teacher-forced module gets them: :func:`_cast` to ``dtype``, or a copy at
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
            out = _cast(obj, dtype, clamp)
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


def _reduce_len(args, out: torch.Tensor) -> int:
    n = out.shape[-1] if out.dim() else 1
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim():
            n = max(n, a.shape[-1])
    return int(n)


class _Hooks:
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
            self.pre_cb(module, self.paths[id(module)], n, args)
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
            self.errors.append(f"{_site_name(self.paths[id(module)], n)}: {type(exc).__name__}: {exc}")
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


def _site_name(path: str, number: int) -> str:
    return (path or "(model)") + (f"#{number}" if number else "")


# ---------------------------------------------------------------------------------------------- the candidate
class _Record:
    __slots__ = ("path", "number", "module", "shape", "output", "used", "version", "alternatives")

    def __init__(self, path, number, module, output):
        self.path, self.number, self.module = path, number, module
        self.alternatives = None  # an ONNX scope's several outputs, (module key, tensor) each
        self.output = output
        self.version = output._version if output is not None else None
        self.shape = list(output.shape) if output is not None else None
        self.used = False


def _run_torch_candidate(model, args, kwargs, dtype: torch.dtype | None,
                         context=contextlib.nullcontext) -> tuple[list[_Record], str | None, int, tuple | None]:
    """One forward of the candidate; the primary output of every module call, in completion order, and where it
    raised (the innermost module call that did, as (path, number))."""
    records: list[_Record] = []
    peak = [0]
    live = [0]
    seen: set[int] = set()

    def pre(module, path, number, a):
        return None

    def post(module, path, number, a, kw, output):
        t = _primary(output)
        kept = t if isinstance(t, torch.Tensor) and t.is_floating_point() else None
        if kept is not None and kept.data_ptr() not in seen:
            seen.add(kept.data_ptr())
            live[0] += kept.numel() * kept.element_size()
            peak[0] = max(peak[0], live[0])
        records.append(_Record(path, number, module, kept))

    hooks = _Hooks(model, pre, post)
    error = None
    with hooks.active(), torch.no_grad(), context():
        try:
            model(*_cast(args, dtype), **_cast(kwargs, dtype, True))
        except Exception as exc:
            where = _site_name(*hooks.failed_at) if hooks.failed_at else "(model)"
            error = f"the candidate's forward raised in {where}: {type(exc).__name__}: {exc}"
    return records, error, peak[0], hooks.failed_at if error else None


# ---------------------------------------------------------------------------------------------- diff
def _dtype_argument(name: str, value, allowed) -> str:
    try:
        value = dtype_name(value)
    except Exception as exc:
        raise InputError(f"{name}: {exc}") from None
    if value not in allowed:
        raise InputError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def diff(reference, candidate=None, inputs=None, *, candidate_dtype=None, autocast=None, grad: bool = False,
         loss_fn=None, keep: bool = False, progress=True) -> Diff:
    """Compare two executions of ``reference`` site by site; see the module docstring.

    ``candidate``: another torch module with the same architecture (aligned by module name, else by execution
    order and output shapes), an ONNX model (path, bytes or ``ModelProto``, run on onnxruntime), or None: the
    reference itself at ``candidate_dtype`` (a private copy). ``candidate_dtype`` ('bfloat16', 'float16',
    'float32') also runs a torch candidate as a private copy at that dtype. ``autocast`` ('bfloat16',
    'float16'; exclusive with ``candidate_dtype``): the candidate (the reference itself when None) runs as it is
    under ``torch.autocast`` on its device type, and each site is judged at the dtype its ops were observed to
    run at. ``inputs`` as in ``scan``.
    ``grad=True`` also compares the gradients of a scalar loss (the sum of the primary output, or
    ``loss_fn(output)``) site by site (:mod:`.gradients`; torch candidates only). ``keep=True`` keeps the
    first divergent site's input and outputs in ``Diff.tensors``.
    """
    started = time.perf_counter()
    if not isinstance(reference, torch.nn.Module):
        raise InputError(f"diff takes a torch.nn.Module as the reference; got a {type(reference).__name__}")
    if candidate_dtype is not None:
        candidate_dtype = _dtype_argument("candidate_dtype", candidate_dtype, _LOW)
    onnx_cand = candidate is not None and _is_onnx(candidate)
    if autocast is not None:
        if candidate_dtype is not None:
            raise InputError("give autocast (--autocast) or candidate_dtype (--candidate-dtype), not both: autocast "
                             "runs the candidate as it is under torch.autocast, candidate_dtype runs a private copy "
                             "cast to that dtype")
        autocast = _dtype_argument("autocast", autocast, _AUTOCAST)
        if onnx_cand:
            raise InputError("an ONNX candidate runs as exported; autocast applies to torch candidates only")
    if candidate is None and candidate_dtype is None and autocast is None:
        raise InputError("diff needs a candidate: another module, an ONNX model, or candidate_dtype= (or "
                         "autocast=) to compare the reference with itself at a lower precision (e.g. "
                         "candidate_dtype='bfloat16')")
    if candidate is not None and not onnx_cand and not isinstance(candidate, torch.nn.Module):
        raise InputError(f"the candidate must be a torch.nn.Module, an ONNX model (path, bytes or ModelProto) or "
                         f"None; got a {type(candidate).__name__}")
    if onnx_cand and grad:
        raise InputError("grad=True compares two torch executions; an ONNX candidate has no backward here")
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"loss_fn must be callable (output -> scalar tensor); got a {type(loss_fn).__name__}")
    if onnx_cand and candidate_dtype not in (None, "float32"):
        raise InputError("an ONNX candidate runs as exported; candidate_dtype applies to torch candidates only")
    args, kwargs = _arguments(reference, inputs)
    ref_dtype = _model_dtype(reference)
    notes: list[str] = []

    with _progress(progress) as say, contextlib.ExitStack() as stack:
        stack.enter_context(untouched(reference))
        reference.eval()
        # ------------------------------------------------------------------ the candidate's own forward
        cand_torch_dtype = None
        cand_failed = None  # (path, number) of the candidate's module call that raised in its own forward
        cand_error = None  # what the candidate's own forward raised
        ac = _Autocast(None, "cpu")
        if onnx_cand:
            say("running the ONNX candidate on onnxruntime")
            values, scopes, cand_desc, subgraphs = onnxsites.run_candidate(candidate, args, kwargs)
            cand_dtype = "float32"
            cand_model = None
        else:
            if autocast is not None:
                if candidate is not None:
                    stack.enter_context(untouched(candidate))
                cand_model = reference if candidate is None else candidate.eval()
                ac = _Autocast(autocast, _device_type(cand_model))
                cand_desc = f"{type(cand_model).__name__} under autocast({ac.device_type}, {autocast})"
            elif candidate is None:
                cand_model = private_copy(reference).to(getattr(torch, candidate_dtype))
                cand_desc = f"{type(reference).__name__} at {candidate_dtype} (a private copy)"
            elif candidate_dtype is not None:
                stack.enter_context(untouched(candidate))
                cand_model = private_copy(candidate).to(getattr(torch, candidate_dtype))
                cand_desc = f"{type(candidate).__name__} at {candidate_dtype} (a private copy)"
            else:
                stack.enter_context(untouched(candidate))
                cand_model = candidate.eval()
                cand_desc = type(candidate).__name__
            cand_dtype = autocast or candidate_dtype or _model_dtype(cand_model)
            cand_torch_dtype = getattr(torch, cand_dtype) if cand_dtype != ref_dtype and not ac else None
            say("running the candidate")
            records, cand_error, cand_bytes, cand_failed = _run_torch_candidate(cand_model, args, kwargs,
                                                                                cand_torch_dtype, ac)
            if cand_error:
                notes.append(cand_error)
        twin = None
        if ac:  # the reference's own modules under the same autocast (the candidate itself when it is the reference)
            twin = reference
        elif cand_dtype != ref_dtype and not onnx_cand:
            twin = cand_model if candidate is None else private_copy(reference).to(getattr(torch, cand_dtype))
        twin_modules = dict(twin.named_modules(remove_duplicate=False)) if twin is not None else {}
        blocks = block_modules(reference)
        block_or_above = set(blocks)
        for m in reference.modules():
            if any(id(s) in blocks for s in m.modules() if s is not m):
                block_or_above.add(id(m))
        block_or_above.add(id(reference))

        # ------------------------------------------------------------------ alignment
        ref_paths = [p for p, _ in reference.named_modules()]
        if onnx_cand:
            records = onnxsites.records(values, scopes, ref_paths, _Record)
            declared = subgraphs.proto.graph.output
            final = values.get(declared[0].name) if len(declared) else None
            if final is not None and np.asarray(final).dtype.kind == "f":  # the model's output: the graph's first
                records.append(_Record("", 0, None, torch.from_numpy(np.asarray(final).copy())))
            cand_bytes = sum(r.output.numel() * r.output.element_size() for r in records)
            del values
            mode = "onnx scopes"
        else:
            cand_paths = {r.path for r in records if r.path}
            shared = cand_paths & set(ref_paths)
            mode = "name" if cand_paths and len(shared) >= 0.5 * len(cand_paths) else "order"
        by_key = {(r.path, r.number): r for r in records}
        pointer = [0]

        def counterpart(path, number, shape) -> _Record | None:
            if mode in ("name", "onnx scopes"):
                r = by_key.get((path, number))
                return r if r is not None and not r.used else None
            for i in range(pointer[0], min(len(records), pointer[0] + _WINDOW)):
                r = records[i]
                if not r.used and r.shape == shape:
                    pointer[0] = i + 1
                    return r
            return None

        # ------------------------------------------------------------------ the reference, streamed
        sites: list[SiteDiff] = []
        coverage = {"own_sites": 0}  # sites that have an own error to measure (leaves and their parents)
        outputs: list[tuple[torch.Tensor, float]] = []  # recent reference outputs and their propagated errors
        input_errors: dict[str, float] = {}  # site → the propagated error of its input
        frames = _CallStack()
        first: dict[str, Any] = {}
        state = {"nonfinite": None}
        recent: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = []
        site_contracts = contracts.Contracts()

        def pre(module, path, number, a):
            frames.enter(a)

        def post(module, path, number, a, kw, output):
            f, leaf = frames.leave()
            count = len(sites)
            try:
                compare(module, path, number, kw, output, f, leaf)
            finally:
                _account(f, sites[count] if len(sites) > count else None)

        def _account(f, s: SiteDiff | None) -> None:
            """Tell the parent call what this one erred by (for :func:`_composition`): the site's propagated error,
            else its own (an output the candidate overwrote later), else that it could not be measured."""
            parent = frames.frames[-1] if len(frames) else None
            if parent is None:
                return
            parent["child_error"] = max(parent["child_error"], f["child_error"])
            parent["child_unmeasured"] |= f["child_unmeasured"]
            if s is None:
                return
            err = next((m["normalized"] for m in (s.propagated, s.own) if m and isinstance(m.get("normalized"), float)
                        and math.isfinite(m["normalized"])), None)
            if err is None or s.status in ("raised", "shape", "unmatched"):
                parent["child_unmeasured"] = True
            else:
                parent["child_error"] = max(parent["child_error"], err)

        def compare(module, path, number, kw, output, f, leaf):
            y = _primary(output)
            if not isinstance(y, torch.Tensor) or not y.is_floating_point():
                return

            name = _site_name(path, number)
            kind = "norm" if known_class(module) else ("leaf" if leaf else "module")
            s = SiteDiff(name=name, cls=type(module).__name__, kind=kind, order=len(sites), depth=len(frames),
                         shape=list(y.shape), status="unmatched")
            sites.append(s)
            r = counterpart(path, number, list(y.shape))
            if r is None:
                s.note = "no counterpart in the candidate"
                return
            if onnx_cand:
                onnxsites.choose(r, y)
            if onnx_cand and not path and r.output is not None and list(r.output.shape) != list(y.shape):
                s.note = (f"the ONNX graph's first output {list(r.output.shape)} is not the model's primary output "
                          f"{list(y.shape)}")
                return
            r.used = True
            s.counterpart = _site_name(r.path, r.number)
            if cand_failed is not None and (r.path, r.number) == cand_failed:
                s.status, s.note = "raised", cand_error  # where the candidate's own forward stopped
                _remember(first, s, module, r.module, f["args"], y, None, keep)
                return
            if r.output is None:
                s.note = "the candidate's forward gave no floating tensor here"
                s.propagated = None
            elif r.output._version != r.version:
                s.note = "propagated error not measured: the candidate overwrote this output in place later"
                r.output = None
                s.propagated = None
            else:
                # a module returning its last child's output (or its input) compares the same pair of tensors
                same = next((m for yy, cc, m in recent if yy is y and cc is r.output), None)
                s.propagated = dict(same) if same is not None else metrics.errors(r.output, y)
                recent.append((y, r.output, s.propagated))
                del recent[:-4]
            r.output = None  # streaming: the candidate's copy is no longer needed
            n = _reduce_len(f["args"], y)
            err = (s.propagated or {}).get("normalized")
            if isinstance(err, float) and math.isfinite(err):
                outputs.append((y, err))
                del outputs[:-64]

            if s.propagated is None:
                s.status = "propagated"
            elif "error" in s.propagated:
                s.status, s.note = "shape", s.propagated["error"]
            elif not s.propagated["reference_finite"]:
                s.status = "reference_not_finite"
                state["nonfinite"] = state["nonfinite"] or name
                return
            else:
                s.status = "propagated"
            own_site = (leaf or f["leaf_children"]) and id(module) not in block_or_above
            if own_site:
                coverage["own_sites"] += 1
            if not own_site or r.module is None:
                if onnx_cand:
                    _onnx_propagated(s, n)
                elif not leaf and not f["child_unmeasured"] and s.status == "propagated" and err is not None:
                    _composition(s, f, err, n, module, r.module, y)
                return
            x_in = _input(f["args"], kw, y)
            if x_in is not None and y is x_in:
                s.note = "returns its input (an identity in evaluation mode): nothing of its own to compare"
                coverage["own_sites"] -= 1
                return
            if _versions(f["args"]) != f["versions"]:
                s.note = "own error not measured: the module wrote its input in place"
                return
            if onnx_cand:  # the site's nodes as a subgraph of their own, on the reference's inputs
                try:
                    with torch.no_grad():
                        yc = torch.from_numpy(subgraphs.run(*r.module, f["args"], kw))
                except onnxsites.NotExtractable as exc:
                    s.own_missing = str(exc)
                    _onnx_propagated(s, n)
                    return
                site_dtype, cand_ref = cand_dtype, onnxsites.Site(subgraphs, *r.module)
            else:
                if not (_stateless(f["args"]) and _stateless(kw)):
                    s.note = "own error not measured: the call takes a stateful argument (a cache object)"
                    return
                try:
                    with torch.no_grad(), ac.observe() as seen, memo.on():
                        yc = _primary(r.module(*memo.cast(f["args"], cand_torch_dtype),
                                               **memo.cast(kw, cand_torch_dtype, True)))
                except Exception as exc:
                    # its own forward ran this module fine: on the reference's input it is another operation (or
                    # aligned wrongly), so nothing is compared here, and that is not a divergence
                    s.note = (f"own error not measured: the candidate's {type(r.module).__name__} raised on the "
                              f"reference's input ({type(exc).__name__}: {exc}); its own forward ran it")
                    return
                if not isinstance(yc, torch.Tensor):
                    s.note = "the candidate's module returned no tensor on the reference's input"
                    return
                # the dtype the candidate's module ran at: under autocast, the least precise one its ops produced
                site_dtype = (seen[0] or dtype_name(str(yc.dtype).replace("torch.", ""))) if seen else cand_dtype
                cand_ref = r.module
            s.dtype = site_dtype
            s.own = metrics.errors(yc, y)
            x_err = next((e for t, e in reversed(outputs) if t is x_in), None) if x_in is not None else None
            if x_err is not None:
                input_errors[s.name] = x_err
            if "error" in s.own:
                s.status, s.note = "shape", "teacher-forced: " + s.own["error"]
                _remember(first, s, module, cand_ref, f["args"], y, yc, keep)
                return
            if kind == "norm":
                v = contracts.judge(site_contracts, module, None if onnx_cand else r.module, x_in, y, yc, ref_dtype,
                                    site_dtype) if x_in is not None else {"error": "no floating tensor input"}
                if "error" not in v:
                    s.elementwise = v
                    s.bound, s.bound_rule = None, contracts.rule(v, site_dtype)
                    s.status = "within" if v["ok"] else "diverged"
                    if s.status == "diverged":
                        _remember(first, s, module, cand_ref, f["args"], y, yc, keep)
                    return
                s.note = f"judged by the dtype-derived rule: {v['error']}"
            tw = None
            if twin is not None and path in twin_modules and site_dtype != ref_dtype:
                if twin is cand_model and r.module is twin_modules[path]:
                    tw = s.own["normalized"]
                else:
                    try:
                        with torch.no_grad(), ac(), memo.on():
                            yt = _primary(twin_modules[path](*memo.cast(f["args"], cand_torch_dtype),
                                                             **memo.cast(kw, cand_torch_dtype, True)))
                        tw = metrics.errors(yt, y).get("normalized") if isinstance(yt, torch.Tensor) else None
                    except Exception:
                        tw = None
                if tw is not None and not math.isfinite(tw):
                    tw = None
                    s.note = "the reference's module at the candidate's dtype is not finite here"
            s.twin = tw
            if twin is not None and s.twin is None and site_dtype != ref_dtype:
                s.bound, s.bound_rule = metrics.bound(site_dtype, ref_dtype, None, n)
                s.bound_rule += " (no faithful twin measured)"
            else:
                s.bound, s.bound_rule = metrics.bound(site_dtype, ref_dtype, s.twin, n)
            if onnx_cand:
                s.bound_rule += " (ONNX: the site's subgraph on the reference's input)"
            s.status = "diverged" if s.own["normalized"] > s.bound else "within"
            if s.status == "diverged":
                _remember(first, s, module, cand_ref, f["args"], y, yc, keep)

        def _composition(s: SiteDiff, f, err: float, n: int, module, cand_module, y) -> None:
            """A module without an own error of its own (a block, the model) whose output errs far more than every
            child's output did: the divergence is in its own code between its children (an in-place write that
            changes a tensor it reuses, a missing or extra term)."""
            floor, floor_rule = metrics.bound(cand_dtype, ref_dtype, None, n)
            x = _input(f["args"], {}, None)
            incoming = next((e for t, e in reversed(outputs) if t is x), None)
            if x is not None and incoming is None and not any(x is a for a in [*args, *kwargs.values()]):
                return  # its input's error is unknown: nothing to tell its own part from
            limit = COMPOSITION * max(f["child_error"], incoming or 0.0, floor)
            if err > limit:
                s.status, s.bound = "diverged", limit
                s.bound_rule = (f"{COMPOSITION:g} × the largest error of its input ({incoming or 0.0:.3g}) and its "
                                f"children's outputs ({f['child_error']:.3g}), at least {COMPOSITION:g} × {floor_rule}")
                s.note = (f"its output errs by {err:.3g} while its input and every child's output erred by at most "
                          f"{max(f['child_error'], incoming or 0.0):.3g}: the divergence is in this module's own code "
                          "between its children")
                _remember(first, s, module, cand_module, f["args"], y, None, keep)

        def _onnx_propagated(s: SiteDiff, n: int) -> None:
            """An ONNX site without an own error is judged on its propagated error (same dtype: 16·u·√n); the
            model's output is compared, not judged (it carries every layer's rounding)."""
            if s.status == "propagated" and s.propagated is not None and s.depth > 0:
                s.bound, s.bound_rule = metrics.bound(cand_dtype, ref_dtype, None, n)
                s.bound_rule += " (ONNX: on the propagated error" + (
                    f"; own error n/a: {s.own_missing})" if s.own_missing else ")")
                if s.propagated["normalized"] > s.bound:
                    s.status = "diverged"

        say("running the reference, comparing site by site")
        hooks = _Hooks(reference, pre, post)
        # the copies diff made itself (a candidate or twin at candidate_dtype) reuse their leaves' outputs
        memo = _Memo()
        private = [m for m in (cand_model if candidate_dtype is not None else None,
                               twin if twin is not None and twin is not cand_model and not ac else None)
                   if m is not None]
        try:
            with hooks.active(), torch.no_grad(), memo.installed(*private):
                reference(*args, **kwargs)
        except NormscopeError:
            raise
        except Exception as exc:
            raise TargetError(f"the reference's forward failed on the inputs ({_describe(args, kwargs)}): "
                              f"{type(exc).__name__}: {exc}") from exc

        notes.extend(f"comparison failed at {e}" for e in hooks.errors[:5])
        unmatched_ref = [s.name for s in sites if s.status == "unmatched"]
        unmatched_cand = [_site_name(r.path, r.number) for r in records if not r.used and r.output is not None
                          and (mode != "onnx scopes")]
        if state["nonfinite"]:
            notes.append(f"the reference itself is not finite from {state['nonfinite']} on: sites there are not "
                         "compared")
        if unmatched_ref:
            notes.append(f"{len(unmatched_ref)} reference sites have no counterpart in the candidate (first: "
                         f"{unmatched_ref[0]})")
        if unmatched_cand:
            notes.append(f"{len(unmatched_cand)} candidate sites have no counterpart in the reference (first: "
                         f"{unmatched_cand[0]})")
        culprit = next((s for s in sites if s.status in ("diverged", "raised", "shape")), None)
        divergence = None
        tensors = None
        if culprit is not None:
            divergence = _explain(culprit, first.get(culprit.name), say)
            if keep and culprit.name in first:
                tensors = first[culprit.name].get("tensors")
        elif cand_error:
            divergence = {"site": None, "reason": cand_error}
        undecided = [] if culprit is not None or cand_error else _undecided(
            sites, coverage["own_sites"], hooks.errors, state["nonfinite"], mode, onnx_cand)
        g = {"sites": [], "first": None, "divergence": None, "params": []}
        if grad:
            if mode != "name":
                notes.append("gradients are compared by module name; the candidate's names differ from the "
                             "reference's, so gradient sites are unmatched")
            from . import gradients

            g = gradients.run(reference, cand_model, twin, args, kwargs, cand_torch_dtype=cand_torch_dtype, ac=ac,
                              ref_dtype=ref_dtype, cand_dtype=cand_dtype, loss_fn=loss_fn,
                              own_site=lambda m, flag: flag and id(m) not in block_or_above,
                              site_contracts=site_contracts, say=say)
            notes.extend(g["notes"][:5])
    return Diff(reference=type(reference).__name__, candidate=cand_desc, reference_dtype=ref_dtype,
                candidate_dtype=cand_dtype, autocast=autocast, inputs=_describe(args, kwargs), sites=sites,
                first_divergence=culprit.name if culprit is not None else None, divergence=divergence,
                unmatched_reference=unmatched_ref, unmatched_candidate=unmatched_cand, notes=notes,
                inconclusive=undecided, failed=culprit is None and bool(cand_error),
                stats={"alignment": mode, "sites": len(sites),
                       **({"self_candidate": True, "error_added": _error_added(sites, input_errors, ref_dtype)}
                          if twin is not None and twin is cand_model and not ac else {}),
                       "own_measured": sum(s.own is not None for s in sites), "reused_leaf_outputs": memo.hits,
                       "candidate_cache_bytes": int(cand_bytes)},
                seconds=time.perf_counter() - started, tensors=tensors, grad=grad, grad_sites=g["sites"],
                grad_first_divergence=g["first"], grad_divergence=g["divergence"], param_grads=g["params"])


def _error_added(sites: list[SiteDiff], input_errors: dict[str, float], ref_dtype: str, top: int = 5) -> list:
    """The candidate is the reference at a lower dtype: a site other than a norm is the reference's own operation
    at that dtype, faithful by construction, so its bound cannot fail. What is known instead is how much error
    each site adds: its own error in units of the dtype's roundoff, and against the error its input already had
    (amplification). The sites that add most, most first."""
    from ..dtypes import UNIT_ROUNDOFF

    out = []
    for s in sites:
        if s.own is None or s.dtype in (None, ref_dtype) or s.dtype not in UNIT_ROUNDOFF:
            continue
        own = s.own.get("normalized")
        if not isinstance(own, float) or not math.isfinite(own):
            continue
        u = UNIT_ROUNDOFF[s.dtype]
        x_err = input_errors.get(s.name)
        out.append({"site": s.name, "cls": s.cls, "dtype": s.dtype, "own_error": own, "own_roundoffs": own / u,
                    "input_error": x_err, "amplification": own / max(x_err or 0.0, u)})
    return sorted(out, key=lambda e: -e["own_roundoffs"])[:top]


def _undecided(sites: list[SiteDiff], own_sites: int, errors: list[str], nonfinite: str | None, mode: str,
               onnx: bool) -> list[str]:
    """Why a run without a divergence still cannot say "no divergence", each with what would decide it."""
    why = []
    align = {"name": "module names", "order": "execution order and output shapes",
             "onnx scopes": "the exporter's node-name scopes"}.get(mode, mode)
    if errors:
        why.append(f"the comparison raised at {len(errors)} site(s), which were not judged (first: {errors[0]}); "
                   "what would decide it: that site compared (report the error; inputs it can take)")
    if nonfinite:
        why.append(f"the reference itself is not finite from {nonfinite} on, so nothing after it was compared; what "
                   "would decide it: inputs on which the reference stays finite")
    judged = [s for s in sites if s.status in ("within", "diverged")]
    compared = sum(1 for s in judged if s.own is not None or s.bound is not None)
    if own_sites and compared < MIN_OWN_SHARE * own_sites:
        why.append(f"only {compared} of the {own_sites} sites with an error of their own were compared ({align}: "
                   f"{sum(s.status == 'unmatched' for s in sites)} reference sites found no counterpart); at least "
                   f"{MIN_OWN_SHARE:.0%} are needed; what would decide it: a candidate whose "
                   f"{'scopes' if onnx else 'module names or execution order'} match the reference's")
    norms = [s for s in sites if s.kind == "norm" and s.status not in ("within", "diverged")]
    if norms:
        why.append(f"{len(norms)} norm site(s) were not judged (first: {norms[0].name}: "
                   f"{norms[0].note or norms[0].status}); what would decide it: that norm aligned with the candidate's "
                   "and run on the reference's input")
    root = next((s for s in sites if s.depth == 0), None)
    if root is None or root.propagated is None or root.status in ("unmatched", "shape"):
        why.append("the final output was not compared (" + (root.note or root.status if root else "no output") +
                   "); what would decide it: a candidate that returns the reference's output")
    return why


def _remember(first, s: SiteDiff, ref_module, cand_module, args, y, yc, keep: bool) -> None:
    if first:
        return
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    first[s.name] = {"ref": ref_module, "cand": cand_module, "shape": tuple(x.shape) if x is not None else None,
                     "tensors": {"input": x, "reference": y.detach().clone(),
                                 "candidate_own": None if yc is None else yc.detach().clone()} if keep else None}


def _infer(module, shape):
    from ..probe.infer import infer

    if isinstance(module, onnxsites.Site):  # an ONNX site: its subgraph, as onnxruntime runs it
        return infer(module.proto(), shape=shape, dtypes=("float32",), seed=0).spec
    m = private_copy(module).float()
    try:
        return infer(m, shape=shape, dtypes=("float32",), seed=0).spec
    except NotANormalization:
        other = _redrawn(m)
        if other is None:
            raise
        return infer(other, shape=shape, dtypes=("float32",), seed=0).spec


def _explain(s: SiteDiff, info: dict[str, Any] | None, say) -> dict[str, Any]:
    if s.status == "raised":
        reason = s.note
    elif s.status == "shape":
        reason = s.note
    elif s.elementwise is not None:
        v = s.elementwise
        faithful = "" if v.get("worst_faithful") is None else f", a faithful one errs by {v['worst_faithful']:.3g}"
        reason = (f"own error at element {tuple(v['worst'])}: |Δ| = {v['worst_error']:.3g} > bound "
                  f"{v['worst_bound']:.3g}{faithful} ({v['outside']} of {v['total']} elements outside; "
                  f"‖Δ‖/‖r‖ = {s.own['normalized']:.3g}) [{s.bound_rule}]")
    else:
        which, m = ("own", s.own) if s.own is not None else ("propagated", s.propagated)
        reason = (f"{which} error ‖Δ‖/‖r‖ = {m['normalized']:.3g} (max abs {m['max_abs']:.3g}, SQNR "
                  f"{m['sqnr_db']:.1f} dB) > bound {s.bound:.3g} [{s.bound_rule}]"
                  + (f"; {s.note}" if which == "propagated" and s.note else ""))
    out: dict[str, Any] = {"site": s.name, "class": s.cls, "kind": s.kind, "reason": reason}
    if s.kind != "norm" or info is None or info.get("shape") is None or info.get("cand") is None:
        return out
    say(f"inferring both contracts at {s.name}")
    from ..spec import differences

    try:
        from ..spec import NormSpec

        ref_spec = NormSpec.from_dict(s.elementwise["contract"]) if s.elementwise is not None else \
            _infer(info["ref"], info["shape"])
        cand_spec = _infer(info["cand"], info["shape"])
    except (NormscopeError, Exception) as exc:  # inference is an explanation; its failure is reported, not raised
        out["contracts_error"] = f"{type(exc).__name__}: {exc}"
        return out
    ndim = len(info["shape"])
    out["contracts"] = {"reference": ref_spec.to_dict(), "candidate": cand_spec.to_dict()}
    out["differences"] = differences(cand_spec, ref_spec, ndim, shape=info["shape"])
    if not out["differences"]:
        out["differences_note"] = ("the two contracts are equivalent: the error comes from how the candidate "
                                   "computes it (precision, order), not from what it computes")
    return out
