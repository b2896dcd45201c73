"""``scan(model, inputs)``: every norm site of a live model, with its contract, role and placement.

One forward is recorded (:mod:`.trace`); sites are found by class, by behaviour and as functional calls;
roles and placements come from the dataflow (:mod:`.dataflow`); each site's contract is inferred on a
private copy at its real input shape and checked against the activation recorded there. The model is left
as it was: parameters, buffers, modes and ``requires_grad`` flags are restored (and hooks are never
registered on it — the recorder uses process-wide hooks), also when the scan fails.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import reference
from ..errors import InputError, NormscopeError, NotANormalization, TargetError
from ..model import Progress, arguments, describe, offloaded, on_meta, private_copy, stored_params, untouched
from ..model import progress as progress_of
from ..precision import dtype_name
from ..probe.infer import VALIDATION_TOL, infer
from ..report.numbers import sig
from ..targets import as_target
from ..targets.base import check_dtype_list
from .classes import known_class
from .config_eps import config_eps, eps_findings, eps_followers, site_keys
from .dataflow import Dataflow, Role, block_modules
from .inline import InlineNorm, find_inline
from .probe_size import same_layout, smaller_shape
from .result import ModelScan, Site
from .trace import NORM_FUNCTIONS, ModuleCall, Op, Trace, record

# f(16x) vs f(64x): a normalization does not see the scale (ε is negligible at those scales)
_SCALE_TOL = {"float64": 1e-6, "float32": 1e-3}
# float64 is opt-in: torch's float64 LayerNorm on CPU is ~200× slower than float32, and some implementations
# change their ε there (torch RMSNorm(eps=None)).
DEFAULT_DTYPES = ("float32", "bfloat16", "float16")
NONFINITE_NOTE = ("the recorded input is not finite (NaN or ±∞): no contract says what a norm returns there, so the "
                  "contract was inferred on probe inputs but not held to this activation")
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
            # without running statistics batch statistics are all it has, in either mode (BiT's weight
            # standardization: F.batch_norm(w, None, None, training=True)); evaluation mode would raise
            kw["training"] = self.training or kw.get("running_mean") is None
        if self.fn_name == "instance_norm" and kw.get("running_mean") is not None:
            kw["use_input_stats"] = self.training
        return self.fn(x, **kw)


# ---------------------------------------------------------------------------------------------- discovery
def _site_name(path: str) -> str:
    return path or "(model)"


class _Candidate:
    """A norm site before its contract is inferred. ``inside``: the call of the normalization class it sits in, for a
    norm inside a class site (BiT's ``BitGroupNormActivation``: ``group_norm`` then an activation) — a site only
    when that class turns out to be no normalization as a whole; ``evidence``: what discovery measured (a gate)."""

    def __init__(self, kind: str, name: str, cls: str, x: torch.Tensor, y: torch.Tensor, xv: int, yv: int,
                 call: int | None, order: int, make: Callable[[], torch.nn.Module], inside: int | None = None,
                 evidence: dict[str, Any] | None = None):
        self.kind, self.name, self.cls = kind, name, cls
        self.x, self.y, self.xv, self.yv = x, y, xv, yv
        self.call, self.order, self.make = call, order, make
        self.inside, self.evidence = inside, evidence or {}
        self.probe: tuple[tuple[int, ...], dict[str, Any] | None] | None = None  # smaller_shape's answer, once made


def _label(c: ModuleCall) -> str:
    return _site_name(c.path) + (f"#{c.number}" if c.number else "")


def _innermost(trace: Trace, call: int | None, among: set[int] | dict[int, Any]) -> int | None:
    """The innermost call of ``among`` that ``call`` runs inside (or is)."""
    while call is not None:
        if call in among:
            return call
        call = trace.calls[call].parent
    return None


def _gated_calls(trace: Trace, class_ids: set[int]) -> dict[int, ModuleCall]:
    """Calls of a normalization class that take more than the tensor they normalize (a gated RMSNorm's
    ``norm(x, gate)``): one output of the first input's shape, and other tensor arguments. No call of this shape
    is a module site by itself (a norm takes one input); the norm inside it is, under the module's name."""
    out = {}
    for c in trace.calls:
        if c.index in class_ids or c.output is None or not c.inputs or len(c.inputs) + len(c.kw_inputs) < 2:
            continue
        if not known_class(c.module) or c.mixing:
            continue
        x, y = trace.values[c.inputs[0]], trace.values[c.output]
        if x.shape == y.shape and x.dtype.is_floating_point:
            out[c.index] = c
    return out


def _gate(trace: Trace, g: ModuleCall, x: int, y: int) -> dict[str, Any]:
    """Where a gated norm's other tensor arguments (its gate) enter, from the call's dataflow: into the value the
    statistic reads (``x · silu(gate)``, Mamba 2), or onto the normalized output (``(w · x̂) · silu(gate)``,
    Qwen3-Next)."""
    gates = {f"args[{i}]": v for i, v in enumerate(g.inputs) if i > 0} | dict(g.kw_inputs)
    reach = set(gates.values())
    for op in trace.ops[g.first_op:g.last_op + 1]:
        if any(i in reach for i in op.inputs):
            reach.update(op.outputs)
    if x in reach:
        applied, note = "before the statistic", (
            "the module multiplies its input by a function of its gate before the statistic: the contract is the "
            "normalization of that gated input (x · f(gate)), read with the gate held as recorded")
    elif g.output in reach and y != g.output:
        applied, note = "after the normalization", (
            "the module multiplies the normalized output by a function of its gate: the contract is the "
            "normalization of its input, the gate's product after it is not part of it")
    else:
        applied, note = "not applied", "the gate reaches neither the statistic nor the output"
    return {"experiment": "the module call's dataflow in the recorded forward: where its other tensor arguments "
                          "enter", "measured": {"gate": sorted(gates), "applied": applied},
            "confidence": "decisive", "note": note}


def _discover(trace: Trace, progress: Progress, behaviour: bool = True
              ) -> tuple[list[_Candidate], list[dict[str, Any]], dict[str, int]]:
    calls = trace.calls
    norm_shaped = [c for c in calls if c.judged is not None or (
        c.x is not None and c.y is not None and c.output is not None and c.output != c.input
        and c.x.is_floating_point())]
    class_calls = [c for c in norm_shaped if known_class(c.module)]
    class_ids = {c.index for c in class_calls}
    gated = _gated_calls(trace, class_ids)
    norm_ops = [op for op in trace.ops if op.norm is not None and "y" in op.norm]
    op_anc = {op.index: trace.ancestors(op.call) for op in norm_ops}
    class_anc = {c.index: trace.ancestors(c.parent) for c in class_calls}
    owners = class_ids | set(gated)

    out: list[_Candidate] = []
    inner: dict[int, list[_Candidate]] = {}  # a gated call → the norms inside it
    rejected: list[dict[str, Any]] = []
    for c in class_calls:
        out.append(_Candidate("module", _label(c), type(c.module).__name__, c.x, c.y, c.input, c.output, c.index,
                              c.first_op, _maker(c)))
    counters: dict[tuple[str, str], int] = {}

    def place(cand: _Candidate, owner: int | None) -> None:
        """A norm inside a class site waits for that site's verdict; one inside a gated call is its module's."""
        if owner in class_ids:
            cand.inside = owner
            out.append(cand)
        elif owner is not None:
            inner.setdefault(owner, []).append(cand)
        else:
            out.append(cand)

    for op in norm_ops:
        path = calls[op.call].path if op.call is not None else ""
        fname = op.norm["function"]
        k = counters.get((path, fname), 0)
        counters[(path, fname)] = k + 1
        x = op.norm["args"].get("input")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not op.outputs or not op.inputs:
            continue
        place(_Candidate("functional", f"{_site_name(path)}:{fname}#{k}", fname, x, op.norm["y"], op.inputs[0],
                         op.outputs[0], op.call, op.index, _functional_maker(op)), _innermost(trace, op.call, owners))
    # behaviour: any other norm-shaped call with no norm inside, innermost first
    containers = set()
    for c in class_calls:
        containers |= class_anc[c.index]
    for op in norm_ops:
        containers |= op_anc[op.index]
    tested = 0
    accepted: set[int] = set()
    untested = [c for c in norm_shaped if c.index not in class_ids and c.index not in containers]
    not_finite = 0
    for c in sorted(untested if behaviour else [], key=lambda c: -c.depth):
        if trace.ancestors(c.index) & accepted or any(c.index in trace.ancestors(a) for a in accepted):
            continue
        if c.judged is not None:  # judged when it returned, and found no normalization
            tested += 1
            continue
        if not _finite(c.x):  # f(16x) vs f(64x) is no test on NaN or ±∞
            not_finite += 1
            continue
        tested += 1
        verdict, measured = _scale_invariant(c)
        if not verdict:
            continue
        progress(f"behaviour: {_label(c)} looks scale-invariant (f(16x) vs f(64x): {sig(measured, 2)})")
        out.append(_Candidate("behaviour", _label(c), type(c.module).__name__, c.x, c.y, c.input, c.output, c.index,
                              c.first_op, _maker(c)))
        accepted.add(c.index)
    # inline patterns, also inside the class sites: a class that applies more than its norm (an activation after
    # it) is no normalization as a whole, and then the norm it computes is the site
    for site in find_inline(trace, accepted):
        owner = _innermost(trace, site.call, owners)
        if owner in class_ids and (site.x, site.y) == (calls[owner].input, calls[owner].output):
            continue  # the class site's own implementation: the same function as the class site
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
            if owner not in class_ids:
                rejected.append({"name": name, "class": f"inline {kind}", "kind": "inline", "reason": str(exc)})
            continue
        place(_Candidate("inline", name, f"inline {kind}", x.detach().clone(), y.detach().clone(), site.x, site.y,
                         site.call, site.first_op, _inline_maker(module)), owner)
    # a gated norm: the one norm inside the call is the module's site, its gate noted
    for g, found in inner.items():
        if len(found) != 1:
            out.extend(found)
            continue
        (cand,) = found
        c = gated[g]
        cand.kind, cand.name, cand.cls = "module", _label(c), type(c.module).__name__
        cand.evidence["gate"] = _gate(trace, c, cand.xv, cand.yv)
        out.append(cand)
    out.sort(key=lambda s: s.order)
    return out, rejected, {"behaviour_candidates_tested": tested,
                           "behaviour_candidates_untested": 0 if behaviour else len(untested),
                           "behaviour_candidates_not_finite": not_finite}


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
        if on_meta(m):  # γ/β recorded on the meta device: a copy with drawn values
            return private_copy(m, training=training)
        return m.train(training)
    return make


def _judged_in_record(c: ModuleCall) -> float | None:
    """The test by behaviour as the record asks it of a large call when it returns (see :func:`.trace.record`):
    what it measured where the call is no normalization; None for a normalization class (kept whatever it
    measures), an input the test cannot judge (not finite, not floating) and a call that passes."""
    if known_class(c.module) or not c.x.is_floating_point() or not _finite(c.x):
        return None
    verdict, measured = _scale_invariant(c)
    return None if verdict else measured


#: elements of the outputs compared at a time in float64
_CHUNK = 1 << 20


def _scale_invariant(c: ModuleCall) -> tuple[bool, float]:
    """The cheap test on the real activation: f(16x) ≈ f(64x) on a private copy."""
    try:
        m = private_copy(c.module)
        x = c.x.cpu()
        with torch.no_grad():
            a = m(x * 16)
            b = m(x * 64)
    except Exception:
        return False, math.inf
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == x.shape == b.shape):
        return False, math.inf
    a, b = a.reshape(-1), b.reshape(-1)
    if not a.numel():
        return False, math.inf
    square, largest = 0.0, 0.0
    for i in range(0, a.numel(), _CHUNK):  # in float64 a piece at a time: the outputs can be hundreds of MiB
        pa, pb = a[i:i + _CHUNK].double(), b[i:i + _CHUNK].double()
        square += float(pa.square().sum())
        piece = float((pa - pb).abs().max())
        if not math.isfinite(piece):
            return False, math.inf
        largest = max(largest, piece)
    scale = math.sqrt(square / a.numel())
    if not math.isfinite(scale) or scale == 0:
        return False, math.inf
    d = largest / scale
    tol = _SCALE_TOL.get(dtype_name(str(c.x.dtype).replace("torch.", "")), 5e-2)
    return d <= tol, d


# ---------------------------------------------------------------------------------------------- contracts
def _finite(t: torch.Tensor) -> bool:
    return t.is_meta or not t.is_floating_point() or bool(torch.isfinite(t).all())


def _nonfinite_count(t: torch.Tensor) -> dict[str, int]:
    """How many values of ``t`` are NaN and how many ±∞, of how many."""
    return {"nan": int(torch.isnan(t).sum()), "inf": int(torch.isinf(t).sum()), "values": t.numel()}


def _nonfinite_inputs(args, kwargs) -> list[str]:
    """The model's floating inputs that hold NaN or ±∞, named as they were given (``pixel_values``, ``args[0]``),
    with how many such values each holds."""
    named = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    out = []
    for name, v in named:
        if isinstance(v, torch.Tensor) and not _finite(v):
            c = _nonfinite_count(v)
            what = " and ".join(f"{c[k]} {label}" for k, label in (("nan", "NaN"), ("inf", "±∞")) if c[k])
            out.append(f"{name} ({what} of {c['values']} values)")
    return out


def _inconclusive(sites: list[Site], bad_inputs: list[str], untested: int) -> list[str]:
    """Why a scan without a finding still cannot say every site holds: sites whose recorded input is not finite
    (named with the model's inputs that are not, where it is theirs), each with what would decide it."""
    blind = [s.name for s in sites if s.activation.get("input_finite") is False]
    if not blind and not (bad_inputs and untested):
        return []
    which = (f"{len(blind)} norm site{'s' * (len(blind) != 1)} received non-finite values (first: {blind[0]}) and "
             "could not be held to their real activations" if blind else "no norm site received them")
    if untested:
        which += (f"; {untested} module call{'s' * (untested != 1)} shaped like a normalization received them and "
                  "could not be tested by behaviour (a norm among them is not listed)")
    if bad_inputs:
        return [f"the input is not finite: {', '.join(bad_inputs)}; {which}; what would decide it: finite inputs"]
    return [f"the forward is not finite before {blind[0]}: the model's inputs are finite, but the input of "
            f"{blind[0]} holds {_describe_count(sites, blind[0])}; {which}; what would decide it: inputs on which the "
            "forward stays finite up to its norms"]


def _describe_count(sites: list[Site], name: str) -> str:
    a = next(s.activation for s in sites if s.name == name)
    parts = [f"{a[k]} {label}" for k, label in (("nan", "NaN"), ("inf", "±∞")) if a.get(k)]
    return f"{' and '.join(parts) or 'non-finite values'} of {a.get('values', '?')} values"


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


Inference = tuple[Any, str]  # (infer's result, the site it ran at)


def _infer_site(cand: _Candidate, dtypes, progress: Progress, call_timeout: float | None = None,
                shared: Inference | None = None, module: torch.nn.Module | None = None, sized: bool = False
                ) -> tuple[Site | None, dict[str, Any] | None, Inference | None]:
    """The site's contract, inferred on its module (or taken from ``shared``: an inference at a site of the same
    kind, or with ``sized`` of the same kind but for its sizes) and held to the site's own real activation with its
    own parameters. ``module``: the site's private copy
    when the caller made it already (``cand.make()`` otherwise). Trained weights that hide the structure (γ ≈ 0 on
    some channels moves no output there) are ``infer``'s to handle: it probes its copy with re-drawn parameters
    (evidence ``parameters_probed``), and the contract is held to the real ones on the real activation below."""
    started = time.perf_counter()
    shape = tuple(cand.x.shape)
    base = dict(name=cand.name, kind=cand.kind, cls=cand.cls, role="other", role_evidence="", layer=None,
                shape=shape, dtype=str(cand.x.dtype).replace("torch.", ""), order=cand.order)

    def run(m, at):
        target = m
        if call_timeout is not None:
            target = as_target(m)
            target.timeout = call_timeout or None  # 0: no limit
        return infer(target, shape=at, dtypes=dtypes, seed=0,
                     progress=lambda msg: progress(f"{cand.name}: {msg}"))

    try:
        module = module if module is not None else cand.make()
        probed, cut = cand.probe if cand.probe is not None else smaller_shape(module, shape, cand.x.dtype)
        result = shared[0] if shared is not None else run(module, probed)
        if cut is not None and not same_layout(result.spec, shape, probed):  # shaped by a cut axis after all
            result, cut = run(cand.make(), shape), None
    except NotANormalization as exc:
        return None, {"name": cand.name, "class": cand.cls, "kind": cand.kind, "reason": str(exc)}, None
    except NormscopeError as exc:
        return Site(**base, error=str(exc), seconds=time.perf_counter() - started), None, None
    inference = shared or (result, cand.name)
    evidence = {k: v.to_dict() for k, v in result.evidence.items()} | cand.evidence
    silent = getattr(module, "silent_casts", ())
    if silent:  # the replay lacks the site's casts: what they do at another dtype was not seen
        for field in ("stats_dtype", "affine_order"):
            if field in evidence:
                evidence[field] = {**evidence[field], "confidence": "not probed", "note": _silent_cast_note(silent),
                                   "measured": {**evidence[field].get("measured", {}), "silent_casts": list(silent)}}
    if cut is not None:
        evidence["probe_shape"] = cut
    calls = 0 if shared else result.calls
    if shared:
        evidence["shared_inference"] = {
            "experiment": "one inference per kind of module", "measured": {"inferred_at": shared[1]},
            "confidence": "decisive",
            "note": f"the contract was inferred at {shared[1]}, a module of the same class, attributes and parameter "
                    "shapes on an input of the same shape and dtype; this site's own activation is checked below"
                    if not sized else
                    f"the contract was inferred at {shared[1]}, a module of the same class and attributes but for its "
                    "sizes (channels, groups, widths), on an input of the same rank and dtype; it holds here only "
                    "because this site's own activation agrees with it (checked below; else it is inferred here)"}
    if cand.x.is_meta:  # shapes without values: nothing recorded to check, and γ/β were drawn
        if sized:  # the copy on an input drawn at the site's (probe) shape instead
            evidence["shared_inference"]["measured"]["check"] = _drawn_check(result, module, cand)
        return Site(**base, spec=result.spec, activation={"not_measured": META_NOTE}, evidence=evidence,
                    calls=calls, seconds=time.perf_counter() - started), None, inference
    try:
        params, sources = stored_params(module, result, sized=sized)
        # on NaN or ∞ nothing a contract says holds: the site is not judged (the scan is inconclusive)
        activation = (_activation_check(result.spec, params, cand.x, cand.y) if _finite(cand.x) else
                      {"not_measured": NONFINITE_NOTE, "input_finite": False, **_nonfinite_count(cand.x)})
    except (ValueError, InputError) as exc:
        if not sized:
            raise
        return Site(**base, spec=result.spec, activation={"ok": False, "error": str(exc)}, evidence=evidence,
                    calls=calls, seconds=time.perf_counter() - started), None, inference  # inferred here instead
    activation["parameters"] = sources
    evidence["validation"] = result.validation
    return Site(**base, spec=result.spec, gamma=_gamma_stats(result.spec, params), activation=activation,
                evidence=evidence, calls=calls, seconds=time.perf_counter() - started), None, inference


def _kind_key(cand: _Candidate, module: torch.nn.Module) -> tuple:
    """What decides a site's contract: its module's class, plain attributes (ε, shapes, flags), parameter and
    buffer shapes and the values of its scalar ones (a learned ε), and the input's shape and dtype — not the
    values of γ and β, which the contract does not depend on. Sites with one key share one inference (a
    22-layer model's 45 norms are inferred once; and one refusal, for a kind that behaves like no normalization);
    each is still held to its own real activation. ``module``: the site's private copy."""
    if hasattr(module, "kind_key"):  # an inline norm's replay: its ops, not the trace's value numbers
        plain = module.kind_key()
    else:
        plain = tuple(sorted((k, repr(v)) for k, v in vars(module).items()
                             if not k.startswith("_") and isinstance(v, bool | int | float | str | tuple | list | dict
                                                                     | type(None))))
    tensors = tuple((n, tuple(t.shape), str(t.dtype), t.item() if t.numel() == 1 and not t.is_meta else None)
                    for n, t in list(module.named_parameters()) + list(module.named_buffers()))
    probed = cand.probe[0] if cand.probe is not None else tuple(cand.x.shape)
    # the classes of its submodules: one class with an activation or an Identity inside (BiT's norm-then-ReLU, and
    # the same class without it) is two kinds
    children = tuple((n, type(m).__module__, type(m).__qualname__) for n, m in module.named_modules() if n)
    return (type(module).__module__, type(module).__qualname__, cand.kind, plain, tensors, children, probed,
            str(cand.x.dtype))


def _drawn_check(result, module: torch.nn.Module, cand: _Candidate) -> dict[str, Any]:
    """The contract against the site's private copy on a standard normal input of its probe shape (what a shared
    inference is held to on the meta device, where nothing was recorded)."""
    shape = cand.probe[0] if cand.probe is not None else tuple(cand.x.shape)
    dtype = cand.x.dtype if cand.x.dtype.is_floating_point else torch.float32
    try:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.no_grad():
            y = module(x)
        params, _ = stored_params(module, result, sized=True)
        return _activation_check(result.spec, params, x, y if isinstance(y, torch.Tensor) else y[0])
    except Exception as exc:  # the copy cannot run on a drawn input: no agreement
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _holds(site: Site) -> bool:
    """Whether a contract shared from a site of another size holds at ``site``: its recorded activation agrees, or
    on the meta device its copy on a drawn input does."""
    if site.activation.get("ok") is True:
        return True
    check = (site.evidence or {}).get("shared_inference", {}).get("measured", {}).get("check") or {}
    return check.get("ok") is True


_INT = re.compile(r"-?\d+")
_INTS = re.compile(r"\((?:-?\d+, )*-?\d+,?\)|\[(?:-?\d+, )*-?\d+\]")


def _sizeless(key):
    """A kind key (:func:`_kind_key`) without its sizes: an integer (channels, groups, a width; written as a number
    or its repr) is "#", a shape its rank. Floats (ε), flags, names, classes and dtypes stay."""
    if isinstance(key, bool) or key is None or isinstance(key, float):
        return key
    if isinstance(key, int):
        return "#"
    if isinstance(key, str):
        if _INT.fullmatch(key):
            return "#"
        if _INTS.fullmatch(key):
            return f"rank {key.count(',') + (0 if key.rstrip(')]').endswith(',') else 1)}"
        return key
    if isinstance(key, tuple | list):
        if key and all(isinstance(v, int) and not isinstance(v, bool) for v in key):
            return f"rank {len(key)}"
        return tuple(_sizeless(v) for v in key)
    return key


def _uncalled_norms(model: torch.nn.Module, trace: Trace) -> list[str]:
    """The modules of a normalization class that the recorded forward never called (a tower the inputs do not
    reach, a merger applied after a layer index the model does not have): no contract is read for them."""
    called = {id(c.module) for c in trace.calls}
    return [name for name, m in model.named_modules() if m is not model and known_class(m) and id(m) not in called]


def _uncalled_note(names: list[str]) -> dict[str, Any]:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    one = len(names) == 1
    them = "it" if one else "them"
    return {"kind": "not_called", "sites": names,
            "message": f"{len(names)} module{'' if one else 's'} of a normalization class {'was' if one else 'were'} "
                       f"not called by the forward on these inputs ({shown}): no contract is read for {them}; what "
                       f"would decide it: inputs whose forward reaches {them}"}


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, tuple | list):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def scan(model, inputs=None, *, dtypes=None, progress: bool | Progress = True,
         call_timeout: float | None = None, restore: bool = True) -> ModelScan:
    """Every norm site of ``model`` with its contract, role and placement.

    ``inputs``: a tensor (passed positionally), a tuple (positional arguments) or a dict (keyword arguments);
    ``None`` builds a small ``input_ids`` batch for Hugging Face text models. ``dtypes`` restricts the dtypes
    ``infer`` tries at each site. ``progress``: True shows a status line on stderr, a callable receives the
    messages, False is silent. ``call_timeout``: the longest one probe call of a site may run (seconds; 0: no
    limit; default: ``infer``'s). The forward runs in evaluation mode under ``torch.no_grad()``. ``restore``: put
    the model back as it was afterwards — modes, parameters and buffers, from copies (False: left as the scan
    leaves it, for a model built only to be read and thrown away).
    """
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"scan takes a torch.nn.Module; got a {type(model).__name__}")
    started = time.perf_counter()
    dtypes = check_dtype_list(dtypes) or DEFAULT_DTYPES
    args, kwargs = arguments(model, inputs)
    meta = on_meta(model) and not offloaded(model)  # offloaded: its hooks load each module's weights for its call
    cache_added = False
    if meta:  # the forward runs on shapes alone
        args, kwargs = _to_meta(args), _to_meta(kwargs)
        if kwargs.get("use_cache") is False:
            # with a KV cache, Hugging Face's mask building never reads values (without one it looks for packed
            # sequences in the position ids, which meta tensors do not have)
            kwargs["use_cache"], cache_added = True, True
    with progress_of(progress) as say:
        with untouched(model) if restore else contextlib.nullcontext():
            model.eval()
            say("recording one forward")
            try:
                try:
                    with torch.no_grad():
                        trace, _ = record(model, lambda: model(*args, **kwargs), judge=_judged_in_record)
                except Exception:
                    if not cache_added:
                        raise
                    # the cache itself fails (a hybrid's cache of linear-attention layers alone, which Hugging
                    # Face's mask building refuses): the forward as the inputs give it
                    kwargs["use_cache"] = False
                    with torch.no_grad():
                        trace, _ = record(model, lambda: model(*args, **kwargs), judge=_judged_in_record)
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
                uncalled = _uncalled_norms(model, trace)
            finally:
                trace.release()
        sites: list[Site] = []
        roles: list[tuple[Role, int, int]] = []
        calls = 0
        inferred: dict[tuple, Inference] = {}  # one inference per kind of module
        # and per kind but for its sizes: a stage's norms of other widths (BiT's 16 GroupNorm widths, its 50 weight
        # standardizations of as many kernel shapes), each held to its own activation (values only, not on meta)
        by_size: dict[tuple, Inference] = {}
        refused: dict[tuple, dict[str, Any]] = {}  # and one refusal: a kind that behaves like no normalization
        not_norms: dict[int, dict[str, Any]] = {}  # class sites that are no normalization, by call
        for i, cand in enumerate(candidates):
            if cand.inside is not None and cand.inside not in not_norms:
                continue  # the implementation of a class site that is a normalization
            say(f"[{i + 1}/{len(candidates)}] {cand.name}")
            try:
                module = cand.make()  # one private copy for the key and the inference
            except NormscopeError:
                module = None  # _infer_site makes it again and reports why it cannot
            if module is not None:
                cand.probe = smaller_shape(module, tuple(cand.x.shape), cand.x.dtype)
            key = _kind_key(cand, module) if module is not None else None
            site, rej = None, None
            if key is not None and key in refused:
                rej = {**refused[key], "name": cand.name, "class": cand.cls, "kind": cand.kind,
                       "reason": f"{refused[key]['reason']} (found at {refused[key]['name']}, a module of the same "
                                 "class, attributes and parameter shapes on an input of the same shape)"}
                rej.pop("sites_inside", None)
            elif key is not None and key in inferred:
                site, rej, _ = _infer_site(cand, dtypes, say, call_timeout, shared=inferred[key], module=module)
                if site is not None and not site.activation.get("ok", True):
                    site = None  # its own activation disagrees: infer this site by itself
            elif key is not None and _sizeless(key) in by_size and (meta or _finite(cand.x)):
                site, rej, _ = _infer_site(cand, dtypes, say, call_timeout, shared=by_size[_sizeless(key)],
                                           module=module, sized=True)
                if site is not None and not _holds(site):
                    site, rej = None, None  # held only by its own numbers: without agreement, inferred here
            if site is None and rej is None:
                site, rej, inference = _infer_site(cand, dtypes, say, call_timeout, module=module)
                if key is not None and inference is not None and key not in inferred:
                    inferred[key] = inference
                    by_size.setdefault(_sizeless(key), inference)
                if key is not None and rej is not None and key not in refused:
                    refused[key] = dict(rej)
            if rej is not None:
                rejected.append(rej)
                if cand.kind == "module" and cand.call is not None:
                    not_norms[cand.call] = rej
                continue
            if cand.inside is not None:  # the norm a class that is none as a whole applies
                not_norms[cand.inside].setdefault("sites_inside", []).append(site.name)
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
    if uncalled:
        notes.append(_uncalled_note(uncalled))
    for s in sites:
        if s.spec is None:
            findings.append({"kind": "not_inferred", "sites": [s.name], "message": f"{s.name}: {s.error}"})
        elif not s.activation.get("ok", True):
            findings.append({"kind": "activation_mismatch", "sites": [s.name],
                             "message": f"{s.name}: the inferred contract reproduces the recorded activation only to "
                                        f"{sig(s.activation['max_relative_error'])} (tolerance "
                                        f"{s.activation['tolerance']:g})"})
    for s in sites:
        ev = (s.evidence or {}).get("stats_dtype") or {}
        if ev.get("measured", {}).get("silent_casts"):
            notes.append({"kind": "undecided", "sites": [s.name], "message": f"{s.name}: {ev['note']}"})
    inside: dict[str, list[dict[str, Any]]] = {}
    for r in rejected:
        if r.get("sites_inside"):  # a norm and more (an activation after it): its norm is the site
            inside.setdefault(r["class"], []).append(r)
        elif r["kind"] != "behaviour":
            findings.append({"kind": "not_a_normalization", "sites": [r["name"]],
                             "message": f"{r['name']} ({r['class']}) looks like a normalization but behaves like none: "
                                        f"{r['reason']}"})
    for cls, rs in inside.items():
        names = [n for r in rs for n in r["sites_inside"]]
        notes.append({"kind": "norm_inside", "sites": names,
                      "message": f"{', '.join(r['name'] for r in rs)} ({cls}) appl{'ies' if len(rs) == 1 else 'y'} "
                                 "more than a normalization (e.g. an activation after it: infer rules the whole out, "
                                 f"'rejected' says how), so the normalization inside is the site: {', '.join(names)}"})
    gates: dict[tuple[str, str], list[str]] = {}
    for s in sites:
        if "gate" in (s.evidence or {}):
            gates.setdefault((s.cls, s.evidence["gate"]["measured"]["applied"]), []).append(s.name)
    for (cls, applied), names in gates.items():
        what = {"before the statistic": "the normalization of its gated input x · f(gate), read with the gate held as "
                                        "recorded",
                "after the normalization": "the normalization of its input; the gate multiplies the normalized "
                                           "output after it"}.get(applied, "the normalization of its input")
        notes.append({"kind": "gated", "sites": names,
                      "message": f"{', '.join(names)} ({cls}): a gated norm, its gate applied {applied}; the contract "
                                 f"is {what}"})
    stats.update({"ops": len(trace.ops), "module_calls": len(trace.calls), "residual_adds": len(flow.residuals),
                  "infer_calls": calls})
    inconclusive = [] if meta else _inconclusive(sites, _nonfinite_inputs(args, kwargs),
                                                 stats.get("behaviour_candidates_not_finite", 0))
    return ModelScan(model=type(model).__name__, inputs=describe(args, kwargs), sites=sites, placement=placement,
                     blocks=block_records, config_eps=stated, findings=findings, rejected=rejected,
                     dtypes=dtypes, seconds=time.perf_counter() - started, stats=stats, streams=streams,
                     notes=notes, inconclusive=inconclusive)
