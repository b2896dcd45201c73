"""Which contracts the fused kernels honour, and the numbers a kernel needs from a spec.

A fused kernel normalizes rows: the statistics reduce over the last axis only, and γ/β are indexed by that
axis. Inside that family every field of a NormSpec is honoured (``center``, ε and its placement, the variance
estimator and algorithm, γ/β, ``gamma_offset``, ``affine_order``), and ``stats_dtype="input"`` where the
input is float32 (its statistics are float32 either way). Anything else raises :class:`SpecError` naming the
field, so a kernel never computes a contract it was not asked for.
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError, SpecError
from ..spec import NormSpec

#: The input dtypes the kernels take (statistics and accumulation in float32).
KERNEL_DTYPES = ("float32", "bfloat16", "float16")

#: Codes the kernels use for the storage format of their 16-bit inputs and outputs.
FORMATS = {"float32": 0, "bfloat16": 1, "float16": 2}
PLACEMENTS = {"inside_sqrt": 0, "outside_sqrt": 1, "clamp": 2, "none": 3}


@dataclasses.dataclass(frozen=True)
class RowContract:
    """A last-axis spec as plain numbers for a row kernel."""

    center: bool
    one_pass: bool
    unbiased: bool
    eps: float
    placement: int
    cast_then_scale: bool
    gamma_offset: float


def unsupported(spec: NormSpec, ndim: int, dtype: str) -> str | None:
    """Why a row kernel cannot honour ``spec`` for an input of ``ndim`` axes at ``dtype``; ``None`` if it can."""
    if not isinstance(spec, NormSpec):
        return f"spec must be a NormSpec; got {type(spec).__name__}"
    if ndim < 1:
        return "the input must have at least one axis (the normalized last axis)"
    last = (ndim - 1,)
    if spec.groups is not None:
        return (f"groups={spec.groups}: a row kernel reduces over the last axis only, not over groups of "
                "channels; use backend='reference'")
    if spec.batch_stats is not None:
        return (f"batch_stats={spec.batch_stats!r}: a row kernel computes per-row statistics, not batch or "
                "running ones; use backend='reference'")
    try:
        axes = spec.resolve_axes(ndim)
        param_axes = spec.resolve_param_axes(ndim)
    except SpecError as exc:
        return str(exc)
    if axes != last:
        return (f"axes={list(spec.axes)}: a row kernel reduces over the last axis only (axes=[-1]); use "
                "backend='reference'")
    if param_axes not in ((), last):
        return (f"param_axes={list(spec.param_axes or ())}: a row kernel indexes γ/β by the last axis only "
                "(param_axes=[-1]); use backend='reference'")
    if dtype not in KERNEL_DTYPES:
        return (f"input dtype {dtype}: the kernels take {', '.join(KERNEL_DTYPES)} with float32 accumulation; "
                "use backend='reference' for float64")
    if dtype != "float32" and spec.output_dtype == "float32":
        return (f"output_dtype='float32' at {dtype}: the kernels write the output in the input dtype; use "
                "backend='reference'")
    if dtype != "float32" and spec.param_dtype == "float32" and (spec.gamma or spec.beta):
        return (f"param_dtype='float32' at {dtype}: the kernels apply γ/β at the input dtype; use "
                "backend='reference'")
    if spec.stats_dtype == "input" and dtype != "float32":
        return (f"stats_dtype='input' at {dtype}: the kernels accumulate statistics in float32; a contract "
                f"with {dtype} statistics needs backend='reference'")
    return None


def row_contract(spec: NormSpec, ndim: int, dtype: str) -> RowContract:
    """The numbers a row kernel needs, or :class:`SpecError` naming the field it cannot honour."""
    if dtype not in KERNEL_DTYPES:
        raise InputError(unsupported(spec, ndim, dtype))
    reason = unsupported(spec, ndim, dtype)
    if reason is not None:
        raise SpecError(reason)
    return RowContract(
        center=spec.center,
        one_pass=spec.center and spec.variance_algorithm == "one_pass",
        unbiased=spec.variance == "unbiased",
        eps=float(spec.eps),
        placement=PLACEMENTS[spec.eps_placement],
        cast_then_scale=spec.affine_order == "cast_then_scale" and spec.stats_dtype == "float32",
        gamma_offset=float(spec.gamma_offset),
    )
