"""Section "parameters": γ/β (and running statistics) from the target when exposed, else probed.

γ/β are measured by the ±u experiment (:func:`normscope.probe.experiments.plus_minus`) at the context's
precise dtype. An exposed parameter is taken when it is the probed one (γ up to the variance estimator's
scale); when the target has parameters of γ's shape but applies something else (2·w, 1 + w) that is a failed
finding. :func:`perturbed` writes distinct random γ/β into the target's private copy and yields a context
that follows them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np

from .. import reference
from ..errors import TargetError
from ..layout import take
from ..numerics import constants as C
from ..probe.experiments import PlusMinus, plus_minus
from ..results.check import Finding
from ..results.params import NormParams
from .context import Context

_SYMBOL = {"gamma": "γ", "beta": "β"}


def same_parameter(exposed: np.ndarray, recovered: np.ndarray, proportional: bool,
                   tol: float = C.RECOVERY_TOLERANCE) -> bool:
    """Whether a recovered γ (up to a scale near 1: a wrong variance estimator hides there) or β is this one.

    ``tol``: the recovery's resolution (relative and absolute), 1e-3 unless it was measured coarser.
    """
    if not proportional:
        return bool(np.allclose(exposed, recovered, rtol=tol, atol=tol))
    denom = float(np.dot(exposed.ravel(), exposed.ravel()))
    if denom == 0:
        return bool(np.allclose(recovered, 0, atol=tol))
    c = float(np.dot(exposed.ravel(), recovered.ravel())) / denom
    resid = float(np.max(np.abs(recovered - c * exposed))) / max(float(np.max(np.abs(recovered))), 1e-300)
    # ÷d vs ÷(d−1) scales the probed γ by √((d−1)/d) or its inverse, within [1/√2, √2] for d ≥ 2
    return C.GAMMA_SCALE_MIN <= c <= C.GAMMA_SCALE_MAX and resid < tol


def probe_affine(ctx: Context) -> PlusMinus:
    """γ (effective) and β at every position from ±a·u at the precise dtype, x̂ from the reference (with the
    context's running statistics where the contract uses them)."""
    base = ctx.spec.without_affine()
    stats = ctx.params.running() if base.uses_running_statistics else {}
    return plus_minus(lambda x: ctx.target(x, ctx.precise), ctx.groups, ctx.rng, 1e3,
                      normalize=lambda x: reference.forward(x, base, **stats))


def recover_affine(ctx: Context) -> tuple[NormParams, PlusMinus | None]:
    """γ, β in their own shape from :func:`probe_affine` (γ without its offset), with the probe itself."""
    spec = ctx.spec
    if not (spec.gamma or spec.beta):
        return NormParams(), None
    pm = probe_affine(ctx)
    axes, pshape = ctx.layout.param_axes, ctx.layout.param_shape
    out = NormParams(
        gamma=take(pm.gamma, axes).reshape(pshape) - spec.gamma_offset if spec.gamma else None,
        beta=take(pm.beta, axes).reshape(pshape) if spec.beta else None)
    return out, pm


def resolve(ctx: Context) -> Iterator[Finding]:
    """Fill in ``ctx.params`` and where they came from; a failure when the probed γ/β are not the target's."""
    spec = ctx.spec
    pshape = ctx.layout.param_shape
    exposed = ctx.target.parameters()
    buffers = ctx.target.buffers()
    sources = []
    if spec.uses_running_statistics:
        running = {f: buffers[f] for f in ("running_mean", "running_var") if f in buffers}
        sources += [f"{f} from the target's buffer" for f in running]
        if "running_var" not in running:
            raise TargetError("the contract uses running statistics but the target exposes no running_mean/"
                              "running_var buffers; check it against the training contract instead")
        ctx.params = ctx.params.merged(running)
    recovered, pm = recover_affine(ctx)
    if pm is not None:
        # the two patterns measure the same γ/β: their disagreement is the recovery's own uncertainty
        ctx.recovery_noise = (pm.gamma_noise, pm.beta_noise)
        ctx.affine_maps = (pm.gamma, pm.beta)
    for field in ("gamma", "beta"):
        if not getattr(spec, field):
            continue
        match = None
        target_values = recovered.get(field)
        for name, values in exposed.items():
            if values.size != int(np.prod(pshape)) or name in ctx.param_names.values():
                continue
            v = values.reshape(pshape)
            if target_values is not None and same_parameter(v, target_values, proportional=field == "gamma",
                                                            tol=ctx.recovery_tolerance()):
                match = name
                break
        sym = _SYMBOL[field]
        if match is not None:
            ctx.params = ctx.params.replace(**{field: exposed[match].reshape(pshape)})
            ctx.param_names[field] = match
            sources.append(f"{sym} from the target's parameter {match!r} (matched at {ctx.precise})")
        elif target_values is not None:
            ctx.params = ctx.params.replace(**{field: target_values})
            ctx.recovered = True
            sources.append(f"{sym} recovered by probing at {ctx.precise}")
            if field == "gamma":
                effective = np.abs(target_values + spec.gamma_offset)
                if not np.all(np.isfinite(effective)) or float(np.max(effective)) <= C.ZERO_GAMMA:
                    yield ctx.finding(
                        "affine.follows_input", "the output follows the input", "fail",
                        float(np.nanmax(effective)) if np.isfinite(effective).any() else math.inf,
                        "|γ| > 0", C.ZERO_GAMMA,
                        "±u inputs give the same output: the probed γ is 0 (or not finite), so the target "
                        "ignores its input and no comparison below can mean anything", dtype=ctx.precise)
            candidates = [n for n, v in exposed.items() if v.size == target_values.size
                          and n not in ctx.param_names.values()]
            held = candidates or [n for n, v in buffers.items() if v.size == target_values.size]
            if not held and ctx.target.capabilities.whole_state and _fixed(ctx, field, target_values):
                yield _not_held(ctx, field, target_values, exposed, buffers)
            if candidates:
                rel = {n: float(np.max(np.abs(exposed[n].reshape(pshape) - target_values))) for n in candidates}
                yield ctx.finding(
                    "affine.is_parameter", f"{sym} is the target's parameter", "fail", rel, "one of them", None,
                    f"the target has parameters {candidates} of {sym}'s shape {pshape}, but the "
                    f"probed {sym} is none of them (max |difference| per parameter shown)"
                    + ("; γ may only differ by the variance estimator's scale" if field == "gamma" else ""),
                    parameter=field)
    if spec.gamma and spec.gamma_offset and "gamma" not in ctx.param_names and not exposed:
        yield ctx.finding(
            "affine.gamma_offset", "γ's offset", "inconclusive", None, f"γ acts as {spec.gamma_offset:g}+w", None,
            f"the contract says the target applies {spec.gamma_offset:g}+w for a stored w: a statement about how it "
            "stores γ, and this target exposes no parameters, so its γ was probed as it acts and any offset fits "
            "it as well; check a module or graph that holds its weights (or the contract without the offset, "
            "which states only what it applies) to decide it")
    ctx.params_source = "; ".join(sources) or "no affine parameters"


def _fixed(ctx: Context, field: str, probed: np.ndarray) -> bool:
    """Whether the γ/β the target applies stays what it is when every parameter it has takes other values: a
    target without parameters, or whose parameters do not reach it (a LayerNorm built with γ but no β). A γ
    computed from parameters of another shape (per group, then repeated per channel) moves with them."""
    with ctx.target.perturbed_parameters(ctx.rng) as values:
        if not values:
            return True
        again, _ = recover_affine(ctx)
    tol = ctx.recovery_tolerance()
    return bool(np.allclose(again.get(field), probed, rtol=tol, atol=tol))


def _not_held(ctx: Context, field: str, probed: np.ndarray, exposed: dict, buffers: dict) -> Finding:
    """The contract names a learned γ/β, and the target (a module: its parameters and buffers are all it holds)
    has none of its size and applies one its parameters do not move (:func:`_fixed`): it is fixed by its code,
    and a checkpoint's γ/β would be dropped — a LayerNorm built without affine checked against one with it
    behaves alike only while γ ≡ 1 and β ≡ 0."""
    sym = _SYMBOL[field]
    identity = (1.0 - ctx.spec.gamma_offset) if field == "gamma" else 0.0
    held = sorted(exposed) + sorted(buffers)
    return ctx.finding(
        "affine.is_parameter", f"{sym} is the target's parameter", "fail",
        float(np.max(np.abs(probed - identity))), f"a parameter of shape {ctx.layout.param_shape}", None,
        f"the contract has a learned {sym} of shape {ctx.layout.param_shape}, but the target holds no parameter or "
        f"buffer of that size "
        + (f"(it holds {', '.join(held)}), and the {sym} it applies stays put when they change: it" if held else
           f"(it holds none at all): the {sym} it applies")
        + f" is fixed by its code (the probed {sym}'s largest distance from "
        f"{identity:g} is shown), so a checkpoint's "
        f"{sym} has nowhere to go; if the target is right, check it against a contract without {sym} "
        f"({field}=False)", parameter=field)


@contextlib.contextmanager
def perturbed(ctx: Context) -> Iterator[tuple[dict[str, np.ndarray] | None, Context]]:
    """Distinct random γ/β in the target's private copy; yields (the values written or None, a context whose
    parameters follow them).

    Parameters that map onto γ/β (matched by :func:`resolve`) are taken as written; when the target has others
    (per-group scale and bias, a γ it applies as 2·w), γ/β are measured again by probing, so the emulation
    never uses values the target no longer holds.
    """
    pshape = ctx.layout.param_shape
    with ctx.target.perturbed_parameters(ctx.rng) as values:
        inner = ctx
        if values:
            mapped = {f: values[n].reshape(pshape) for f, n in ctx.param_names.items() if n in values}
            inner = ctx.with_params(ctx.params.merged(mapped))
            unmapped = [n for n in values if n not in ctx.param_names.values()]
            if unmapped and (ctx.spec.gamma or ctx.spec.beta):
                again, pm = recover_affine(inner)
                inner = inner.with_params(inner.params.merged(again), recovered=True,
                                          recovery_noise=(pm.gamma_noise, pm.beta_noise))
        yield values, inner
