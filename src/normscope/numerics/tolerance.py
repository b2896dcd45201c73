"""The public error model: per-element bounds on what a faithful implementation of a contract may err by.

Everything here is a pure function of arrays, a :class:`~normscope.spec.NormSpec`, a dtype and the parameters
(:class:`~normscope.results.params.NormParams`): no target, no battery.

Forward, at dtype d with statistics computed in c (:func:`normscope.dtypes.compute_dtype`), element by element::

    |y − exact| ≤ 2·|faithful − exact|                               (another faithful order errs as much)
                 + k·u(c)·(max|x| in the group / denominator)·|γ|     (the statistics' accumulation, amplified)
                 + k·u(c)·|β|
                 + 4·u(d)·max(|γ·x̂| + |β|, |exact|)                  (roundings at the output dtype)
                 [+ k·u(c)·(max|x| / denominator)²·|γ·x̂|/2]          (one-pass variance: its cancellation)
                 [+ 2·(δγ·|x̂| + δβ)]                                (γ/β measured by probing, with noise δ)

with k = 2·log₂(group size) + 8 (:func:`summation_factor`) and ``faithful`` the reference's emulation of a
faithful kernel at d (:func:`normscope.reference.forward` with ``dtype=``). Backward: 2 × a faithful
``nn.Norm``'s error at d + the rounding of the terms that cancel in dx (:func:`backward_rounding`) + :func:`atol`.
:func:`compare` measures an output against a bound and returns a :class:`Comparison` (an empty one raises:
nothing compared is never ok).

The factors are named in :mod:`normscope.numerics.constants`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .. import reference
from ..dtypes import UNIT_ROUNDOFF, compute_dtype, dtype_name
from ..errors import InputError
from ..groups import Groups
from ..layout import Layout
from ..precision import Precision
from ..results.params import NormParams
from ..spec import NormSpec
from . import constants as C

__all__ = [
    "Comparison", "Conditioning", "accumulation_bound", "atol", "backward_bound", "backward_rounding", "compare",
    "conditioning", "faithful_gradients", "forward_bound", "noise_floor", "recovery_tolerance", "summation_factor",
]

GRADIENTS = ("dx", "dgamma", "dbeta")


def _params(params) -> NormParams:
    return params if isinstance(params, NormParams) else NormParams.from_dict(params)


def summation_factor(n: int) -> float:
    """k = 2·log₂(n) + 8: the roundings a pairwise sum of n terms and the steps around it may add (n ≥ 2)."""
    return C.SUMMATION_LOG2 * math.log2(max(n, 2)) + C.SUMMATION_TERMS


def atol(dtype: str, scale: float) -> float:
    """A few units of ``dtype``'s rounding at an output scale (never below the rounding at 1)."""
    d = dtype_name(dtype)
    return C.ATOL_UNITS[d] * UNIT_ROUNDOFF[d] * max(1.0, scale)


def noise_floor(call_noise: float, scale: float) -> float:
    """What two calls on one input may differ by at outputs up to ``scale``, given the measured relative
    call-to-call noise of the target (0 for a deterministic one)."""
    return C.NOISE_FLOOR_FACTOR * call_noise * max(1.0, scale)


def recovery_tolerance(dtype: str, noise: tuple[float, float] = (0.0, 0.0)) -> float:
    """The resolution of γ/β recovered by probing at ``dtype`` (relative, and absolute near 0), given the two
    patterns' measured disagreement ``noise`` (γ, β)."""
    return max(C.RECOVERY_TOLERANCE, C.RECOVERY_ULPS * UNIT_ROUNDOFF[dtype_name(dtype)],
               C.RECOVERY_NOISE_FACTOR * max(noise))


@dataclasses.dataclass(frozen=True, eq=False)
class Conditioning:
    """How rounding is amplified for one input under one spec.

    ``compute``: the statistics' dtype; ``k``: :func:`summation_factor` of the group size; ``stats``: float64
    intermediates without the affine; ``gain``: max|x| in the group / denominator, per element; ``gamma``:
    |γ + offset| per element (1.0 without γ).
    """

    compute: str
    groups: Groups
    k: float
    stats: reference.Statistics
    gain: np.ndarray
    gamma: np.ndarray | float


def conditioning(x, spec: NormSpec, dtype: str, params=None) -> Conditioning:
    """The :class:`Conditioning` of input ``x`` (float64 values) under ``spec`` at ``dtype``."""
    p = _params(params)
    x = np.asarray(x, dtype=np.float64)
    g = Groups.of(spec, x.shape)
    with np.errstate(all="ignore"):
        st = reference.statistics(x, spec.without_affine(), **p.running())
        gain = g.spread(g.max(np.abs(x))) / st.denom
    return Conditioning(compute_dtype(spec, dtype), g, summation_factor(g.size), st, gain,
                        p.effective_gamma(spec, x.shape))


def accumulation_bound(x, spec: NormSpec, dtype: str, params=None, *, exact=None,
                       recovery_noise: tuple[float, float] | None = None) -> np.ndarray:
    """Per-element error a faithful implementation may add beyond 2 × the emulation's own error.

    Statistics accumulated in the compute dtype c err by ~k·u(c)·max|x|, amplified by 1/denominator:
    k·u(c)·(max|x| in the group / denominator)·|γ| + k·u(c)·|β|, plus 4·u(dtype)·max(|γ·x̂| + |β|, |exact|) for
    the roundings of x̂, γ·x̂ and the sum at the output dtype. A one-pass variance adds its cancellation,
    k·u(c)·(max|x| / denominator)²·|γ·x̂|/2; γ/β measured by probing (``recovery_noise`` = the two patterns'
    disagreement for γ and β) add 2·(δγ·|x̂| + δβ).
    """
    p = _params(params)
    d = dtype_name(dtype)
    x = np.asarray(x, dtype=np.float64)
    if exact is None:
        with np.errstate(all="ignore"):
            exact = reference.forward(x, spec, **p.kwargs())
    cond = conditioning(x, spec, d, p)
    uc, ud, k, st, gain, gam = (UNIT_ROUNDOFF[cond.compute], UNIT_ROUNDOFF[d], cond.k, cond.stats, cond.gain,
                                cond.gamma)
    bet = p.abs_beta(spec, x.shape)
    with np.errstate(all="ignore"):
        xhat = np.nan_to_num(np.abs(st.xhat))
        terms = xhat * gam + bet  # |γ·x̂| + |β|: the output's roundings scale with these, not with |y|
        bound = k * uc * (gain * gam + bet) + C.OUTPUT_ROUNDINGS * ud * np.maximum(terms, np.abs(exact))
        if recovery_noise is not None:
            dg, db = recovery_noise
            bound = bound + C.RECOVERY_NOISE_FACTOR * (dg * xhat + db)
        if spec.center and spec.variance_algorithm == "one_pass":
            # E[x²] − E[x]² in c errs by ~k·u(c)·max|x|², which moves x̂ by x̂·δvar/(2·denominator²)
            bound = bound + k * uc * gain**2 * xhat * gam / 2
    return bound


def forward_bound(x, spec: NormSpec, dtype: str, params=None, *, exact=None, emulated=None,
                  param_dtype: str | None = None, recovery_noise: tuple[float, float] | None = None) -> np.ndarray:
    """Per-element bound on |y − exact| for an implementation of ``spec`` run at ``dtype`` on ``x``.

    ``x`` is rounded to ``dtype`` (the values the implementation sees). ``exact`` (the float64 reference) and
    ``emulated`` (the reference's faithful emulation at ``dtype``, γ/β stored at ``param_dtype``) are computed
    when not given. The bound is 2·max(|emulated − exact|, |sequential − exact|) + :func:`accumulation_bound`,
    where *sequential* is the same emulation with its statistics summed by a plain loop: a faithful kernel may
    add its terms in any order, and a sequential sum of a long row (or of a constant one, or at a large offset)
    errs far more than a pairwise one — measured on this very input, so the bound widens only where it does.
    """
    p = _params(params)
    d = dtype_name(dtype)
    x = Precision(d).round(np.asarray(x, dtype=np.float64)).astype(np.float64)
    with np.errstate(all="ignore"):
        if exact is None:
            exact = reference.forward(x, spec, **p.kwargs())
        if emulated is None:
            emulated = exact if d == "float64" else reference.forward(x, spec, dtype=d, param_dtype=param_dtype,
                                                                      **p.kwargs())
        faithful = np.abs(emulated - exact)
        if d != "float64" and not spec.uses_running_statistics:  # statistics summed over the input
            sequential = reference.forward(x, spec, dtype=d, param_dtype=param_dtype, summation="sequential",
                                           **p.kwargs())
            faithful = np.fmax(faithful, np.abs(sequential - exact))
    return C.FAITHFUL_FACTOR * faithful + accumulation_bound(x, spec, d, p, exact=exact,
                                                             recovery_noise=recovery_noise)


def backward_rounding(x, dy, spec: NormSpec, dtype: str, params=None) -> dict[str, np.ndarray]:
    """What rounding may add to each gradient at ``dtype``, beyond a faithful module's own error.

    dx = (γ/D)(dy − mean(dy) − x̂·mean(dy·x̂)) subtracts terms of size |γ|·max|dy|/D that cancel (exactly, for
    groups of two): a kernel rounds them in its compute dtype c and in the gradient dtype, so each element may
    err by (k·u(c) + 4·u(dtype))·2·|γ|·max|dy|/D·(1 + max|x|/D) — the last factor for kernels that work from x
    rather than x̂ (torch's GroupNorm backward does). dγ and dβ sum |dy|·(|x̂| + |x|/D) and |dy| over the
    batch positions: k·u(dtype) of those sums.
    """
    p = _params(params)
    d = dtype_name(dtype)
    x, dy = np.asarray(x, dtype=np.float64), np.asarray(dy, dtype=np.float64)
    cond = conditioning(x, spec, d, p)
    g, k, st, gam = cond.groups, cond.k, cond.stats, cond.gamma
    lay = Layout.of(spec, x.shape)
    with np.errstate(all="ignore"):
        dymax = g.max(np.abs(dy))
        gain = 1 + cond.gain  # formulas in x rather than x̂ carry |x|/D, as the forward does
        out = {"dx": (k * UNIT_ROUNDOFF[cond.compute] + C.OUTPUT_ROUNDINGS * UNIT_ROUNDOFF[d]) * 2 * gam
               * g.spread(dymax) / st.denom * gain}
        axes = lay.param_grad_axes
        n = math.prod(x.shape[a] for a in axes)
        kd = summation_factor(n) * UNIT_ROUNDOFF[d]
        out["dgamma"] = kd * (np.abs(dy) * (np.abs(st.xhat) + gain)).sum(axis=axes).reshape(lay.param_shape)
        out["dbeta"] = kd * np.abs(dy).sum(axis=axes).reshape(lay.param_shape)
    return out


def faithful_gradients(x, dy, spec: NormSpec, dtype: str, params=None) -> dict[str, np.ndarray]:
    """dx (and dγ, dβ where the spec has them) of a faithful ``nn.Norm`` run at ``dtype``, as float64.

    The module is built in float64 with ``params`` and cast once to ``dtype`` (parameters rounded once);
    BatchNorm-style specs run with running statistics when ``batch_stats="running"``.
    """
    import torch

    from ..dtypes import torch_dtype
    from ..nn.modules import Norm

    p = _params(params)
    d = dtype_name(dtype)
    x, dy = np.asarray(x, dtype=np.float64), np.asarray(dy, dtype=np.float64)
    lay = Layout.of(spec, x.shape)
    module_shape = lay.param_shape if (spec.gamma or spec.beta) else lay.stats_shape
    m = Norm(spec, module_shape, momentum=0.0, dtype=torch.float64)
    with torch.no_grad():
        for field, attr in (("gamma", "weight"), ("beta", "bias")):
            if getattr(m, attr) is not None and field in p:
                getattr(m, attr).copy_(torch.from_numpy(p.get(field).copy()).reshape(getattr(m, attr).shape))
        if spec.batch_stats is not None and "running_var" in p:
            for field in ("running_mean", "running_var"):
                buf = getattr(m, field)
                buf.copy_(torch.from_numpy(p.get(field).copy()).reshape(buf.shape))
    m.train(not spec.uses_running_statistics)
    m = m.to(torch_dtype(d))  # parameters rounded once, from float64
    xt = torch.from_numpy(x).to(torch_dtype(d)).requires_grad_(True)
    m.zero_grad()
    m(xt).backward(torch.from_numpy(dy).to(torch_dtype(d)))
    out = {"dx": xt.grad.double().numpy()}
    for label, attr in (("dgamma", "weight"), ("dbeta", "bias")):
        w = getattr(m, attr)
        if w is not None and w.grad is not None:
            out[label] = w.grad.double().numpy().reshape(lay.param_shape)
    return out


def backward_bound(x, dy, spec: NormSpec, dtype: str, params=None, *, exact=None,
                   faithful: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Per-element bounds on the gradients' errors at ``dtype``: {"dx": …, "dgamma": …, "dbeta": …}.

    Each is 2·|faithful − exact| + :func:`backward_rounding` + :func:`atol` at the gradient's scale, with
    ``exact`` the reference's analytic (dx, dγ, dβ) and ``faithful`` :func:`faithful_gradients` (both computed
    when not given). Gradients the spec does not have are left out.
    """
    p = _params(params)
    d = dtype_name(dtype)
    x, dy = np.asarray(x, dtype=np.float64), np.asarray(dy, dtype=np.float64)
    if exact is None:
        exact = reference.backward(x, dy, spec, **p.kwargs())
    if faithful is None:
        faithful = faithful_gradients(x, dy, spec, d, p)
    rounding = backward_rounding(x, dy, spec, d, p)
    out = {}
    for label, ex in zip(GRADIENTS, exact, strict=True):
        if ex is None or label not in faithful:
            continue
        out[label] = (C.FAITHFUL_FACTOR * np.abs(faithful[label] - ex) + rounding[label]
                      + atol(d, float(np.max(np.abs(ex)))))
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Comparison:
    """An output measured against a per-element bound.

    ``error`` = |got − exact| (∞ where ``got`` is not finite), ``bound`` (broadcast to it), ``ratio`` =
    error / bound (0 where the error is 0); ``worst`` indexes the element of the largest ratio, whose error and
    bound are ``worst_error`` and ``worst_bound`` (one pair: a pass never shows an error above its bound), and
    ``worst_faithful`` the faithful implementation's error there (None without one). ``outside`` of ``total``
    elements exceed their bound; ``nonfinite`` outputs are not finite.
    """

    error: np.ndarray
    bound: np.ndarray
    ratio: np.ndarray
    worst: tuple[int, ...]
    worst_error: float
    worst_bound: float
    worst_faithful: float | None
    max_error: float
    max_ratio: float
    outside: int
    total: int
    nonfinite: int

    @property
    def ok(self) -> bool:
        return self.max_ratio <= 1.0

    def summary(self) -> str:
        return f"{self.outside} of {self.total} elements outside"


def compare(got, exact, faithful, bound) -> Comparison:
    """``got`` against ``exact`` within ``bound`` (per element, or one value); ``faithful`` is a faithful
    implementation's output (or None), reported at the worst element.

    Raises :class:`~normscope.errors.InputError` when ``got`` or ``exact`` holds no element: a comparison of
    nothing is neither within its bound nor outside it, and a caller must not read it as either."""
    got, exact = np.asarray(got, dtype=np.float64), np.asarray(exact, dtype=np.float64)
    if got.size == 0 or exact.size == 0:
        raise InputError(f"nothing to compare: the output has shape {got.shape} and the exact one {exact.shape}; an "
                         "empty comparison is neither a pass nor a failure — compare arrays that hold elements")
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), exact.shape)
    finite = np.isfinite(got)
    with np.errstate(all="ignore"):
        err = np.where(finite, np.abs(got - exact), math.inf)
        ratio = np.where(err == 0, 0.0, err / bound)
    flat = int(np.argmax(ratio))
    worst = tuple(int(i) for i in np.unravel_index(flat, ratio.shape))
    e = float(err.ravel()[flat])
    b = float(bound.ravel()[flat])
    f = None
    if faithful is not None:
        f = float(np.abs(np.asarray(faithful, dtype=np.float64) - exact).ravel()[flat])
    return Comparison(err, bound, ratio, worst, e, b, f, float(err.max()), float(ratio.max()), int((ratio > 1).sum()),
                      int(ratio.size), int((~finite).sum()))
