"""What ``diff`` compares the reference with, one strategy per kind of candidate:

- :class:`ModuleCandidate` — another torch module, run as it is (at its own dtype);
- :class:`CopyCandidate` — a private copy (of the candidate, or of the reference itself) cast to a dtype;
- :class:`AutocastCandidate` — a torch module (the reference itself when none is given) under ``torch.autocast``;
- :class:`OnnxCandidate` — an ONNX model on onnxruntime, its intermediate values mapped by the exporter's scopes;
- :class:`OpenVinoCandidate` — a model as OpenVINO runs it, mapped the same way;
- :class:`MlxCandidate` — an MLX module tree (an mlx-lm port), its module calls recorded and aligned by name;
- :class:`LlamaCppCandidate` — a GGUF as llama.cpp runs it, its named graph tensors mapped to the sites.

Each runs its own forward once (:meth:`Candidate.run`: the primary output of every call, where it raised), aligns
those records with the reference's module paths (:meth:`Candidate.align`) and, during the reference's forward,
runs one site on the reference's own inputs (:meth:`Candidate.own`: teacher forcing) and says what the
reference's module makes of the same inputs at the candidate's dtype (:meth:`Candidate.twin_error`: the *twin*).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..dtypes import dtype_name
from ..errors import InputError
from ..model import private_copy, untouched
from . import llamacpp_sites, metrics, mlx_sites, onnxsites, openvino_sites
from .execution import (
    Autocast,
    Hooks,
    Kid,
    Memo,
    Record,
    Replay,
    cast,
    device_type,
    input_at,
    input_of,
    model_dtype,
    primary,
    restored,
    site_name,
    stateless,
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

    def recorded_input(self, r: Record) -> torch.Tensor | None:
        """The input the candidate's own forward gave this call, where its record keeps it (None: not kept)."""
        return None

    @property
    def twin_modules(self) -> dict[str, torch.nn.Module]:
        if self._twin_modules is None:
            self._twin_modules = dict(self.twin.named_modules(remove_duplicate=False)) if self.twin is not None else {}
        return self._twin_modules

    def twin_error(self, path: str, r: Record, site_dtype: str, ref_dtype: str, own_error: float, args, kw,
                   y: torch.Tensor, memo: Memo, kids: list[Kid] = (), state=None) -> tuple[float | None, str | None]:
        """The reference's module at the candidate's dtype on the same inputs (its judged children replayed as in
        the candidate's run): the error precision alone makes."""
        if self.twin is None or path not in self.twin_modules or site_dtype == ref_dtype:
            return None, None
        if self.twin is self.model and r.module is self.twin_modules[path]:
            tw = own_error
        else:
            try:
                ready = restored(args, kw, state)
                if isinstance(ready, str):
                    return None, None
                replay = Replay(list(kids), lambda kid: self.twin_modules.get(kid.path))
                with torch.no_grad(), self.ac(), replay.installed():
                    yt = primary(self.twin_modules[path](*memo.cast(ready[0], self.torch_dtype),
                                                         **memo.cast(ready[1], self.torch_dtype, True)))
                tw = metrics.errors(yt, y).get("normalized") if isinstance(yt, torch.Tensor) else None
                if tw is not None and replay.feeds is not None:
                    tw = max(tw, replay.feeds[0])
            except Exception:
                tw = None
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

        hooks = Hooks(self.model, lambda *a: None, post)
        with hooks.active(), torch.no_grad(), self.ac():
            try:
                self.model(*cast(args, self.torch_dtype), **cast(kwargs, self.torch_dtype, True))
            except Exception as exc:
                where = site_name(*hooks.failed_at) if hooks.failed_at else "(model)"
                self.error = f"the candidate's forward raised in {where}: {type(exc).__name__}: {exc}"
                self.failed = hooks.failed_at
        self.cache_bytes = peak

    def parting(self, reference: torch.nn.Module) -> str | None:
        return None if self.model is reference else structure_parting(reference, self.model)

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
        replay = Replay(list(kids))
        args, kw = memo.cast(args, dtype), memo.cast(kw, dtype, True)
        before = versions(args)
        try:
            with torch.no_grad(), self.ac.observe() as seen, replay.installed():
                self.own_output = r.module(*args, **kw)
                yc = primary(self.own_output)
        except Exception as exc:
            # its own forward ran this module fine: on the reference's input it is another operation (or aligned
            # wrongly), so nothing is compared here, and that is not a divergence
            raise NotMeasured(f"own error not measured: the candidate's {type(r.module).__name__} raised on the "
                              f"reference's input ({type(exc).__name__}: {exc}); its own forward ran it") from None
        if not isinstance(yc, torch.Tensor):
            raise NotMeasured("the candidate's module returned no tensor on the reference's input")
        self.replay = replay
        self.wrote_input = versions(args) != before
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
        super().__init__(candidate.eval(), desc, dtype, ref_dtype)
        if dtype != ref_dtype:
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
    scopes the exporter left (:func:`.onnxsites.records`). Subclasses run it (:meth:`run` fills ``values``,
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
        records = onnxsites.records(self.values, self.scopes, ref_paths, Record)
        if self.final is not None and np.asarray(self.final).dtype.kind == "f":  # the model's output
            records.append(Record("", 0, None, torch.from_numpy(np.asarray(self.final).copy())))
        self.cache_bytes = kept_bytes(records)
        self.values, self.final = {}, None
        self.records = records
        return Alignment(records, self.scopes_label, graph=True)

    def matched(self, r: Record, y: torch.Tensor, path: str) -> str | None:
        onnxsites.choose(r, y)
        if not path and r.output is not None and list(r.output.shape) != list(y.shape):
            return (f"the graph's first output {list(r.output.shape)} is not the model's primary output "
                    f"{list(y.shape)}")
        return None


class OnnxCandidate(GraphCandidate):
    """An ONNX model on onnxruntime; a site's own output is its nodes extracted as a subgraph of their own."""

    bound_suffix = " (ONNX: the site's subgraph on the reference's input)"
    runner = " on onnxruntime"

    def __init__(self, proto):
        super().__init__("", "float32")
        self.proto = proto
        self.subgraphs = None

    def run(self, args, kwargs) -> None:
        self.values, self.scopes, self.desc, self.subgraphs = onnxsites.run_candidate(self.proto, args, kwargs)
        declared = self.subgraphs.proto.graph.output
        self.final = self.values.get(declared[0].name) if len(declared) else None

    def own(self, r: Record, args, kw, memo: Memo, kids=(), state=None) -> tuple[torch.Tensor, str, Any]:
        try:
            with torch.no_grad():
                yc = torch.from_numpy(self.subgraphs.run(*r.module, args, kw))
        except onnxsites.NotExtractable as exc:
            raise NotMeasured(None, missing=str(exc)) from None
        return yc, self.dtype, onnxsites.Site(self.subgraphs, *r.module)


class OpenVinoCandidate(GraphCandidate):
    """A model as OpenVINO runs it on the CPU, at the runtime's own inference precision (:mod:`.openvino_sites`):
    the reference converted here (``"openvino"``; a site's own output is its module converted alone), or a model
    converted elsewhere (sites judged on their propagated error)."""

    runner = " on OpenVINO"
    scopes_label = "openvino scopes"
    bound_suffix = " (OpenVINO: the site's module converted alone, on the reference's input)"

    def __init__(self, model, reference: torch.nn.Module):
        super().__init__("", "float32")
        self.converted_here = isinstance(model, str) and model == "openvino"
        self.model_obj = reference if self.converted_here else model
        self.modules = openvino_sites.Modules(reference) if self.converted_here else None

    def run(self, args, kwargs) -> None:
        self.values, self.scopes, self.desc, self.dtype, self.final = openvino_sites.run_candidate(
            self.model_obj, args, kwargs)

    def own(self, r: Record, args, kw, memo: Memo, kids=(), state=None) -> tuple[torch.Tensor, str, Any]:
        if self.modules is None:
            raise NotMeasured(None, missing=openvino_sites.OWN_MISSING)
        try:
            return self.modules.run(r.path, args, kw), self.dtype, None
        except openvino_sites.NotConvertible as exc:
            raise NotMeasured(None, missing=f"OpenVINO: this module alone could not be converted ({exc})") from None


class MlxCandidate(Candidate):
    """A model as MLX runs it on the CPU (:mod:`.mlx_sites`): an ``mlx.nn.Module`` with the reference's module
    names (an mlx-lm port), or ``"mlx"``, the reference ported here by mlx-lm. Each site's own output is its MLX
    module called on the reference's input; at a dtype below the reference's, the twin is the reference's module
    at that dtype."""

    runner = " on MLX"
    torch_modules = False
    bound_suffix = " (MLX: the site's module on the reference's input)"

    def __init__(self, model, reference: torch.nn.Module, ref_dtype: str):
        from ..extras import require

        mx = require("mlx.core", "mlx")
        ported = isinstance(model, str)
        self.mlx_model = mlx_sites.port(reference) if ported else model
        mlx_sites.refuse_quantized(self.mlx_model)
        dtype = mlx_sites.model_dtype(self.mlx_model)
        what = "the reference ported by mlx-lm" if ported else type(model).__name__
        super().__init__(f"MLX {mx.__version__} CPU ({what})", dtype)
        if dtype != ref_dtype:
            self.torch_dtype = getattr(torch, dtype)
            self.twin = private_copy(reference, dtype=self.torch_dtype)


    def run(self, args, kwargs) -> None:
        def record(path, number, call, out):
            self.records.append(Record(path, number, call, mlx_sites.floating(mlx_sites.output(out))))

        self.error, self.failed, self.notes = mlx_sites.run_candidate(self.mlx_model, args, kwargs, record)
        self.cache_bytes = kept_bytes(self.records)

    def recorded_input(self, r: Record) -> torch.Tensor | None:
        return mlx_sites.floating(mlx_sites.first_array(r.module.args))

    def own(self, r: Record, args, kw, memo: Memo, kids=(), state=None) -> tuple[torch.Tensor, str, Any]:
        x = input_of(args, kw, None)
        if x is None:  # an embedding's token ids
            x = next((a for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)), None)
        if x is None:
            raise NotMeasured("own error not measured: the reference's call has no tensor input")
        try:
            yc = mlx_sites.teacher_forced(r.module, x)
        except ValueError as exc:
            raise NotMeasured(f"own error not measured: {exc}") from None
        except Exception as exc:
            raise NotMeasured(f"own error not measured: the candidate's {type(r.module.module).__name__} raised on "
                              f"the reference's input ({type(exc).__name__}: {exc}); its own forward ran it") from None
        y = mlx_sites.floating(yc)
        if y is None:
            raise NotMeasured("the candidate's module returned no floating array on the reference's input")
        return y, mlx_sites.dtype_of(yc), r.module.module


class LlamaCppCandidate(Candidate):
    """A GGUF as llama.cpp runs it on the CPU (:mod:`.llamacpp_sites`): ``"llama.cpp"`` (the reference written as a
    GGUF here) or a ``.gguf`` path. Its named graph tensors are the sites; where a site's input is named too (a
    norm reads the residual stream), its own error is the candidate's output against the reference's module on the
    candidate's own input; elsewhere the site is judged on its propagated error."""

    graph = True
    torch_modules = False
    runner = " on llama.cpp"
    scopes_label = "llama.cpp tensor names"
    bound_suffix = " (llama.cpp: its output against the reference's module on the candidate's own input)"

    def __init__(self, source, reference: torch.nn.Module, stack: contextlib.ExitStack):
        from ..extras import require

        require("llama_cpp", "llamacpp")
        ref_dtype = model_dtype(reference)
        if ref_dtype not in ("float32", "float64"):
            raise InputError(f"the reference is {ref_dtype}; llama.cpp computes in float32 (from the file's weights at "
                             "their own types), so a less precise reference would be the suspect, not the judge: "
                             "give a float32 reference (model.float())")
        super().__init__("", "float32")
        self.reference = reference
        self.modules = dict(reference.named_modules())
        if isinstance(source, str) and source == "llama.cpp":
            import tempfile

            from ..artifacts.gguf_write import write_gguf

            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="normscope-gguf-"))
            self.path = write_gguf(reference, Path(folder) / "reference.gguf")
            self.written_here = True
        else:
            self.path = Path(source)
            if not self.path.is_file():
                raise InputError(f"{source}: no such GGUF file")
            self.written_here = False
        self.values: dict = {}
        self.info = None

    def run(self, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            ids = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                        and not a.is_floating_point() and not a.is_complex()), None)
        if ids is None or ids.dim() not in (1, 2) or ids.is_floating_point():
            raise InputError("a llama.cpp candidate runs on token ids: give input_ids (batch × tokens) as the inputs")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and not bool((mask == 1).all()):
            self.notes.append("the attention mask has padding; llama.cpp decoded every token of each sample")
        self.values, self.info, self.desc = llamacpp_sites.run_candidate(self.path,
                                                                         ids.reshape(-1, ids.shape[-1]).cpu())
        self.dtype = self.info.matrix_dtype
        if self.written_here:
            self.desc += "; the GGUF written here from the reference (normscope.artifacts.write_gguf)"

    def align(self, ref_paths: list[str]) -> Alignment:
        stated = llamacpp_sites.stated_contracts(self.path, self.info)
        self.records = llamacpp_sites.records(self.values, self.info, ref_paths, Record, stated)
        self.cache_bytes = kept_bytes(self.records)
        self.values = {}
        return Alignment(self.records, self.scopes_label, graph=True)

    def own(self, r: Record, args, kw, memo: Memo, kids=(), state=None) -> tuple[torch.Tensor, str, Any]:
        site = r.module
        module = self.modules.get(r.path)
        if site.input is None or module is None:
            raise NotMeasured(None, missing="llama.cpp: this site's input is not a named tensor of its graph")
        if isinstance(site.input, str):  # the token ids: the reference's own input, so its own output is the site's
            return site.output, site.dtype, site.stated
        if not (stateless(args) and stateless(kw)):  # running the module again would write to its cache
            raise NotMeasured(None, missing="llama.cpp: the reference's call takes a stateful argument (a cache "
                                            "object), so its module is not run again on the candidate's input")
        at = input_at(args, kw, None)
        if at is None:
            raise NotMeasured(None, missing="llama.cpp: the reference's call has no tensor input")
        x_ref = (args if at[0] == "arg" else kw)[at[1]]
        if tuple(site.input.shape) != tuple(x_ref.shape):
            raise NotMeasured(None, missing=f"llama.cpp: its input {list(site.input.shape)} is not the reference's "
                                            f"{list(x_ref.shape)}")
        x_cand = site.input.to(x_ref.device, x_ref.dtype)
        swapped = list(args), dict(kw)
        swapped[0 if at[0] == "arg" else 1][at[1]] = x_cand
        with torch.no_grad():
            y_ref = primary(module(*args, **kw))
            y_on_cand = primary(module(*swapped[0], **swapped[1]))
        # the candidate's own error at this site, carried onto the reference's output to be judged like any other
        yc = y_ref.double() + (site.output.to(y_ref.device).double() - y_on_cand.double())
        return yc.to(y_ref.dtype), site.dtype, site.stated


def candidate_for(reference: torch.nn.Module, candidate, candidate_dtype: str | None, autocast: str | None,
                  ref_dtype: str, stack: contextlib.ExitStack) -> Candidate:
    """The strategy for what the user gave (arguments already validated)."""
    if candidate is not None and onnxsites.is_onnx(candidate):
        return OnnxCandidate(candidate)
    if candidate is not None and openvino_sites.is_openvino(candidate):
        return OpenVinoCandidate(candidate, reference)
    if candidate is not None and mlx_sites.is_mlx(candidate):
        return MlxCandidate(candidate, reference, ref_dtype)
    if candidate is not None and llamacpp_sites.is_gguf(candidate):
        return LlamaCppCandidate(candidate, reference, stack)
    if autocast is not None:
        return AutocastCandidate(candidate, reference, autocast, ref_dtype, stack)
    if candidate_dtype is not None:
        return CopyCandidate(candidate, reference, candidate_dtype, ref_dtype, stack)
    return ModuleCandidate(candidate, reference, ref_dtype, stack)
