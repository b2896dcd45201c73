"""Section "degenerate and extreme inputs": constant and zero vectors, tiny variances at the knee where ε takes
over, values whose squares overflow, a large offset, the variance algorithm, and non-finite confinement."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from .. import reference
from ..dtypes import UNIT_ROUNDOFF, compute_dtype
from ..errors import TargetError
from ..numerics import constants as C
from ..numerics.tolerance import forward_bound
from ..precision import Precision
from ..report.numbers import sig
from ..results.check import Finding
from ..spec import NormSpec
from .context import Context

#: Inputs near these values square past the dtype's range unless statistics are wider.
LARGE_VALUES = (("float16", 3e4), ("bfloat16", 1e37), ("float32", 1e18))


def knee(spec: NormSpec) -> float:
    """The variance where ε takes over: ε inside the root, ε² outside it or as a clamp."""
    return spec.eps if spec.eps_placement == "inside_sqrt" else spec.eps**2


def extremes(ctx: Context) -> Iterator[Finding]:
    g, d, spec = ctx.groups, ctx.dtype, ctx.spec
    # degenerate inputs at every dtype (a kernel may special-case half precision), once in --quick
    dtypes = [d] + ([] if ctx.quick else [t for t in ("float16", "bfloat16") if t in ctx.accepted and t != d])
    variances = {C.TINY_VARIANCE}
    if spec.eps > 0 and knee(spec) > C.KNEE_FLOOR:
        variances |= {knee(spec), knee(spec) * C.BELOW_KNEE}
    base = spec.without_affine().replace(batch_stats=None)
    for dt in dtypes:
        at = "" if dt == d else f" at {dt}"
        const = g.spread(ctx.rng.uniform(-3, 3, size=g.count)) * np.ones(ctx.shape)
        yield ctx.compare("extreme.constant_vector", f"constant vector{at}", const, dt,
                          "every group constant (variance 0)")
        zero = np.zeros(ctx.shape)
        if spec.eps_placement == "none":
            y = ctx.target(zero, dt)
            yield ctx.finding("extreme.zero_vector", f"zero vector{at}", "skip", int((~np.isfinite(y)).sum()), None,
                              None, "the contract has no ε: 0/0 is undefined for a zero vector", dtype=dt)
        else:
            f = ctx.compare("extreme.zero_vector", f"zero vector{at}", zero, dt, "all zeros: finite and equal to β")
            f.expected = "β"
            yield f
        u = ctx.pattern()
        for v in sorted(variances, reverse=True):
            x = math.sqrt(v) * u  # zero mean: the statistics are exact, only ε decides the gain
            f = ctx.compare("extreme.tiny_variance", f"tiny variance {v:.3g}{at}", x, dt,
                            f"variance {sig(v)}: the gain is capped as ε and its placement say", variance=v)
            with np.errstate(all="ignore"):
                gain = float(np.std(reference.forward(x, base)) / max(float(np.std(x)), 1e-300))
            f.expected = {"gain": gain, "no-ε gain": 1.0}
            yield f
    for dt, scale in LARGE_VALUES:
        if dt in ctx.accepted:
            yield ctx.compare("extreme.large_values", f"large values {scale:g}",
                              scale * ctx.pattern() + 0.1 * scale, dt,
                              f"values near {scale:g}: squares overflow {dt} unless statistics are wider", scale=scale)
    offset = 1e8 if d == "float64" else 1e4
    x = offset + ctx.pattern()
    yield ctx.compare("extreme.offset", f"offset {offset:g} + small spread", x, d,
                      "a large common offset with unit spread (one-pass variance cancels)", offset=offset)
    if spec.center and not spec.uses_running_statistics:
        yield variance_algorithm(ctx)
    yield from nonfinite(ctx)


def variance_algorithm(ctx: Context) -> Finding:
    """Where the two variance algorithms part ways beyond their noise, the target must follow its contract's.

    Input: an offset M with spread s per group, M = s·u(c)^-0.65 (c the statistics' dtype). There one-pass
    E[x²] − E[x]² is a difference of two numbers near M² whose spacing is ≫ s², so any one-pass kernel,
    whatever its summation order, returns a variance of 0 or ≫ s², while two-pass is accurate. The target is
    measured against the exact output in units of a faithful two-pass implementation's bound (as the forward
    findings do); one-pass must sit far outside it, two-pass inside. Where the one-pass emulation itself is
    not outside that bound by a clear margin, the candidates do not separate: a skip with both numbers.
    """
    spec = ctx.spec
    fid = "extreme.variance_algorithm"
    name = f"{spec.variance_algorithm.replace('_', '-')} variance at offset"
    # at bf16/fp16 inputs with fp32 statistics the offset cannot both survive the input rounding and cancel:
    # the experiment moves to the precise dtype the target accepts
    d = ctx.dtype if ctx.dtype in ("float32", "float64") else ctx.precise
    c = compute_dtype(spec, d)
    spread = max(1.0, C.SPREAD_ABOVE_KNEE * math.sqrt(knee(spec)))  # far above the knee: ε does not hide it
    offset = spread * min(UNIT_ROUNDOFF[c] ** -C.OFFSET_EXPONENT, C.OFFSET_CAP / UNIT_ROUNDOFF[d])
    x = Precision(d).round(offset + spread * ctx.pattern()).astype(np.float64)
    two, one = spec.replace(variance_algorithm="two_pass"), spec.replace(variance_algorithm="one_pass")
    y = ctx.target(x, d)
    exact = ctx.ref(x)
    emul_two, emul_one = ctx.emulate(x, d, spec=two), ctx.emulate(x, d, spec=one)
    params = {"algorithm": spec.variance_algorithm, "dtype": d}
    if not all(np.all(np.isfinite(a)) for a in (exact, emul_two, y)):
        return ctx.finding(fid, name, "skip", None, None, None,
                           f"the contract or the target is not finite at offset {sig(offset)} at {d}", **params)
    bound = forward_bound(x, two, d, ctx.params, exact=exact, emulated=emul_two,
                          recovery_noise=ctx.recovery_noise if ctx.recovered else None)
    with np.errstate(all="ignore"):
        target = float(np.max(np.abs(y - exact) / bound))
        one_pass = float(np.max(np.nan_to_num(np.abs(emul_one - exact), nan=np.inf) / bound))
    numbers = {"target": target, "one_pass_emulation": one_pass}
    where = (f"offset {sig(offset)} with spread {sig(spread)} at {d}: error in units of a faithful two-pass "
             f"bound — the target {sig(target)}, a one-pass emulation {sig(one_pass)}")
    if not one_pass > C.SEPARATION:
        return ctx.finding(fid, name, "skip", numbers, None, C.SEPARATION,
                           f"{where}; the two algorithms do not separate beyond noise here, nothing to tell apart",
                           **params)
    if spec.variance_algorithm == "two_pass":
        ok = target <= 1
        return ctx.finding(fid, name, "pass" if ok else "fail", target, "≤ 1 (two-pass)", 1.0,
                           f"{where}; a two-pass variance stays within the bound"
                           + ("" if ok else ", this target does not (one-pass cancellation?)"), **params)
    ok = target > 1
    inside = 1 / target if target > 0 else math.inf  # ≤ 1: the target leaves the two-pass bound
    return ctx.finding(fid, name, "pass" if ok else "fail", inside, "< 1 (one-pass cancels)", 1.0,
                       f"{where}; a one-pass variance cancels and leaves the bound (measured: the bound over the "
                       "target's error)" + ("" if ok else ", this target stays within it as a two-pass one does"),
                       **params)


def nonfinite(ctx: Context) -> Iterator[Finding]:
    """One NaN or ∞ input changes nothing outside its normalization group (beyond call-to-call noise)."""
    g, d = ctx.groups, ctx.dtype
    x = ctx.pattern() * 3
    y0 = ctx.target(x, d)
    p = tuple(0 for _ in ctx.shape)
    own = g.labels == g.labels[p]
    floor = ctx.noise_floor(float(np.max(np.abs(y0))))
    for bad in (math.nan, math.inf):
        xb = x.copy()
        xb[p] = bad
        try:
            y = ctx.target(xb, d)
        except TargetError as exc:  # validation that refuses non-finite input, by design
            yield ctx.finding("extreme.nonfinite_confined", f"{bad} confined to its group", "skip", None, 0, 0,
                              f"the target refuses an input holding {bad} (it raised: {exc}); nothing to confine",
                              value=str(bad), dtype=d)
            continue
        outside = ~own
        with np.errstate(invalid="ignore"):
            moved = ~np.isfinite(y[outside]) | (np.abs(y[outside] - y0[outside]) > floor)
        leaked = int(moved.sum())
        yield ctx.finding("extreme.nonfinite_confined", f"{bad} confined to its group",
                          "pass" if leaked == 0 else "fail", leaked, 0, 0,
                          f"one {bad} input changed {leaked} outputs outside its normalization group"
                          + (f" (by more than the call-to-call noise {sig(floor)})" if floor else ""),
                          value=str(bad), dtype=d)
