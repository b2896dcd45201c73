"""Black-box inference of a normalization's complete contract.

Every experiment is an input whose correct output the reference knows; each field of the NormSpec comes
with the experiment that decided it and the numbers it measured. Experiments run per normalization
group, so one call carries many of them. The order:

1. dtypes the target accepts; train/eval behaviour (modules);
2. dependency: perturb single positions → the reduced axes (and GroupNorm groups);
3. scale invariance (else not a normalization) and common shift → ``center``;
4. ±u with u already normalized → β, γ (up to one scale) and ``param_axes``; for modules and ONNX models
   a private copy with random parameters pins γ's scale, hence ``variance`` (and γ's offset);
5. gain r(v) for u·√v down to the underflow range → ``eps`` and ``eps_placement``;
6. large common offset with small spread → ``variance_algorithm``;
7. bfloat16/float16 outputs against the reference's emulations → ``stats_dtype`` and ``affine_order``;
8. evaluation mode of train/eval modules → running statistics;
9. validation on fresh inputs: the contract must reproduce the target, or it is not a normalization.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference
from ..errors import InputError, NotANormalization, TargetError
from ..inputs import probe_shape, quiet
from ..jsonable import jsonable
from ..precision import UNIT_ROUNDOFF, Precision
from ..spec import NormSpec
from ..targets import Target, as_target
from ..targets.base import check_dtype_list, no_dtype_error
from .experiments import plus_minus, ulps, varying_axes
from .groups import Groups

SCHEMA = "normscope.inference/1"

# A "real" normalization reproduces its inferred contract to this relative error on fresh inputs.
VALIDATION_TOL = {"float64": 1e-5, "float32": 1e-4}

Progress = Callable[[str], None]


@dataclasses.dataclass
class Evidence:
    """Why one field has its value: the experiment, what it measured, and how sure that is."""

    experiment: str
    measured: dict[str, Any]
    confidence: str = "decisive"  # decisive · from parameters · assumed · not probed · weak
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"experiment": self.experiment, "measured": jsonable(self.measured),
                "confidence": self.confidence, "note": self.note}


@dataclasses.dataclass
class Inference:
    """The inferred contract with its evidence and the recovered parameters."""

    spec: NormSpec
    evidence: dict[str, Evidence]
    params: dict[str, np.ndarray]
    calls: int
    target: str
    shape: tuple[int, ...]
    probe_dtype: str
    dtypes: tuple[str, ...]
    seconds: float
    validation: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "target": self.target,
            "shape": list(self.shape),
            "probe_dtype": self.probe_dtype,
            "dtypes": list(self.dtypes),
            "spec": self.spec.to_dict(),
            "summary": self.spec.summary(),
            "evidence": {k: v.to_dict() for k, v in self.evidence.items()},
            "params": {k: np.asarray(v).tolist() for k, v in self.params.items()},
            "validation": jsonable(self.validation),
            "calls": self.calls,
            "seconds": round(self.seconds, 4),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _rel(a: np.ndarray, b: np.ndarray, scale: float | None = None) -> float:
    """max |a − b| relative to the RMS of b (or ``scale``)."""
    with np.errstate(all="ignore"):
        s = scale if scale is not None else float(np.sqrt(np.mean(np.square(b))))
        d = np.abs(a - b)
        if not np.all(np.isfinite(d)):
            return math.inf
        return float(d.max() / max(s, 1e-300))


def _natural(axes: tuple[int, ...], ndim: int, channel_style: bool) -> list[int]:
    """Report axes negative (trailing features) or non-negative (channel-first layouts)."""
    return sorted(axes) if channel_style else sorted(a - ndim for a in axes)


class _Prober:
    def __init__(self, target: Target, shape: tuple[int, ...], dtypes, seed: int, progress: Progress | None):
        self.t = target
        self.shape = shape
        self.ndim = len(shape)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InputError(f"seed must be an integer ≥ 0; got {seed!r}")
        self.rng = np.random.default_rng(seed)
        self.progress = progress or (lambda _msg: None)
        self.evidence: dict[str, Evidence] = {}
        allowed = dtypes or ("float64", "float32", "float16", "bfloat16")
        self.accepted = tuple(d for d in allowed if target.accepts(d, shape))
        if not self.accepted:
            raise no_dtype_error(target, allowed)
        if not {"float64", "float32"} & set(self.accepted):
            raise TargetError(
                f"{target.description} ran only on {', '.join(self.accepted)}; inference probes the structure "
                "in float32 or float64 (its experiments need their range and precision): allow one of them")
        self.dtype = "float64" if "float64" in self.accepted else "float32"
        self.noise = 64 * UNIT_ROUNDOFF[self.dtype]
        # set by the experiments as they run, in the order infer() calls them
        self.mode_change = 0.0  # modes(): train vs eval output change
        self.x0 = self.y0 = None  # dependency(): the base input and output, reused by invariances()
        self.scale_change = 0.0
        self.dep_records: list[dict[str, Any]] = []

    def run(self, x: np.ndarray, dtype: str | None = None) -> np.ndarray:
        return self.t(x, dtype or self.dtype)

    # ------------------------------------------------------------------ 1. modes
    def modes(self) -> bool:
        if not self.t.has_modes:
            return False
        x = self.rng.normal(size=self.shape) * 10
        with self.t.mode(True):
            y_train = self.run(x)
        with self.t.mode(False):
            y_eval = self.run(x)
        differ = _rel(y_train, y_eval) > 1e-9
        self.mode_change = _rel(y_train, y_eval)
        return differ

    # ------------------------------------------------------------------ 2. dependency
    def dependency(self) -> Groups:
        self.progress("dependency: which inputs each output depends on")
        shape = self.shape
        # Distinct values one apart: any two positions differ, so no group (even of two) has a variance
        # small enough for ε to matter, and scale invariance is a fair test.
        n = int(np.prod(shape))
        x0 = (self.rng.permutation(n) - (n - 1) / 2).reshape(shape).astype(np.float64)
        y0 = self.run(x0)
        if not np.all(np.isfinite(y0)):
            raise NotANormalization(
                f"the output has {int((~np.isfinite(y0)).sum())} non-finite values on a plain input")
        self.x0, self.y0 = x0, y0
        self.scale_change = _rel(self.run(x0 * 4.0), y0)
        if self.scale_change > 1e-2:
            raise NotANormalization(
                f"scaling the input by 4 changed the output by {self.scale_change:.3g} (relative max); a "
                "normalization is invariant to positive scale (softmax, elementwise maps and plain linear "
                "layers are not)")
        thr = 1e-6 * float(np.sqrt(np.mean(y0**2))) + 1e-300
        delta = 1e3 * (float(np.abs(x0).max()) + 1)
        probes = [tuple(0 for _ in shape), tuple(s - 1 for s in shape), tuple(s // 2 for s in shape)]
        found = None
        records = []
        for p in probes:
            moved = np.zeros(shape, dtype=bool)
            for sign in (1.0, -1.0):  # both signs: in a group of two only a change of order shows
                x = x0.copy()
                x[p] += sign * delta
                moved |= np.abs(self.run(x) - y0) > thr
            moved[p] = True
            n_moved = int(moved.sum())
            coords = np.nonzero(moved)
            axes, blocks = [], {}
            for a in range(self.ndim):
                values = np.unique(coords[a])
                if len(values) > 1:
                    axes.append(a)
                    if len(values) < shape[a]:
                        blocks[a] = values
            records.append({"position": list(p), "outputs_moved": n_moved})
            if len(blocks) > 1:
                raise NotANormalization(
                    f"perturbing x{list(p)} moved outputs in partial blocks along axes {sorted(blocks)}: "
                    "no reduction axes with groups explain it")
            groups = group_axis = None
            if blocks:
                (a, values), = blocks.items()
                b = len(values)
                start = (p[a] // b) * b
                if shape[a] % b or not np.array_equal(values, np.arange(start, start + b)):
                    raise NotANormalization(
                        f"perturbing x{list(p)} moved {b} of {shape[a]} positions along axis {a} "
                    f"({', '.join(map(str, values[:8].tolist()))}{', …' if b > 8 else ''}): not a "
                        "contiguous channel group, so no axes/groups explain it")
                groups, group_axis = shape[a] // b, a
            candidate = Groups.build(shape, tuple(axes), groups, group_axis)
            expected = candidate.labels == candidate.labels[p]
            if not np.array_equal(expected, moved):
                raise NotANormalization(
                    f"perturbing x{list(p)} moved {n_moved} outputs, but reducing over axes {axes} would move "
                    f"{int(expected.sum())}: the dependency pattern (e.g. causal or windowed) is not a reduction")
            key = (tuple(axes), groups, group_axis)
            if found is not None and key != found:
                raise NotANormalization(
                    f"different positions depend on different axes ({records}); no single set of reduced axes "
                    "explains the target")
            found = key
        axes, groups, group_axis = found
        self.dep_records = records
        return Groups.build(shape, axes, groups, group_axis)

    # ------------------------------------------------------------------ 3. invariances
    def invariances(self) -> bool:
        self.progress("invariances: common shift")
        scale_change = self.scale_change
        shift = 3 * float(np.std(self.x0))
        y_shift = self.run(self.x0 + shift)
        shift_change = _rel(y_shift, self.y0)
        center = shift_change < 1e-3
        self.evidence["center"] = Evidence(
            "add 3σ to every input: a centred norm does not move",
            {"shift": shift, "relative_change": shift_change, "relative_change_scale_4": scale_change},
            "decisive" if (shift_change < 1e-5 or shift_change > 1e-2) else "weak",
        )
        return center

    # ------------------------------------------------------------------ 4. affine
    def plus_minus(self, g: Groups, a: float):
        """β̂ and γ̂ = γ·r(a²) at every position from ±a·u, and the measurement's relative noise."""
        pm = plus_minus(self.run, g, self.rng, a)
        if not np.all(np.isfinite(pm.gamma)) or not np.all(np.isfinite(pm.beta)):
            raise NotANormalization("±u inputs (u already normalized) produced non-finite outputs")
        scale = max(float(np.max(np.abs(pm.gamma))), 1e-300)
        return pm.gamma, pm.beta, max(pm.gamma_noise, pm.beta_noise) / scale

    @staticmethod
    def fit_linear(obs: np.ndarray, p: np.ndarray):
        """Least squares obs ≈ c0 + c1·p; returns c0, c1 and the max residual relative to |obs|."""
        A = np.stack([np.ones(p.size), p.ravel()], axis=1)
        coef, *_ = np.linalg.lstsq(A, obs.ravel(), rcond=None)
        resid = np.abs(A @ coef - obs.ravel()).max() / max(np.abs(obs).max(), 1e-300)
        return float(coef[0]), float(coef[1]), float(resid)

    def expand_param(self, values: np.ndarray, axes: list[int]) -> np.ndarray | None:
        sizes = tuple(self.shape[a] for a in axes)
        v = np.asarray(values, dtype=np.float64)
        if v.size != int(np.prod(sizes)) or v.size < 2:
            return None
        full = [1] * self.ndim
        for a in axes:
            full[a] = self.shape[a]
        return np.broadcast_to(v.reshape(full), self.shape)

    # ------------------------------------------------------------------ 5. ε
    def gain_scan(self, g: Groups, gamma_hat, beta_hat, dtype: str, variances: np.ndarray):
        """ρ(v) = r(v)/r(V) for each variance v, measured per group by least squares."""
        rho = []
        per_call = g.count
        u = g.pattern(self.rng)
        gu = gamma_hat * u
        denom = g.sum(gu * gu)
        for start in range(0, len(variances), per_call):
            chunk = variances[start:start + per_call]
            scales = np.sqrt(np.resize(chunk, g.count))
            x = g.spread(scales) * u
            y = self.run(x, dtype)
            with np.errstate(all="ignore"):
                r = g.sum((y - beta_hat) * gu) / denom
            rho.extend(r[: len(chunk)].tolist())
        return np.array(rho)

    def fit_eps(self, variances, rho, noise, floor):
        """Fit each ε placement to the measured gains; ``floor`` is the smallest gain still measurable."""
        finite = np.isfinite(rho) & (rho > floor)
        v, r = variances[finite], rho[finite]
        if v.size == 0:
            raise NotANormalization(
                f"the gain of u·√v was unmeasurable at every variance from {variances.max():g} to {variances.min():g}")
        informative = (1 - r > max(100 * noise, 1e-12)) & (r > 1e-7)
        models = {
            "inside_sqrt": (lambda v, r: v * (1 / r**2 - 1), lambda v, e: np.sqrt(v / (v + e))),
            "outside_sqrt": (lambda v, r: np.sqrt(v) * (1 / r - 1), lambda v, e: np.sqrt(v) / (np.sqrt(v) + e)),
            "clamp": (lambda v, r: np.sqrt(v) / r, lambda v, e: np.minimum(1.0, np.sqrt(v) / e)),
        }
        out: dict[str, Any] = {"variances_scanned": [float(v.max()), float(v.min())], "points": int(len(v)),
                               "informative_points": int(informative.sum())}
        if informative.sum() == 0:
            out["gain_range"] = [float(r.min()), float(r.max())]
            return "none", 0.0, out, "decisive"
        residuals, estimates = {}, {}
        for name, (estimate, model) in models.items():
            with np.errstate(all="ignore"):
                e_i = estimate(v[informative], r[informative])
            e_i = e_i[np.isfinite(e_i) & (e_i > 0)]
            if e_i.size == 0:
                residuals[name] = math.inf
                continue
            sensitive = (r[informative] > 0.05) & (r[informative] < 0.95)
            e_s = estimate(v[informative][sensitive], r[informative][sensitive]) if sensitive.any() else e_i
            e_s = e_s[np.isfinite(e_s) & (e_s > 0)]
            eps = float(np.median(e_s if e_s.size else e_i))
            with np.errstate(all="ignore"):
                pred = model(v, eps)
                res = float(np.max(np.abs(np.log(np.maximum(r, 1e-300)) - np.log(np.maximum(pred, 1e-300)))))
            residuals[name], estimates[name] = res, eps
        best = min(residuals, key=residuals.get)
        ordered = sorted(residuals.values())
        out["model_residuals"] = residuals
        out["eps_by_model"] = estimates
        decisive = len(ordered) < 2 or ordered[1] > 10 * max(ordered[0], 1e-12)
        return best, estimates[best], out, "decisive" if decisive else "weak"

    # ------------------------------------------------------------------ 6. one-pass
    def one_pass(self, g: Groups, noise: float) -> bool:
        """A large common offset M with unit spread: E[x²]−E[x]² loses ~M²·u, two-pass only ~M·u.

        u is the target's effective precision (the ±u noise, at least the probe dtype's), so a target that
        computes in float32 behind a float64 interface is probed at an offset float32 can carry:
        M = u^-0.65 keeps two-pass error M·u ≲ 1% while one-pass error M²·u ≫ 1.
        """
        u_eff = max(noise / 4, UNIT_ROUNDOFF[self.dtype])
        offset = float(f"{u_eff ** -0.65:.1g}")
        u = g.pattern(self.rng)
        x = offset + u
        with np.errstate(all="ignore"):
            rounded = Precision(self.dtype).round(x).astype(np.float64) - offset
        y_off, y_dev = self.run(x), self.run(rounded)
        change = _rel(y_off, y_dev)
        self.evidence["variance_algorithm"] = Evidence(
            f"input {offset:g} + u (σ = 1) vs the same deviations without the offset: E[x²]−E[x]² cancels",
            {"offset": offset, "effective_precision": u_eff, "relative_change": change},
            "decisive" if (change < 0.01 or change > 0.2) else "weak",
        )
        return change > 0.05


@dataclasses.dataclass
class _Fit:
    """One parameter of a private copy explained as γ (slope, intercept) or β (offset) of the output."""

    name: str
    intercept: float
    slope: float
    residual: float
    axes: list[int]


@dataclasses.dataclass
class _Affine:
    """What the ±u experiments found: γ̂ = γ·r(V) and β̂ at every position, and the fields they decide."""

    gamma_hat: np.ndarray
    beta_hat: np.ndarray
    noise: float
    gamma: bool
    beta: bool
    param_axes: list[int]
    variance: str
    gamma_offset: float
    fitted: dict[str, _Fit | None] | None


BIG = 1e6  # ±u is scaled to variance 1e12: ε is negligible for every placement (ε/√V ≤ 1e-8 for ε ≤ 1e-2)


@quiet
def infer(
    target,
    *,
    shape,
    framework: str | None = None,
    dtypes=None,
    seed: int = 0,
    progress: Progress | None = None,
) -> Inference:
    """Recover the complete contract of a black-box normalization.

    ``target``: a torch module, an ONNX model (path, bytes, ModelProto), a Target, or a plain callable with
    ``framework="torch"|"numpy"|"jax"``. ``shape``: the input shape to probe with. Raises
    :class:`~normscope.NotANormalization` when no NormSpec explains the target, with the experiment that
    ruled it out.
    """
    started = time.perf_counter()
    t = as_target(target, framework)
    shape = probe_shape(shape)
    calls_before = t.calls
    pr = _Prober(t, shape, check_dtype_list(dtypes), seed, progress)
    ev = pr.evidence
    ndim = len(shape)

    has_modes = pr.modes()
    current_training = t.training
    structure_training = True if has_modes else bool(current_training)
    with t.mode(structure_training):
        g = pr.dependency()
        if not g.axes:
            raise NotANormalization(
                "each output depends only on its own input (perturbing one position moved no other "
                "output): an elementwise map, not a normalization")
        if g.size < 2:
            raise TargetError(f"each statistic covers one element at shape {shape}; probe a larger shape")
        center = pr.invariances()

        aff = _affine(pr, g)
        placement, eps, eps_dtype = _epsilon(pr, g, aff)
        algorithm = "two_pass"
        if center:
            algorithm = "one_pass" if pr.one_pass(g, aff.noise) else "two_pass"
        else:
            ev["variance_algorithm"] = Evidence("not applicable without centring", {}, "decisive")

        channel_style = (0 in g.axes) or g.groups is not None or bool(
            aff.param_axes and not set(aff.param_axes) <= set(g.axes))
        spec = NormSpec(
            center=center,
            axes=_natural(g.axes, ndim, channel_style),
            groups=g.groups,
            group_axis=None if g.group_axis is None else _natural((g.group_axis,), ndim, channel_style)[0],
            eps=eps,
            eps_placement=placement,
            variance=aff.variance,
            variance_algorithm=algorithm,
            gamma=aff.gamma,
            beta=aff.beta,
            param_axes=_natural(tuple(aff.param_axes), ndim, channel_style),
            gamma_offset=aff.gamma_offset if aff.gamma else 0.0,
            batch_stats=("batch" if has_modes else None),
        )
        unit_axes = _natural(tuple(a for a in range(ndim) if shape[a] == 1), ndim, channel_style)
        ev["axes"] = Evidence("perturb one input by ±1e3·max|x| and see which outputs move",
                              {"probes": pr.dep_records, "group_size": g.size, "groups_per_call": g.count},
                              "weak" if unit_axes else "decisive",
                              f"axes {unit_axes} have size 1 at this shape, so whether they are reduced cannot be "
                              "seen: probe a shape with at least 2 along them" if unit_axes else "")

        params = _parameter_values(pr, g, spec, aff)

        spec = _precision_with_parameters(pr, spec, params, aff, "")

        pr.progress("validation on fresh inputs")
        validation = _validate(pr, spec, params, g, None, eps_dtype)

    final = spec
    if has_modes:
        with t.mode(False):
            running = _running_stats(pr, spec, params, g)
        params.update(running)
        eval_spec = spec.replace(batch_stats="running")
        with t.mode(False):
            if not current_training:  # evaluation may apply its statistics at another precision than training
                train_ev = {k: ev[k] for k in ("stats_dtype", "affine_order") if k in ev}
                eval_spec = _precision_with_parameters(pr, eval_spec, params, aff, ", evaluation mode")
                for k, e in train_ev.items():
                    ev[k].measured["training_mode"] = {"chosen": getattr(spec, k), "evidence": e.measured}
            validation["eval"] = _validate(pr, eval_spec, params, g, running, eps_dtype)
        ev["batch_stats"] = Evidence(
            "outputs in train and eval mode differ; train mode reduces over the batch, eval is per-channel affine",
            {"train_vs_eval_relative_change": pr.mode_change, "module_mode": "train" if current_training else "eval"})
        if not current_training:
            final = eval_spec
    else:
        ev["batch_stats"] = Evidence("train and eval modes give the same output" if t.has_modes else
                                     "no train/eval modes", {}, "decisive")

    return Inference(
        spec=final, evidence=ev, params=params, calls=t.calls - calls_before, target=t.description,
        shape=shape, probe_dtype=pr.dtype, dtypes=pr.accepted, seconds=time.perf_counter() - started,
        validation=validation)


def _affine(pr: _Prober, g: Groups) -> _Affine:
    """Step 4: β, γ (up to scale) and param_axes; with a private copy, γ's scale, variance and offset."""
    pr.progress("affine: ±u with u already normalized")
    ev = pr.evidence
    gamma_hat, beta_hat, noise = pr.plus_minus(g, BIG)
    if noise > max(1e-3, 16 * UNIT_ROUNDOFF[pr.dtype]):
        raise NotANormalization(
            f"two different inputs with identical statistics (±u, u normalized per group) gave γ/β estimates "
            f"that differ by {noise:.3g} (relative): the output depends on more than the mean and variance "
            "(e.g. max-abs scaling)")
    noise = max(noise, pr.noise)
    tol = max(1000 * noise, 1e-7) * max(float(np.max(np.abs(gamma_hat))), 1.0)
    g_axes = varying_axes(gamma_hat, tol)
    b_axes = varying_axes(beta_hat, tol)
    unbiased_gain = math.sqrt((g.size - 1) / g.size)
    fitted = _fit_parameters(pr, g, tol)

    if fitted is not None:
        gamma, beta = fitted["gamma"] is not None, fitted["beta"] is not None
        param_axes = sorted(set((fitted["gamma"] or fitted["beta"]).axes))
        variance, gamma_offset = "biased", 0.0
        if gamma:
            fit = fitted["gamma"]
            gain = abs(fit.slope)
            variance = "unbiased" if abs(gain - unbiased_gain) < abs(gain - 1) else "biased"
            gamma_offset = round(fit.intercept / fit.slope, 6) + 0.0  # no −0.0
            ev["gamma"] = Evidence(
                f"a private copy with random parameters: output slope follows parameter {fit.name!r}",
                {"parameter": fit.name, "fit_intercept": fit.intercept, "fit_slope": fit.slope,
                 "fit_residual": fit.residual}, "from parameters")
            ev["variance"] = Evidence(
                "large-variance gain against the known γ: 1 means ÷d, √((d−1)/d) means ÷(d−1)",
                {"gain": gain, "biased_expects": 1.0, "unbiased_expects": unbiased_gain, "d": g.size})
        else:
            const = float(np.mean(gamma_hat))
            variance = "unbiased" if abs(const - unbiased_gain) < abs(const - 1) else "biased"
            ev["variance"] = Evidence(
                "large-variance gain (no γ): 1 means ÷d, √((d−1)/d) means ÷(d−1)",
                {"gain": const, "biased_expects": 1.0, "unbiased_expects": unbiased_gain, "d": g.size})
        if beta:
            ev["beta"] = Evidence(
                f"a private copy with random parameters: output offset equals parameter {fitted['beta'].name!r}",
                {"parameter": fitted["beta"].name, "fit_residual": fitted["beta"].residual}, "from parameters")
        ev["gamma_offset"] = Evidence("intercept/slope of the output scale against the weight",
                                      {"gamma_offset": gamma_offset}, "from parameters")
    else:
        param_axes = sorted(set(g_axes) | set(b_axes))
        beta = float(np.max(np.abs(beta_hat))) > tol
        const = float(np.mean(gamma_hat))
        gamma, variance, gamma_offset = bool(g_axes), "biased", 0.0
        if not g_axes:
            if abs(const - 1) <= tol:
                gamma = False
            elif abs(const - unbiased_gain) <= tol:
                gamma, variance = False, "unbiased"
            else:
                gamma = True
            ev["variance"] = Evidence(
                "large-variance gain (no learned γ varies): 1 means ÷d, √((d−1)/d) means ÷(d−1)",
                {"gain": const, "biased_expects": 1.0, "unbiased_expects": unbiased_gain, "d": g.size},
                "assumed" if gamma else "decisive",
                "a constant γ≠1 and ÷d vs ÷(d−1) are confounded; assumed ÷d" if gamma else "")
        else:
            ev["variance"] = Evidence(
                "large-variance gain", {"d": g.size}, "assumed",
                "with a learned γ of unknown scale, ÷d and ÷(d−1) are behaviourally identical up to γ's "
                "scale; assumed ÷d (pass a module or ONNX model to pin it)")
        ev["gamma"] = Evidence(
            "±a·u (u normalized): γ·r = (y₊ − y₋)/2u per coordinate",
            {"varies_along_axes": g_axes, "mean": const, "min": float(gamma_hat.min()),
             "max": float(gamma_hat.max())},
            "decisive" if g_axes or not gamma else "weak")
        ev["gamma_offset"] = Evidence("not inferable from behaviour", {}, "not probed",
                                      "(1+w) and γ=1+w are the same function; known only from weights")
    if not (gamma or beta):
        param_axes = []
    ev.setdefault("beta", Evidence(
        "±a·u: β = (y₊ + y₋)/2 per coordinate",
        {"varies_along_axes": b_axes, "max_abs": float(np.max(np.abs(beta_hat)))}))
    ev["param_axes"] = Evidence(
        "axes along which the recovered γ/β vary",
        {"gamma_axes": g_axes, "beta_axes": b_axes, "param_axes": param_axes},
        "from parameters" if fitted else ("decisive" if param_axes else "weak"))
    return _Affine(gamma_hat, beta_hat, noise, gamma, beta, param_axes, variance, gamma_offset, fitted)


def _fit_parameters(pr: _Prober, g: Groups, tol: float) -> dict[str, _Fit | None] | None:
    """In a private copy with random parameters, find the parameter acting as γ (y ∝ c₀ + c₁·w) and as β."""
    with pr.t.perturbed_parameters(pr.rng) as values:
        if not values:
            return None
        gp, bp, _ = pr.plus_minus(g, BIG)
    pg_axes, pb_axes = varying_axes(gp, tol), varying_axes(bp, tol)
    fitted: dict[str, _Fit | None] = {"gamma": None, "beta": None}
    for name, v in values.items():
        if fitted["gamma"] is None and (full := pr.expand_param(v, pg_axes)) is not None:
            c0, c1, res = pr.fit_linear(gp, full)
            if res < 1e-4 and abs(c1) > 1e-3:
                fitted["gamma"] = _Fit(name, c0, c1, res, pg_axes)
                continue
        if fitted["beta"] is None and (full := pr.expand_param(v, pb_axes)) is not None:
            b0, b1, res = pr.fit_linear(bp, full)
            if res < 1e-4 and abs(b1 - 1) < 1e-3:
                fitted["beta"] = _Fit(name, b0, b1, res, pb_axes)
    return fitted if (fitted["gamma"] or fitted["beta"]) else None


def _epsilon(pr: _Prober, g: Groups, aff: _Affine) -> tuple[str, float, str]:
    """Step 5: ε and its placement from the gain of u·√v, cross-checked at float32; returns the dtype used."""
    pr.progress("ε: gain of u·√v for v down to the underflow range")
    lo = -60 if pr.dtype == "float64" else -36
    variances = 10.0 ** np.arange(4, lo - 1, -1, dtype=np.float64)
    rho = pr.gain_scan(g, aff.gamma_hat, aff.beta_hat, pr.dtype, variances)
    # Below this gain the signal γ·r·u drowns in the rounding of β (and of the output itself).
    floor = 1e3 * aff.noise * (1 + float(np.max(np.abs(aff.beta_hat)))
                               / max(float(np.mean(np.abs(aff.gamma_hat))), 1e-300))
    placement, eps_fit, measured, confidence = pr.fit_eps(variances, rho, aff.noise, floor)
    eps_dtype = pr.dtype
    if pr.dtype == "float64" and "float32" in pr.accepted and placement != "none":
        v32 = 10.0 ** np.arange(4, -37, -1, dtype=np.float64)
        rho32 = pr.gain_scan(g, aff.gamma_hat, aff.beta_hat, "float32", v32)
        n32 = 64 * UNIT_ROUNDOFF["float32"]
        p32, e32, _, _ = pr.fit_eps(v32, rho32, n32, floor * n32 / aff.noise)
        measured["float32_check"] = {"placement": p32, "eps": e32}
        if p32 == placement and e32 > 0 and abs(e32 / eps_fit - 1) > 0.02 and e32 > 1e-10:
            measured["dtype_dependent"] = {"float64": eps_fit, "float32": e32}
            eps_fit, eps_dtype = e32, "float32"
    # an unbiased estimator scales the variance by d/(d−1): the measured ε is ε/k inside, ε/√k outside
    k = g.size / (g.size - 1) if aff.variance == "unbiased" else 1.0
    correction = math.sqrt(k) if placement in ("outside_sqrt", "clamp") else k
    eps = float(f"{eps_fit * correction:.6g}") if placement != "none" else 0.0
    note = ""
    if "dtype_dependent" in measured:
        dep = measured["dtype_dependent"]
        note = (f"ε depends on the input dtype ({dep['float64']:.4g} at float64, {dep['float32']:.4g} at float32, "
                "e.g. finfo(dtype).eps); reported at float32")
    pr.evidence["eps"] = Evidence(
        "gain r(v) of u·√v: inside ε = v(1/r²−1), outside ε = √v(1/r−1), clamp ε = √v/r",
        {**measured, "eps": eps, "measured_at": eps_dtype}, confidence, note)
    pr.evidence["eps_placement"] = Evidence(
        "the placement whose ε estimates agree across v (log-residual)",
        {"residuals": measured.get("model_residuals", {}), "chosen": placement}, confidence)
    return placement, eps, eps_dtype


def _parameter_values(pr: _Prober, g: Groups, spec: NormSpec, aff: _Affine) -> dict[str, np.ndarray]:
    """γ = γ̂ / r(V) with r(V) from the reference for the inferred spec, and β = β̂, at the param shape."""
    base = spec.without_affine()
    u = g.pattern(pr.rng)
    xhat = reference.forward(BIG * u, base)
    r_v = g.spread(g.sum(xhat * u) / g.sum(u * u))
    pidx = spec.resolve_param_axes(pr.ndim)
    take = tuple(slice(None) if a in pidx else 0 for a in range(pr.ndim))
    params: dict[str, np.ndarray] = {}
    if aff.gamma:
        params["gamma"] = (aff.gamma_hat / r_v)[take] - spec.gamma_offset
    if aff.beta:
        params["beta"] = aff.beta_hat[take]
    return params


def _precision_with_parameters(pr: _Prober, spec: NormSpec, params, aff: _Affine, mode: str) -> NormSpec:
    """Step 7, with distinct random γ/β in a private copy where possible (identity γ/β hide the cast order)."""
    if aff.fitted is None:
        return _precision(pr, spec, params, pr.evidence, "as recovered" + mode)
    with pr.t.perturbed_parameters(pr.rng) as values:
        known = {field: np.asarray(values[fit.name], dtype=np.float64).reshape(
            reference.param_shape(pr.shape, spec)) for field, fit in aff.fitted.items() if fit is not None}
        known.update({k: v for k, v in params.items() if k.startswith("running_")})
        return _precision(pr, spec, known, pr.evidence, "random, in a private copy" + mode)


def _precision(pr: _Prober, spec: NormSpec, params, ev, source: str) -> NormSpec:
    low = [d for d in ("bfloat16", "float16") if d in pr.accepted]
    if not low:
        note = f"the target accepts only {', '.join(pr.accepted)}; fp32 statistics assumed"
        ev["stats_dtype"] = Evidence("needs bfloat16/float16 inputs", {}, "not probed", note)
        ev["affine_order"] = Evidence("needs bfloat16/float16 inputs", {}, "not probed", note)
        return spec
    pr.progress("precision: low-precision outputs against the reference's emulations")
    g = Groups.of(spec, pr.shape)
    candidates = [(s, o) for s in ("float32", "input") for o in ("cast_then_scale", "scale_then_cast")]
    per_dtype: dict[str, dict] = {}
    for d in low:
        sigma = g.spread(10.0 ** pr.rng.uniform(-1, 2, size=g.count))
        offset = g.spread(np.where(np.arange(g.count) % 2 == 0, 0.0, 30.0)) * sigma
        x = Precision(d).round(pr.rng.normal(size=pr.shape) * sigma + offset).astype(np.float64)
        y = pr.run(x, d)
        ulp = ulps(y, d)
        scores = {}
        for c in candidates:
            cand = spec.replace(stats_dtype=c[0], affine_order=c[1])
            # parameters stored in the input dtype (torch .to(dtype)) or kept in fp32 (flax): the closer
            for pdt in (None, "float32"):
                yr = reference.forward(x, cand, dtype=d, gamma=params.get("gamma"), beta=params.get("beta"),
                                       running_mean=params.get("running_mean"), running_var=params.get("running_var"),
                                       param_dtype=pdt)
                with np.errstate(all="ignore"):
                    err = float(np.nanmean(np.abs(y - yr) / ulp))
                scores[c] = min(scores.get(c, math.inf), err)
        per_dtype[d] = scores
    # Decide on the dtype whose best candidate matches most closely (a faithful path matches to ~0 ulps).
    decider = min(per_dtype, key=lambda d: min(per_dtype[d].values()))
    scores = per_dtype[decider]
    best = min(scores, key=scores.get)
    measured = {f"{d}: {c[0]} statistics, {c[1].replace('_', ' ')}": v
                for d, sc in per_dtype.items() for c, v in sc.items()}
    def separates(sc) -> bool:  # this dtype's best for the chosen statistics beats the other by 2×
        mine = min(v for (st, _), v in sc.items() if st == best[0])
        other = min(v for (st, _), v in sc.items() if st != best[0])
        return other > 2 * max(mine, 0.05)

    # decisive when the best-matching dtype separates the two, or another dtype does so clearly
    quality = "decisive" if scores[best] < 1.0 and any(separates(sc) for sc in per_dtype.values()) else "weak"
    note = ""
    if scores[best] >= 1.0:
        note = (f"no candidate reproduces the {decider} output (best {scores[best]:.2g} ulps mean): the target "
                "rounds differently from every emulated contract")
    ev["stats_dtype"] = Evidence(
        f"{'/'.join(low)} outputs vs the reference emulating each candidate (mean error in ulps; γ/β {source})",
        {"mean_error_ulps": measured, "decided_at": decider, "chosen": best[0]}, quality, note)
    order_other = scores[(best[0], "scale_then_cast" if best[1] == "cast_then_scale" else "cast_then_scale")]
    if (spec.gamma or spec.beta) and best[0] == "float32" and order_other == scores[best]:
        ev["affine_order"] = Evidence("× γ before or after the cast back", {"error_ulps": scores[best]},
                                      "not probed", "γ ≡ 1 and β ≡ 0 here: the order is not observable")
        order = "scale_then_cast"
    elif (spec.gamma or spec.beta) and best[0] == "float32":
        conf = "decisive" if order_other > 1.5 * max(scores[best], 0.02) and scores[best] < 1.0 else "weak"
        ev["affine_order"] = Evidence(
            f"same experiment at {decider}: × γ before or after the cast back",
            {"chosen": best[1], "error_chosen_ulps": scores[best], "error_other_ulps": order_other}, conf)
        order = best[1]
    else:
        ev["affine_order"] = Evidence("not applicable (no affine, or statistics in the input dtype)", {},
                                      "decisive")
        order = "scale_then_cast"
    return spec.replace(stats_dtype=best[0], affine_order=order)


def _inputs(pr: _Prober, g: Groups):
    rng = pr.rng
    yield "normal σ=10", rng.normal(size=pr.shape) * 10
    yield "offset 3 + N(0,1)", 3.0 + rng.normal(size=pr.shape)
    scales = g.spread(10.0 ** rng.uniform(-2, 2, size=g.count))
    yield "heavy-tailed, per-group scales 1e-2..1e2", rng.standard_t(3, size=pr.shape) * scales


def _validate(pr: _Prober, spec, params, g, running, dtype: str) -> dict[str, Any]:
    tol = VALIDATION_TOL.get(dtype, 1e-2)
    out: dict[str, Any] = {"tolerance": tol, "dtype": dtype}
    worst = 0.0
    kw = {}
    if running:
        kw = {"running_mean": running.get("running_mean"), "running_var": running.get("running_var")}
    for label, x in _inputs(pr, g):
        x = Precision(dtype).round(x).astype(np.float64)
        y = pr.run(x, dtype)
        yr = reference.forward(x, spec, gamma=params.get("gamma"), beta=params.get("beta"),
                               dtype=dtype if dtype != "float64" else None, **kw)
        err = _rel(y, yr, max(1.0, float(np.sqrt(np.mean(yr**2)))))
        out[label] = err
        worst = max(worst, err)
    out["max_relative_error"] = worst
    if not worst <= tol:
        errors = ", ".join(f"{k}: {v:.3g}" for k, v in out.items() if k not in ("tolerance", "dtype"))
        raise NotANormalization(
            f"the closest contract found ({spec.summary()}) reproduces the target only to a relative error of "
            f"{worst:.3g} on fresh inputs ({errors}); "
            f"a normalization matches to ≤ {tol:g}: no NormSpec explains this target")
    return out


def _running_stats(pr: _Prober, spec: NormSpec, params, g: Groups) -> dict[str, np.ndarray]:
    """Eval mode is a per-channel affine y = A·x + B: recover running mean and variance from A and B."""
    pr.progress("running statistics in evaluation mode")
    x1 = pr.rng.normal(size=pr.shape) * 3
    x2 = x1 + 1.0 + pr.rng.uniform(0.5, 1.5, size=pr.shape)
    y1, y2 = pr.run(x1), pr.run(x2)
    slope = (y2 - y1) / (x2 - x1)
    intercept = y1 - slope * x1
    ndim = pr.ndim
    kept = [a for a in range(ndim) if a not in spec.resolve_axes(ndim) and a != 0]
    take = tuple(slice(None) if a in kept else 0 for a in range(ndim))
    A, B = slope[take], intercept[take]
    pidx = spec.resolve_param_axes(ndim)
    gamma = params.get("gamma")
    beta = params.get("beta")
    gam = np.ones_like(A) if gamma is None or tuple(pidx) != tuple(kept) else gamma + spec.gamma_offset
    bet = np.zeros_like(A) if beta is None or tuple(pidx) != tuple(kept) else beta
    with np.errstate(all="ignore"):
        var = (gam / A) ** 2 - spec.eps
        mean = (bet - B) / A if spec.center else np.zeros_like(A)
    return {"running_mean": mean, "running_var": var}
