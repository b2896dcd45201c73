"""Error metrics of one site: a candidate tensor against the reference's, and the bound a faithful execution at
the candidate's dtype is allowed.

The verdict uses one number per site, the *normalised error* e = ‖c − r‖₂ / ‖r‖₂ (the relative RMS error; SQNR
= −20·log₁₀ e): insensitive to the few outlier channels trained transformers have, which make any max-based
number at bf16 swing by 10×. Its bound is measured where it can be (see :func:`bound`). Metrics are computed in
one pass over both tensors with float64 accumulators (numba, when installed; otherwise torch passes in float32,
float64 when either side is): the differences of two nearby float32 values are exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..dtypes import UNIT_ROUNDOFF
from ..numba_threads import load
from ..report.numbers import sig

# A faithful execution at a lower precision may err by up to MARGIN × what the reference's own module makes at
# that precision on the same input (the "twin"), plus SLACK units of rounding of the candidate's dtype.
MARGIN = 4.0
SLACK = 2.0
# Same precision on both sides (a port, another runtime): FLOOR · u · √n, n the length of the longest axis the
# site reduces over (reordered sums differ by about √n roundings).
FLOOR = 16.0
REL_FLOOR = 1e-3  # max rel divides by max(|r|, REL_FLOOR · rms(r))


def _build():
    """(sums, max_rel): one pass each over both tensors with float64 accumulators (numba, compiled once per
    machine and cached on disk)."""
    import numba
    import numpy as np

    @numba.njit(cache=True, nogil=True)
    def sums(c, r):  # pragma: no cover - compiled
        rn2 = cn2 = dn2 = dot = mx = s1 = 0.0
        for i in range(c.size):
            a = np.float64(c[i])
            b = np.float64(r[i])
            d = a - b
            rn2 += b * b
            cn2 += a * a
            dn2 += d * d
            dot += a * b
            s1 += abs(d)
            mx = max(mx, abs(d))
        return rn2, cn2, dn2, dot, mx, s1

    @numba.njit(cache=True, nogil=True)
    def max_rel(c, r, floor):  # pragma: no cover - compiled
        m = 0.0
        for i in range(c.size):
            b = np.float64(r[i])
            m = max(m, abs(np.float64(c[i]) - b) / max(abs(b), floor))
        return m

    return sums, max_rel


def _kernels():
    """The compiled (sums, max_rel), or None without numba: the torch passes."""
    return load("diff metrics", _build)


def _flat(t: torch.Tensor):
    wide = torch.float64 if t.dtype == torch.float64 else torch.float32
    return t.detach().to("cpu", wide).reshape(-1).contiguous().numpy()


def _errors_numba(kernels, candidate: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    sums, max_rel = kernels
    c, r = _flat(candidate), _flat(reference)
    n = max(r.size, 1)
    rn2, cn2, dn2, dot, max_abs, s1 = sums(c, r)
    finite_r, finite_c = math.isfinite(rn2), math.isfinite(cn2)
    out: dict[str, Any] = {"finite": finite_c, "reference_finite": finite_r}
    if not finite_r or not finite_c:
        return {**out, **_NONFINITE}
    rn, cn, dn = math.sqrt(rn2), math.sqrt(cn2), math.sqrt(dn2)
    floor = REL_FLOOR * rn / math.sqrt(n) if rn > 0 else 1e-30
    return _summary(out, n, rn, cn, dn, dot, max_abs, s1 / n, float(max_rel(c, r, floor)) if c.size else 0.0)


#: the metrics of a site where either side is not finite
_NONFINITE = dict(max_abs=math.inf, max_rel=math.inf, mean_abs=math.inf, cosine=math.nan, sqnr_db=-math.inf,
                  normalized=math.inf, max_normalized=math.inf)


def _summary(out: dict[str, Any], n: int, rn: float, cn: float, dn: float, dot: float, max_abs: float,
             mean_abs: float, max_rel: float) -> dict[str, Any]:
    """The site's metrics from the norms of the reference, the candidate and their difference (both paths)."""
    rms = rn / math.sqrt(n)
    out.update(
        max_abs=max_abs,
        max_rel=max_rel,
        mean_abs=mean_abs,
        cosine=min(1.0, dot / (cn * rn)) if cn > 0 and rn > 0 else (1.0 if cn == rn else 0.0),
        sqnr_db=(20 * math.log10(rn / dn) if dn > 0 else math.inf) if rn > 0 else -math.inf,
        normalized=dn / rn if rn > 0 else (0.0 if dn == 0 else math.inf),
        max_normalized=max_abs / rms if rms > 0 else (0.0 if max_abs == 0 else math.inf),
        rms=rms,
    )
    return out


def errors(candidate: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """max abs, max rel (floored), mean abs, cosine, SQNR (dB), and the two normalised errors of ``candidate``:
    ``normalized`` = ‖c − r‖₂ / ‖r‖₂ (the relative RMS error, 10^(−SQNR/20)) and ``max_normalized`` =
    max|c − r| / rms(r) (the worst element in units of the output's scale)."""
    if tuple(candidate.shape) != tuple(reference.shape):
        return {"shape": list(candidate.shape),
                "error": f"shape {list(candidate.shape)} vs the reference's {list(reference.shape)}"}
    kernels = _kernels()
    if kernels is not None:
        return _errors_numba(kernels, candidate, reference)
    wide = torch.float64 if torch.float64 in (candidate.dtype, reference.dtype) else torch.float32
    c = candidate.detach().to("cpu", wide)
    r = reference.detach().to("cpu", wide)
    n = max(r.numel(), 1)
    rn = float(torch.linalg.vector_norm(r))
    cn = float(torch.linalg.vector_norm(c))
    if math.isinf(rn) and not math.isnan(rn) and bool(torch.isfinite(r).all()):  # overflow of the norm only
        r, c = r.double(), c.double()
        rn, cn = float(torch.linalg.vector_norm(r)), float(torch.linalg.vector_norm(c))
    finite_r, finite_c = math.isfinite(rn), math.isfinite(cn)
    out: dict[str, Any] = {"finite": finite_c, "reference_finite": finite_r}
    if not finite_r or not finite_c:
        return {**out, **_NONFINITE}
    d = c - r
    dn = float(torch.linalg.vector_norm(d))
    rms = rn / math.sqrt(n)
    max_abs = float(torch.linalg.vector_norm(d, ord=math.inf)) if d.numel() else 0.0
    mean_abs = float(torch.linalg.vector_norm(d, ord=1)) / n if d.numel() else 0.0
    floor = REL_FLOOR * rms if rms > 0 else 1e-30
    dot = float(torch.dot(c.reshape(-1), r.reshape(-1))) if cn > 0 and rn > 0 else 0.0
    max_rel = float(d.abs_().div_(r.abs().clamp_min_(floor)).max()) if d.numel() else 0.0
    return _summary(out, n, rn, cn, dn, dot, max_abs, mean_abs, max_rel)


#: the largest bound a faithful execution gets without a twin: 16·u·√n passes 1 at bfloat16 once n ≥ 256, which
#: would call any output faithful
CAP = 0.1
#: the most a scaled output may differ from c·y and still be "the same computation, scaled"
FACTOR_REST = 0.02


def bound(dtype: str, reference_dtype: str, twin: float | None, n: int) -> tuple[float, str]:
    """The normalised error a faithful execution at ``dtype`` may show at a site, and how it was derived.

    ``twin``: the normalised error of the reference's own module run at ``dtype`` on the same input (None when
    the two dtypes are the same). ``n``: the longest axis the site reduces over.
    """
    u = UNIT_ROUNDOFF[dtype]
    if twin is None:
        b = FLOOR * u * math.sqrt(max(n, 1))
        if b > CAP:  # bf16 over a long axis: 16·u·√n passes 1, and every output would be "faithful"
            return CAP, f"{CAP:g} (16·u·√n at {dtype} is {sig(b)}: above what rounding can explain)"
        return b, f"{FLOOR:g}·u·√n at {dtype} (u={sig(u)}, n={n})"
    b = MARGIN * twin + SLACK * u
    return b, f"{MARGIN:g} × the reference's own module at {dtype} ({sig(twin)}) + {SLACK:g}·u"


def constant_factor(yc: torch.Tensor, y: torch.Tensor, tolerance: float) -> float | None:
    """c when ``yc`` is ``c·y`` for one constant c clearly ≠ 1 (the rest, ‖yc − c·y‖/‖c·y‖, within ``tolerance`` and
    within :data:`FACTOR_REST`, and c further from 1 than ten times the rest and than 10⁻³), else None: a scale
    applied in another place, not another computation."""
    a, b = yc.detach().double().flatten(), y.detach().double().flatten()
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return None
    yy = float(b @ b)
    if yy == 0.0:
        return None
    c = float(a @ b) / yy
    if c == 0.0:
        return None
    rest = float(torch.linalg.vector_norm(a - c * b)) / (abs(c) * math.sqrt(yy))
    if rest > min(tolerance, FACTOR_REST) or abs(c - 1.0) <= max(10 * rest, 1e-3):
        return None
    return c
