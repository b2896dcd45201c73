"""The trusted reference: float64 NumPy forward and analytic backward for any NormSpec.

``forward`` also emulates low-precision execution (``dtype="bfloat16"|"float16"|"float32"``): the input is
rounded to the dtype, the statistics are computed in float32 or in the input dtype as ``stats_dtype``
says, and the affine is applied before or after the cast back as ``affine_order`` says, rounding after
every operation as a kernel would (see :mod:`normscope.precision`). A checker can therefore tell a
faithful bfloat16 implementation from one that computes its statistics in bfloat16 or casts in the
wrong order.

Parameter shapes: γ and β have the sizes of the input along ``param_axes`` (``(H,)`` for LayerNorm over
the hidden axis, ``(C,)`` for GroupNorm/BatchNorm over channels). Running statistics have the sizes of
the input along the axes that are *not* reduced (``(C,)`` for BatchNorm). ``gamma=None`` means the
identity scale (effective γ = 1), ``beta=None`` means β = 0. These shapes, the grouping and the broadcast
of parameters against the input come from :mod:`normscope.layout`; dtype names and the statistics
(compute) dtype from :mod:`normscope.dtypes`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .dtypes import compute_dtype, dtype_name
from .errors import InputError
from .layout import Layout, param_shape, stats_shape
from .precision import Precision
from .spec import NormSpec

__all__ = ["FORMULAS", "forward", "backward", "statistics", "Statistics", "param_shape", "stats_shape"]

# The ways a faithful kernel may write one contract (see ``forward``'s ``formula``).
FORMULAS = ("divide", "rsqrt", "rsqrt_once", "folded")


@dataclasses.dataclass(frozen=True)
class Statistics:
    """Intermediates of one forward pass, in the original input layout, as float64 arrays.

    ``mean`` is zero for RMS-style specs; ``var`` is the variance (or mean square) the denominator sees;
    ``denom`` is √(var+ε), √var+ε, max(√var, ε) or √var; ``xhat`` is the normalized value before affine.
    """

    mean: np.ndarray
    var: np.ndarray
    denom: np.ndarray
    xhat: np.ndarray
    count: int


def _check_input(x: np.ndarray, name: str = "x") -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub" and str(arr.dtype) != "bfloat16":
        raise InputError(f"{name} must be a real numeric array; got dtype {arr.dtype}")
    return arr.astype(np.float64)


def _running(lay: Layout, values, name: str, p: Precision, stored: Precision | None = None) -> np.ndarray:
    """Running statistics as the kernel reads them: stored in ``stored`` precision, loaded into ``p``."""
    if values is None:
        raise InputError(
            f"this spec uses running statistics (batch_stats='running' or 'frozen'); pass {name}= with the sizes "
            f"along the kept axes {list(lay.stats_axes)}"
        )
    values = lay.group(np.broadcast_to(lay.expand(values, lay.stats_axes, name), lay.shape))
    return p.round((stored or p).round(values))


def _stats(x: np.ndarray, spec: NormSpec, lay: Layout, p: Precision, running_mean, running_var,
           stored: Precision | None = None):
    """Mean, centred values, variance, denominator and x̂ in the grouped layout, rounded as ``p``.

    ``stored``: the precision running statistics are kept in (a module cast with ``.to(dtype)`` keeps its
    buffers in that dtype, and its kernel reads them from there).
    """
    xg = lay.group(x)
    n = lay.count
    n_var = n - 1 if spec.variance == "unbiased" else n
    with np.errstate(all="ignore"):
        if spec.uses_running_statistics:
            mean = _running(lay, running_mean, "running_mean", p, stored) if spec.center else np.zeros_like(xg)
            var = _running(lay, running_var, "running_var", p, stored)
            dev = p.op(xg - mean) if spec.center else xg
        elif not spec.center:
            mean = np.zeros((1,) * xg.ndim, dtype=p.work)
            dev = xg
            var = p.mean(p.op(xg * xg), lay.reduce_axes, n_var)
        elif spec.variance_algorithm == "two_pass":
            mean = p.mean(xg, lay.reduce_axes, n)
            dev = p.op(xg - mean)
            var = p.mean(p.op(dev * dev), lay.reduce_axes, n_var)
        else:  # one_pass: E[x²] − E[x]², with its cancellation, clamped at 0 as implementations do
            mean = p.mean(xg, lay.reduce_axes, n)
            ex2 = p.mean(p.op(xg * xg), lay.reduce_axes, n)
            var = p.op(ex2 - p.op(mean * mean))
            if spec.variance == "unbiased":
                var = p.op(var * p.scalar(n / (n - 1) if n > 1 else math.inf))
            var = np.maximum(var, p.scalar(0.0))
            dev = p.op(xg - mean)
        eps = p.scalar(spec.eps)
        if spec.eps_placement == "inside_sqrt":
            denom = p.op(np.sqrt(p.op(var + eps)))
        elif spec.eps_placement == "outside_sqrt":
            denom = p.op(p.op(np.sqrt(var)) + eps)
        elif spec.eps_placement == "clamp":
            denom = p.op(np.maximum(p.op(np.sqrt(var)), eps))
        else:
            denom = p.op(np.sqrt(var))
        xhat = p.op(dev / denom)
    return mean, dev, var, denom, xhat


def statistics(x, spec: NormSpec, *, running_mean=None, running_var=None) -> Statistics:
    """The float64 intermediates (mean, variance, denominator, x̂), broadcast to the input's shape."""
    x = _check_input(x)
    lay = Layout.of(spec, x.shape)
    mean, _, var, denom, xhat = _stats(x, spec, lay, Precision("float64"), running_mean, running_var)
    full = lay.grouped_shape

    def out(a):
        return lay.ungroup(np.broadcast_to(a, full).copy())

    return Statistics(out(mean), out(var), out(denom), lay.ungroup(xhat), lay.count)


def forward(
    x,
    spec: NormSpec,
    *,
    gamma=None,
    beta=None,
    running_mean=None,
    running_var=None,
    dtype: str | None = None,
    param_dtype: str | None = None,
    formula: str = "divide",
    summation: str = "exact",
) -> np.ndarray:
    """y = spec(x) in float64, or as an implementation faithful to ``spec`` computes it at ``dtype``.

    ``param_dtype`` is where γ/β (and running statistics) are stored (default: the spec's ``param_dtype`` — the
    input dtype, as a module cast with ``.to(dtype)``, or ``"float32"`` for frameworks that keep parameters in
    fp32, such as flax). For
    γ/β it matters only for ``scale_then_cast``: with ``cast_then_scale`` the product is taken in the input
    dtype. Returns float64 values (at a low-precision ``dtype``, values exactly representable in that dtype).

    ``formula`` picks one of the ways a faithful kernel may write the same contract, which round
    differently: ``"divide"`` (x̂ = (x − μ) / denominator), ``"rsqrt"`` (x̂ = (x − μ) · (1 / denominator), the
    root and its reciprocal each rounded), ``"rsqrt_once"`` (x̂ = (x − μ) · rsqrt(σ² + ε) with the reciprocal root
    rounded once, as JAX's ``lax.rsqrt`` does; the same as ``"rsqrt"`` for ε outside the root or a clamp) or
    ``"folded"`` (y = x·a + b with a = γ/denominator and b = β − μ·a in the compute dtype, then one cast; a
    folded kernel has no separate x̂, so it is a form of ``scale_then_cast`` only).

    ``summation``: how the statistics' sums accumulate at a low-precision ``dtype`` — ``"exact"`` (rounded once,
    as a pairwise or tree reduction approaches) or ``"sequential"`` (a plain loop, each partial sum rounded in
    the accumulator: the largest error a faithful kernel's summation order may add).
    """
    if formula not in FORMULAS:
        raise InputError(f"formula must be one of {', '.join(FORMULAS)}; got {formula!r}")
    if not isinstance(spec, NormSpec):
        raise InputError(f"spec must be a NormSpec; got {type(spec).__name__} (try NormSpec.preset(...))")
    x = _check_input(x)
    lay = Layout.of(spec, x.shape)
    d = Precision(dtype_name(dtype))
    if param_dtype is None and spec.param_dtype == "float32" and d.name in ("bfloat16", "float16"):
        param_dtype = "float32"  # kept in fp32 while the input is 16-bit (the exact reference stays exact)
    stored = Precision(dtype_name(param_dtype)) if param_dtype is not None else d
    c = Precision(compute_dtype(spec, d.name), summation)
    g = lay.expand(gamma, lay.param_axes, "gamma") if spec.gamma else None
    b = lay.expand(beta, lay.param_axes, "beta") if spec.beta else None
    if gamma is not None and not spec.gamma:
        raise InputError("gamma was given but the spec has gamma=False")
    if beta is not None and not spec.beta:
        raise InputError("beta was given but the spec has beta=False")

    # the output's dtype: the input's, or fp32 where the contract promotes it (fp32 parameters, flax)
    out = Precision("float32") if spec.output_dtype == "float32" and d.name in ("bfloat16", "float16") else d
    x_in = c.round(d.round(x))
    mean, dev, var, denom, xhat = _stats(x_in, spec, lay, c, running_mean, running_var, stored)
    with np.errstate(all="ignore"):
        if formula != "divide":
            if formula == "rsqrt_once" and spec.eps_placement in ("inside_sqrt", "none"):
                v = c.op(var + c.scalar(spec.eps)) if spec.eps_placement == "inside_sqrt" else var
                inv = c.round(1.0 / np.sqrt(np.asarray(v, dtype=np.float64)))  # one rounding, as an rsqrt op
            else:
                inv = c.op(c.scalar(1.0) / denom)  # the root rounded, then its reciprocal
            xhat = c.op(dev * inv)
        if formula == "folded":  # a = γ·inv, b = β − μ·a, y = x·a + b, all in c, then one cast
            full = lay.grouped_shape
            a = lay.ungroup(np.broadcast_to(inv, full))
            if g is not None:
                a = c.op(a * _scale(g, spec, c, stored))
            shift = c.op(lay.ungroup(np.broadcast_to(mean, full)) * a) if spec.center else np.zeros_like(a)
            b_c = c.round(stored.round(b)) if b is not None else c.scalar(0.0)
            return np.asarray(out.round(c.op(c.op(x_in * a) + c.op(b_c - shift))), dtype=np.float64)
    xhat = lay.ungroup(xhat)
    with np.errstate(all="ignore"):
        if spec.affine_order == "cast_then_scale":
            y = d.round(xhat)
            if g is not None:
                y = d.op(y * _scale(g, spec, d))
            if b is not None:
                y = d.op(y + d.round(b))
        else:
            y = xhat
            if g is not None:
                y = c.op(y * _scale(g, spec, c, stored))
            if b is not None:
                y = c.op(y + c.round(stored.round(b)))
            y = out.round(y)
    return np.asarray(y, dtype=np.float64)


def _scale(weight: np.ndarray, spec: NormSpec, p: Precision, stored: Precision | None = None):
    """The effective γ in precision ``p``: the stored weight (held in ``stored`` precision) plus the offset."""
    w = p.round((stored or p).round(weight))
    return p.op(p.scalar(spec.gamma_offset) + w) if spec.gamma_offset else w


def backward(
    x,
    dy,
    spec: NormSpec,
    *,
    gamma=None,
    beta=None,
    running_mean=None,
    running_var=None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Analytic float64 gradients (dx, dγ, dβ) of ``sum(dy * forward(x))``.

    dγ/dβ are ``None`` when the spec has no γ/β. Running statistics are constants (as in evaluation).
    """
    x = _check_input(x)
    dy = _check_input(dy, "dy")
    if dy.shape != x.shape:
        raise InputError(f"dy has shape {dy.shape} but x has shape {x.shape}; they must match")
    lay = Layout.of(spec, x.shape)
    p = Precision("float64")
    _, dev, var, denom, xhat = _stats(x, spec, lay, p, running_mean, running_var)
    g = lay.expand(gamma, lay.param_axes, "gamma") if spec.gamma else None
    reduce_params, pshape = lay.param_grad_axes, lay.param_shape

    dbeta = dy.sum(axis=reduce_params).reshape(pshape) if spec.beta else None
    dgamma = (dy * lay.ungroup(xhat)).sum(axis=reduce_params).reshape(pshape) if spec.gamma else None
    scale = 1.0 if g is None else spec.gamma_offset + g
    dxhat = lay.group(dy * scale)

    with np.errstate(all="ignore"):
        if spec.uses_running_statistics:
            return lay.ungroup(dxhat / denom), dgamma, dbeta
        axes, n = lay.reduce_axes, lay.count
        n_var = n - 1 if spec.variance == "unbiased" else n
        s = np.sqrt(var)
        if spec.eps_placement == "inside_sqrt":
            d_denom = 0.5 / denom
        elif spec.eps_placement == "clamp":
            d_denom = np.where(s > spec.eps, 0.5 / s, 0.0)
        else:  # outside_sqrt and none: d(√v)/dv
            d_denom = 0.5 / s
        if spec.variance_algorithm == "one_pass":
            d_denom = np.where(var > 0, d_denom, 0.0)  # the clamp at 0 has no gradient
        # ∂L/∂var, through the denominator: −Σ(g·dev)/denom² · denom'(var)
        dvar = -(dxhat * dev).sum(axis=axes, keepdims=True) / denom**2 * d_denom
        dx = dxhat / denom + dvar * 2.0 * dev / n_var
        if spec.center:
            dx = dx - dx.sum(axis=axes, keepdims=True) / n
    return lay.ungroup(dx), dgamma, dbeta
