"""``scan(model, inputs)``: every norm site of a live model, with its contract, role and placement.

One forward is recorded (:mod:`.trace`); sites are found by class, by behaviour and as functional calls;
roles and placements come from the dataflow (:mod:`.dataflow`); each site's contract is inferred on a
private copy at its real input shape and checked against the activation recorded there. The model is left
as it was: parameters, buffers, modes and ``requires_grad`` flags are restored (and hooks are never
registered on it — the recorder uses process-wide hooks), also when the scan fails.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import reference
from ..errors import InputError, NormscopeError, NotANormalization, TargetError
from ..model import Progress, arguments, describe, offloaded, on_meta, private_copy, redrawn, stored_params, untouched
from ..model import progress as progress_of
from ..precision import dtype_name
from ..probe.infer import VALIDATION_TOL, infer
from ..targets import as_target
from ..targets.base import check_dtype_list
from .classes import known_class
from .config_eps import config_eps, eps_findings, eps_followers, site_keys
from .dataflow import Dataflow, Role, block_modules
from .inline import InlineNorm, find_inline
from .result import ModelScan, Site
from .trace import NORM_FUNCTIONS, ModuleCall, Op, Trace, record

# f(16x) vs f(64x): a normalization does not see the scale (ε is negligible at those scales)
_SCALE_TOL = {"float64": 1e-6, "float32": 1e-3}
# float64 is opt-in: torch's float64 LayerNorm on CPU is ~200× slower than float32, and some implementations
# change their ε there (torch RMSNorm(eps=None)).
DEFAULT_DTYPES = ("float32", "bfloat16", "float16")
META_NOTE = ("the model is on the meta device (shapes without values): each contract is inferred on a copy with "
             "drawn parameters, no activation is checked, no γ statistics, and only sites of a normalization class "
             "or call are found (finding one by behaviour needs values)")



class FunctionalNorm(torch.nn.Module):
    """A functional normalization call as a module: the recorded arguments, tensors held as its own parameters
    (γ/β) and buffers (running statistics), so ``infer`` can probe it like any module."""

    def __init__(self, name: str, args: dict[str, Any]):
        super().__init__()
        self.fn_name = name
        self.fn = next(f for f, (n, _) in NORM_FUNCTIONS.items() if n == name)
        self.static: dict[str, Any] = {}
        self.tensors: list[str] = []
        for k, v in args.items():
            if k in ("input", "cudnn_enable", "cudnn_enabled"):
                continue
            if isinstance(v, torch.Tensor):
                if k.startswith("running_"):
                    self.register_buffer(k, v.detach().clone())
                else:
                    self.register_parameter(k, torch.nn.Parameter(v.detach().clone(), requires_grad=False))
                self.tensors.append(k)
            else:
                self.static[k] = v
        self.batch = name in ("batch_norm", "instance_norm")

    def forward(self, x):
        kw = dict(self.static)
        for k in self.tensors:
            kw[k] = getattr(self, k)
        if self.fn_name == "batch_norm":
            kw["training"] = self.training
        if self.fn_name == "instance_norm" and kw.get("running_mean") is not None:
            kw["use_input_stats"] = self.training
        return self.fn(x, **kw)


# ---------------------------------------------------------------------------------------------- discovery
def _site_name(path: str) -> str:
    return path or "(model)"


class _Candidate:
    def __init__(self, kind: str, name: str, cls: str, x: torch.Tensor, y: torch.Tensor, xv: int, yv: int,
                 call: int | None, order: int, make: Callable[[], torch.nn.Module]):
        self.kind, self.name, self.cls = kind, name, cls
        self.x, self.y, self.xv, self.yv = x, y, xv, yv
        self.call, self.order, self.make = call, order, make


def _discover(trace: Trace, progress: Progress, behaviour: bool = True
              ) -> tuple[list[_Candidate], list[dict[str, Any]], dict[str, int]]:
    calls = trace.calls
    norm_shaped = [c for c in calls if c.x is not None and c.y is not None and c.output is not None
                   and c.output != c.input and c.x.is_floating_point()]
    class_calls = [c for c in norm_shaped if known_class(c.module)]
    class_ids = {c.index for c in class_calls}
    norm_ops = [op for op in trace.ops if op.norm is not None and "y" in op.norm]
    op_anc = {op.index: trace.ancestors(op.call) for op in norm_ops}
    class_anc = {c.index: trace.ancestors(c.parent) for c in class_calls}

    def label(c: ModuleCall) -> str:
        return _site_name(c.path) + (f"#{c.number}" if c.number else "")

    out: list[_Candidate] = []
    rejected: list[dict[str, Any]] = []
    for c in class_calls:
        out.append(_Candidate("module", label(c), type(c.module).__name__, c.x, c.y, c.input, c.output, c.index,
                              c.first_op, _maker(c)))
    counters: dict[tuple[str, str], int] = {}
    for op in norm_ops:
        if op_anc[op.index] & class_ids:
            continue  # the implementation of a module site
        path = calls[op.call].path if op.call is not None else ""
        fname = op.norm["function"]
        k = counters.get((path, fname), 0)
        counters[(path, fname)] = k + 1
        x = op.norm["args"].get("input")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not op.outputs or not op.inputs:
            continue
        out.append(_Candidate("functional", f"{_site_name(path)}:{fname}#{k}", fname, x, op.norm["y"], op.inputs[0],
                              op.outputs[0], op.call, op.index, _functional_maker(op)))
    # behaviour: any other norm-shaped call with no norm inside, innermost first
    containers = set()
    for c in class_calls:
        containers |= class_anc[c.index]
    for op in norm_ops:
        containers |= op_anc[op.index]
    tested = 0
    accepted: set[int] = set()
    untested = [c for c in norm_shaped if c.index not in class_ids and c.index not in containers]
    for c in sorted(untested if behaviour else [], key=lambda c: -c.depth):
        if trace.ancestors(c.index) & accepted or any(c.index in trace.ancestors(a) for a in accepted):
            continue
        tested += 1
        verdict, measured = _scale_invariant(c)
        if not verdict:
            continue
        progress(f"behaviour: {label(c)} looks scale-invariant (f(16x) vs f(64x): {measured:.2g})")
        out.append(_Candidate("behaviour", label(c), type(c.module).__name__, c.x, c.y, c.input, c.output, c.index,
                              c.first_op, _maker(c)))
        accepted.add(c.index)
    for site in find_inline(trace, class_ids | accepted):
        x, y = trace.tensor(site.x), trace.tensor(site.y)
        path = calls[site.call].path if site.call is not None else ""
        k = counters.get((path, "inline"), 0)
        counters[(path, "inline")] = k + 1
        name = f"{_site_name(path)}:inline#{k}"
        kind = "LayerNorm" if site.centred else "RMSNorm"
        try:
            if x is None or y is None:
                raise ValueError("its input or output was written in place later in the forward")
            module = InlineNorm(trace, site)
        except ValueError as exc:
            rejected.append({"name": name, "class": f"inline {kind}", "kind": "inline", "reason": str(exc)})
            continue
        out.append(_Candidate("inline", name, f"inline {kind}", x.detach().clone(), y.detach().clone(), site.x,
                              site.y, site.call, site.first_op, _inline_maker(module)))
    out.sort(key=lambda s: s.order)
    return out, rejected, {"behaviour_candidates_tested": tested,
                           "behaviour_candidates_untested": 0 if behaviour else len(untested)}


def _silent_cast_note(dtypes: tuple[str, ...]) -> str:
    return (f"not decided: the forward casts to {', '.join(dtypes)} a value already in {', '.join(dtypes)}, a cast "
            "that leaves no trace at this dtype, so the precision of the statistics and the order of γ and the cast "
            "back were not seen; scan with an input of another dtype (a bfloat16 tensor saved with torch.save, "
            "given as --inputs x.pt) to decide them")


def _maker(c: ModuleCall) -> Callable[[], torch.nn.Module]:
    return lambda: private_copy(c.module, training=False)


def _inline_maker(module: InlineNorm) -> Callable[[], torch.nn.Module]:
    return lambda: private_copy(module)


def _functional_maker(op: Op) -> Callable[[], torch.nn.Module]:
    def make():
        m = FunctionalNorm(op.norm["function"], op.norm["args"])
        training = bool(op.norm["args"].get("training", False) or (
            op.norm["function"] == "instance_norm" and op.norm["args"].get("running_mean") is None))
        return m.train(training)
    return make


def _scale_invariant(c: ModuleCall) -> tuple[bool, float]:
    """The cheap test on the real activation: f(16x) ≈ f(64x) on a private copy."""
    try:
        m = private_copy(c.module)
        x = c.x.cpu()
        with torch.no_grad():
            a, b = m(x * 16), m(x * 64)
    except Exception:
        return False, math.inf
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == x.shape == b.shape):
        return False, math.inf
    a, b = a.double(), b.double()
    scale = float(a.square().mean().sqrt())
    if not math.isfinite(scale) or scale == 0:
        return False, math.inf
    d = float((a - b).abs().max()) / scale
    tol = _SCALE_TOL.get(dtype_name(str(c.x.dtype).replace("torch.", "")), 5e-2)
    return d <= tol, d


# ---------------------------------------------------------------------------------------------- contracts
def _activation_check(spec, params, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """The contract against the real activation recorded at the site."""
    d = dtype_name(str(x.dtype).replace("torch.", ""))
    x64 = x.detach().double().cpu().numpy()
    y64 = y.detach().double().cpu().numpy()
    emulate = d if d in ("bfloat16", "float16") else None
    yr = reference.forward(x64, spec, gamma=params.get("gamma"), beta=params.get("beta"),
                           running_mean=params.get("running_mean"), running_var=params.get("running_var"),
                           dtype=emulate)
    with np.errstate(all="ignore"):
        scale = max(1.0, float(np.sqrt(np.mean(yr ** 2))))
        diff = np.abs(y64 - yr)
        err = float(diff.max() / scale) if np.all(np.isfinite(diff)) else math.inf
    tol = VALIDATION_TOL.get(d, 1e-2)
    return {"max_relative_error": err, "tolerance": tol, "dtype": d, "ok": bool(err <= tol),
            "experiment": "reference.forward(recorded input, inferred contract, recovered γ/β) vs the recorded output"}


def _gamma_stats(spec, params) -> dict[str, float] | None:
    g = params.get("gamma")
    if g is None or not spec.gamma:
        return None
    g = np.asarray(g, dtype=np.float64)
    return {"mean": float(g.mean()), "min": float(g.min()), "max": float(g.max()), "offset": float(spec.gamma_offset)}


Inference = tuple[Any, str | None, str]  # (infer's result, a note on re-drawn parameters, the site it ran at)


def _infer_site(cand: _Candidate, dtypes, progress: Progress, call_timeout: float | None = None,
                shared: Inference | None = None, module: torch.nn.Module | None = None
                ) -> tuple[Site | None, dict[str, Any] | None, Inference | None]:
    """The site's contract, inferred on its module (or taken from ``shared``: an inference at a site of the same
    kind) and held to the site's own real activation with its own parameters. ``module``: the site's private copy
    when the caller made it already (``cand.make()`` otherwise)."""
    started = time.perf_counter()
    shape = tuple(cand.x.shape)
    base = dict(name=cand.name, kind=cand.kind, cls=cand.cls, role="other", role_evidence="", layer=None,
                shape=shape, dtype=str(cand.x.dtype).replace("torch.", ""), order=cand.order)

    def run(m):
        target = m
        if call_timeout is not None:
            target = as_target(m)
            target.timeout = call_timeout or None  # 0: no limit
        return infer(target, shape=shape, dtypes=dtypes, seed=0,
                     progress=lambda msg: progress(f"{cand.name}: {msg}"))

    note = None
    try:
        module = module if module is not None else cand.make()
        result = None
        if shared is not None:
            result, note, _ = shared
        try:
            if result is None:
                result = run(module)
        except NotANormalization as first:
            # Trained weights can hide the structure (γ ≈ 0 on some channels moves no output there): the
            # contract does not depend on γ/β's values, so probe a copy with re-drawn vector parameters and
            # hold the contract to the real ones on the real activation below.
            other = redrawn(module)
            if other is None:
                raise
            try:
                result = run(other)
            except NotANormalization as second:
                raise NotANormalization(f"{first} (and with re-drawn parameters: {second})") from None
            note = (f"probed on a copy with re-drawn γ/β because the module's own parameters made the probe "
                    f"fail ({first})")
    except NotANormalization as exc:
        return None, {"name": cand.name, "class": cand.cls, "kind": cand.kind, "reason": str(exc)}, None
    except NormscopeError as exc:
        return Site(**base, error=str(exc), seconds=time.perf_counter() - started), None, None
    inference = shared or (result, note, cand.name)
    evidence = {k: v.to_dict() for k, v in result.evidence.items()}
    silent = getattr(module, "silent_casts", ())
    if silent:  # the replay lacks the site's casts: what they do at another dtype was not seen
        for field in ("stats_dtype", "affine_order"):
            if field in evidence:
                evidence[field] = {**evidence[field], "confidence": "not probed", "note": _silent_cast_note(silent),
                                   "measured": {**evidence[field].get("measured", {}), "silent_casts": list(silent)}}
    calls = 0 if shared else result.calls
    if shared:
        evidence["shared_inference"] = {
            "experiment": "one inference per kind of module", "measured": {"inferred_at": shared[2]},
            "confidence": "decisive",
            "note": f"the contract was inferred at {shared[2]}, a module of the same class, attributes and parameter "
                    "shapes on an input of the same shape and dtype; this site's own activation is checked below"}
    if cand.x.is_meta:  # shapes without values: nothing recorded to check, and γ/β were drawn
        return Site(**base, spec=result.spec, activation={"not_measured": META_NOTE}, evidence=evidence,
                    calls=calls, seconds=time.perf_counter() - started), None, inference
    params, sources = stored_params(module, result)
    activation = _activation_check(result.spec, params, cand.x, cand.y)
    activation["parameters"] = sources
    evidence["validation"] = result.validation
    if note:
        evidence["parameters_probed"] = {"experiment": "re-drawn vector parameters", "measured": {},
                                         "confidence": "decisive", "note": note}
    return Site(**base, spec=result.spec, gamma=_gamma_stats(result.spec, params), activation=activation,
                evidence=evidence, calls=calls, seconds=time.perf_counter() - started), None, inference


def _kind_key(cand: _Candidate, module: torch.nn.Module) -> tuple:
    """What decides a site's contract: its module's class, plain attributes (ε, shapes, flags), parameter and
    buffer shapes and the values of its scalar ones (a learned ε), and the input's shape and dtype — not the
    values of γ and β, which the contract does not depend on. Sites with one key share one inference (a
    22-layer model's 45 norms are inferred once); each is still held to its own real activation. ``module``: the
    site's private copy."""
    plain = tuple(sorted((k, repr(v)) for k, v in vars(module).items()
                         if not k.startswith("_") and isinstance(v, bool | int | float | str | tuple | list | dict
                                                                 | type(None))))
    tensors = tuple((n, tuple(t.shape), str(t.dtype), t.item() if t.numel() == 1 and not t.is_meta else None)
                    for n, t in list(module.named_parameters()) + list(module.named_buffers()))
    return (type(module).__module__, type(module).__qualname__, cand.kind, plain, tensors, tuple(cand.x.shape),
            str(cand.x.dtype))


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, tuple | list):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def scan(model, inputs=None, *, dtypes=None, progress: bool | Progress = True,
         call_timeout: float | None = None) -> ModelScan:
    """Every norm site of ``model`` with its contract, role and placement.

    ``inputs``: a tensor (passed positionally), a tuple (positional arguments) or a dict (keyword arguments);
    ``None`` builds a small ``input_ids`` batch for Hugging Face text models. ``dtypes`` restricts the dtypes
    ``infer`` tries at each site. ``progress``: True shows a status line on stderr, a callable receives the
    messages, False is silent. ``call_timeout``: the longest one probe call of a site may run (seconds; 0: no
    limit; default: ``infer``'s). The forward runs in evaluation mode under ``torch.no_grad()``.
    """
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"scan takes a torch.nn.Module; got a {type(model).__name__}")
    started = time.perf_counter()
    dtypes = check_dtype_list(dtypes) or DEFAULT_DTYPES
    args, kwargs = arguments(model, inputs)
    meta = on_meta(model) and not offloaded(model)  # offloaded: its hooks load each module's weights for its call
    if meta:  # the forward runs on shapes alone
        args, kwargs = _to_meta(args), _to_meta(kwargs)
        if kwargs.get("use_cache") is False:
            # with a KV cache, Hugging Face's mask building never reads values (without one it looks for packed
            # sequences in the position ids, which meta tensors do not have)
            kwargs["use_cache"] = True
    with progress_of(progress) as say:
        with untouched(model):
            model.eval()
            say("recording one forward")
            try:
                with torch.no_grad():
                    trace, _ = record(model, lambda: model(*args, **kwargs))
            except NormscopeError:
                raise
            except Exception as exc:
                raise TargetError(f"the forward of {type(model).__name__} failed on the scan inputs "
                                  f"({describe(args, kwargs)}): {type(exc).__name__}: {exc}") from exc
            blocks = block_modules(model)
            flow = Dataflow(trace, blocks)
            say("finding norm sites")
            try:
                candidates, rejected, stats = _discover(trace, say, behaviour=not meta)
            finally:
                trace.release()
        sites: list[Site] = []
        roles: list[tuple[Role, int, int]] = []
        calls = 0
        inferred: dict[tuple, Inference] = {}  # one inference per kind of module
        for i, cand in enumerate(candidates):
            say(f"[{i + 1}/{len(candidates)}] {cand.name}")
            try:
                module = cand.make()  # one private copy for the key and the inference
            except NormscopeError:
                module = None  # _infer_site makes it again and reports why it cannot
            key = _kind_key(cand, module) if module is not None else None
            site, rej = None, None
            if key is not None and key in inferred:
                site, rej, _ = _infer_site(cand, dtypes, say, call_timeout, shared=inferred[key], module=module)
                if site is not None and not site.activation.get("ok", meta):
                    site = None  # its own activation disagrees: infer this site by itself
            if site is None and rej is None:
                site, rej, inference = _infer_site(cand, dtypes, say, call_timeout, module=module)
                if key is not None and inference is not None and key not in inferred:
                    inferred[key] = inference
            if rej is not None:
                rejected.append(rej)
                continue
            role = flow.role(cand.xv, cand.yv, cand.call)
            site.role, site.role_evidence = role.role, role.why
            site.layer = flow.layer(cand.call)
            site.stream = flow.stream_of(cand.xv, cand.yv, cand.call)
            sites.append(site)
            roles.append((role, cand.xv, cand.yv))
            calls += site.calls
        placement, block_records, streams = flow.placements(roles)
    stated = config_eps(getattr(model, "config", None))
    followers = eps_followers(model, stated)
    findings, notes = eps_findings(sites, stated, followers)
    for s in sites:
        s.eps_keys = sorted(site_keys(s, followers)) if followers is not None else None
    if meta:
        notes.insert(0, {"kind": "meta", "sites": [], "message": META_NOTE})
    for s in sites:
        if s.spec is None:
            findings.append({"kind": "not_inferred", "sites": [s.name], "message": f"{s.name}: {s.error}"})
        elif not s.activation.get("ok", True):
            findings.append({"kind": "activation_mismatch", "sites": [s.name],
                             "message": f"{s.name}: the inferred contract reproduces the recorded activation only to "
                                        f"{s.activation['max_relative_error']:.3g} (tolerance "
                                        f"{s.activation['tolerance']:g})"})
    for s in sites:
        ev = (s.evidence or {}).get("stats_dtype") or {}
        if ev.get("measured", {}).get("silent_casts"):
            notes.append({"kind": "undecided", "sites": [s.name], "message": f"{s.name}: {ev['note']}"})
    for r in rejected:
        if r["kind"] != "behaviour":
            findings.append({"kind": "not_a_normalization", "sites": [r["name"]],
                             "message": f"{r['name']} ({r['class']}) looks like a normalization but behaves like none: "
                                        f"{r['reason']}"})
    stats.update({"ops": len(trace.ops), "module_calls": len(trace.calls), "residual_adds": len(flow.residuals),
                  "infer_calls": calls})
    return ModelScan(model=type(model).__name__, inputs=describe(args, kwargs), sites=sites, placement=placement,
                     blocks=block_records, config_eps=stated, findings=findings, rejected=rejected,
                     dtypes=dtypes, seconds=time.perf_counter() - started, stats=stats, streams=streams,
                     notes=notes)
