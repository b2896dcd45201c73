"""The worked hand calculation of LayerNorm and RMSNorm, with every intermediate, and the invariances.

Every number comes from :mod:`normscope.reference`, so what ``normscope explain`` prints is what the
reference computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import reference
from .errors import InputError
from .spec import NormSpec

SCHEMA = "normscope.explain/1"
KINDS = ("layernorm", "rmsnorm", "both")
INVARIANCE_TOL = 1e-9  # an output that moves less than this is reported unchanged


def _floats(name: str, values: Sequence[float] | None, n: int) -> np.ndarray | None:
    if values is None:
        return None
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 1:
        arr = np.full(n, arr[0])
    if arr.size != n:
        raise InputError(f"{name} needs 1 or {n} numbers (one per input value); got {arr.size}")
    if not np.all(np.isfinite(arr)):
        raise InputError(f"{name} must be finite numbers; got {arr.tolist()}")
    return arr


def _specs(eps: float) -> dict[str, NormSpec]:
    placement = "inside_sqrt" if eps > 0 else "none"
    return {
        "layernorm": NormSpec(center=True, axes=[-1], eps=eps, eps_placement=placement),
        "rmsnorm": NormSpec(center=False, axes=[-1], eps=eps, eps_placement=placement, beta=False),
    }


def explain(values: Sequence[float] = (1.0, 2.0, 3.0), **kwargs) -> dict[str, Any]:
    """Step-by-step LayerNorm/RMSNorm of ``values`` with the invariance and ε demonstrations, as data.

    Keywords: ``kind`` ("layernorm", "rmsnorm", "both"), ``eps``, ``gamma``, ``beta``. Values so large
    that a step overflows float64 (a sum, the squares, x + 10 or 5 · x) are refused with an InputError
    naming that step: printing ∞ for a finite mean would be a wrong answer, and JSON has no ∞.
    """
    with np.errstate(all="ignore"):
        data = _explain(values, **kwargs)
    where = _first_nonfinite(data)
    if where:
        raise InputError(
            f"the values are too large for a float64 hand calculation ({where} overflows); normalization is "
            "unchanged by scaling the input (up to ε), so divide them by a power of ten, e.g. keep |x| below 1e150")
    return data


def _first_nonfinite(value, path: str = "") -> str:
    """The path of the first non-finite number in nested dicts/lists ("" when all are finite)."""
    if isinstance(value, float):
        return "" if math.isfinite(value) else path or "a value"
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return ""
    for key, v in items:
        label = f"{path}{key}" if str(key).startswith("[") else (f"{path}.{key}" if path else str(key))
        found = _first_nonfinite(v, label)
        if found:
            return found.split("[")[0]
    return ""


def _explain(
    values: Sequence[float] = (1.0, 2.0, 3.0),
    *,
    kind: str = "both",
    eps: float = 0.0,
    gamma: Sequence[float] | None = None,
    beta: Sequence[float] | None = None,
) -> dict[str, Any]:
    if kind not in KINDS:
        raise InputError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    x = np.asarray(list(values), dtype=np.float64)
    if x.ndim != 1 or x.size < 2:
        raise InputError("explain needs at least two numbers, e.g. normscope explain 1 2 3")
    if not np.all(np.isfinite(x)):
        raise InputError(f"explain needs finite numbers; got {x.tolist()}")
    if not math.isfinite(eps) or eps < 0:
        raise InputError(f"--eps must be a finite number ≥ 0; got {eps}")
    if eps == 0 and kind != "rmsnorm" and np.ptp(x) <= 1e-15 * float(np.max(np.abs(x))):
        raise InputError("the values are all equal: with ε = 0 LayerNorm divides 0 by 0; give --eps (e.g. 1e-5) "
                         "to see how ε defines it, or use --kind rmsnorm")
    if eps == 0 and not np.any(x):
        raise InputError("all values are 0: with ε = 0 both norms divide 0 by 0; give --eps (e.g. 1e-5)")
    g = _floats("--gamma", gamma, x.size)
    b = _floats("--beta", beta, x.size)
    specs = _specs(eps)
    kinds = ["layernorm", "rmsnorm"] if kind == "both" else [kind]
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "input": x.tolist(),
        "eps": eps,
        "gamma": None if g is None else g.tolist(),
        "beta": None if b is None else b.tolist(),
    }
    for k in kinds:
        spec = specs[k]
        stats = reference.statistics(x, spec)
        y = reference.forward(x, spec, gamma=g, beta=b if k == "layernorm" else None)
        if k == "layernorm":
            out[k] = {
                "formula": "γ·(x − μ)/√(σ² + ε) + β",
                "mean": float(stats.mean[0]),
                "deviations": (x - stats.mean).tolist(),
                "variance": float(stats.var[0]),
                "std": float(stats.denom[0]),
                "normalized": stats.xhat.tolist(),
                "output": y.tolist(),
                "output_mean": float(y.mean()),
                "output_mean_square": float((y**2).mean()),
            }
        else:
            out[k] = {
                "formula": "γ·x/√(mean(x²) + ε)",
                "squares": (x**2).tolist(),
                "mean_square": float(stats.var[0]),
                "rms": float(stats.denom[0]),
                "normalized": stats.xhat.tolist(),
                "output": y.tolist(),
                "output_mean": float(y.mean()),
                "output_mean_square": float((y**2).mean()),
            }
    out["invariances"] = _invariances(x, kinds, eps)
    out["eps_gain"] = _eps_gain(eps if eps > 0 else 1e-5)
    return out


def _invariances(x: np.ndarray, kinds: list[str], eps: float) -> list[dict[str, Any]]:
    demo_eps = eps if eps > 0 else 1e-5
    rows = []
    for label, fn in (("x + 10", lambda v: v + 10.0), ("5 · x", lambda v: 5.0 * v)):
        row: dict[str, Any] = {"transform": label, "tolerance": INVARIANCE_TOL}
        for k in kinds:
            for e, suffix in ((0.0, ""), (demo_eps, "_with_eps")):
                if label == "x + 10" and suffix:
                    continue
                spec = _specs(e)[k]
                change = float(np.max(np.abs(reference.forward(fn(x), spec) - reference.forward(x, spec))))
                row[f"{k}_max_change{suffix}"] = change
                row[f"{k}_unchanged{suffix}"] = change <= INVARIANCE_TOL
        if label == "5 · x":
            row["eps"] = demo_eps
        rows.append(row)
    return rows


def _eps_gain(eps: float, variance: float = 1e-12) -> dict[str, Any]:
    """Gain (output spread ÷ input spread) of a near-constant vector, measured through the reference."""
    u = np.array([-1.0, 0.0, 1.0]) * math.sqrt(1.5)  # unit variance, zero mean
    x = 1.0 + math.sqrt(variance) * u
    spread = float(np.std(x - x.mean()))

    def gain(spec: NormSpec) -> float:
        return float(np.std(reference.forward(x, spec.without_affine())) / spread)

    base = NormSpec(center=True, axes=[-1], eps=0.0, eps_placement="none")
    return {
        "variance": variance,
        "eps": eps,
        "gain_without_eps": gain(base),
        "gain_eps_inside_sqrt": gain(base.replace(eps=eps, eps_placement="inside_sqrt")),
        "gain_eps_outside_sqrt": gain(base.replace(eps=eps, eps_placement="outside_sqrt")),
        "cap_inside_sqrt": 1.0 / math.sqrt(eps),
    }
