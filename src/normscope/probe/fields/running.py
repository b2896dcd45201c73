"""``running_mean`` / ``running_var``: the statistics a train/eval module applies in evaluation mode.

In evaluation mode such a module is a per-channel affine map y = A·x + B; with the γ/β recovered in training
mode, A = γ/√(var + ε) and B = β − mean·A give the running variance and mean.
"""

from __future__ import annotations

import numpy as np

from ... import layout
from ...layout import Layout
from ...results.params import NormParams
from ...spec import NormSpec
from .probe import Probe


def running_stats(probe: Probe, spec: NormSpec, params: NormParams) -> NormParams:
    """Recover running mean and variance from two evaluation-mode calls (the target must be in eval mode).

    ``spec`` is the contract (its ε the one evaluation uses) and ``params`` its γ/β, used where they are indexed
    like the running statistics (else γ ≡ 1, β ≡ 0 are assumed).
    """
    probe.progress("running statistics in evaluation mode")
    x1 = probe.rng.normal(size=probe.shape) * 3
    x2 = x1 + 1.0 + probe.rng.uniform(0.5, 1.5, size=probe.shape)
    y1, y2 = probe.run(x1), probe.run(x2)
    slope = (y2 - y1) / (x2 - x1)
    intercept = y1 - slope * x1
    lay = Layout.of(spec, probe.shape)
    A, B = layout.take(slope, lay.stats_axes), layout.take(intercept, lay.stats_axes)
    same_axes = lay.param_axes == lay.stats_axes
    gamma, beta = params.gamma, params.beta
    gam = gamma + spec.gamma_offset if gamma is not None and same_axes else np.ones_like(A)
    bet = beta if beta is not None and same_axes else np.zeros_like(A)
    with np.errstate(all="ignore"):
        var = (gam / A) ** 2 - spec.eps
        mean = (bet - B) / A if spec.center else np.zeros_like(A)
    return NormParams(running_mean=mean, running_var=var)
