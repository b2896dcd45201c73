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
        self.seed = seed
        self.repeat = 0.0  # determinism(): relative difference between identical calls (0: deterministic)
        self.noise = 64 * UNIT_ROUNDOFF[self.dtype]
        # set by the experiments as they run, in the order infer() calls them
        self.mode_change = 0.0  # modes(): train vs eval output change
        self.x0 = self.y0 = None  # dependency(): the base input and output, reused by invariances()
        self.scale_change = 0.0
        self.dep_records: list[dict[str, Any]] = []

    def run(self, x: np.ndarray, dtype: str | None = None) -> np.ndarray:
        return self.t(x, dtype or self.dtype)

    # ------------------------------------------------------------------ 0. determinism
    def determinism(self) -> None:
        """The same input three times: how far identical calls disagree becomes the floor of every experiment.

        A target that reduces in a different order on each call (atomics on a GPU) moves by an ulp or so of
        its compute precision; without this floor such noise reads as a train/eval difference or as a
        dependency between positions. Uses its own random stream, so a deterministic target is probed
        exactly as before.
        """
        x = np.random.default_rng([self.seed, 7]).normal(size=self.shape) * 10
        ys = [self.run(x) for _ in range(3)]
        finite = np.all([np.isfinite(y) for y in ys], axis=0)
        spread = max(_rel(y[finite], ys[0][finite]) for y in ys[1:]) if finite.any() else 0.0
        self.repeat = spread
        self.noise = max(self.noise, 16 * spread)
        note = ""
        if spread > 0:
            note = (f"non-deterministic: identical calls differ by up to {spread:.3g} (relative); every experiment "
                    f"treats differences below {self.noise:.3g} as noise, and train/eval below {self.mode_floor:.3g}")
        self.evidence["determinism"] = Evidence(
            f"the same input three times at {self.dtype}",
            {"max_relative_difference": spread, "noise_floor": self.noise}, "decisive", note)

    @property
    def mode_floor(self) -> float:
        """A train/eval change below this is the target's own call-to-call noise."""
        return max(1e-9, 1000 * self.repeat)

    # ------------------------------------------------------------------ 1. modes
    def modes(self) -> bool:
        if not self.t.has_modes:
            return False
        x = self.rng.normal(size=self.shape) * 10
        with self.t.mode(True):
            y_train = self.run(x)
        with self.t.mode(False):
            y_eval = self.run(x)
        self.mode_change = _rel(y_train, y_eval)
        return self.mode_change > self.mode_floor

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
            self._refuse_affine_map(x0)
            raise NotANormalization(
                f"scaling the input by 4 changed the output by {self.scale_change:.3g} (relative max); a "
                "normalization is invariant to positive scale (softmax, elementwise maps and plain linear "
                "layers are not)")
        thr = max(1e-6, 100 * self.repeat) * float(np.sqrt(np.mean(y0**2))) + 1e-300
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

    def _refuse_affine_map(self, x0: np.ndarray) -> None:
        """Not scale invariant: say so plainly when the output is a fixed affine map of each input on its own."""
        for axis in range(self.ndim):
            affine = _channel_affine(self, axis, x0 + 0.25)  # x0 + ¼ has no zero entry
            if affine is not None and all(np.ptp(v) <= 1e-9 * max(float(np.max(np.abs(v))), 1.0) for v in affine):
                raise NotANormalization(
                    f"scaling the input by 4 changed the output by {self.scale_change:.3g} (relative max): the "
                    f"output is the same elementwise affine map y = {float(affine[0][0]):.4g}·x + "
                    f"{float(affine[1][0]):.4g} at every position, not a normalization")
            if affine is not None:
                raise NotANormalization(
                    f"scaling the input by 4 changed the output by {self.scale_change:.3g} (relative max), and "
                    f"the output is a fixed affine map y = A·x + B of each input on its own, with A and B set by "
                    f"axis {axis} alone: no statistics of the input are used (a frozen BatchNorm whose "
                    "statistics live in buffers normscope does not recognise — it reads running_mean/running_var "
                    "— or a per-channel scale), so this is not a normalization of its input")


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
    calls_before, modified_before = t.calls, t.input_modifications
    pr = _Prober(t, shape, check_dtype_list(dtypes), seed, progress)
    ev = pr.evidence
    ndim = len(shape)

    pr.determinism()
    has_modes = pr.modes()
    if not has_modes and (frozen := _frozen_batchnorm(pr)) is not None:
        spec, params, validation = frozen
        _note_input_changes(pr, modified_before)
        return Inference(
            spec=spec, evidence=ev, params=params, calls=t.calls - calls_before, target=t.description,
            shape=shape, probe_dtype=pr.dtype, dtypes=pr.accepted, seconds=time.perf_counter() - started,
            validation=validation)
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
    _note_input_changes(pr, modified_before)

    return Inference(
        spec=final, evidence=ev, params=params, calls=t.calls - calls_before, target=t.description,
        shape=shape, probe_dtype=pr.dtype, dtypes=pr.accepted, seconds=time.perf_counter() - started,
        validation=validation)


def _note_input_changes(pr: _Prober, before: int) -> None:
    """A finding, not a failure: the target writes to the tensor it is given (normscope passes it a copy)."""
    changed = pr.t.input_modifications - before
    if changed:
        pr.evidence["modifies_input"] = Evidence(
            "the input array handed to the target, compared after each call", {"calls_that_modified_input": changed},
            "decisive", "the target modifies its input in place: a caller that reuses its tensor gets other values "
                        "(normscope gave it a private copy on every call)")


def _running_buffers(pr: _Prober) -> tuple[str, str, int] | None:
    """Buffers named ``…running_mean``/``…running_var`` of one channel axis of the probe shape, with that axis."""
    bufs = pr.t.buffers()
    means = [n for n in bufs if n.split(".")[-1] == "running_mean"]
    for m in means:
        v = m[: -len("running_mean")] + "running_var"
        if v not in bufs or bufs[m].ndim != 1 or bufs[m].shape != bufs[v].shape:
            continue
        c = bufs[m].shape[0]
        axes = [a for a in (1, pr.ndim - 1) if pr.ndim > a and pr.shape[a] == c]
        if axes:
            return m, v, axes[0]
    return None


def _channel_affine(pr: _Prober, axis: int, x: np.ndarray):
    """A, B of y = A·x + B from ±x around 0 (x nonzero), per position; None when the map is not affine."""
    y1, y2, y0 = pr.run(x), pr.run(-x), pr.run(np.zeros(pr.shape))
    with np.errstate(all="ignore"):
        A = (y1 - y2) / (2 * x)
    B = (y1 + y2) / 2
    scale = max(float(np.max(np.abs(y1))), 1e-300)
    if not (np.all(np.isfinite(A)) and np.all(np.isfinite(B))):
        return None
    tol = max(1e3 * pr.noise, 1e-9) * scale
    if float(np.max(np.abs(y0 - B))) > tol:
        return None
    others = tuple(a for a in range(pr.ndim) if a != axis)
    A_c, B_c = A.mean(axis=others), B.mean(axis=others)
    full = [1] * pr.ndim
    full[axis] = pr.shape[axis]
    if float(np.max(np.abs(A * x - A_c.reshape(full) * x))) > tol or float(np.max(np.abs(B - B_c.reshape(full)))) > tol:
        return None
    return A_c, B_c


def _frozen_batchnorm(pr: _Prober):
    """A BatchNorm frozen in both modes: running statistics in buffers, output a per-channel affine map.

    Recognised from its ``running_mean``/``running_var`` buffers; ε and its placement come from the gain of
    the channel as its running variance is set to v = 10⁴ … 10⁻⁶⁰ in a private copy (the same fit as the
    gain scan of batch-statistics norms), γ and β from the map itself. Returns None when the target is
    not one (no such buffers, or an output that is not a per-channel affine map).
    """
    found = _running_buffers(pr)
    if found is None:
        return None
    mean_name, var_name, axis = found
    x = pr.rng.uniform(0.5, 1.5, size=pr.shape) * pr.rng.choice([-1.0, 1.0], size=pr.shape) * 3
    affine = _channel_affine(pr, axis, x)
    if affine is None:
        return None
    pr.progress("frozen BatchNorm: running statistics read from buffers, ε from a private copy")
    ev, ndim, c = pr.evidence, pr.ndim, pr.shape[axis]
    bufs = pr.t.buffers()
    running = {"running_mean": bufs[mean_name], "running_var": bufs[var_name]}
    big = BIG**2

    def gains(var: np.ndarray, mean: np.ndarray):
        with pr.t.with_buffers({mean_name: mean, var_name: var}) as ok:
            if not ok:
                return None
            return _channel_affine(pr, axis, x)

    ref = gains(np.full(c, big), np.zeros(c))
    moved = gains(np.full(c, big), np.full(c, BIG))
    if ref is None or moved is None:
        return None
    gamma_c = ref[0] * math.sqrt(big)  # ε is negligible at variance 1e12
    beta_c = ref[1]
    shift = (moved[1] - ref[1]) / np.where(ref[0] != 0, ref[0] * BIG, 1.0)  # −1 when the mean is subtracted
    center = bool(np.median(np.abs(shift + 1)) < 1e-3)
    variances = 10.0 ** np.arange(4, (-60 if pr.dtype == "float64" else -36) - 1, -1, dtype=np.float64)
    rho = []
    for start in range(0, len(variances), c):
        chunk = variances[start:start + c]
        v = np.resize(chunk, c)
        got = gains(v, np.zeros(c))
        if got is None:
            return None
        with np.errstate(all="ignore"):
            rho.extend((got[0] * np.sqrt(v) / gamma_c)[: len(chunk)].tolist())
    rho = np.array(rho)
    placement, eps, measured, confidence = pr.fit_eps(variances, rho, pr.noise, 1e3 * pr.noise)
    eps = float(f"{eps:.6g}") if placement != "none" else 0.0
    tol = max(1000 * pr.noise, 1e-7) * max(float(np.max(np.abs(gamma_c))), 1.0)
    gamma = bool(np.max(np.abs(gamma_c - 1)) > tol)
    beta = bool(np.max(np.abs(beta_c)) > tol)
    channel = [axis] if axis == 1 else [axis - ndim]
    axes = [a for a in range(ndim) if a != axis] if axis == 1 else [a - ndim for a in range(ndim) if a != axis]
    spec = NormSpec(center=center, axes=axes, eps=eps, eps_placement=placement, gamma=gamma, beta=beta,
                    param_axes=channel if (gamma or beta) else [], batch_stats="running")
    params = dict(running)
    if gamma:
        params["gamma"] = gamma_c
    if beta:
        params["beta"] = beta_c
    evidence_axes = {"buffers": [mean_name, var_name], "channel_axis": axis, "channels": c}
    ev["axes"] = Evidence(
        "running_mean/running_var buffers of one channel axis, and an output that is a per-channel affine map "
        "y = A·x + B (no position depends on another)", evidence_axes, "from parameters",
        "statistics come from the buffers in every mode (a frozen BatchNorm): the reduced axes are the "
        "channel axis's complement by convention")
    ev["batch_stats"] = Evidence("train and eval modes give the same output, a per-channel affine map whose "
                                 "slope follows the running_var buffer", {"train_vs_eval_relative_change":
                                 pr.mode_change}, "from parameters")
    ev["center"] = Evidence("running_mean set to 1e6 in a private copy: the offset moves by −1e6·A when the "
                            "mean is subtracted", {"offset_shift_over_A_mean": float(np.median(shift))})
    ev["eps"] = Evidence("gain of each channel as its running_var is set to v in a private copy: inside "
                         "ε = v(1/r²−1), outside ε = √v(1/r−1), clamp ε = √v/r", {**measured, "eps": eps},
                         confidence)
    ev["eps_placement"] = Evidence("the placement whose ε estimates agree across v (log-residual)",
                                   {"residuals": measured.get("model_residuals", {}), "chosen": placement},
                                   confidence)
    ev["gamma"] = Evidence("slope of the map at running_var = 1e12: γ = A·1e6", {
        "min": float(gamma_c.min()), "max": float(gamma_c.max())}, "decisive")
    ev["beta"] = Evidence("offset of the map at running_mean = 0", {"max_abs": float(np.max(np.abs(beta_c)))})
    ev["param_axes"] = Evidence("the channel axis of the buffers", {"param_axes": spec.param_axes}, "from parameters")
    for field, why in (("variance", "the variance is a stored buffer: no estimator runs"),
                       ("variance_algorithm", "the variance is a stored buffer: no reduction runs")):
        ev[field] = Evidence(why, {}, "not probed")
    ev["gamma_offset"] = Evidence("not inferable from behaviour", {}, "not probed")
    g = Groups.build(pr.shape, tuple(a for a in range(ndim) if a != axis))
    spec = _precision(pr, spec, params, ev, "from the map, running statistics from buffers")
    pr.progress("validation on fresh inputs")
    validation = _validate(pr, spec, params, g, running, pr.dtype)
    return spec, params, validation


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
    separation: dict[str, dict] = {}
    for d in low:
        sigma = g.spread(10.0 ** pr.rng.uniform(-1, 2, size=g.count))
        if d == "float16":  # stay where every candidate is finite: a group's sum of squares below 2¹⁴
            sigma = sigma * min(1.0, math.sqrt(2.0**14 / g.size) / 34 / 100)
        offset = g.spread(np.where(np.arange(g.count) % 2 == 0, 0.0, 30.0)) * sigma
        x = Precision(d).round(pr.rng.normal(size=pr.shape) * sigma + offset).astype(np.float64)
        y = pr.run(x, d)
        ulp = ulps(y, d)
        with np.errstate(all="ignore"):  # the same call again: a non-deterministic target's own noise, in ulps
            repeat = float(np.nanmean(np.abs(pr.run(x, d) - y) / ulp))
        scores, elements = {}, {}
        for c in candidates:
            cand = spec.replace(stats_dtype=c[0], affine_order=c[1])
            # parameters stored in the input dtype (torch .to(dtype)) or kept in fp32 (flax): the closer
            for pdt in (None, "float32"):
                yr = reference.forward(x, cand, dtype=d, gamma=params.get("gamma"), beta=params.get("beta"),
                                       running_mean=params.get("running_mean"), running_var=params.get("running_var"),
                                       param_dtype=pdt)
                with np.errstate(all="ignore"):
                    e = np.abs(y - yr) / ulp
                    err = float(np.nanmean(e))
                if not err >= scores.get(c, math.inf):
                    scores[c], elements[c] = err, e
        per_dtype[d] = scores
        separation[d] = _separation(scores, elements, repeat)
    measured = {f"{d}: {c[0]} statistics, {c[1].replace('_', ' ')}": v
                for d, sc in per_dtype.items() for c, v in sc.items()}
    # Decide where the two statistics dtypes separate most, among the dtypes where the winner reproduces the
    # target; decisive only when they separate beyond noise there and no other such dtype says otherwise.
    informative = [d for d in low if separation[d]["beyond_noise"] and separation[d]["reproduces"]]
    pool = informative or [d for d in low if separation[d]["reproduces"]] or low
    decider = max(pool, key=lambda d: separation[d]["ratio"])
    chosen = separation[decider]["winner"]
    disagree = [d for d in informative if separation[d]["winner"] != chosen]
    scores = per_dtype[decider]
    best = min((c for c in candidates if c[0] == chosen), key=scores.get)
    quality, note = "decisive", ""
    both = "; ".join(f"{d}: fp32 statistics {separation[d]['float32']:.3g} vs input-dtype {separation[d]['input']:.3g} "
                     f"ulps, sign test z={separation[d]['sign_z']:.2g}" for d in low)
    if not informative:
        quality = "ambiguous"
        note = f"the candidates do not separate beyond noise ({both}); the closer one is reported"
        if not separation[decider]["reproduces"]:
            note += (f"; no candidate reproduces the {decider} output (best {scores[best]:.2g} ulps mean): the "
                     "target rounds differently from every emulated contract")
    elif disagree:
        quality = "ambiguous"
        note = f"the dtypes disagree ({both}); the larger separation, at {decider}, is reported"
    ev["stats_dtype"] = Evidence(
        f"{'/'.join(low)} outputs vs the reference emulating each candidate (mean error in ulps; γ/β {source}), "
        "decided where the two statistics dtypes separate most",
        {"mean_error_ulps": measured, "decided_at": decider, "chosen": best[0],
         "separation": {d: {k: v for k, v in sep.items() if k not in ("closer_elements", "floor", "reproduces")}
                        for d, sep in separation.items()}},
        quality, note)
    orders = ("cast_then_scale", "scale_then_cast")

    def order_ratio(d: str) -> float:  # how far the two cast orders (fp32 statistics) separate at d
        a, b = sorted(per_dtype[d][("float32", o)] for o in orders)
        return (b + 0.02) / (a + 0.02)

    order_at = max(low, key=order_ratio)
    sc = per_dtype[order_at]
    order = min(orders, key=lambda o: sc[("float32", o)])
    mine, other = sc[("float32", order)], sc[("float32", orders[1 - orders.index(order)])]
    if (spec.gamma or spec.beta) and best[0] == "float32" and other == mine:
        ev["affine_order"] = Evidence("× γ before or after the cast back", {"error_ulps": mine},
                                      "not probed", "γ ≡ 1 and β ≡ 0 here: the order is not observable")
        order = "scale_then_cast"
    elif (spec.gamma or spec.beta) and best[0] == "float32":
        conf = "decisive" if other > 1.5 * max(mine, 0.02) and mine < 1.0 else "weak"
        ev["affine_order"] = Evidence(
            f"same experiment, at {order_at} where the two orders separate most: × γ before or after the cast "
            "back", {"chosen": order, "error_chosen_ulps": mine, "error_other_ulps": other}, conf)
    else:
        ev["affine_order"] = Evidence("not applicable (no affine, or statistics in the input dtype)", {},
                                      "decisive")
        order = "scale_then_cast"
    return spec.replace(stats_dtype=best[0], affine_order=order)


def _separation(scores: dict, elements: dict, repeat: float) -> dict[str, Any]:
    """How far fp32 and input-dtype statistics separate at one dtype, and whether beyond noise.

    Beyond noise: the worse candidate's mean error is 1.5× the better one's (both floored at 0.05 ulps
    and twice the call-to-call noise), their difference exceeds that floor, and the better one is closer
    at clearly more elements (sign test, z ≥ 5: a few outlying elements cannot decide). The winner
    reproduces the target when it is within 2 ulps (mean) plus that noise.
    """
    best = {st: min((c for c in scores if c[0] == st), key=scores.get) for st in ("float32", "input")}
    diff = elements[best["input"]] - elements[best["float32"]]
    diff = diff[np.isfinite(diff)]
    n_f, n_i = int(np.sum(diff >= 0.5)), int(np.sum(diff <= -0.5))  # fp32 (input) closer by ≥ ½ ulp
    sign_z = (n_f - n_i) / math.sqrt(max(n_f + n_i, 1))
    s_f, s_i = scores[best["float32"]], scores[best["input"]]
    winner = "float32" if s_f <= s_i else "input"
    lo, hi = sorted((s_f, s_i))
    floor = max(0.05, 2 * repeat)
    ratio = (hi + floor) / (lo + floor) if math.isfinite(hi) else math.inf
    agrees = sign_z >= 5 if winner == "float32" else sign_z <= -5
    return {"float32": s_f, "input": s_i, "winner": winner, "floor": floor, "ratio": ratio,
            "closer_elements": {"float32": n_f, "input": n_i}, "sign_z": sign_z, "repeat_noise_ulps": repeat,
            "beyond_noise": bool(ratio >= 1.5 and hi - lo > floor and agrees),
            "reproduces": bool(lo <= 2.0 + repeat)}


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
