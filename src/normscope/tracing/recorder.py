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
(:func:`normscope.sites.classes.known_class`) plus functional norm calls, attention from a ``TorchFunctionMode`` that
sees ``F.scaled_dot_product_attention`` and eager softmax over ``(batch, heads, query, key)`` logits (or ``(batch,
heads, window, query, key)``); residual adds are the adds of the block's current stream (an identity test, no graph
capture), and in a block whose shortcut is a projection the add of two tensors computed from its input along
separate paths (:mod:`.lineage`). The mode is active only during
the model's forward at recorded steps. Any exception inside a probe is caught, logged once, and that probe is
disabled; training never sees it.
"""

from __future__ import annotations

import inspect
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
from ..sites.trace import ADDS, EMBEDDING, NORM_FUNCTIONS, SOFTMAX, TRANSPARENT
from . import attention
from .activations import PENDING_BYTES, ActivationBatch, writes_in_place
from .buffers import Buffers
from .discovery import discover
from .gradients import GradientCollector
from .residual import Stream
from .statistics import StepEntries, per_sample
from .store import SCHEMA
from .updates import UpdateCollector
from .writer import RecordWriter

log = logging.getLogger("normscope.trace")

def _same_ids(a, ids: torch.Tensor) -> bool:
    """Whether ``a`` is the forward's token ids or a view of all of them (``input_ids.view(-1, T)``)."""
    if a is ids:
        return True
    return (isinstance(a, torch.Tensor) and a.dtype == ids.dtype and a.numel() == ids.numel()
            and a.device == ids.device and a.data_ptr() == ids.data_ptr())


_INPUT_NAMES = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features", "input", "x")


def _model_inputs(args, kwargs) -> tuple[torch.Tensor | None, list[tuple[str, torch.Tensor]]]:
    """The forward's data: its first positional tensor, else the first keyword tensor of the usual input names,
    else its first floating keyword tensor that is not a mask, else its first integer one that is not; and the other
    floating inputs of the usual names, each a data site of its own (a model of two modalities)."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    named = [(k, kwargs[k]) for k in _INPUT_NAMES if isinstance(kwargs.get(k), torch.Tensor)]
    if first is None:
        rest = [v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and "mask" not in k and k != "labels"]
        first = next(iter([v for _, v in named] + [v for v in rest if v.is_floating_point()] + rest), None)
    more = [(k, v) for k, v in named if v is not first and v.is_floating_point() and k != "inputs_embeds"]
    return first, more


_PLAIN, _SDPA, _SOFTMAX, _NORM, _EMBEDDING, _ADD, _TRANSPARENT, _MIXING = range(8)


def _kind(func) -> tuple[str, int, bool, bool]:
    """What the mode does with ``func``: its name, its kind, whether its name says it writes in place, and whether
    it takes an ``inplace`` flag (``F.relu(x, True)``: a positional ``True`` may ask for it)."""
    name = getattr(func, "__name__", "")
    if func is F.scaled_dot_product_attention:
        kind = _SDPA
    elif func in NORM_FUNCTIONS:
        kind = _NORM
    elif name in SOFTMAX:
        kind = _SOFTMAX
    elif name in EMBEDDING:
        kind = _EMBEDDING
    elif name in ADDS:
        kind = _ADD
    elif name in TRANSPARENT:
        kind = _TRANSPARENT
    elif name in ("conv1d", "pad"):
        kind = _MIXING
    else:
        kind = _PLAIN
    try:
        flag = "inplace" in inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin: its in-place forms are named with a trailing underscore
        flag = False
    return name, kind, writes_in_place(name, (), {}), flag


class _Mode(TorchFunctionMode):
    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tr = tracer
        self.kinds = tracer.kinds  # func -> _kind(func), looked up once per function and tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self.tr
        if tr._busy:
            return func(*args, **kwargs)
        known = self.kinds.get(func)
        if known is None:
            known = self.kinds[func] = _kind(func)
        name, kind, in_place, flag = known
        stream = tr.stream
        if (tr.activations.items or tr.attention_pending) and (
                in_place or (kwargs and writes_in_place("", (), kwargs)) or (flag and writes_in_place("", args, kwargs))):
            tr._flush()
        if kind == _SDPA:
            if "attention" not in tr.disabled:
                tr._guard("attention", tr._attention_sdpa, args, kwargs)
        elif kind == _SOFTMAX and "attention" not in tr.disabled and args and isinstance(args[0], torch.Tensor):
            tr._guard("attention", tr._attention_softmax, func, args, kwargs)
        if kind == _NORM and "norms" not in tr.disabled and not tr._in_norm:
            out = func(*args, **kwargs)
            tr._guard("norms", tr._functional_norm, func, args, kwargs, out)
        elif kind == _EMBEDDING and tr._ids is not None and args and _same_ids(args[0], tr._ids):
            out = func(*args, **kwargs)
            tr._guard("data", tr._embedding, out)
        elif kind == _ADD and stream.scopes and "residual" not in tr.disabled:
            add = tr._guard("residual", stream.before_add, name, args)
            out = func(*args, **kwargs)
            if add is not None:
                tr._guard("residual", stream.after_add, add, out)
        else:
            out = func(*args, **kwargs)
            if stream.scopes:
                if kind == _TRANSPARENT and args and isinstance(out, torch.Tensor):
                    stream.follow(args[0], out)
                elif kind == _MIXING:
                    stream.mixing(name, args, kwargs)
        if stream.scopes and stream.scopes[-1]["lineage"] is not None:
            stream.derive(args, out)
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
        self._mode: _Mode | None = None
        self.kinds: dict[Any, tuple[str, int, bool, bool]] = {}  # what the mode does with each function it saw
        self._last_step = -1
        self.recording = True  # step 0 is recorded
        self._ids: torch.Tensor | None = None  # the token ids of the forward in flight
        self._warned: set[str] = set()  # the reasons for left-out entries already logged
        self.rank, self.world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.layout = discover(model, layers)
        self.blocks, self.norms = self.layout.blocks, self.layout.norms
        self.param_group = self.layout.param_group
        self.meta.update({"model": type(model).__name__, "blocks": self.layout.block_names,
                          "norms": sorted(f"{'' if lay is None else lay}:{s}" for lay, s in self.norms.values())})
        if hasattr(torch, "compiler") and hasattr(torch.compiler, "disable"):
            # under torch.compile the probes run eagerly (a graph break each) instead of being traced into the graph
            for name in ("_guard", "_root_pre", "_root_post", "_block_pre", "_block_post", "_norm_pre", "_norm_post"):
                setattr(self, name, torch.compiler.disable(getattr(self, name), recursive=True))
        # the collectors, each owning one kind of statistic, and the writer
        self.buffers = Buffers()
        self._unmasked_groups: dict[tuple, attention.Group] = {}  # SDPA calls without a mask tensor, by shape
        self._groups_used: set[tuple] = set()  # the keys of those used since the last step
        self.entries = StepEntries()  # the forward's entries (activations, attention) of the step being recorded
        self.activations = ActivationBatch(self.entries, self._guard, self.disabled, self._left_out)
        self.gradients = GradientCollector(self.layout, self._guard, self._recording, self.disabled)
        self.updates = UpdateCollector(self.layout, self._guard, self._recording, self.buffers)
        self.stream = Stream(self.layout, self.activations, self._guard, self._fail, self.disabled)
        self.writer = RecordWriter(self.run_dir, self.sinks, self._fail, self.disabled)
        self._reset()

    def _recording(self) -> bool:
        return self.recording

    def _drain(self) -> None:
        """Wait for the writer to write every record handed to it (in a hook or ``step``: never raises)."""
        try:
            self.writer.drain()
        except Exception as exc:  # never break training
            self._fail("writer", exc)

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
            self.writer.open()
            self.writer.write({"schema": SCHEMA, "kind": "header", "every": self.every, "world_size": self.world,
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
            if id(m) in self.blocks or id(m) in self.layout.nested:
                self._handles.append(m.register_forward_pre_hook(self._block_pre, with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._block_post, always_call=True))
            if id(m) in self.norms:
                self._handles.append(m.register_forward_pre_hook(self._norm_pre))
                self._handles.append(m.register_forward_hook(self._norm_post, always_call=True))
        for p in self.layout.params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self.gradients.hook))
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles.append(register_optimizer_step_pre_hook(self.updates.pre))
        self._handles.append(register_optimizer_step_post_hook(self.updates.post))

    def _detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def close(self) -> None:
        self._open = False
        self._detach()
        self.buffers.clear()
        self._unmasked_groups.clear()
        self._exit_mode()
        self.writer.close(lambda: {"kind": "end", "time": time.time(), "last_step": self._last_step,
                                   "disabled": sorted(self.disabled), "errors": list(self.errors)})

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

    def _fail(self, probe: str, exc: BaseException, step: int | None = None) -> None:
        """Disable ``probe`` after its failure at ``step`` (by default the step being recorded), said once."""
        if probe in self.disabled:
            return
        self.disabled.add(probe)
        step = self._last_step + 1 if step is None else step
        msg = f"{type(exc).__name__}: {exc}"
        self.errors.append({"probe": probe, "step": step, "error": msg})
        log.warning("normscope.trace: probe %r failed at step %d and is disabled (%s)", probe, step, msg)

    # ------------------------------------------------------------------ the step's state
    def _reset(self) -> None:
        self.entries.clear()
        # prepared masks kept for the shapes the step used: lengths that vary from batch to batch do not pile up
        self._unmasked_groups = {k: g for k, g in self._unmasked_groups.items() if k in self._groups_used}
        self._groups_used = set()
        self._samples: dict[str, dict[str, list]] = {}
        self._counters: dict[tuple, int] = {}  # (attention, layer, scope) → its calls this forward
        self.stream.reset()
        self._attention_groups: dict[tuple, attention.Group] = {}  # this forward's SDPA masks, by call shape
        # SDPA calls whose statistics wait for the forward's batch: (entry key, call, group, q and k versions)
        self.attention_pending: list[tuple] = []
        self._attention_bytes = 0
        self.activations.reset()
        self.gradients.reset()
        self.updates.reset()

    def _defer(self, stage: str, layer: int | None, site: str, x: torch.Tensor, kind: str = "") -> None:
        self.activations.defer(stage, layer, site, x, kind)

    def _flush(self) -> None:
        """Take the forward's pending statistics: its SDPA calls', a launch per group, and its activations' (see
        :mod:`.activations`)."""
        pending, self.attention_pending, self._attention_bytes = self.attention_pending, [], 0
        if pending:
            self._guard("attention", self._attention_batch, pending)
        self._attention_groups = {}
        self.activations.flush()

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
        # the records of the steps before are written before this forward runs: a process killed from here on
        # loses at most the step in flight (the writer had the time since the last step to write them)
        self._drain()
        self._counters = {}
        self.stream.reset()
        self._ids = None
        x, more = _model_inputs(args, kwargs)
        if "data" not in self.disabled and isinstance(x, torch.Tensor):
            if x.is_floating_point():
                self._guard("data", self._data, x, "input")
            else:
                self._ids = x  # the lookup of these ids is the data stage
                self._guard("data", self._tokens, x)
            for name, t in more:  # a second modality (CLIP's images beside its text)
                self._guard("data", self._data, t, name)
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
            self.stream.reset()
            self._ids = None
            try:
                mode.__exit__(None, None, None)
            except Exception as exc:  # a mode stack disturbed by user code: stop using the mode
                self._fail("attention", exc)

    def _data(self, x: torch.Tensor, site: str) -> None:
        s = per_sample(x)
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
        self._guard("blocks", self.stream.enter, module, args, kwargs)
        return None

    def _block_post(self, module, args, output):
        self.stream.exit(module, output)
        return None

    def _layer(self) -> int | None:
        return self.stream.layer()

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
            # the scale the norm applies, c + w where it has an offset c (Gemma: 1 + w), summarised with the batch: a
            # parameter of the model as it is (its version is checked then), any other weight as a copy (FSDP's
            # unsharded weight: its storage may not outlive the call)
            c = self.layout.scale_offsets.get(id(module))
            if c:
                scale = w.detach() + c
            elif id(w) in self.layout.param_group:  # the layout holds the model's parameters: the id is theirs
                scale = w.detach()
            else:
                scale = w.detach().clone()
            self._defer("norm_output", layer, site, scale, "scale")
        if args:
            self.stream.normalized(args[0], y)

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
            self.stream.normalized(x, out)

    # ------------------------------------------------------------------ attention and residual adds
    def _attention_sdpa(self, args, kwargs) -> None:
        """The logits are recomputed now, while q and k are in cache, with the mask the forward's other calls of the
        same shapes share."""
        call = attention.SdpaCall(args, kwargs)
        # a call without a mask tensor (causal or none) depends on its shapes and scale alone: its group is kept from
        # step to step; one with a mask tensor shares its group within this forward, while that tensor is held
        groups = self._unmasked_groups if call.mask is None else self._attention_groups
        if call.mask is None:
            self._groups_used.add(call.group)
        group = groups.get(call.group)
        if group is None:
            group = groups[call.group] = attention.Group(self.buffers)
        key = self._logits_key()
        if not group.fast(call):
            self.entries.add(*key, group.stats(call))
            return
        # taken with the forward's other calls of this group, in one launch; q and k stay alive until then (autograd
        # holds them anyway while training)
        self.entries.slot(key)
        self.attention_pending.append((key, call, group, call.q._version, call.k._version))
        self._attention_bytes += call.q.nbytes + call.k.nbytes
        if self._attention_bytes > PENDING_BYTES:
            self._flush()

    def _attention_batch(self, pending: list[tuple]) -> None:
        fresh = [p for p in pending if p[1].q._version == p[3] and p[1].k._version == p[4]]
        if len(fresh) < len(pending):
            self._left_out(len(pending) - len(fresh), "had attention inputs changed in place, by an operation the "
                           "tracer does not see, before their statistics were taken")
        groups: dict[int, tuple[attention.Group, list]] = {}
        for p in fresh:
            groups.setdefault(id(p[2]), (p[2], []))[1].append(p)
        for group, items in groups.values():
            for item, stats in zip(items, group.stats_batch([p[1] for p in items]), strict=True):
                self.entries.add(*item[0], stats)

    def _attention_softmax(self, func, args, kwargs) -> None:
        x = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not x.is_floating_point() or x.dim() not in (4, 5) or dim not in (-1, x.dim() - 1):
            return
        if x.dim() == 5:  # (batch, heads, windows, query, key): windowed attention (Hiera), the windows' rows as rows
            x = x.flatten(2, 3)
        self.entries.add(*self._logits_key(), attention.eager_logit_stats(x))

    def _logits_key(self) -> tuple:
        """The entry of an attention call: its block's layer, the nested element it runs in (Swin's ``blocks.1``)
        and its order there (``#1`` for the second: cross-attention, a second window pass)."""
        layer = self._layer()
        prefix = ""
        if self.stream.scopes:
            self.stream.scopes[-1]["attn"] = True
            prefix = self.stream.scopes[-1]["prefix"].rstrip(".")
        k = self._counters.get(("attn", layer, prefix), 0)
        self._counters[("attn", layer, prefix)] = k + 1
        return "attention_logits", layer, prefix if k == 0 else f"{prefix}#{k}"

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
            if not self.recording:  # memory kept only while steps in a row are recorded
                self.buffers.clear()
                self._unmasked_groups.clear()
                if recorded:  # no recorded forward comes next to wait for the writer: the record is written now
                    self._drain()
            if self._open:
                try:
                    self._attach() if self.recording else self._detach()
                except Exception as exc:
                    self._fail("writer", exc)

    def _entries(self, loss, losses) -> tuple[list[dict[str, Any]], dict[str, dict[str, list]]]:
        """The step's record in chain order: the forward's entries, the loss, gradients (backward order), updates."""
        if self.activations.items or self.attention_pending:  # a forward whose end was not seen
            self._flush()
        entries = self.entries.records()
        samples = {k: {f: list(v) for f, v in d.items()} for k, d in self._samples.items()}
        if loss is not None:
            lv = float(loss.detach().float().mean()) if isinstance(loss, torch.Tensor) else float(loss)
            entries.append({"stage": "loss", "layer": None, "site": "", "sum": lv, "count": 1,
                            "nonfinite": 0 if math.isfinite(lv) else 1})
        if losses is not None:
            t = torch.as_tensor(losses).detach().float().reshape(-1)
            samples["loss"] = {"loss": t.tolist()}
        return entries + self.gradients.entries() + self.updates.entries(), samples

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
        if self.rank != 0 or not self.writer.is_open:
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
        self.writer.write(rec)
        self._written = time.perf_counter() - t1


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
