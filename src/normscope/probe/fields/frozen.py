"""A BatchNorm frozen in both modes: every field from its running-statistics buffers and a per-channel affine map.

Such a module (``FrozenBatchNorm2d``) never reduces over its input, so the dependency experiment would call it
an elementwise map. It is recognised from ``running_mean``/``running_var`` buffers of one channel axis and an
output that is a per-channel affine map; ε and its placement come from the gain of each channel as its running
variance is set to v = 10⁴ … 10⁻⁶⁰ in a private copy (the fit of :mod:`.eps`), γ and β from the map itself,
``center`` from moving the running mean.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ...groups import Groups
from ...results.inference import Confidence, Evidence
from ...results.params import NormParams
from ...spec import NormSpec
from . import eps as eps_field
from .affine import BIG
from .low_precision import low_precision
from .modes import Modes
from .probe import Probe, channel_affine
from .target import Determinism
from .validation import validate


@dataclasses.dataclass(frozen=True)
class Frozen:
    spec: NormSpec
    params: NormParams
    validation: dict[str, Any]
    evidence: dict[str, Evidence]


def running_buffers(probe: Probe) -> tuple[str, str, int] | None:
    """Buffers named ``…running_mean``/``…running_var`` of one channel axis of the probe shape, with that axis."""
    bufs = probe.target.buffers()
    means = [n for n in bufs if n.split(".")[-1] == "running_mean"]
    for m in means:
        v = m[: -len("running_mean")] + "running_var"
        if v not in bufs or bufs[m].ndim != 1 or bufs[m].shape != bufs[v].shape:
            continue
        c = bufs[m].shape[0]
        axes = [a for a in (1, probe.ndim - 1) if probe.ndim > a and probe.shape[a] == c]
        if axes:
            return m, v, axes[0]
    return None


def frozen_batchnorm(probe: Probe, det: Determinism, found_modes: Modes) -> Frozen | None:
    """The whole contract of a frozen BatchNorm; None when the target is not one (no such buffers, or an output
    that is not a per-channel affine map)."""
    read = read_map(probe, det, found_modes)
    if read is None:
        return None
    spec, params, ev = read
    axis = ev["axes"].measured["channel_axis"]
    g = Groups.build(probe.shape, tuple(a for a in range(probe.ndim) if a != axis))
    rounding = low_precision(probe, spec, params, "from the map, running statistics from buffers")
    ev.update(rounding.evidence)
    probe.progress("validation on fresh inputs")
    validation = validate(probe, rounding.spec, params, g, probe.dtype)
    return Frozen(rounding.spec, params, validation, ev)


def read_map(probe: Probe, det: Determinism, found_modes: Modes) -> tuple[NormSpec, NormParams, dict] | None:
    """A frozen BatchNorm's contract (before its low-precision fields), parameters and evidence, read from its
    per-channel affine map as the running buffers are set in a private copy; None when the target is not one.
    Also what evaluation mode of a training BatchNorm computes (its own ε)."""
    found = running_buffers(probe)
    if found is None:
        return None
    mean_name, var_name, axis = found
    x = probe.rng.uniform(0.5, 1.5, size=probe.shape) * probe.rng.choice([-1.0, 1.0], size=probe.shape) * 3
    if channel_affine(probe, axis, x, det.noise) is None:
        return None
    probe.progress("frozen BatchNorm: running statistics read from buffers, ε from a private copy")
    ndim, c = probe.ndim, probe.shape[axis]
    bufs = probe.target.buffers()
    big = BIG**2

    def gains(var: np.ndarray, mean: np.ndarray):
        with probe.target.with_buffers({mean_name: mean, var_name: var}) as ok:
            if not ok:
                return None
            return channel_affine(probe, axis, x, det.noise)

    ref = gains(np.full(c, big), np.zeros(c))
    moved = gains(np.full(c, big), np.full(c, BIG))
    if ref is None or moved is None:
        return None
    gamma_c = ref[0] * math.sqrt(big)  # ε is negligible at variance 1e12
    beta_c = ref[1]
    shift = (moved[1] - ref[1]) / np.where(ref[0] != 0, ref[0] * BIG, 1.0)  # −1 when the mean is subtracted
    center = bool(np.median(np.abs(shift + 1)) < 1e-3)
    scanned = eps_field.variances(probe.dtype)
    rho = []
    for start in range(0, len(scanned), c):
        chunk = scanned[start:start + c]
        v = np.resize(chunk, c)
        got = gains(v, np.zeros(c))
        if got is None:
            return None
        with np.errstate(all="ignore"):
            rho.extend((got[0] * np.sqrt(v) / gamma_c)[: len(chunk)].tolist())
    rho = np.array(rho)
    placement, eps, measured, confidence = eps_field.fit_eps(scanned, rho, det.noise, 1e3 * det.noise)
    eps = float(f"{eps:.6g}") if placement != "none" else 0.0
    tol = max(1000 * det.noise, 1e-7) * max(float(np.max(np.abs(gamma_c))), 1.0)
    gamma = bool(np.max(np.abs(gamma_c - 1)) > tol)
    beta = bool(np.max(np.abs(beta_c)) > tol)
    channel = [axis] if axis == 1 else [axis - ndim]
    axes = [a for a in range(ndim) if a != axis] if axis == 1 else [a - ndim for a in range(ndim) if a != axis]
    spec = NormSpec(center=center, axes=axes, eps=eps, eps_placement=placement, gamma=gamma, beta=beta,
                    param_axes=channel if (gamma or beta) else [], batch_stats="frozen")
    params = NormParams(gamma=gamma_c if gamma else None, beta=beta_c if beta else None,
                        running_mean=bufs[mean_name], running_var=bufs[var_name])
    ev: dict[str, Evidence] = {}
    ev["axes"] = Evidence(
        "running_mean/running_var buffers of one channel axis, and an output that is a per-channel affine map "
        "y = A·x + B (no position depends on another)",
        {"buffers": [mean_name, var_name], "channel_axis": axis, "channels": c}, Confidence.FROM_PARAMETERS,
        "statistics come from the buffers in every mode (a frozen BatchNorm): the reduced axes are the "
        "channel axis's complement by convention")
    ev["batch_stats"] = Evidence("train and eval modes give the same output, a per-channel affine map whose "
                                 "slope follows the running_var buffer",
                                 {"train_vs_eval_relative_change": found_modes.change}, Confidence.FROM_PARAMETERS)
    ev["center"] = Evidence("running_mean set to 1e6 in a private copy: the offset moves by −1e6·A when the "
                            "mean is subtracted", {"offset_shift_over_A_mean": float(np.median(shift))})
    ev["eps"] = Evidence("gain of each channel as its running_var is set to v in a private copy: inside "
                         "ε = v(1/r²−1), outside ε = √v(1/r−1), clamp ε = √v/r", {**measured, "eps": eps},
                         confidence)
    ev["eps_placement"] = eps_field.placement_evidence(measured, placement, confidence)
    ev["gamma"] = Evidence("slope of the map at running_var = 1e12: γ = A·1e6", {
        "min": float(gamma_c.min()), "max": float(gamma_c.max())}, Confidence.DECISIVE)
    ev["beta"] = Evidence("offset of the map at running_mean = 0", {"max_abs": float(np.max(np.abs(beta_c)))})
    ev["param_axes"] = Evidence("the channel axis of the buffers", {"param_axes": spec.param_axes},
                                Confidence.FROM_PARAMETERS)
    for field, why in (("variance", "the variance is a stored buffer: no estimator runs"),
                       ("variance_algorithm", "the variance is a stored buffer: no reduction runs")):
        ev[field] = Evidence(why, {}, Confidence.NOT_PROBED)
    ev["gamma_offset"] = Evidence("not inferable from behaviour", {}, Confidence.NOT_PROBED)
    return spec, params, ev
