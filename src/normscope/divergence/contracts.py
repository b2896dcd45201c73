"""Norm sites judged by the project's error model (:mod:`normscope.numerics.tolerance`).

At a norm site the reference module's contract is inferred once (``normscope.infer`` on a private copy, at the
site's shape with the leading axis cut to 2 — γ/β re-drawn when trained weights hide a channel), γ/β are read
from the module's own parameters, and the candidate's teacher-forced output is compared element by element with
the float64 reference of that contract, within :func:`~normscope.numerics.tolerance.forward_bound` at the
candidate's dtype. The contract is first held to the reference module itself: its output within
:data:`REF_SHARE` of the candidate's bound when the candidate runs at a lower dtype, else within the bound at
the reference's dtype; a contract that does not describe the reference judges nothing, and the site falls back
to the dtype-derived rule with a note.

Contracts are cached per (class, scalar attributes, parameter shapes, input shape): a model's twelve identical
LayerNorms are inferred once; each site still uses its own γ/β.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import NormscopeError
from ..model import private_copy, stored_params
from ..report.numbers import sig

_PLAIN = (bool, int, float, str)
#: a candidate at a lower dtype than the reference: the contract must reproduce the reference module's output
#: within this share of the candidate's per-element bound (else the full check at the reference's dtype runs)
REF_SHARE = 0.25


def _key(module: torch.nn.Module, shape: tuple[int, ...]) -> tuple:
    attrs = tuple(sorted((k, v) for k, v in vars(module).items()
                         if not k.startswith("_") and isinstance(v, _PLAIN + (tuple,))
                         and (not isinstance(v, tuple) or all(isinstance(e, _PLAIN) for e in v))))
    params = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    return type(module), attrs, params, tuple(shape)


def _probe_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (min(shape[0], 2),) + tuple(shape[1:]) if len(shape) >= 3 else tuple(shape)


def infer_module(module: torch.nn.Module, shape: tuple[int, ...]):
    """The inference of a norm module at inputs of ``shape`` (on a float32 private copy, at infer's own dtypes:
    the contract ``normscope infer`` reports). Trained weights that hide the structure are ``infer``'s to handle: it
    probes its copy again with re-drawn vector parameters (evidence ``parameters_probed``). Raises what inference
    raises."""
    from ..probe.infer import infer

    return infer(private_copy(module).float(), shape=shape, seed=0)


class Contracts:
    """The inferred contract (spec, γ/β) of each norm module met, cached by configuration."""

    def __init__(self):
        self._cache: dict[tuple, Any] = {}

    def infer(self, module: torch.nn.Module, shape: tuple[int, ...]):
        """(spec, NormParams, sources) of ``module`` at inputs of ``shape``; raises what inference raises."""
        from ..results.params import NormParams

        key = _key(module, shape)
        hit = self._cache.get(key)
        if isinstance(hit, Exception):
            raise hit
        if hit is None:
            try:
                hit = infer_module(module, _probe_shape(shape))
            except (NormscopeError, Exception) as exc:
                self._cache[key] = exc
                raise
            self._cache[key] = hit
        params, sources = stored_params(module, hit)
        if any(v == "recovered by probing" for v in sources.values()) and hit is not None:
            # γ/β recovered from another module of the same configuration are not this module's
            self._cache.pop(key, None)
        return hit.spec, NormParams.from_dict({k: v for k, v in params.items() if k in ("gamma", "beta",
                                                                                         "running_mean",
                                                                                         "running_var")}), sources


def _dtype_of(module: torch.nn.Module | None, default: str) -> str:
    if module is None:  # an ONNX candidate: its parameters are at the dtype it runs at
        return default
    for p in module.parameters():
        if p.is_floating_point():
            return str(p.dtype).replace("torch.", "")
    return default


def judge(contracts: Contracts, ref_module, cand_module, x: torch.Tensor, y: torch.Tensor, yc: torch.Tensor,
          ref_dtype: str, cand_dtype: str) -> dict[str, Any]:
    """The element-wise verdict at a norm site, or ``{"error": why}`` when the error model cannot judge it.

    ``x``: the reference's input; ``y``: the reference's output; ``yc``: the candidate's module on ``x`` (cast
    to ``cand_dtype``). Returns the spec, the worst element's error and bound (and the faithful emulation's
    error there), how many elements are outside, and the reference module's own check.
    """
    from .. import reference
    from ..numerics import tolerance
    from ..precision import Precision

    if tuple(x.shape) != tuple(y.shape) or tuple(yc.shape) != tuple(y.shape):
        return {"error": "the norm's input and output shapes differ"}
    try:
        spec, params, sources = contracts.infer(ref_module, tuple(x.shape))
    except Exception as exc:  # the error model is unavailable here; the caller falls back and says why
        return {"error": f"the reference's contract could not be inferred: {type(exc).__name__}: {exc}"}
    x64 = x.detach().to("cpu", torch.float64).numpy()
    pdtype = _dtype_of(cand_module, cand_dtype)
    y64 = y.detach().double().cpu().numpy()
    with np.errstate(all="ignore"):
        try:
            ref_exact = reference.forward(x64, spec, **params.kwargs())
            xc = Precision(cand_dtype).round(x64).astype(np.float64) if cand_dtype != ref_dtype else x64
            exact = ref_exact if cand_dtype == ref_dtype else reference.forward(xc, spec, **params.kwargs())
            emulated = reference.forward(xc, spec, dtype=cand_dtype, param_dtype=pdtype, **params.kwargs())
            bound = tolerance.forward_bound(xc, spec, cand_dtype, params, exact=exact, emulated=emulated)
            ref_check = None
            if cand_dtype != ref_dtype:
                # the contract is held to the reference module first. When the candidate runs lower, it suffices
                # that the contract reproduces the reference within REF_SHARE of the candidate's own bound (the
                # verdict's budget moves by at most that share); otherwise the full check at the reference's dtype
                ratio = float(np.nanmax(np.abs(y64 - ref_exact) / (REF_SHARE * bound))) if y64.size else 0.0
                if np.isfinite(ratio) and ratio <= 1:
                    ref_check = {"dtype": cand_dtype, "rule": f"within {REF_SHARE:g} × the candidate's bound",
                                 "max_ratio": ratio}
            if ref_check is None:
                ref_cmp = tolerance.compare(y64, ref_exact, None,
                                            tolerance.forward_bound(x64, spec, ref_dtype, params, exact=ref_exact))
                if not ref_cmp.ok:
                    return {"error": f"the inferred contract ({spec}) does not describe the reference module "
                                     f"itself: worst element |Δ| {sig(ref_cmp.worst_error)} > bound "
                                     f"{sig(ref_cmp.worst_bound)} at {ref_dtype}", "spec": str(spec)}
                ref_check = {"dtype": ref_dtype, "rule": "the error model at the reference's dtype",
                             "max_ratio": ref_cmp.max_ratio, "worst_error": ref_cmp.worst_error,
                             "worst_bound": ref_cmp.worst_bound}
            got = yc.detach().double().cpu().numpy()
            c = tolerance.compare(got, exact, emulated, bound)
            kept = None
            if not c.ok and cand_dtype != ref_dtype:
                # a candidate may read its input at the reference's precision and round only what it computes
                # (OpenVINO runs a norm in float32 at bfloat16 inference precision): held to the exact output on
                # the unrounded input, it is within the contract where it is within the bound there
                emulated_kept = reference.forward(x64, spec, dtype=cand_dtype, param_dtype=pdtype, **params.kwargs())
                c_kept = tolerance.compare(got, ref_exact, emulated_kept, tolerance.forward_bound(
                    x64, spec, cand_dtype, params, exact=ref_exact, emulated=emulated_kept))
                if c_kept.max_ratio < c.max_ratio:
                    c, kept = c_kept, f"its input unrounded (at {ref_dtype})"
        except NormscopeError as exc:
            return {"error": f"the error model could not be evaluated: {exc}", "spec": str(spec)}
    return {"spec": str(spec), "contract": spec.to_dict(), "parameters": sources, "ok": c.ok,
            "worst": list(c.worst), "worst_error": c.worst_error, "worst_bound": c.worst_bound,
            "worst_faithful": c.worst_faithful, "max_ratio": c.max_ratio, "outside": c.outside, "total": c.total,
            "nonfinite": c.nonfinite, "param_dtype": pdtype, "input": kept or f"its input rounded to {cand_dtype}",
            "reference_check": ref_check}


def rule(v: dict[str, Any], dtype: str) -> str:
    held = f", on {v['input']}" if v.get("input") else ""
    return (f"error model of {v['spec']} at {dtype}{held}: worst element |Δ| {sig(v['worst_error'])} vs bound "
            f"{sig(v['worst_bound'])} (ratio {sig(v['max_ratio'])}; {v['outside']} of {v['total']} outside)")
