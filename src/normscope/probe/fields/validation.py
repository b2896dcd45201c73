"""Validation: the inferred contract must reproduce the target on fresh inputs, or it is not a normalization."""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import reference
from ...errors import NotANormalization
from ...groups import Groups
from ...precision import Precision
from ...report.numbers import sig
from ...results.params import NormParams
from ...spec import NormSpec
from .probe import Probe, rel

# A "real" normalization reproduces its inferred contract to this relative error on fresh inputs.
VALIDATION_TOL = {"float64": 1e-5, "float32": 1e-4}


def inputs(probe: Probe, g: Groups):
    """Three input families the experiments did not use: normal, offset, heavy-tailed with per-group scales."""
    rng = probe.rng
    yield "normal σ=10", rng.normal(size=probe.shape) * 10
    yield "offset 3 + N(0,1)", 3.0 + rng.normal(size=probe.shape)
    scales = g.spread(10.0 ** rng.uniform(-2, 2, size=g.count))
    yield "heavy-tailed, per-group scales 1e-2..1e2", rng.standard_t(3, size=probe.shape) * scales


def validate(probe: Probe, spec: NormSpec, params: NormParams, g: Groups, dtype: str) -> dict[str, Any]:
    """The relative error of ``spec`` (with ``params``: γ, β, running statistics) against the target at ``dtype``
    on each input family; :class:`NotANormalization` above :data:`VALIDATION_TOL`."""
    tol = VALIDATION_TOL.get(dtype, 1e-2)
    out: dict[str, Any] = {"tolerance": tol, "dtype": dtype}
    worst = 0.0
    for label, x in inputs(probe, g):
        x = Precision(dtype).round(x).astype(np.float64)
        y = probe.run(x, dtype)
        yr = reference.forward(x, spec, dtype=dtype if dtype != "float64" else None, **params.kwargs())
        err = rel(y, yr, max(1.0, float(np.sqrt(np.mean(yr**2)))))
        out[label] = err
        worst = max(worst, err)
    out["max_relative_error"] = worst
    if not worst <= tol:
        errors = ", ".join(f"{k}: {sig(v)}" for k, v in out.items() if k not in ("tolerance", "dtype"))
        raise NotANormalization(
            f"the closest contract found ({spec.summary()}) reproduces the target only to a relative error of "
            f"{sig(worst)} on fresh inputs ({errors}); "
            f"a normalization matches to ≤ {tol:g}: no NormSpec explains this target")
    return out
