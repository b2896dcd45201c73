"""The verdict step of ``diff``: why a run without a divergence still cannot say "no divergence"
(:func:`undecided`), how much error each site of a lower-precision copy adds (:func:`error_added`), and the
explanation of the first divergent site, with both contracts inferred at a norm (:func:`explain`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import NormscopeError
from ..report.numbers import sig
from ..targets.mlx_target import is_mlx_module
from .contracts import infer_module
from .result import SiteDiff

MIN_OWN_SHARE = 0.5  # "no divergence" needs at least this share of the sites with an own error compared with one


def error_added(sites: list[SiteDiff], input_errors: dict[str, float], ref_dtype: str, top: int = 5) -> list:
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


def undecided(sites: list[SiteDiff], own_sites: int, errors: list[str], nonfinite: str | None, mode: str,
               onnx: bool, replays: bool = False) -> list[str]:
    """Why a run without a divergence still cannot say "no divergence", each with what would decide it."""
    why = []
    align = {"name": "module names", "order": "execution order and output shapes",
             "onnx scopes": "the exporter's node-name scopes",
             "openvino scopes": "OpenVINO's node-name scopes",
             "llama.cpp tensor names": "llama.cpp's graph tensor names"}.get(mode, mode)
    if errors:
        why.append(f"the comparison raised at {len(errors)} site(s), which were not judged (first: {errors[0]}); "
                   "what would decide it: that site compared (report the error; inputs it can take)")
    if nonfinite:
        why.append(f"the reference itself is not finite from {nonfinite} on, so nothing after it was compared; what "
                   "would decide it: inputs on which the reference stays finite")
    # a runtime graph's output is judged too (:func:`.judge.graph_output`), but it is no site of its own to cover
    judged = [s for s in sites if s.status in ("within", "diverged") and not (onnx and s.depth == 0)]
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
    elif onnx and root.status == "propagated" and root.bound is not None:
        why.append(f"the final output's error ({sig(root.propagated['normalized'])}) is not accounted for: "
                   f"{root.note}")
    elif replays and root.own is None and root.status != "regrouped":
        why.append(f"the final output's error ({sig(root.propagated['normalized'])}) is not accounted for: the "
                   f"model's own run, its judged children replayed, was not measured ({root.note or root.status}); "
                   "what would decide it: a model whose top-level call can be run again on the same inputs")
    return why


def between_children(s: SiteDiff) -> str:
    """Where a module's own error lives: its own code between its children (each replayed with the reference's
    output), and any child its run computed itself (no judgement of its own)."""
    text = (f"the error is in this module's own code, between its children ({s.children_replayed} child call(s) "
            "replayed with the reference's outputs")
    if s.children_run:
        more = f" and {len(s.children_run) - 3} more" if len(s.children_run) > 3 else ""
        text += (f"; computed by the candidate inside it, without a judgement of their own: "
                 f"{', '.join(s.children_run[:3])}{more}")
    return text + ")"


def infer_contract(module, shape):
    """The site's full inference (contract and recovered γ/β) at infer's own dtypes: an ONNX site's subgraph as
    onnxruntime runs it, an MLX module as MLX runs it, a torch module through :func:`.contracts.infer_module`."""
    from ..probe.infer import infer
    from .runtimes.onnx import Site
    from .runtimes.openvino import Site as OpenVinoSite

    if isinstance(module, Site):
        return infer(module.proto(), shape=shape, seed=0)
    if isinstance(module, OpenVinoSite):  # the site's nodes in an OpenVINO model, as OpenVINO runs them
        from ..targets.numpy_target import NumpyTarget

        return infer(NumpyTarget(module.function(), f"OpenVINO nodes of {module.scope}"), shape=shape, seed=0,
                     dtypes=("float32",))
    if is_mlx_module(module):
        return infer(module, shape=shape, seed=0)
    return infer_module(module, shape)


def parameter_differences(ref, cand, cand_module) -> list[str]:
    """Where the effective γ/β (as probed from outside; γ with each side's own offset added) of two sites differ
    beyond the rounding of the candidate's parameter dtype: a parameter difference, not precision."""
    u = 2.0 ** -24
    from ..dtypes import UNIT_ROUNDOFF

    if is_mlx_module(cand_module):
        from .runtimes.mlx import model_dtype

        u = UNIT_ROUNDOFF.get(model_dtype(cand_module), u)
    params = [p for p in getattr(cand_module, "parameters", lambda: [])()
              if hasattr(p, "is_floating_point") and p.is_floating_point()]  # a torch module's
    if params:
        u = UNIT_ROUNDOFF.get(str(params[0].dtype).replace("torch.", ""), u)
    tol = max(8 * u, 1e-5)
    out = []
    for field, symbol in (("gamma", "γ"), ("beta", "β")):
        a, b = getattr(ref.params, field, None), getattr(cand.params, field, None)
        if a is None or b is None or np.shape(a) != np.shape(b):
            continue
        a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
        if field == "gamma":
            a, b = a + ref.spec.gamma_offset, b + cand.spec.gamma_offset
        scale = max(float(np.max(np.abs(a))), 1e-12)
        off = np.flatnonzero(np.abs(b - a) > tol * np.maximum(np.abs(a), 1e-3 * scale))
        if off.size:
            i = int(off[np.argmax(np.abs(b - a)[off])])
            factor = b[i] / a[i] if a[i] else math.inf
            out.append(f"the effective {symbol} differs at {off.size} of {a.size} channels (largest at channel {i}: "
                       f"{sig(b[i], 4)} in the candidate vs {sig(a[i], 4)} in the reference, ×{sig(factor)}), beyond the "
                       f"rounding of its parameters ({sig(tol, 2)} relative)")
    return out


def explain(s: SiteDiff, info: dict[str, Any] | None, say) -> dict[str, Any]:
    if s.status == "raised":
        reason = s.note
    elif s.status == "shape":
        reason = s.note
    elif s.elementwise is not None:
        v = s.elementwise
        faithful = "" if v.get("worst_faithful") is None else f", a faithful one errs by {sig(v['worst_faithful'])}"
        reason = (f"own error at element {tuple(v['worst'])}: |Δ| = {sig(v['worst_error'])} > bound "
                  f"{sig(v['worst_bound'])}{faithful} ({v['outside']} of {v['total']} elements outside; "
                  f"‖Δ‖/‖r‖ = {sig(s.own['normalized'])}) [{s.bound_rule}]")
    elif s.beyond_twin is not None and s.note:  # its weights are not the reference's, quantized
        reason = (f"{s.note} [{s.bound_rule}]; its output errs by ‖Δ‖/‖r‖ = {sig(s.own['normalized'])}, the same "
                  f"module with those weights by {sig(s.twin)}")
    elif s.beyond_twin is not None and s.feeds is not None and s.feeds > s.bound and not s.beyond_twin > s.bound:
        reason = (f"own error: its code hands {s.feeds_to} an input that errs by ‖Δ‖/‖r‖ = {sig(s.feeds)} "
                  f"(the reference's input to it, replayed) > bound {sig(s.bound)} [{s.bound_rule}]")
    elif s.beyond_twin is not None:
        reason = (f"own error ‖Δ‖/‖r‖ = {sig(s.own['normalized'])}, of which the candidate's dequantized weights "
                  f"explain {sig(s.twin)}: its output departs from the reference run with them by "
                  f"{sig(s.beyond_twin)} > bound {sig(s.bound)} [{s.bound_rule}]")
        if s.kind == "module":
            reason += "; " + between_children(s)
    else:
        which, m = ("own", s.own) if s.own is not None else ("propagated", s.propagated)
        other = {k: v for k, v in s.outputs.items() if v is not None and v > s.bound}
        if which == "own" and other and not m["normalized"] > s.bound and not (s.feeds or 0.0) > s.bound:
            name, err = max(other.items(), key=lambda kv: kv[1])
            reason = (f"own error of its output {name!r} (not the primary): ‖Δ‖/‖r‖ = {sig(err)} > bound "
                      f"{sig(s.bound)} [{s.bound_rule}]; the primary output errs by {sig(m['normalized'])}")
        elif which == "own" and s.feeds is not None and s.feeds > s.bound and not m["normalized"] > s.bound:
            reason = (f"own error: its code hands {s.feeds_to} an input that errs by ‖Δ‖/‖r‖ = {sig(s.feeds)} "
                      f"(the reference's input to it, replayed) > bound {sig(s.bound)} [{s.bound_rule}]")
        else:
            reason = (f"{which} error ‖Δ‖/‖r‖ = {sig(m['normalized'])} (max abs {sig(m['max_abs'])}, SQNR "
                      f"{m['sqnr_db']:.1f} dB) > bound {sig(s.bound)} [{s.bound_rule}]"
                      + (f"; {s.note}" if which == "propagated" and s.note else ""))
        if which == "own" and s.kind == "module":
            reason += "; " + between_children(s)
    out: dict[str, Any] = {"site": s.name, "class": s.cls, "kind": s.kind, "reason": reason}
    if s.kind != "norm" or info is None or info.get("shape") is None or info.get("cand") is None:
        return out
    say(f"inferring both contracts at {s.name}")
    from ..spec import NormSpec, differences

    try:
        ref = infer_contract(info["ref"], info["shape"])
        stated = hasattr(info["cand"], "as_inference")  # a contract the candidate's file states (a GGUF)
        cand = None if stated else infer_contract(info["cand"], info["shape"])
    except (NormscopeError, Exception) as exc:  # inference is an explanation; its failure is reported, not raised
        out["contracts_error"] = f"{type(exc).__name__}: {exc}"
        return out
    # the reference's contract as the error model judged it (inferred once per site), else as inferred here
    ref_spec = NormSpec.from_dict(s.elementwise["contract"]) if s.elementwise is not None else ref.spec
    if stated:
        cand = info["cand"].as_inference(ref_spec)
        out["stated_note"] = info["cand"].note
    cand_spec = _unprobed(ref_spec, _offset_unseen(ref_spec, cand, out), cand, out)
    ndim = len(info["shape"])
    out["contracts"] = {"reference": ref_spec.to_dict(), "candidate": cand_spec.to_dict()}
    out["differences"] = differences(cand_spec, ref_spec, ndim, shape=info["shape"])
    params = parameter_differences(ref, cand, info["cand"])
    if params:
        out["parameter_differences"] = params
        out["differences"] += params
    if not out["differences"]:
        out["differences_note"] = ("the two contracts are equivalent and so are their parameters: the error comes "
                                   "from how the candidate computes it (precision, order), not from what it computes")
    elif params and len(params) == len(out["differences"]):
        out["differences_note"] = "the two contracts are the same, but their parameters are not"
    return out


_DTYPE_FIELDS = {"stats_dtype": "statistics dtype", "affine_order": "cast/scale order", "param_dtype": "γ/β dtype"}


def _unprobed(ref_spec, cand_spec, cand, out: dict[str, Any]):
    """The candidate's spec with the fields its inference could not probe (a graph that takes float32 only has no
    statistics dtype, cast order or parameter dtype to observe) taken from the reference's, so that they are not
    reported as differences; the note names them."""
    from ..results.inference import Confidence

    fields = [f for f in _DTYPE_FIELDS if (ev := cand.evidence.get(f)) is not None
              and ev.confidence == Confidence.NOT_PROBED and getattr(cand_spec, f) != getattr(ref_spec, f)]
    if not fields:
        return cand_spec
    out["unprobed_note"] = (f"the candidate's {', '.join(_DTYPE_FIELDS[f] for f in fields)} could not be probed (it "
                            "takes one dtype): taken as the reference's")
    return cand_spec.replace(**{f: getattr(ref_spec, f) for f in fields})


def _offset_unseen(ref_spec, cand, out: dict[str, Any]):
    """The candidate's spec to compare. A black box's γ offset is not observable (``1+w`` and ``γ = 1+w`` are one
    function): when the candidate's was not probed, its spec takes the reference's offset, and its γ (the
    effective one) is compared with the reference's effective γ (:func:`parameter_differences`), so a doubled
    offset shows as a γ that differs by 1, not as an offset the candidate lacks."""
    from ..results.inference import Confidence

    ev = cand.evidence.get("gamma_offset")
    if not (ref_spec.gamma and cand.spec.gamma and ref_spec.gamma_offset and ev is not None
            and (ev.confidence == Confidence.NOT_PROBED or ev.measured.get("effective_gamma"))):
        return cand.spec
    out["offset_note"] = (f"the candidate's γ offset cannot be seen from outside (1+w and γ = 1+w are one function): "
                          f"its effective γ is compared with the reference's ({ref_spec.gamma_offset:g}+w)")
    return cand.spec.replace(gamma_offset=ref_spec.gamma_offset)
