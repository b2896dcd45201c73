"""What ``diff`` compares the reference with, one strategy per kind of candidate:

- :class:`ModuleCandidate` — another torch module, run as it is (at its own dtype);
- :class:`CopyCandidate` — a private copy (of the candidate, or of the reference itself) cast to a dtype;
- :class:`AutocastCandidate` — a torch module (the reference itself when none is given) under ``torch.autocast``;
- :class:`GraphCandidate` — the common part of a runtime's graph mapped to the sites by its node-name scopes;
- the runtimes' candidates, one module each in :mod:`.runtimes` (ONNX Runtime, OpenVINO, MLX, llama.cpp).

Each runs its own forward once (:meth:`Candidate.run`: the primary output of every call, where it raised), aligns
those records with the reference's module paths (:meth:`Candidate.align`) and, during the reference's forward,
runs one site on the reference's own inputs (:meth:`Candidate.own`: teacher forcing) and says what the
reference's module makes of the same inputs at the candidate's dtype (:meth:`Candidate.twin_error`: the *twin*).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import torch

from ..dtypes import dtype_name
from ..errors import InputError
from ..model import private_copy, untouched
from . import metrics, quantized
from .execution import (
    Autocast,
    Hooks,
    Kid,
    Memo,
    Record,
    Replay,
    cast,
    device_type,
    input_of,
    model_dtype,
    primary,
    restored,
    site_name,
    versions,
)

WINDOW = 16  # order alignment: how far ahead in the candidate's calls a counterpart is looked for


def kept_bytes(records: list[Record]) -> int:
    """The bytes of the candidate's outputs its records keep."""
    return sum(r.output.numel() * r.output.element_size() for r in records if r.output is not None)


class NotMeasured(Exception):
    """A site's own error cannot be measured; ``note`` says why. ``missing``: the site is still judged on its
    propagated error (an ONNX site whose nodes cannot be extracted as a subgraph)."""

    def __init__(self, note: str | None, missing: str | None = None):
        super().__init__(note or missing)
        self.note, self.missing = note, missing


class Alignment:
    """Which candidate record is the counterpart of a reference module call: by path and call number when the
    names match or a runtime's graph was mapped to the paths (``graph``: ONNX/OpenVINO scopes, llama.cpp tensor
    names), else by execution order and output shape within a window."""

    def __init__(self, records: list[Record], mode: str, graph: bool = False):
        self.records, self.mode, self.graph = records, mode, graph
        self.by_key = {(r.path, r.number): r for r in records}
        self.pointer = 0

    def counterpart(self, path: str, number: int, shape: list[int]) -> Record | None:
        if self.mode == "name" or self.graph:
            r = self.by_key.get((path, number))
            return r if r is not None and not r.used else None
        for i in range(self.pointer, min(len(self.records), self.pointer + WINDOW)):
            r = self.records[i]
            if not r.used and r.shape == shape:
                self.pointer = i + 1
                return r
        return None

    def unmatched(self) -> list[str]:
        """The candidate's calls no reference call took (a graph's values outside every scope are not counted)."""
        if self.graph:
            return []
        return [site_name(r.path, r.number) for r in self.records if not r.used and r.output is not None]


class Candidate:
    """The common part of every strategy: its description, dtype, and what its forward left behind."""

    graph = False  # a runtime's graph mapped to the sites by scopes (ONNX, OpenVINO): sites without an own error
                   # are judged on their propagated error
    torch_modules = True  # its records' modules are torch modules (their parameters tell their dtype)
    model: torch.nn.Module | None = None
    twin: torch.nn.Module | None = None  # the reference's modules at the candidate's dtype (None: not needed)
    # a quantized candidate's modules by path → their quantization in words; its twin is the reference with the
    # candidate's dequantized weights, and each site is judged against the twin's output (empty: not quantized)
    quantized: dict[str, str] = {}
    weight_faults: dict[str, str] = {}  # quantized modules whose weights are not the reference's, quantized: why
    torch_dtype: torch.dtype | None = None  # what the reference's inputs are cast to before a candidate call
    ac = Autocast(None, "cpu")
    bound_suffix = ""
    runner = ""  # what runs it, for the progress line (" on onnxruntime")

    def __init__(self, desc: str, dtype: str):
        self.desc, self.dtype = desc, dtype
        self.records: list[Record] = []
        self.error: str | None = None  # what its own forward raised
        self.failed: tuple[str, int] | None = None  # the innermost module call that raised, (path, number)
        self.cache_bytes = 0
        self.notes: list[str] = []  # what the run says about itself (inputs it could not take)
        self._twin_modules: dict[str, torch.nn.Module] | None = None

    @property
    def self_copy(self) -> bool:
        """The reference itself at a lower dtype: the candidate is its own twin."""
        return self.twin is not None and self.twin is self.model and not self.ac

    def run(self, args, kwargs) -> None:
        raise NotImplementedError

    def parting(self, reference: torch.nn.Module) -> str | None:
        """Where the candidate's structure parts from the reference's, for an alignment by execution order."""
        return None

    def align(self, ref_paths: list[str]) -> Alignment:
        cand_paths = {r.path for r in self.records if r.path}
        shared = cand_paths & set(ref_paths)
        mode = "name" if cand_paths and len(shared) >= 0.5 * len(cand_paths) else "order"
        return Alignment(self.records, mode)

    def matched(self, r: Record, y: torch.Tensor, path: str) -> str | None:
        """None when ``r`` can stand for the reference's output ``y``, else why not."""
        return None

    #: a module's own error isolates its own code: its judged children replayed with the reference's outputs
    #: (:class:`.execution.Replay`), so every module of the tree is judged, not only leaves
    replays_children = False

    def own(self, r: Record, args, kw, memo: Memo, kids: list[Kid] = (), state=None) -> tuple[torch.Tensor, str, Any]:
        """The site's output on the reference's inputs, the dtype it ran at, and the module that ran it. ``kids``:
        the children to replay (candidates that :attr:`replays_children`; ``self.replay`` then says what the
        module's code fed them); ``state``: the call's stateful arguments as they were before it."""
        raise NotImplementedError

    def covered_by(self, name: str, names: list[str]) -> list[str]:
        """The sites (among ``names``) that compute the unmatched site ``name`` inside themselves, each judged on its
        own, so that it is accounted for by them (a runtime's graph that fuses a module into its consumers); [] when
        none does."""
        return []

    def recorded_input(self, r: Record) -> torch.Tensor | None:
        """The input the candidate's own forward gave this call, where its record keeps it (None: not kept)."""
        return None

    @property
    def twin_modules(self) -> dict[str, torch.nn.Module]:
        if self._twin_modules is None:
            self._twin_modules = dict(self.twin.named_modules(remove_duplicate=False)) if self.twin is not None else {}
        return self._twin_modules

    def twin_output(self, path: str, r: Record, args, kw, memo: Memo, kids: list[Kid] = (), state=None
                    ) -> tuple[torch.Tensor | None, float | None]:
        """The twin's module on the reference's inputs (its judged children replayed as in the candidate's run),
        and the largest error of what its code handed them; (None, None) where it cannot run."""
        try:
            ready = restored(args, kw, state)
            if isinstance(ready, str):
                return None, None
            replay = Replay(list(kids), lambda kid: self.twin_modules.get(kid.path))
            with torch.no_grad(), self.ac(), replay.installed():
                yt = primary(self.twin_modules[path](*memo.cast(ready[0], self.torch_dtype),
                                                     **memo.cast(ready[1], self.torch_dtype, True)))
        except Exception:
            return None, None
        if not isinstance(yt, torch.Tensor):
            return None, None
        return yt, (replay.feeds[0] if replay.feeds is not None else None)

    def twin_error(self, path: str, r: Record, site_dtype: str, ref_dtype: str, own_error: float, args, kw,
                   y: torch.Tensor, memo: Memo, kids: list[Kid] = (), state=None) -> tuple[float | None, str | None]:
        """The reference's module at the candidate's dtype on the same inputs (its judged children replayed as in
        the candidate's run): the error precision alone makes."""
        if self.twin is None or path not in self.twin_modules or site_dtype == ref_dtype:
            return None, None
        if self.twin is self.model and r.module is self.twin_modules[path]:
            tw = own_error
        else:
            yt, fed = self.twin_output(path, r, args, kw, memo, kids, state)
            tw = metrics.errors(yt, y).get("normalized") if yt is not None else None
            if tw is not None and fed is not None:
                tw = max(tw, fed)
        if tw is not None and not math.isfinite(tw):
            return None, "the reference's module at the candidate's dtype is not finite here"
        return tw, None


def structure_parting(reference: torch.nn.Module, candidate: torch.nn.Module) -> str | None:
    """Where two models' structures part (None: the same parameter shapes, in the same order, up to names): models
    aligned by execution order must be the same architecture, or every comparison pairs unrelated modules."""
    ref = [(n, tuple(p.shape)) for n, p in reference.named_parameters()]
    cand = [(n, tuple(p.shape)) for n, p in candidate.named_parameters()]
    if sorted(s for _, s in ref) == sorted(s for _, s in cand):
        return None
    for i, ((rn, rs), (cn, cs)) in enumerate(zip(ref, cand, strict=False)):
        if rs != cs:
            return (f"parameter {i + 1}: the reference's {rn} {list(rs)} against the candidate's {cn} {list(cs)} "
                    f"({len(ref)} and {len(cand)} parameter tensors, {sum(math.prod(s) for _, s in ref):,} and "
                    f"{sum(math.prod(s) for _, s in cand):,} values)")
    longer, (n, shape) = ("reference", ref[len(cand)]) if len(ref) > len(cand) else ("candidate", cand[len(ref)])
    return (f"the {longer} has more parameter tensors ({len(ref)} against {len(cand)}), from {n} {list(shape)} "
            "on")


class TorchCandidate(Candidate):
    """A torch module, run with forward hooks; its sites are its module calls."""

    replays_children = True

    def __init__(self, model: torch.nn.Module, desc: str, dtype: str, ref_dtype: str):
        super().__init__(desc, dtype)
        self.model = model
        self.torch_dtype = getattr(torch, dtype) if dtype != ref_dtype and not self.ac else None
        self.replay: Replay | None = None  # the last own run's replay (what the module's code fed its children)
        self.wrote_input = False  # the last own run wrote its input in place (a parent cannot replay it then)
        self.own_output = None  # the last own run's whole output (its outputs beyond the primary are judged too)

    def run(self, args, kwargs) -> None:
        """One forward; the primary output of every module call, in completion order, and where it raised."""
        peak, live, seen = 0, 0, set()

        def post(module, path, number, a, kw, output):
            nonlocal peak, live
            t = primary(output)
            kept = t if isinstance(t, torch.Tensor) and t.is_floating_point() else None
            if kept is not None and kept.data_ptr() not in seen:
                seen.add(kept.data_ptr())
                live += kept.numel() * kept.element_size()
                peak = max(peak, live)
            x = input_of(a, kw, t if isinstance(t, torch.Tensor) else None)
            self.records.append(Record(path, number, module, kept, x.dtype if x is not None else None))

        self.forward(args, kwargs, lambda *a: None, post)
        self.cache_bytes = peak

    def forward(self, args, kwargs, pre, post) -> Hooks:
        """The candidate's forward on the inputs (cast to its dtype) with ``pre``/``post`` told of every module
        call (:class:`.execution.Hooks`); what it raised, and where, kept in ``error``/``failed``."""
        hooks = Hooks(self.model, pre, post)
        with hooks.active(), torch.no_grad(), self.ac():
            try:
                self.model(*cast(args, self.torch_dtype), **cast(kwargs, self.torch_dtype, True))
            except Exception as exc:
                where = site_name(*hooks.failed_at) if hooks.failed_at else "(model)"
                self.error = f"the candidate's forward raised in {where}: {type(exc).__name__}: {exc}"
                self.failed = hooks.failed_at
        return hooks

    def parting(self, reference: torch.nn.Module) -> str | None:
        return None if self.model is reference else structure_parting(reference, self.model)

    def teacher_forced(self, r: Record, args, kw, replay: Replay, context, laid_out: str = ""):
        """The candidate's module ``r`` run on ``args``/``kw`` (the reference's inputs) with its judged children
        replayed, under ``context``: its primary output and what ``context`` gave (``with context as given``)."""
        before = versions(args)
        try:
            with torch.no_grad(), context as given, replay.installed():
                self.own_output = r.module(*args, **kw)
                yc = primary(self.own_output)
        except Exception as exc:
            # its own forward ran this module fine: on the reference's input it is another operation (or aligned
            # wrongly), so nothing is compared here, and that is not a divergence
            raise NotMeasured(f"own error not measured: the candidate's {type(r.module).__name__} raised on the "
                              f"reference's input{laid_out} ({type(exc).__name__}: {exc}); its own forward ran "
                              "it") from None
        if not isinstance(yc, torch.Tensor):
            raise NotMeasured("the candidate's module returned no tensor on the reference's input")
        self.replay = replay
        self.wrote_input = versions(args) != before
        return yc, given

    def own(self, r: Record, args, kw, memo: Memo, kids: list[Kid] = (), state=None) -> tuple[torch.Tensor, str, Any]:
        self.replay, self.own_output = None, None
        ready = restored(args, kw, state)
        if isinstance(ready, str):
            raise NotMeasured(f"own error not measured: {ready}")
        args, kw = ready
        dtype = self.torch_dtype
        x = input_of(args, kw)
        if dtype is None and x is not None and r.input_dtype is not None and r.input_dtype != x.dtype:
            dtype = r.input_dtype  # a module the candidate runs at another dtype (one layer cast to bfloat16)
        args, kw = memo.cast(args, dtype), memo.cast(kw, dtype, True)
        yc, seen = self.teacher_forced(r, args, kw, Replay(list(kids)), self.ac.observe())
        # the dtype the candidate's module ran at: under autocast, the least precise one its ops produced
        site_dtype = (seen[0] or dtype_name(str(yc.dtype).replace("torch.", ""))) if seen else self.dtype
        return yc, site_dtype, r.module


class ModuleCandidate(TorchCandidate):
    """Another torch module with the reference's architecture, run as it is."""

    def __init__(self, candidate: torch.nn.Module, reference: torch.nn.Module, ref_dtype: str,
                 stack: contextlib.ExitStack):
        stack.enter_context(untouched(candidate))
        dtype = model_dtype(candidate)
        # parameters at another dtype than the first's (a layer cast to bfloat16): named, not hidden behind one dtype
        others = sorted({dtype_name(str(t.dtype).replace("torch.", "")) for t in candidate.parameters()
                         if t.is_floating_point()} - {dtype})
        desc = type(candidate).__name__ + (f", partly {', '.join(others)}" if others else "")
        unread = quantized.undecodable(candidate)
        if unread:
            raise InputError(f"the candidate's weights are quantized in a form diff does not dequantize "
                             f"({', '.join(unread[:2])}{' …' if len(unread) > 2 else ''}): held to float rounding "
                             "every site would fail for its quantization alone; diff reads torchao's weight-only "
                             "tensors and MLX's quantized layers (docs/diff.md, Quantized candidates)")
        layers = quantized.torch_quantized(candidate)
        if layers:
            desc += "; quantized: " + ", ".join(sorted({quantized.torch_kind(w) for w in layers.values()}))
        super().__init__(candidate.eval(), desc, dtype, ref_dtype)
        if layers:  # torchao's weight-only quantization: judged against the reference with the dequantized weights
            self.quantized = {path: quantized.torch_kind(w) for path, w in layers.items()}
            self.twin, self.weight_faults = quantized.torch_twin(reference, layers, getattr(torch, dtype))
            self.notes.extend(quantized.notes(self.quantized))
        elif dtype != ref_dtype:
            self.twin = private_copy(reference, dtype=getattr(torch, dtype))



class CopyCandidate(TorchCandidate):
    """A private copy cast to ``dtype``: of ``candidate``, or of the reference itself (then it is its own twin)."""

    def __init__(self, candidate: torch.nn.Module | None, reference: torch.nn.Module, dtype: str, ref_dtype: str,
                 stack: contextlib.ExitStack):
        source = reference if candidate is None else candidate
        if candidate is not None:
            stack.enter_context(untouched(candidate))
        model = private_copy(source, dtype=getattr(torch, dtype))
        super().__init__(model, f"{type(source).__name__} at {dtype} (a private copy)", dtype, ref_dtype)
        cast = getattr(model, "_normscope_cast_state", [])
        if cast:
            more = f" and {len(cast) - 3} more" if len(cast) > 3 else ""
            self.notes.append(f"the model keeps {len(cast)} floating tensor(s) outside its parameters and buffers "
                              f"({', '.join(cast[:3])}{more}); its private copy holds them at {dtype} too")
        if dtype != ref_dtype:
            self.twin = model if candidate is None else private_copy(reference, dtype=getattr(torch, dtype))



class AutocastCandidate(TorchCandidate):
    """A torch module (the reference itself when ``candidate`` is None) as it is under ``torch.autocast``; each
    site is judged at the dtype its ops were observed to run at, against the reference's module under the same
    autocast (the twin)."""

    def __init__(self, candidate: torch.nn.Module | None, reference: torch.nn.Module, dtype: str, ref_dtype: str,
                 stack: contextlib.ExitStack):
        if candidate is not None:
            stack.enter_context(untouched(candidate))
        model = reference if candidate is None else candidate.eval()
        self.ac = Autocast(dtype, device_type(model))
        super().__init__(model, f"{type(model).__name__} under autocast({self.ac.device_type}, {dtype})", dtype,
                         ref_dtype)
        self.twin = reference


class GraphCandidate(Candidate):
    """A model as a runtime runs its graph: every intermediate value, mapped to the torch sites by the node-name
    scopes the exporter left (:func:`.runtimes.onnx.records`). Subclasses run it (:meth:`run` fills ``values``,
    ``scopes`` and ``final``) and say how a site runs alone (:meth:`own`)."""

    graph = True
    torch_modules = False
    scopes_label = "onnx scopes"  # how the alignment is named in the result

    def __init__(self, desc: str, dtype: str):
        super().__init__(desc, dtype)
        self.values: dict[str, Any] = {}
        self.scopes: dict[str, list[str]] = {}
        self.final: Any = None  # the value of the graph's first declared output

    def align(self, ref_paths: list[str]) -> Alignment:
        from .runtimes.onnx import records as scope_records

        records = scope_records(self.values, self.scopes, ref_paths, Record)
        if self.final is not None and np.asarray(self.final).dtype.kind == "f":  # the model's output
            records.append(Record("", 0, None, torch.from_numpy(np.asarray(self.final).copy())))
        self.cache_bytes = kept_bytes(records)
        self.values, self.final = {}, None
        self.records = records
        return Alignment(records, self.scopes_label, graph=True)

    def matched(self, r: Record, y: torch.Tensor, path: str) -> str | None:
        from .runtimes.onnx import choose

        choose(r, y)
        if not path and r.output is not None and list(r.output.shape) != list(y.shape):
            return (f"the graph's first output {list(r.output.shape)} is not the model's primary output "
                    f"{list(y.shape)}")
        return None


def candidate_for(reference: torch.nn.Module, candidate, candidate_dtype: str | None, autocast: str | None,
                  ref_dtype: str, stack: contextlib.ExitStack) -> Candidate:
    """The strategy for what the user gave (arguments already validated): a runtime's
    (:mod:`.runtimes`), else a torch strategy."""
    from .runtimes import runtime_of

    runtime = runtime_of(candidate)
    if runtime is not None:
        return runtime.candidate(candidate, reference, ref_dtype, stack)
    if isinstance(candidate, torch.nn.Module) and (autocast or candidate_dtype) and quantized.torch_quantized(candidate):
        raise InputError("the candidate's weights are quantized (torchao): it is judged as it runs, against its own "
                         "dequantized weights; a copy cast to another dtype or run under autocast would be another "
                         "model: leave --candidate-dtype and --autocast out")
    from .sharded import ShardedCandidate, is_sharded

    if isinstance(candidate, torch.nn.Module) and is_sharded(candidate):
        if autocast or candidate_dtype:
            raise InputError("a sharded candidate runs as its ranks hold it: a private copy at another dtype or "
                             "autocast would be another model; leave candidate_dtype and autocast out")
        return ShardedCandidate(candidate, reference, ref_dtype, stack)
    if autocast is not None:
        return AutocastCandidate(candidate, reference, autocast, ref_dtype, stack)
    if candidate_dtype is not None:
        return CopyCandidate(candidate, reference, candidate_dtype, ref_dtype, stack)
    return ModuleCandidate(candidate, reference, ref_dtype, stack)
