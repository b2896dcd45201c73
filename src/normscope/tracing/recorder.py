"""``normscope.trace(model, run_dir)``: record the residual chain of a training run, step by step.

What is recorded at a recorded step (every ``every``-th), in chain order:

- ``data``: the model's input per sample (a float input, else the output of the first embedding lookup);
- per block (``layer``): ``layer_input`` (the stream entering the block), ``norm_input``/``norm_output`` of each
  norm in it (with the norm's scale RMS and the smallest per-row RMS of its input), ``attention_logits`` per head
  (max |logit|, fully masked query rows, softmax entropy), ``sublayer_output`` (attention, MLP: the branch of each
  residual add) and ``residual_sum`` (the stream after each add);
- ``loss`` (and per-sample losses where given), ``grad`` per layer and parameter group (local gradients, seen as
  they are accumulated), ``update`` (RMS of the optimizer's change over RMS of the parameter, per group).

Activations are summarised as sufficient statistics (sum of squares, count, max |x|, non-finite count), so the
micro-batches of gradient accumulation and the ranks of a distributed run combine exactly (sums add, maxima take
the max). Blocks come from :func:`normscope.sites.dataflow.block_modules`, norms from the scan's class discovery
(:func:`normscope.sites.core.known_class`) plus functional norm calls, attention from a ``TorchFunctionMode`` that
sees ``F.scaled_dot_product_attention`` and eager softmax over ``(batch, heads, query, key)`` logits; residual adds
are the adds of the block's current stream (an identity test, no graph capture). The mode is active only during
the model's forward at recorded steps. Any exception inside a probe is caught, logged once, and that probe is
disabled; training never sees it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import InputError
from ..jsonable import jsonable
from ..sites.core import known_class
from ..sites.dataflow import block_modules
from ..sites.trace import ADDS, EMBEDDING, NORM_FUNCTIONS, SOFTMAX
from . import attention, fused
from .fused import absmax
from .store import SCHEMA, TRACE_FILE

log = logging.getLogger("normscope.trace")

def act_stats(x: torch.Tensor) -> dict[str, float]:
    """Sum of squares, count, max |x| and non-finite count of a tensor (finite entries only), in float32."""
    return batch_stats([x])[0]


def batch_stats(xs: list[torch.Tensor], max_abs: bool = True, rows: bool = False) -> list[dict[str, float]]:
    """:func:`act_stats` of several tensors: one fused call for those it takes, else one norm kernel per (device,
    dtype) and one host transfer per group.

    The fast path is one read per tensor on the CPU (:mod:`.fused`), else a sum of squares and a min/max per
    tensor; a tensor whose numbers come back non-finite (or overflow) is summarised again exactly, its non-finite
    entries counted and left out. ``max_abs=False`` skips the min/max pass (no ``"max"`` in the result).
    ``rows=True`` adds ``"min_row_sumsq"`` (the smallest Σx² over the last dimension's rows) where the fused path
    gave it and every entry is finite.
    """
    out: list[dict[str, float] | None] = [None] * len(xs)
    ts = [x.detach() if x.is_floating_point() else x.detach().float() for x in xs]
    one = fused.sums(ts, rows=rows) or [None] * len(ts)  # CPU float32 with numba: all in one read each
    todo: dict[tuple, list[int]] = {}
    for i, (x, f) in enumerate(zip(ts, one, strict=True)):
        if x.numel() == 0:
            out[i] = {"sumsq": 0.0, "n": 0, "max": 0.0, "nonfinite": 0}
        elif f is not None:
            out[i] = _finish(x, f.sumsq, *((-f.max, f.max) if max_abs else (None, None)))
            if rows and not out[i]["nonfinite"]:
                out[i]["min_row_sumsq"] = f.min_row_sumsq
        else:
            todo.setdefault((x.device, x.dtype), []).append(i)
    for ids in todo.values():
        group = [ts[i] for i in ids]
        sums = [_sumsq(x) for x in group]
        ends = [torch.aminmax(x) for x in group] if max_abs else []
        cols = torch.stack([*sums, *(e.min.double() for e in ends), *(e.max.double() for e in ends)]).tolist()
        n = len(group)
        for j, i in enumerate(ids):
            out[i] = _finish(ts[i], cols[j], *((cols[n + j], cols[2 * n + j]) if max_abs else (None, None)))
    return out  # type: ignore[return-value]


def _sumsq(x: torch.Tensor) -> torch.Tensor:
    """Σx² as a float64 scalar tensor: a BLAS dot for contiguous float32/float64 (a third of ``vector_norm``'s
    time on the CPU), the float32 2-norm squared otherwise."""
    if x.dtype in (torch.float32, torch.float64) and x.is_contiguous():
        flat = x.reshape(-1)
        return torch.dot(flat, flat).double()
    return torch.linalg.vector_norm(x, 2, dtype=torch.float32).double().square()


def _finish(x: torch.Tensor, ss: float, lo: float | None, hi: float | None) -> dict[str, float]:
    mx = None if lo is None else max(hi, -lo)
    bad = 0
    if not (math.isfinite(ss) and (mx is None or math.isfinite(mx))):
        fin = torch.isfinite(x)
        bad = int(x.numel() - int(fin.sum()))
        x = torch.where(fin, x, torch.zeros((), dtype=x.dtype))
        ss = float(torch.linalg.vector_norm(x, 2, dtype=torch.float64)) ** 2  # float64: no overflow of Σx²
        mx = None if mx is None else float(absmax(x))
    st = {"sumsq": ss, "n": x.numel(), "max": mx, "nonfinite": bad}
    if mx is None:
        del st["max"]
    return st


def _per_sample(x: torch.Tensor) -> dict[str, list[float]]:
    """:func:`act_stats` per sample (dim 0); the non-finite entries are looked for only when the sums say so."""
    x = x.detach()
    if x.dim() == 0:
        x = x.reshape(1)
    flat = x.reshape(x.shape[0], -1)
    if not flat.is_floating_point():
        flat = flat.float()
    rows = flat.shape[0]
    ss, mx = torch.stack([torch.linalg.vector_norm(flat, 2, dim=1, dtype=torch.float32) ** 2,
                          absmax(flat, dim=1)]).tolist() if rows else ([], [])
    bad = [0] * rows
    if not all(math.isfinite(v) for v in ss + mx):
        fin = torch.isfinite(flat)
        bad = (~fin).sum(1).tolist()
        flat = torch.where(fin, flat, torch.zeros((), dtype=flat.dtype))
        ss = (torch.linalg.vector_norm(flat, 2, dim=1, dtype=torch.float32) ** 2).tolist()
        mx = absmax(flat, dim=1).tolist()
    return {"sumsq": ss, "n": [flat.shape[1]] * rows, "max": mx, "nonfinite": bad}


def _most(f, a, b):
    """``f`` (max or min) of two numbers, NaN if either is: Python's own max/min keep or drop a NaN by the order
    of their arguments."""
    if a != a:
        return a
    if b != b:
        return b
    return f(a, b)


def _merge(acc: dict[str, Any], new: dict[str, Any]) -> None:
    """Fold one observation into an accumulator: sums add, maxima max, minima min (a NaN kept), per-head lists
    elementwise."""
    for k, v in new.items():
        if k not in acc:
            acc[k] = list(v) if isinstance(v, list) else v
            continue
        old = acc[k]
        if isinstance(v, list):
            if k.startswith("max") or k.startswith("min"):
                f = max if k.startswith("max") else min
                acc[k] = [_most(f, a, b) for a, b in zip(old, v, strict=False)] if len(old) == len(v) else old
            else:
                acc[k] = [a + b for a, b in zip(old, v, strict=False)] if len(old) == len(v) else old
        elif k.startswith("max"):
            acc[k] = _most(max, old, v)
        elif k.startswith("min"):
            acc[k] = _most(min, old, v)
        elif isinstance(v, int | float):
            acc[k] = old + v


PENDING_BYTES = 256 << 20  # activations a forward may hold for its batched statistics before they are taken
_IN_PLACE = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
             "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__"}


def _writes_in_place(name: str, args, kwargs) -> bool:
    """Whether a call may write into a tensor it is given (``add_``, ``x += y``, ``x[i] = v``, ``out=``,
    ``inplace=True``): the pending statistics are taken before it runs. A positional ``True`` counts too (the
    ``inplace`` flag of ``F.relu(x, True)``); a false alarm only takes them early."""
    return ((name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE
            or kwargs.get("out") is not None or kwargs.get("inplace") is True
            or any(a is True for a in args[1:]))


def _deferrable(x: torch.Tensor) -> bool:
    """A dense tensor with a version counter: its statistics can wait for the forward's batch."""
    if x.layout != torch.strided or x.is_meta or not x.is_floating_point():
        return False
    try:
        return x._version >= 0
    except Exception:  # inference tensors have no version counter
        return False


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's local shard (an FSDP2 ``DTensor`` parameter or gradient), else the tensor itself: each rank
    summarises its own shard, and the ranks' sums add up to the whole tensor's."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _same_ids(a, ids: torch.Tensor) -> bool:
    """Whether ``a`` is the forward's token ids or a view of all of them (``input_ids.view(-1, T)``)."""
    if a is ids:
        return True
    return (isinstance(a, torch.Tensor) and a.dtype == ids.dtype and a.numel() == ids.numel()
            and a.device == ids.device and a.data_ptr() == ids.data_ptr())


class _Mode(TorchFunctionMode):
    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tr = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self.tr
        if tr._busy:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if tr._pending_items and _writes_in_place(name, args, kwargs):
            tr._flush()
        if func is F.scaled_dot_product_attention and "attention" not in tr.disabled:
            tr._guard("attention", tr._attention_sdpa, args, kwargs)
        elif name in SOFTMAX and "attention" not in tr.disabled and args and isinstance(args[0], torch.Tensor):
            tr._guard("attention", tr._attention_softmax, func, args, kwargs)
        elif func in NORM_FUNCTIONS and "norms" not in tr.disabled and not tr._in_norm:
            out = func(*args, **kwargs)
            tr._guard("norms", tr._functional_norm, func, args, kwargs, out)
            return out
        elif name in EMBEDDING and tr._ids is not None and args and _same_ids(args[0], tr._ids):
            out = func(*args, **kwargs)
            tr._guard("data", tr._embedding, out)
            return out
        out = func(*args, **kwargs)
        if name in ADDS and tr._streams and "residual" not in tr.disabled:
            tr._guard("residual", tr._residual, args, out)
        return out


class Tracer:
    """The live recorder; use :func:`trace` (a context manager) rather than building one directly."""

    def __init__(self, model: torch.nn.Module, run_dir: str | os.PathLike, every: int = 1, layers=None,
                 record_eval: bool = False, meta: dict[str, Any] | None = None, sinks=()):
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"trace takes a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InputError(f"every must be a positive integer (record every N-th step), got {every!r}")
        self.model = model
        self.run_dir = Path(run_dir)
        self.every = every
        self.record_eval = record_eval
        self.meta = dict(meta or {})
        self.sinks = list(sinks or ())
        for i, sink in enumerate(self.sinks):
            if not callable(getattr(sink, "write", None)):
                raise InputError(f"sinks[{i}] ({type(sink).__name__}) has no write(record) method; a sink takes each "
                                 "record the tracer writes (see normscope.tracing.sinks)")
        self.disabled: set[str] = set()
        self.errors: list[dict[str, Any]] = []
        self._busy = False
        self._in_norm = 0
        self._handles: list[Any] = []
        self._open = False
        self._cost = 0.0  # seconds spent in the tracer's probes during the current step (``tracer_ms``)
        self._written = 0.0  # seconds the last record took to write
        self._buffers: dict[Any, torch.Tensor] = {}  # reused memory while steps in a row are recorded
        self._streams: list[dict[str, Any]] = []  # one per active block call
        self._file = None
        self._mode: _Mode | None = None
        self._last_step = -1
        self.recording = True  # step 0 is recorded
        self._ids: torch.Tensor | None = None  # the token ids of the forward in flight
        self._warned: set[str] = set()  # the reasons for left-out entries already logged
        self._reset()
        self.rank, self.world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self._discover(layers)
        if hasattr(torch, "compiler") and hasattr(torch.compiler, "disable"):
            # under torch.compile the probes run eagerly (a graph break each) instead of being traced into the graph
            for name in ("_guard", "_root_pre", "_root_post", "_block_pre", "_block_post", "_norm_pre", "_norm_post"):
                setattr(self, name, torch.compiler.disable(getattr(self, name), recursive=True))

    # ------------------------------------------------------------------ discovery
    def _discover(self, layers) -> None:
        model = self.model
        names = {id(m): n for n, m in model.named_modules()}
        if layers is not None:
            mods = []
            for i, item in enumerate(layers):
                if isinstance(item, str):
                    try:
                        item = model.get_submodule(item)
                    except AttributeError:
                        raise InputError(f"layers[{i}] = {item!r} names no submodule of the model; pass module "
                                         "names as in model.named_modules() or the modules themselves") from None
                if not isinstance(item, torch.nn.Module) or id(item) not in names:
                    raise InputError(f"layers[{i}] is not a submodule of the traced model; pass its modules or names")
                mods.append(item)
        else:
            found = block_modules(model)
            inner = set()
            for m in model.modules():
                if id(m) in found:
                    for sub in m.modules():
                        if sub is not m and id(sub) in found:
                            inner.add(id(sub))
            mods = [m for m in model.modules() if id(m) in found and id(m) not in inner]
        self.blocks = {id(m): i for i, m in enumerate(mods)}
        self.block_names = [names[id(m)] for m in mods]
        self.norms: dict[int, tuple[int | None, str]] = {}
        prefixes = sorted(((names[id(m)] + ".", i) for m, i in zip(mods, range(len(mods)), strict=True)),
                          key=lambda p: -len(p[0]))
        self._prefixes = prefixes
        for n, m in model.named_modules():
            if m is model or not known_class(m):
                continue
            self.norms[id(m)] = self._locate(n)
        # parameter groups: (layer, group) per parameter
        self.param_group: dict[int, tuple[int | None, str]] = {}
        self.param_order: list[tuple[int | None, str]] = []
        for n, p in model.named_parameters():
            key = self._locate(n.rsplit(".", 1)[0] if "." in n else n)
            layer, rest = key
            # a block's child module (attn, mlp, ln_1, …); outside the blocks the module itself (the embedding and
            # the final norm are apart even when one parent holds both)
            group = (rest.split(".")[0] if layer is not None else rest) if rest else "params"
            g = (layer, group)
            self.param_group[id(p)] = g
            if g not in self.param_order:
                self.param_order.append(g)
        self.params = [p for p in model.parameters()]
        self.meta.update({"model": type(model).__name__, "blocks": self.block_names,
                          "norms": sorted(f"{'' if lay is None else lay}:{s}" for lay, s in self.norms.values())})

    def _locate(self, name: str) -> tuple[int | None, str]:
        """(block index, name inside the block) of a module path; (None, full path) outside the blocks."""
        for pre, i in self._prefixes:
            if (name + ".").startswith(pre):
                return i, name[len(pre):]
        return None, name

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Tracer:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        self._open = True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self._file = open(self.run_dir / TRACE_FILE, "a", encoding="utf-8")
            self._write({"schema": SCHEMA, "kind": "header", "every": self.every, "world_size": self.world,
                         "time": time.time(), **self.meta})
        if self.recording:
            self._attach()

    def _attach(self) -> None:
        """Install the hooks (at a recorded step); between recorded steps none is installed, so they cost nothing."""
        if self._handles:
            return
        root = self.model
        self._handles.append(root.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._handles.append(root.register_forward_hook(self._root_post, always_call=True))
        for m in root.modules():
            if id(m) in self.blocks:
                self._handles.append(m.register_forward_pre_hook(self._block_pre, with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._block_post, always_call=True))
            if id(m) in self.norms:
                self._handles.append(m.register_forward_pre_hook(self._norm_pre))
                self._handles.append(m.register_forward_hook(self._norm_post, always_call=True))
        for p in self.params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(register_optimizer_step_post_hook(self._opt_post))

    def _detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def close(self) -> None:
        self._open = False
        self._detach()
        self._buffers.clear()
        self._exit_mode()
        if self._file is not None:
            self._write({"kind": "end", "time": time.time(), "last_step": self._last_step,
                         "disabled": sorted(self.disabled), "errors": self.errors})
            self._file.close()
            self._file = None
            self._close_sinks()

    # ------------------------------------------------------------------ failure handling
    def _guard(self, probe: str, fn, *args):
        if probe in self.disabled:
            return None
        busy = self._busy
        self._busy = True
        t0 = time.perf_counter()
        try:
            with torch._C.DisableTorchFunction():  # the probe's own ops do not pass through the mode again
                return fn(*args)
        except Exception as exc:  # never break training
            self._fail(probe, exc)
            return None
        finally:
            self._busy = busy
            if not busy:
                self._cost += time.perf_counter() - t0

    def _fail(self, probe: str, exc: BaseException) -> None:
        if probe in self.disabled:
            return
        self.disabled.add(probe)
        msg = f"{type(exc).__name__}: {exc}"
        self.errors.append({"probe": probe, "step": self._last_step + 1, "error": msg})
        log.warning("normscope.trace: probe %r failed at step %d and is disabled (%s)", probe, self._last_step + 1, msg)

    # ------------------------------------------------------------------ accumulation
    def _reset(self) -> None:
        self._acc: dict[tuple, dict[str, Any]] = {}
        self._samples: dict[str, dict[str, list]] = {}
        self._grads: dict[int, dict[str, float]] = {}
        self._updates: dict[tuple, dict[str, float]] = {}
        self._old: dict[int, torch.Tensor] = {}
        self._lrs: dict[int, float] = {}  # id(parameter) -> the learning rate of its optimizer group at this step
        self._opt_depth: dict[int, int] = {}  # id(optimizer) -> nesting of its step() calls in flight
        self._counters: dict[tuple, int] = {}
        self._pending_reset()
        self._grad_batch: dict[int, torch.Tensor] = {}
        self._grad_order: dict[tuple, None] = {}  # parameter groups in the order the backward finished them
        self._grad_queued = False

    def _add(self, stage: str, layer: int | None, site: str, stats: dict[str, Any]) -> None:
        key = (stage, layer, site)
        acc = self._acc.get(key)
        if acc is None:
            self._acc[key] = dict(stats)
        else:
            _merge(acc, stats)

    # ------------------------------------------------------------------ batched statistics
    def _pending_reset(self) -> None:
        self._pending_tensors: list[torch.Tensor] = []
        self._pending_versions: list[int] = []
        self._pending_slots: dict[int, int] = {}  # id(tensor) -> index, while that tensor is pending
        self._pending_items: list[tuple[tuple, int, str]] = []  # (entry key, tensor index, kind)
        self._pending_bytes = 0
        self._attention_groups: dict[tuple, attention.Group] = {}  # this forward's SDPA masks, by call shape

    def _defer(self, stage: str, layer: int | None, site: str, x: torch.Tensor, kind: str = "") -> None:
        """Take the statistics of ``x`` for an entry with the rest of the forward's, in one batch.

        The entry keeps its place in chain order now. The forward's activations are summarised together when it
        ends (one fused call on the CPU, one host transfer per device otherwise), before a call that writes in place
        (so a later in-place change is not seen), and when the held tensors pass ``PENDING_BYTES``. A tensor seen
        twice (a block's input is the previous block's sum and its first norm's input) is read once. ``kind``:
        ``"rows"`` adds the smallest row RMS (a norm's input); ``"scale"``: ``x`` is a norm's scale γ, whose RMS
        (``max_scale_rms``) is all the entry takes from it.
        """
        key = (stage, layer, site)
        self._acc.setdefault(key, {})
        if "statistics" in self.disabled:
            return
        if not _deferrable(x):  # now, on torch's path
            self._apply([(key, 0, kind)], [x], [act_stats(x)])
            return
        i = self._pending_slots.get(id(x))
        if i is None or self._pending_tensors[i] is not x or self._pending_versions[i] != x._version:
            i = len(self._pending_tensors)
            self._pending_tensors.append(x)
            self._pending_versions.append(x._version)
            self._pending_slots[id(x)] = i
            self._pending_bytes += x.numel() * x.element_size()
        self._pending_items.append((key, i, kind))
        if self._pending_bytes > PENDING_BYTES:
            self._flush()

    def _flush(self) -> None:
        """Take the pending statistics in one batch. The pending tensors are released first, so a failure (logged,
        the probe disabled) cannot keep them alive."""
        tensors, versions = self._pending_tensors, self._pending_versions
        items = self._pending_items
        self._pending_reset()
        if items:
            self._guard("statistics", self._batch, items, tensors, versions)

    def _batch(self, items, tensors: list[torch.Tensor], versions: list[int]) -> None:
        fresh = [t._version == v for t, v in zip(tensors, versions, strict=True)]
        if not all(fresh):  # written in place by something the function mode does not see
            self._left_out(sum(not f for f in fresh), "were changed in place, by an operation the tracer does not "
                           "see, before their statistics were taken")
            items = [it for it in items if fresh[it[1]]]
            tensors = [t if f else t.new_empty(0) for t, f in zip(tensors, fresh, strict=True)]
        try:
            stats = batch_stats(tensors, rows=True)
        except Exception:  # one odd tensor (a subclass, freed storage): each alone, the failing ones left out
            stats = []
            for t in tensors:
                try:
                    stats.append(batch_stats([t], rows=True)[0])
                except Exception:
                    stats.append(None)
            self._left_out(sum(s is None for s in stats), "had statistics that could not be taken")
            items = [it for it in items if stats[it[1]] is not None]
        self._apply(items, tensors, stats)

    def _apply(self, items, tensors: list[torch.Tensor], stats: list[dict[str, Any]]) -> None:
        for key, i, kind in items:
            st = dict(stats[i])
            low = st.pop("min_row_sumsq", None)
            x = tensors[i]
            if kind == "scale":  # a norm's γ: its RMS, not an activation's entry (NaN when not finite)
                rms = math.sqrt(st["sumsq"] / st["n"]) if st["n"] and not st["nonfinite"] else math.nan
                _merge(self._acc[key], {"max_scale_rms": rms})
                continue
            if kind == "rows" and x.dim() >= 1 and x.numel():
                if low is not None:
                    st["min_row_rms"] = math.sqrt(low / x.shape[-1])
                else:  # torch's path, finite rows only
                    rows = torch.linalg.vector_norm(x.detach(), 2, dim=-1, dtype=torch.float32) / math.sqrt(
                        x.shape[-1])
                    rows = rows[torch.isfinite(rows)]
                    if rows.numel():
                        st["min_row_rms"] = float(rows.min())
            _merge(self._acc[key], st)

    def _left_out(self, n: int, why: str) -> None:
        """Log once per reason that ``n`` activations' entries are left out of the record."""
        if why not in self._warned:
            self._warned.add(why)
            log.warning("normscope.trace: %d activation(s) %s at step %d; their entries are left out of the record "
                        "(logged once)", n, why, self._last_step + 1)

    def _active(self) -> bool:
        return self.recording and (self.record_eval or torch.is_grad_enabled())

    # ------------------------------------------------------------------ forward hooks
    def _root_pre(self, module, args, kwargs):
        if not self._active() or self._mode is not None:
            return None
        self._counters = {}
        self._ids = None
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is None:  # keyword inputs: the usual names first, then the first tensor
            named = [kwargs.get(k) for k in ("input_ids", "inputs_embeds", "pixel_values", "input", "x")]
            x = next((v for v in named + list(kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if "data" not in self.disabled and isinstance(x, torch.Tensor):
            if x.is_floating_point():
                self._guard("data", self._data, x, "input")
            else:
                self._ids = x  # the lookup of these ids is the data stage
                self._guard("data", self._tokens, x)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return None

    def _root_post(self, module, args, output):
        self._exit_mode()
        return None

    def _exit_mode(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            self._flush()
            self._streams.clear()
            self._ids = None
            try:
                mode.__exit__(None, None, None)
            except Exception as exc:  # a mode stack disturbed by user code: stop using the mode
                self._fail("attention", exc)

    def _data(self, x: torch.Tensor, site: str) -> None:
        s = _per_sample(x)
        cur = self._samples.setdefault(site, {k: [] for k in s})
        for k, v in s.items():
            cur[k].extend(v)

    def _tokens(self, ids: torch.Tensor) -> None:
        ids = ids.detach()
        flat = ids.reshape(ids.shape[0], -1) if ids.dim() else ids.reshape(1, 1)
        cur = self._samples.setdefault("tokens", {"min_id": [], "max_id": []})
        cur["min_id"].extend(flat.amin(1).tolist())
        cur["max_id"].extend(flat.amax(1).tolist())

    def _embedding(self, out) -> None:
        self._ids = None
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            self._data(out, "embedding")

    def _block_pre(self, module, args, kwargs):
        if self._mode is None or "blocks" in self.disabled:
            return None
        self._guard("blocks", self._enter_block, module, args, kwargs)
        return None

    def _enter_block(self, module, args, kwargs) -> None:
        layer = self.blocks[id(module)]
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        self._streams.append({"layer": layer, "stream": x, "alt": None, "attn": False, "module": module})
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            self._defer("layer_input", layer, "", x)

    def _block_post(self, module, args, output):
        if self._streams and self._streams[-1]["module"] is module:
            self._streams.pop()
        return None

    def _layer(self) -> int | None:
        return self._streams[-1]["layer"] if self._streams else None

    def _norm_pre(self, module, args):
        if self._mode is None:
            return None
        self._in_norm += 1
        if "norms" not in self.disabled and args and isinstance(args[0], torch.Tensor):
            self._guard("norms", self._norm_in, self.norms[id(module)], args[0])
        return None

    def _norm_in(self, where: tuple[int | None, str], x: torch.Tensor) -> None:
        if x.is_floating_point():
            self._defer("norm_input", *where, x, "rows")

    def _norm_post(self, module, args, output):
        if self._mode is None:
            return None
        self._in_norm = max(0, self._in_norm - 1)
        if "norms" not in self.disabled and isinstance(output, torch.Tensor):
            self._guard("norms", self._norm_out, module, args, output)
        return None

    def _norm_out(self, module, args, y: torch.Tensor) -> None:
        layer, site = self.norms[id(module)]
        if y.is_floating_point():
            self._defer("norm_output", layer, site, y)
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.numel() and w.is_floating_point() and "statistics" not in self.disabled:
            # a copy, summarised with the batch: a parameter's storage may not outlive the call (FSDP)
            self._defer("norm_output", layer, site, w.detach().clone(), "scale")
        s = self._streams[-1] if self._streams else None
        if s is not None and args and args[0] is s["stream"]:
            s["alt"] = y  # post-norm: the normalized sum may be the stream the next add reads

    def _functional_norm(self, func, args, kwargs, out) -> None:
        fname = NORM_FUNCTIONS[func][0]
        layer = self._layer()
        k = self._counters.get((layer, fname), 0)
        self._counters[(layer, fname)] = k + 1
        site = f"{fname}#{k}"
        x = args[0] if args else kwargs.get("input")
        if isinstance(x, torch.Tensor):
            self._norm_in((layer, site), x)
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            self._defer("norm_output", layer, site, out)
            s = self._streams[-1] if self._streams else None
            if s is not None and x is s["stream"]:
                s["alt"] = out

    # ------------------------------------------------------------------ attention and residual adds
    def _attention_sdpa(self, args, kwargs) -> None:
        """The logits are recomputed now, while q and k are in cache, with the mask the forward's other calls of the
        same shapes share."""
        call = attention.SdpaCall(args, kwargs)
        group = self._attention_groups.get(call.group)
        if group is None:
            group = self._attention_groups[call.group] = attention.Group(self._buffer)
        self._add(*self._logits_key(), group.stats(call))

    def _attention_softmax(self, func, args, kwargs) -> None:
        x = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if x.dim() != 4 or dim not in (-1, 3) or not x.is_floating_point():
            return
        self._add(*self._logits_key(), attention.eager_logit_stats(x))

    def _logits_key(self) -> tuple:
        layer = self._layer()
        if self._streams:
            self._streams[-1]["attn"] = True
        k = self._counters.get(("attn", layer), 0)
        self._counters[("attn", layer)] = k + 1
        return "attention_logits", layer, "" if k == 0 else f"#{k}"

    def _residual(self, args, out) -> None:
        s = self._streams[-1]
        if len(args) < 2 or not isinstance(out, torch.Tensor):
            return
        a, b = args[0], args[1]
        if a is s["stream"] or a is s["alt"]:
            stream, branch = a, b
        elif b is s["stream"] or b is s["alt"]:
            stream, branch = b, a
        else:
            return
        if (not isinstance(branch, torch.Tensor) or not isinstance(stream, torch.Tensor)
                or branch.shape != stream.shape or not branch.is_floating_point()):
            return
        part = "attn" if s["attn"] else "mlp"
        k = self._counters.get((s["layer"], part), 0)
        self._counters[(s["layer"], part)] = k + 1
        site = part if k == 0 else f"{part}#{k}"
        self._defer("sublayer_output", s["layer"], site, branch)
        self._defer("residual_sum", s["layer"], site, out)
        s["stream"], s["alt"], s["attn"] = out, None, False

    # ------------------------------------------------------------------ gradients and updates
    def _grad_hook(self, p: torch.Tensor) -> None:
        """A parameter's gradient is final for this backward: summarise it when the backward ends.

        The parameters of one backward are summarised together in a callback the autograd engine runs at its end
        (before a clip or an optimizer step can change them), with one kernel per statistic for all of them.
        """
        if not self.recording or "grad" in self.disabled or p.grad is None:
            return
        self._grad_batch[id(p)] = p
        self._grad_order.setdefault(self.param_group[id(p)])  # the order the backward finished them in
        if self._grad_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._grad_flush)
            self._grad_queued = True
        except Exception:  # not inside a backward the engine runs (or no such API): summarise now
            self._grad_flush()

    def _grad_flush(self) -> None:
        self._grad_queued = False
        batch, self._grad_batch = self._grad_batch, {}
        self._guard("grad", self._grad_stats, [p for p in batch.values() if p.grad is not None])

    def _grad_stats(self, params: list[torch.Tensor]) -> None:
        for p, st in zip(params, batch_stats([_local(p.grad) for p in params]), strict=True):
            self._grads[id(p)] = st  # the accumulated gradient: the last backward wins

    def _own(self, optimizer) -> list[torch.Tensor]:
        ids = self.param_group
        return [p for g in optimizer.param_groups for p in g["params"] if id(p) in ids]

    def _opt_pre(self, optimizer, args, kwargs) -> None:
        # an optimizer subclass whose step() calls super().step() runs the global hooks once per level: only the
        # outermost call measures, so the subclass's own writes around super().step() are part of the update
        depth = self._opt_depth.get(id(optimizer), 0)
        self._opt_depth[id(optimizer)] = depth + 1
        if self.recording and depth == 0:
            self._guard("update", self._keep_parameters, optimizer)

    def _keep_parameters(self, optimizer) -> None:
        """Before the step: the parameters' values, in one batched copy into buffers kept while steps in a row are
        recorded."""
        with torch.no_grad():
            own = self._own(optimizer)
            for g in optimizer.param_groups:  # the learning rate each parameter is stepped with
                lr = g.get("lr")
                if isinstance(lr, torch.Tensor):
                    lr = float(lr)
                if isinstance(lr, int | float) and not isinstance(lr, bool):
                    for p in g["params"]:
                        self._lrs[id(p)] = float(lr)
            if own:
                # fresh memory each step would cost its page faults
                values = [_local(p.detach()) for p in own]
                bufs = [self._buffer(id(p), v.shape, v.dtype, v.device) for p, v in zip(own, values, strict=True)]
                torch._foreach_copy_(bufs, values)
                self._old.update(zip(map(id, own), bufs, strict=True))

    def _buffer(self, key, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Contiguous memory kept while steps in a row are recorded (a parameter's copy before the step, the
        attention recompute's operands and logits)."""
        b = self._buffers.get(key)
        if b is None or b.shape != shape or b.dtype != dtype or b.device != device:
            b = self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return b

    def _opt_post(self, optimizer, args, kwargs) -> None:
        depth = self._opt_depth.get(id(optimizer), 1) - 1
        if depth > 0:
            self._opt_depth[id(optimizer)] = depth
            return
        self._opt_depth.pop(id(optimizer), None)
        if self._old:
            try:
                self._guard("update", self._update_stats, optimizer)
            finally:
                self._old.clear()

    def _update_stats(self, optimizer) -> None:
        """After the step: the change of each parameter against its kept value, summed per parameter group."""
        with torch.no_grad():
            own = [p for p in self._own(optimizer) if id(p) in self._old]
            if not own:
                return
            stats: list[tuple[torch.Tensor, dict[str, Any]]] = []
            rest: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
            olds, news = [self._old[id(p)] for p in own], [_local(p.detach()) for p in own]
            # the change and its sums in one read of both copies, one call for all parameters
            for p, d, w, one in zip(own, olds, news, fused.update_sums(olds, news), strict=True):
                if one is not None and all(map(math.isfinite, one)):
                    stats.append((p, {"sumsq": one[0], "n": d.numel(), "max": one[1], "nonfinite": 0,
                                      "param_sumsq": one[2]}))
                else:
                    d.sub_(w)  # old - new, in place in the copy: the update, negated
                    rest.append((p, d, w))
            if rest:  # torch's reductions, batched; the exact path where a number is not finite
                moves = batch_stats([d for _, d, _ in rest])
                sizes = batch_stats([w for _, _, w in rest], max_abs=False)
                for (p, _, _), us, ps in zip(rest, moves, sizes, strict=True):
                    stats.append((p, {"sumsq": us["sumsq"], "n": us["n"], "max": us["max"],
                                      "nonfinite": us["nonfinite"] + ps["nonfinite"], "param_sumsq": ps["sumsq"]}))
            for p, st in stats:
                if id(p) in self._lrs:
                    st["max_lr"] = self._lrs[id(p)]
                g = self.param_group[id(p)]
                acc = self._updates.setdefault(g, {"sumsq": 0.0, "n": 0, "max": 0.0, "nonfinite": 0,
                                                   "param_sumsq": 0.0})
                _merge(acc, st)

    # ------------------------------------------------------------------ the step
    def step(self, step: int, loss=None, sample_ids=None, losses=None) -> None:
        """Close step ``step``: write its record (at recorded steps) and arm the next one. Never raises."""
        recorded = self.recording
        try:
            self._step(step, loss, sample_ids, losses)
        except Exception as exc:
            self._fail("writer", exc)
        finally:
            self._last_step = int(step) if isinstance(step, int) else self._last_step + 1
            self.recording = (self._last_step + 1) % self.every == 0
            self._reset()
            if recorded:  # the record's writing counts towards the next recorded step
                self._cost, self._written = self._written, 0.0
            if not self.recording:
                self._buffers.clear()
            if self._open:
                try:
                    self._attach() if self.recording else self._detach()
                except Exception as exc:
                    self._fail("writer", exc)

    def _entries(self, loss, losses) -> tuple[list[dict[str, Any]], dict[str, dict[str, list]]]:
        if self._grad_batch:  # a backward whose end-callback did not run
            self._grad_flush()
        if self._pending_items:  # a forward whose end was not seen
            self._flush()
        entries = []
        for (stage, layer, site), st in self._acc.items():
            if st:  # an entry whose statistics were not taken (a disabled probe, an in-place change) is left out
                entries.append({"stage": stage, "layer": layer, "site": site, **st})
        samples = {k: {f: list(v) for f, v in d.items()} for k, d in self._samples.items()}
        if loss is not None:
            lv = float(loss.detach().float().mean()) if isinstance(loss, torch.Tensor) else float(loss)
            entries.append({"stage": "loss", "layer": None, "site": "", "sum": lv, "count": 1,
                            "nonfinite": 0 if math.isfinite(lv) else 1})
        if losses is not None:
            t = torch.as_tensor(losses).detach().float().reshape(-1)
            samples["loss"] = {"loss": t.tolist()}
        grads: dict[tuple, dict[str, Any]] = {}
        for p in self.params:
            st = self._grads.get(id(p))
            if st is not None:
                g = self.param_group[id(p)]
                if g in grads:
                    _merge(grads[g], st)
                else:
                    grads[g] = dict(st)
        # backward order: as the backward finished each group's first gradient (a NaN born in layer 3's backward
        # also poisons layers 0-2 and, within a layer, the parameters its backward reaches later)
        for g in [*self._grad_order, *reversed(self.param_order)]:
            if g in grads:
                entries.append({"stage": "grad", "layer": g[0], "site": g[1], **grads.pop(g)})
        for g in self.param_order:
            if g in self._updates:
                entries.append({"stage": "update", "layer": g[0], "site": g[1], **self._updates[g]})
        return entries, samples

    def _step(self, step, loss, sample_ids, losses) -> None:
        if not self.recording:
            return
        t0 = time.perf_counter()
        entries, samples = self._entries(loss, losses)
        if self.world > 1 and "reduce" not in self.disabled:
            from .distributed import reduce_record

            try:
                entries, samples, sample_ids = reduce_record(entries, samples, sample_ids)
            except Exception as exc:
                self._fail("reduce", exc)
        if self.rank != 0 or self._file is None:
            return
        rec: dict[str, Any] = {"kind": "step", "step": int(step), "time": time.time(), "entries": entries,
                               "samples": samples}
        if sample_ids is not None:
            if isinstance(sample_ids, torch.Tensor):
                sample_ids = sample_ids.reshape(-1).tolist()
            rec["sample_ids"] = [s if isinstance(s, int | str) else str(s) for s in sample_ids]
        if self.disabled:
            rec["disabled"] = sorted(self.disabled)
        # the tracer's own time in this step's probes (the writing of this record counts towards the next)
        rec["tracer_ms"] = (self._cost + time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        self._write(rec)
        self._written = time.perf_counter() - t1

    def _write(self, rec: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(_dumps(rec) + "\n")
        self._file.flush()  # a killed process loses at most the step in flight
        for i, sink in enumerate(self.sinks):
            probe = f"sink {i}"
            if probe in self.disabled:
                continue
            try:
                sink.write(rec)
            except Exception as exc:  # a failing sink is disabled; the JSONL store goes on
                self._fail(probe, exc)

    def _close_sinks(self) -> None:
        for i, sink in enumerate(self.sinks):
            close = getattr(sink, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:
                    self._fail(f"sink {i}", exc)


def _short(v, key: str = ""):
    """A record as JSON-ready values in one walk: floats to 7 significant digits (float32 statistics carry no more:
    a third of the line length), non-finite floats as strings, NumPy scalars as Python numbers. Times (the ``time``
    fields, seconds since the epoch) keep their full precision."""
    t = type(v)
    if t is float:
        if v - v != 0.0:  # inf or NaN
            return str(v)
        return v if key == "time" else float(f"{v:.7g}")
    if t is list or t is tuple:
        return [_short(x) for x in v]
    if t is dict:
        return {str(k): _short(x, k) for k, x in v.items()}
    if t is int or t is str or t is bool or v is None:
        return v
    return jsonable(v)  # NumPy values and other numbers: the general conversion


def _dumps(rec) -> str:
    import json

    return json.dumps(_short(rec), separators=(",", ":"))


def trace(model: torch.nn.Module, run_dir: str | os.PathLike, every: int = 1, *, layers=None,
          record_eval: bool = False, meta: dict[str, Any] | None = None, sinks=()) -> Tracer:
    """Record the residual chain of ``model`` into ``run_dir`` (``trace.jsonl``, schema ``normscope.trace/1``).

    Use as a context manager and call ``tr.step(step, loss=..., sample_ids=..., losses=...)`` once per optimizer
    step, after it. ``every``: record every N-th step (between them no hook is installed). ``layers``: the block
    modules (or their names) when the repeated-module discovery does not find them. ``record_eval``: also record
    forwards run with gradients disabled (evaluation); by default they are ignored. ``sinks``: objects with
    ``write(record)`` (and optionally ``close()``) that also receive every record written on rank 0, e.g.
    :class:`normscope.tracing.sinks.TensorBoardSink`; a sink that raises is disabled, the store goes on.
    """
    return Tracer(model, run_dir, every=every, layers=layers, record_eval=record_eval, meta=meta, sinks=sinks)
