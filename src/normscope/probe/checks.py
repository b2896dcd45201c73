"""The acceptance battery: prove that an implementation honours an expected contract.

Each finding compares the target with the float64 reference (and, at low precision, with the reference's
emulation of a faithful implementation at that dtype). The tolerance is derived, not chosen: at dtype d
an implementation passes when its error against the exact result is at most twice the error of a
faithful implementation at d, plus a small atol (a few units of d's rounding). Every finding carries
what it measured, what it expected and the tolerance it used.

Sections, in the order the acceptance procedure gives them: hand case, invariances, degenerate and
extreme inputs, dependency, affine broadcast, forward/backward against the reference, train/eval rules.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import reference
from ..errors import InputError, NormscopeError, NotANormalization, TargetError
from ..inputs import probe_shape, quiet, spec_fits
from ..jsonable import jsonable
from ..loading import read_json_file
from ..precision import UNIT_ROUNDOFF, Precision
from ..presets import preset_from_text
from ..spec import NormSpec, differences
from ..targets import Target, as_target
from ..targets.base import check_dtype_list, no_dtype_error
from .experiments import plus_minus, ulps, varying_axes
from .groups import Groups

SCHEMA = "normscope.check/1"
HIDDEN_SIZES = (1, 3, 64, 123, 1000, 4097)
Progress = Callable[[str], None]

# small atol (units of the dtype's rounding × output scale) for invariance and dependency findings
ATOL_UNITS = {"float64": 64, "float32": 16, "float16": 4, "bfloat16": 4}  # ≥ 1 ulp: two rounded outputs


@dataclasses.dataclass
class Finding:
    """One check: pass, fail or skip, with the numbers behind the verdict."""

    name: str
    section: str
    status: str  # pass · fail · skip
    measured: Any = None
    expected: Any = None
    tolerance: Any = None
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: jsonable(v) for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass
class Report:
    target: str
    expected: NormSpec
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    findings: list[Finding]
    params_source: str
    calls: int
    seconds: float
    quick: bool
    differences: list[str] = dataclasses.field(default_factory=list)
    inferred: NormSpec | None = None
    inference_error: str = ""
    dtypes_run: tuple[str, ...] = ()  # the dtypes the target ran at (``dtypes`` lists every one tried)

    @property
    def ok(self) -> bool:
        return all(f.status != "fail" for f in self.findings)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "fail"]

    def counts(self) -> dict[str, int]:
        out = {"pass": 0, "fail": 0, "skip": 0}
        for f in self.findings:
            out[f.status] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "target": self.target,
            "ok": self.ok,
            "expected": self.expected.to_dict(),
            "expected_summary": self.expected.summary(),
            "shape": list(self.shape),
            "dtypes": list(self.dtypes),
            "dtypes_run": list(self.dtypes_run),
            "params_source": self.params_source,
            "counts": self.counts(),
            "findings": [f.to_dict() for f in self.findings],
            "differences": self.differences,
            "inferred": self.inferred.to_dict() if self.inferred else None,
            "inference_error": self.inference_error,
            "calls": self.calls,
            "seconds": round(self.seconds, 3),
            "quick": self.quick,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def text(self) -> str:
        """Plain-text report (what ``assert_conforms`` raises with)."""
        c = self.counts()
        lines = [f"{self.target} vs {self.expected.summary()}: {c['pass']} passed, {c['fail']} failed, "
                 f"{c['skip']} skipped"]
        for f in self.findings:
            if f.status == "fail":
                lines.append(f"  FAIL {f.section}/{f.name}: {f.why} (measured {_short(f.measured)}, expected "
                             f"{_short(f.expected)}, tolerance {_short(f.tolerance)})")
        for d in self.differences:
            lines.append(f"  contract difference: {d}")
        return "\n".join(lines)

    def to_junit(self, path: str | Path) -> None:
        """JUnit XML, one testcase per finding, for CI systems."""
        c = self.counts()
        suite = ET.Element("testsuite", name=f"normscope check {self.target}", tests=str(len(self.findings)),
                           failures=str(c["fail"]), skipped=str(c["skip"]), time=f"{self.seconds:.3f}")
        for f in self.findings:
            case = ET.SubElement(suite, "testcase", classname=f"normscope.{f.section}", name=f.name)
            detail = (f"measured: {_short(f.measured)}; expected: {_short(f.expected)}; tolerance: "
                      f"{_short(f.tolerance)}")
            if f.status == "fail":
                el = ET.SubElement(case, "failure", message=f.why)
                el.text = detail + ("\n" + "\n".join(self.differences) if self.differences else "")
            elif f.status == "skip":
                ET.SubElement(case, "skipped", message=f.why)
            else:
                ET.SubElement(case, "system-out").text = detail
        ET.ElementTree(ET.Element("testsuites")).getroot().append(suite)
        tree = ET.ElementTree(suite)
        ET.indent(tree)
        tree.write(str(path), encoding="utf-8", xml_declaration=True)


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_short(x) for x in v[:8]) + (", …" if len(v) > 8 else "") + "]"
    return str(v)


@dataclasses.dataclass(frozen=True)
class _Conditioning:
    """compute: the statistics' dtype; k: the summation factor 2·log2(group size) + 8; stats: float64
    intermediates without affine; gain: max|x| in the group / denominator; gamma: |γ_eff| per element."""

    compute: str
    groups: Groups
    k: float
    stats: reference.Statistics
    gain: np.ndarray
    gamma: np.ndarray | float


def _expand(values, shape, spec: NormSpec) -> np.ndarray:
    axes = spec.resolve_param_axes(len(shape))
    full = [1] * len(shape)
    for a in axes:
        full[a] = shape[a]
    return np.asarray(values, dtype=np.float64).reshape(full)


def _same_parameter(exposed: np.ndarray, recovered: np.ndarray, proportional: bool, tol: float = 1e-3) -> bool:
    """Whether a recovered γ (up to a scale near 1: a wrong variance estimator hides there) or β is this one.

    ``tol``: the recovery's resolution (relative and absolute), 1e-3 unless it was measured coarser.
    """
    if not proportional:
        return bool(np.allclose(exposed, recovered, rtol=tol, atol=tol))
    denom = float(np.dot(exposed.ravel(), exposed.ravel()))
    if denom == 0:
        return bool(np.allclose(recovered, 0, atol=tol))
    c = float(np.dot(exposed.ravel(), recovered.ravel())) / denom
    resid = float(np.max(np.abs(recovered - c * exposed))) / max(float(np.max(np.abs(recovered))), 1e-300)
    # ÷d vs ÷(d−1) scales the probed γ by √((d−1)/d) or its inverse, within [1/√2, √2] for d ≥ 2
    return 0.7071 <= c <= 1.4143 and resid < tol


_DTYPE_WORDS = ("dtype", "type", "half", "float16", "bfloat16", "bf16", "fp16", "precision", "supported")


def _names_a_dtype(reason: str, dtype: str) -> bool:
    """Whether an error reads as a refusal of the input's dtype (by design) rather than a failure on it."""
    text = reason.lower()
    if " failed on a " in text:  # "<target> failed on a <dtype> input of shape (…): <Error>: <message>"
        text = text.split(" failed on a ", 1)[1].split(": ", 2)[-1]
    return "not finite" not in text and any(w in text for w in _DTYPE_WORDS)


def resolve_expected(expect, eps: float | None = None, shape=None) -> NormSpec:
    """A NormSpec from a NormSpec, a preset name (with knobs: ``name:groups=32``) or a spec JSON file path."""
    if isinstance(expect, NormSpec):
        spec = expect
    elif isinstance(expect, str | Path) and Path(str(expect)).is_dir():
        raise InputError(f"--expect {expect} is a directory; give a preset name or a spec JSON file")
    elif isinstance(expect, str | Path) and (str(expect).endswith(".json") or Path(str(expect)).is_file()):
        path = Path(expect)
        if not path.is_file():
            raise InputError(f"no such spec file: {path}")
        data = read_json_file(path)
        if isinstance(data, dict) and data.get("schema") in ("normscope.inference/1", "normscope.check/1"):
            data = data.get("spec") or data.get("expected")  # a saved inference or check names its contract
        spec = NormSpec.from_dict(data)
    elif isinstance(expect, str):
        spec = preset_from_text(expect, shape)
    else:
        raise InputError(f"expect must be a NormSpec, a preset name or a spec JSON path; got {type(expect).__name__}")
    spec = spec.replace(eps=eps) if eps is not None else spec
    return spec if shape is None else spec_fits(spec, shape)


# ------------------------------------------------------------------------------------------------------
class _Battery:
    def __init__(self, target: Target, spec: NormSpec, shape, dtypes, quick: bool, seed: int, progress):
        self.t = target
        self.spec = spec
        self.shape = tuple(shape)
        self.ndim = len(self.shape)
        self.quick = quick
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InputError(f"seed must be an integer ≥ 0; got {seed!r}")
        self.rng = np.random.default_rng(seed)
        self.progress = progress or (lambda _m: None)
        self.findings: list[Finding] = []
        allowed = dtypes or ("float32", "float16", "bfloat16")
        self.accepted = tuple(d for d in allowed if target.accepts(d, self.shape))
        if not self.accepted and dtypes is None and target.accepts("float64", self.shape):
            self.accepted = ("float64",)
        if not self.accepted:
            raise no_dtype_error(target, allowed)
        # every dtype tried is in the report: one that cannot run is a finding, never an omission
        self.tried = tuple(dict.fromkeys((*allowed, *self.accepted)))
        for d in self.tried:
            if d not in self.accepted:
                self.dtype_not_run(d, asked=dtypes is not None)
        # Contracts are stated for the dtypes models run in: float32 leads; float64 only when asked for
        # (some implementations change at float64, e.g. torch RMSNorm's eps=None becomes finfo(float64).eps).
        self.dtype = "float32" if "float32" in self.accepted else (
            "float64" if "float64" in self.accepted else self.accepted[0])
        try:
            spec.resolve_axes(self.ndim)
            spec.resolve_param_axes(self.ndim)
            self.groups = Groups.of(spec, self.shape)
        except NormscopeError as exc:
            raise InputError(f"the expected contract does not fit shape {self.shape}: {exc}") from None
        if self.groups.size < 2 and spec.center:
            raise InputError(
                f"at shape {self.shape} each statistic covers one element: a centred norm outputs β whatever the "
                "input, so nothing can be checked; use a shape with at least 2 elements per group")
        self.params: dict[str, np.ndarray] = {}
        self.param_names: dict[str, str] = {}
        self.params_source = ""
        self.params_recovered = False
        self.recovery_noise = (0.0, 0.0)
        self.param_dtype: str | None = None
        self._affine_maps: tuple[np.ndarray, np.ndarray] | None = None
        # γ/β are measured at a precise dtype the target accepts, asked for or not: at bf16/fp16 the ±u
        # experiment's own rounding would hide them
        self.precise = next((d for d in ("float32", "float64") if d in self.accepted or target.accepts(d, self.shape)),
                            self.dtype)
        self.call_noise = 0.0  # relative call-to-call variation of the output (non-deterministic targets)

    # -------------------------------------------------------------- helpers
    def dtype_not_run(self, d: str, asked: bool):
        """A dtype tried that the target cannot run: a failure when asked for or when the target takes the input
        and then fails on it (non-finite output, an error that is not a dtype refusal); otherwise a skip that
        names the dtype and the target's reason."""
        reason = self.t.rejection(d) or "the target does not run at this dtype"
        refused = d not in self.t.supported_dtypes or _names_a_dtype(reason, d)
        if asked or not refused:
            self.add(f"runs at {d}", "dtypes", "fail", reason, d, None,
                     f"{d} was {'asked for' if asked else 'tried'} and the target cannot run it: {reason}")
        else:
            self.add(f"runs at {d}", "dtypes", "skip", reason, d, None,
                     f"not checked at {d}: the target refuses it ({reason}); ask for it with dtypes= to make "
                     "this a failure")

    def add(self, name, section, status, measured=None, expected=None, tolerance=None, why="") -> Finding:
        finding = Finding(name, section, status, measured, expected, tolerance, why)
        self.findings.append(finding)
        return finding

    def ref(self, x, dtype=None, spec=None, **kw):
        spec = spec or self.spec
        with np.errstate(all="ignore"):
            return reference.forward(x, spec, gamma=self.params.get("gamma"), beta=self.params.get("beta"),
                                     running_mean=self.params.get("running_mean"),
                                     running_var=self.params.get("running_var"),
                                     dtype=None if dtype in (None, "float64") else dtype, **kw)

    def emulate(self, x, dtype, spec=None):
        """The faithful output at ``dtype``; γ/β stored at the input dtype or fp32, whichever the target uses."""
        if dtype == "float64":
            return self.ref(x, spec=spec)
        return self.ref(x, dtype, spec=spec, param_dtype=self.param_dtype)

    def atol(self, dtype, scale):
        return ATOL_UNITS[dtype] * UNIT_ROUNDOFF[dtype] * max(1.0, scale)

    def conditioning(self, x, dtype, spec) -> _Conditioning:
        """How rounding at ``dtype`` is amplified for input ``x`` under ``spec``."""
        compute = "float32" if spec.stats_dtype == "float32" and dtype in ("float16", "bfloat16") else dtype
        g = Groups.of(spec, x.shape)
        with np.errstate(all="ignore"):
            st = reference.statistics(x, spec.without_affine(), running_mean=self.params.get("running_mean"),
                                      running_var=self.params.get("running_var"))
            gain = g.spread(g.max(np.abs(x))) / st.denom
        w = self.params.get("gamma") if spec.gamma else None
        gamma = np.abs(_expand(w, x.shape, spec) + spec.gamma_offset) if w is not None else 1.0
        return _Conditioning(compute, g, 2 * math.log2(max(g.size, 2)) + 8, st, gain, gamma)

    def error_bound(self, x, dtype, exact, spec=None) -> np.ndarray:
        """Per-element error a faithful implementation may add beyond its output rounding.

        Statistics accumulated in the compute dtype c (fp32, or the input dtype) err by ~k·u(c)·max|x|, and
        the normalization amplifies that by 1/denominator: k·u(c)·(max|x| in the group / denominator)·|γ|
        + k·u(c)·|β|, with k = 2·log2(group size) + 8 (pairwise summation), plus 4·u(dtype)·(|γ·x̂| + |β|)
        for the roundings of x̂, γ·x̂ and the sum at the output dtype. A one-pass variance adds its
        cancellation, k·u(c)·(max|x| / denominator)²·|γ·x̂|/2.
        """
        spec = spec or self.spec
        cond = self.conditioning(x, dtype, spec)
        uc, ud, k, st, gain, gam = UNIT_ROUNDOFF[cond.compute], UNIT_ROUNDOFF[dtype], cond.k, cond.stats, \
            cond.gain, cond.gamma
        lay_b = self.params.get("beta") if spec.beta else None
        bet = np.abs(_expand(lay_b, x.shape, spec)) if lay_b is not None else 0.0
        # rounding of x̂, γ·x̂ and the sum at the output dtype: a few units of |γ·x̂| + |β|, not of |y|
        with np.errstate(all="ignore"):
            terms = np.nan_to_num(np.abs(st.xhat)) * gam + bet
        bound = k * uc * (gain * gam + bet) + 4 * ud * np.maximum(terms, np.abs(exact))
        if self.params_recovered:  # γ/β measured by probing carry the measurement's uncertainty
            dg, db = self.recovery_noise
            with np.errstate(all="ignore"):
                bound = bound + 2 * (dg * np.nan_to_num(np.abs(st.xhat)) + db)
        if spec.center and spec.variance_algorithm == "one_pass":
            # E[x²] − E[x]² in c errs by ~k·u(c)·max|x|², which moves x̂ by x̂·δvar/(2·denominator²)
            with np.errstate(all="ignore"):
                bound = bound + k * uc * gain**2 * np.nan_to_num(np.abs(st.xhat)) * gam / 2
        return bound

    def compare(self, name, section, x, dtype, why, run=None, spec=None):
        """Target vs reference at ``dtype``: |error| ≤ 2 × faithful error + bound, element by element."""
        x = Precision(dtype).round(x).astype(np.float64)
        y = (run or self.t)(x, dtype)
        exact = self.ref(x, spec=spec)
        emul = self.emulate(x, dtype, spec=spec)
        with np.errstate(all="ignore"):
            scale = float(np.nanmax(np.abs(exact))) if np.isfinite(exact).any() else 1.0
            faithful = np.abs(emul - exact)
        if not np.all(np.isfinite(emul)) or not np.all(np.isfinite(exact)):
            if np.array_equal(np.isfinite(y), np.isfinite(emul)):
                return self.add(name, section, "skip", None, None, None,
                                f"{why}: the contract itself is not finite here at {dtype}; the target agrees")
            return self.add(name, section, "skip", int((~np.isfinite(y)).sum()), int((~np.isfinite(emul)).sum()),
                            None, f"{why}: the contract itself overflows or is undefined at {dtype}")
        if float(faithful.max()) > 0.5 * max(scale, 1e-300) and dtype != "float64":
            return self.add(name, section, "skip", None, float(faithful.max()), None,
                            f"{why}: a faithful {dtype} implementation itself errs by {float(faithful.max()):.3g} "
                            "here")
        bound = 2 * faithful + self.error_bound(x, dtype, exact, spec)
        with np.errstate(all="ignore"):
            err = np.abs(y - exact)
            if not np.all(np.isfinite(y)):
                bad = int((~np.isfinite(y)).sum())
                return self.add(name, section, "fail", math.inf, 0.0, float(bound.max()),
                                f"{why} at {dtype}: {bad} non-finite outputs where the contract is finite")
            ratio = np.where(err == 0, 0.0, err / bound)
        worst = int(np.argmax(ratio))
        status = "pass" if float(ratio.max()) <= 1.0 else "fail"
        e, b = float(err.ravel()[worst]), float(bound.ravel()[worst])
        # measured and tolerance are the same element's pair (the worst ratio), so they agree with the verdict
        return self.add(name, section, status, e, 0.0, b,
                        f"{why} ({dtype}; worst element {e:.3g} vs 2 × faithful "
                        f"{float(faithful.ravel()[worst]):.2g} + accumulation bound; largest error "
                        f"{float(err.max()):.3g})")

    def pattern(self):
        return self.groups.pattern(self.rng)

    # -------------------------------------------------------------- parameters
    def resolve_params(self):
        """γ/β (and running statistics) from the target when exposed, else recovered by probing."""
        spec = self.spec
        pshape = reference.param_shape(self.shape, spec)
        exposed = self.t.parameters()
        buffers = self.t.buffers()
        sources = []
        if spec.batch_stats == "running":
            for field in ("running_mean", "running_var"):
                if field in buffers:
                    self.params[field] = buffers[field]
                    sources.append(f"{field} from the target's buffer")
            if "running_var" not in self.params:
                raise TargetError("the contract uses running statistics but the target exposes no running_mean/"
                                  "running_var buffers; check it against the training contract instead")
        recovered = self._recover_affine(pshape)
        for field in ("gamma", "beta"):
            if not getattr(spec, field):
                continue
            match = None
            target_values = recovered.get(field)
            for name, values in exposed.items():
                if values.size != int(np.prod(pshape)) or name in self.param_names.values():
                    continue
                v = values.reshape(pshape)
                if target_values is not None and _same_parameter(v, target_values, proportional=field == "gamma",
                                                                 tol=self.recovery_tolerance()):
                    match = name
                    break
            if match is not None:
                self.params[field] = exposed[match].reshape(pshape)
                self.param_names[field] = match
                sources.append(f"{'γ' if field == 'gamma' else 'β'} from the target's parameter {match!r} (matched "
                               f"at {self.precise})")
            elif target_values is not None:
                self.params[field] = target_values
                self.params_recovered = True
                sources.append(f"{'γ' if field == 'gamma' else 'β'} recovered by probing at {self.precise}")
                if field == "gamma":
                    effective = np.abs(target_values + spec.gamma_offset)
                    if not np.all(np.isfinite(effective)) or float(np.max(effective)) <= 1e-6:
                        self.add("the output follows the input", "affine", "fail",
                                 float(np.nanmax(effective)) if np.isfinite(effective).any() else math.inf,
                                 "|γ| > 0", 1e-6,
                                 "±u inputs give the same output: the probed γ is 0 (or not finite), so the target "
                                 "ignores its input and no comparison below can mean anything")
                candidates = [n for n, v in exposed.items() if v.size == target_values.size
                              and n not in self.param_names.values()]
                if candidates:
                    sym = "γ" if field == "gamma" else "β"
                    rel = {n: float(np.max(np.abs(exposed[n].reshape(pshape) - target_values)))
                           for n in candidates}
                    self.add(f"{sym} is the target's parameter", "affine", "fail", rel, "one of them",
                             None, f"the target has parameters {candidates} of {sym}'s shape {pshape}, but the "
                             f"probed {sym} is none of them (max |difference| per parameter shown)"
                             + ("; γ may only differ by the variance estimator's scale" if field == "gamma" else ""))
        self.params_source = "; ".join(sources) or "no affine parameters"

    def recovery_tolerance(self) -> float:
        """The resolution of γ/β recovered by probing at ``self.precise`` (relative, and absolute near 0)."""
        return max(1e-3, 8 * UNIT_ROUNDOFF[self.precise], 2 * max(self.recovery_noise))

    def _affine_full(self) -> tuple[np.ndarray, np.ndarray]:
        """γ (effective) and β at every position from ±a·u: γ = (y₊−y₋)/2x̂ with x̂ from the reference."""
        base = self.spec.without_affine()
        stats = {k: self.params.get(k) for k in ("running_mean", "running_var")} if base.batch_stats == "running" \
            else {}
        pm = plus_minus(lambda x: self.t(x, self.precise), self.groups, self.rng, 1e3,
                        normalize=lambda x: reference.forward(x, base, **stats))
        # the two patterns measure the same γ/β: their disagreement is the recovery's own uncertainty
        self._last_noise = (pm.gamma_noise, pm.beta_noise)
        return pm.gamma, pm.beta

    def _recover_affine(self, pshape) -> dict[str, np.ndarray]:
        """γ, β from ±a·u: β = (y₊+y₋)/2, γ = (y₊−y₋)/2x̂ with x̂ from the reference."""
        spec = self.spec
        if not (spec.gamma or spec.beta):
            return {}
        gam, bet = self._affine_full()
        self.recovery_noise = self._last_noise
        self._affine_maps = (gam, bet)
        pidx = spec.resolve_param_axes(self.ndim)
        take = tuple(slice(None) if ax in pidx else 0 for ax in range(self.ndim))
        out = {}
        if spec.gamma:
            out["gamma"] = gam[take].reshape(pshape) - spec.gamma_offset
        if spec.beta:
            out["beta"] = bet[take].reshape(pshape)
        return out

    @contextlib.contextmanager
    def perturbed(self) -> Iterator[dict[str, np.ndarray] | None]:
        """Distinct random γ/β in the target's private copy; ``self.params`` follows them inside the block.

        Parameters that map onto γ/β (matched in ``resolve_params``) are taken as written; when the target has
        others (per-group scale and bias, a γ it applies as 2·w), γ/β are measured again by probing, so the
        emulation never uses values the target no longer holds. Yields the values written, or None.
        """
        saved, noise, recovered = self.params, self.recovery_noise, self.params_recovered
        pshape = reference.param_shape(self.shape, self.spec)
        with self.t.perturbed_parameters(self.rng) as values:
            try:
                if values:
                    mapped = {f: values[n].reshape(pshape) for f, n in self.param_names.items() if n in values}
                    self.params = {**saved, **mapped}
                    unmapped = [n for n in values if n not in self.param_names.values()]
                    if unmapped and (self.spec.gamma or self.spec.beta):
                        maps = self._affine_maps
                        self.params.update(self._recover_affine(pshape))
                        self.params_recovered = True
                        self._affine_maps = maps
                yield values
            finally:
                self.params, self.recovery_noise, self.params_recovered = saved, noise, recovered

    # -------------------------------------------------------------- 1. hand case
    def hand_case(self):
        g = self.groups
        flat = g.labels.ravel()
        order = np.argsort(flat, kind="stable")
        rank = np.empty(flat.size, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=g.count))[:-1]])
        rank[order] = np.arange(flat.size) - starts[flat[order]]
        x = np.array([1.0, 2.0, 3.0])[rank % 3].reshape(self.shape)
        stats = reference.statistics(x, self.spec.replace(batch_stats=None)
                                     if self.spec.batch_stats == "running" else self.spec,
                                     running_mean=self.params.get("running_mean"),
                                     running_var=self.params.get("running_var"))
        first = g.labels == 0
        kind = "mean square" if not self.spec.center else "variance"
        stages = {"mean": float(stats.mean[first][0]), kind: float(stats.var[first][0]),
                  "denominator": float(stats.denom[first][0]),
                  "normalized": [float(v) for v in stats.xhat[first][:3]]}
        note = "" if g.size % 3 == 0 else f" (group size {g.size} is not a multiple of 3: stages differ from the text)"
        f = self.compare("hand case [1, 2, 3]", "hand", x, self.dtype,
                         "every group holds [1, 2, 3, 1, 2, 3, …]" + note)
        f.expected = {"stages": stages}

    # -------------------------------------------------------------- 2. invariances
    def invariances(self):
        """Scale and shift: measured is how far the output's change departs from the contract's change."""
        x = self.pattern() * 10 + self.rng.normal(size=self.shape)
        d = self.dtype
        y = self.t(x, d)
        floor = self.noise_floor(float(np.max(np.abs(y))))
        for a in (5.0,):
            ys = self.t(a * x, d)
            ref_change = float(np.max(np.abs(self.ref(a * x) - self.ref(x))))
            change = float(np.max(np.abs(ys - y)))
            tol = ref_change + self.atol(d, float(np.max(np.abs(y)))) + floor
            dev = abs(change - ref_change)
            self.add(f"scale × {a:g}", "invariance", "pass" if dev <= tol else "fail", dev, 0.0, tol,
                     f"multiplying the input by {a:g} moved the output by {change:.3g}; the contract moves it by "
                     f"{ref_change:.3g} (only ε breaks exact invariance)")
        shift = 3 * float(np.std(x))
        ys = self.t(x + shift, d)
        ref_change = float(np.max(np.abs(self.ref(x + shift) - self.ref(x))))
        change = float(np.max(np.abs(ys - y)))
        scale = float(np.max(np.abs(y)))
        if self.spec.center:
            tol = self.atol(d, scale) * 4 + floor
            dev = max(change - ref_change, 0.0)
            why = f"adding {shift:.3g} to every input moved the output by {change:.3g}; a centred norm must not move"
        else:
            tol = 0.01 * ref_change + self.atol(d, scale) + floor
            dev = abs(change - ref_change)
            why = (f"adding {shift:.3g} to every input moved the output by {change:.3g}; an RMS norm must move by "
                   f"{ref_change:.3g}")
        self.add("common shift", "invariance", "pass" if dev <= tol else "fail", dev, 0.0, tol,
                 why + f" (contract: {ref_change:.3g})")

    # -------------------------------------------------------------- determinism
    def noise_floor(self, scale: float) -> float:
        """What two calls on the same input may differ by at outputs up to ``scale``: twice the measured
        call-to-call noise (relative to each output) at that scale."""
        return 2 * self.call_noise * max(1.0, scale)

    def determinism(self):
        """Call the target three times on one input: findings that compare two calls allow for what differs."""
        x = self.rng.normal(size=self.shape) * 2 + 0.5
        d = self.dtype
        runs = [self.t(x, d) for _ in range(3)]
        with np.errstate(all="ignore"):
            spread = float(np.nanmax([np.nanmax(np.abs(r - runs[0])) for r in runs[1:]]))
            scale = max(1.0, float(np.nanmax(np.abs(runs[0]))))
            # rounding noise scales with each output: measure it relative to the element (floored near 0)
            size = np.maximum(np.abs(runs[0]), max(1e-2 * float(np.sqrt(np.nanmean(runs[0] ** 2))), 1e-300))
            relative = float(np.nanmax([np.nanmax(np.abs(r - runs[0]) / size) for r in runs[1:]]))
        if not (np.isfinite(spread) and np.isfinite(relative)):
            spread = relative = 0.0  # non-finite outputs are judged by the forward findings
        self.call_noise = relative
        if spread == 0:
            self.add("same output on repeated calls", "determinism", "pass", 0.0, 0.0, 0.0,
                     f"three calls on one input at {d} returned identical outputs")
        else:
            self.add("same output on repeated calls", "determinism", "skip", spread, 0.0, None,
                     f"the target is not deterministic: three calls on one input at {d} differ by up to "
                     f"{spread:.3g} ({spread / scale / UNIT_ROUNDOFF[d]:.3g} units of {d}'s rounding at the output "
                     "scale); findings that compare two calls allow twice this")

    # -------------------------------------------------------------- 3. degenerate and extreme
    def extremes(self):
        g, d = self.groups, self.dtype
        # degenerate inputs at every dtype (a kernel may special-case half precision), once in --quick
        dtypes = [d] + ([] if self.quick else [t for t in ("float16", "bfloat16") if t in self.accepted and t != d])
        spec = self.spec
        # where ε takes over: variance ≈ ε inside the root, standard deviation ≈ ε outside it or as a clamp
        knee = spec.eps if spec.eps_placement == "inside_sqrt" else spec.eps**2
        variances = {1e-12}
        if spec.eps > 0 and knee > 1e-36:
            variances |= {knee, knee * 0.01}
        base = spec.without_affine().replace(batch_stats=None)
        for dt in dtypes:
            at = "" if dt == d else f" at {dt}"
            const = g.spread(self.rng.uniform(-3, 3, size=g.count)) * np.ones(self.shape)
            self.compare(f"constant vector{at}", "extreme", const, dt, "every group constant (variance 0)")
            zero = np.zeros(self.shape)
            if spec.eps_placement == "none":
                y = self.t(zero, dt)
                self.add(f"zero vector{at}", "extreme", "skip", int((~np.isfinite(y)).sum()), None, None,
                         "the contract has no ε: 0/0 is undefined for a zero vector")
            else:
                f = self.compare(f"zero vector{at}", "extreme", zero, dt, "all zeros: finite and equal to β")
                f.expected = "β"
            u = self.pattern()
            for v in sorted(variances, reverse=True):
                x = math.sqrt(v) * u  # zero mean: the statistics are exact, only ε decides the gain
                f = self.compare(f"tiny variance {v:.3g}{at}", "extreme", x, dt,
                                 f"variance {v:.3g}: the gain is capped as ε and its placement say")
                with np.errstate(all="ignore"):
                    gain = float(np.std(reference.forward(x, base)) / max(float(np.std(x)), 1e-300))
                f.expected = {"gain": gain, "no-ε gain": 1.0}
        for dt, scale in (("float16", 3e4), ("bfloat16", 1e37), ("float32", 1e18)):
            if dt in self.accepted:
                self.compare(f"large values {scale:g}", "extreme", scale * self.pattern() + 0.1 * scale, dt,
                             f"values near {scale:g}: squares overflow {dt} unless statistics are wider")
        offset = 1e8 if d == "float64" else 1e4
        x = offset + self.pattern()
        self.compare(f"offset {offset:g} + small spread", "extreme", x, d,
                     "a large common offset with unit spread (one-pass variance cancels)")
        if self.spec.center and self.spec.batch_stats != "running":
            self.variance_algorithm()
        self.nonfinite()

    def variance_algorithm(self):
        """Where the two variance algorithms part ways beyond their noise, the target must follow its contract's.

        Input: an offset M with spread s per group, M = s·u(c)^-0.65 (c the statistics' dtype). There one-pass
        E[x²] − E[x]² is a difference of two numbers near M² whose spacing is ≫ s², so any one-pass kernel,
        whatever its summation order, returns a variance of 0 or ≫ s², while two-pass is accurate. The target is
        measured against the exact output in units of a faithful two-pass implementation's bound (as the forward
        findings do); one-pass must sit far outside it, two-pass inside. Where the one-pass emulation itself is
        not outside that bound by a clear margin, the candidates do not separate: a skip with both numbers.
        """
        spec = self.spec
        name = f"{spec.variance_algorithm.replace('_', '-')} variance at offset"
        # at bf16/fp16 inputs with fp32 statistics the offset cannot both survive the input rounding and cancel:
        # the experiment moves to the precise dtype the target accepts
        d = self.dtype if self.dtype in ("float32", "float64") else self.precise
        c = "float32" if spec.stats_dtype == "float32" and d in ("float16", "bfloat16") else d
        knee = spec.eps if spec.eps_placement == "inside_sqrt" else spec.eps**2
        spread = max(1.0, 10 * math.sqrt(knee))  # far above the knee: ε does not hide the variance
        offset = spread * min(UNIT_ROUNDOFF[c] ** -0.65, 0.05 / UNIT_ROUNDOFF[d])
        x = Precision(d).round(offset + spread * self.pattern()).astype(np.float64)
        two, one = spec.replace(variance_algorithm="two_pass"), spec.replace(variance_algorithm="one_pass")
        y = self.t(x, d)
        exact = self.ref(x)
        emul_two, emul_one = self.emulate(x, d, spec=two), self.emulate(x, d, spec=one)
        if not all(np.all(np.isfinite(a)) for a in (exact, emul_two, y)):
            return self.add(name, "extreme", "skip", None, None, None,
                            f"the contract or the target is not finite at offset {offset:.3g} at {d}")
        with np.errstate(all="ignore"):
            bound = 2 * np.abs(emul_two - exact) + self.error_bound(x, d, exact, two)
            target = float(np.max(np.abs(y - exact) / bound))
            one_pass = float(np.max(np.nan_to_num(np.abs(emul_one - exact), nan=np.inf) / bound))
        numbers = {"target": target, "one_pass_emulation": one_pass}
        where = (f"offset {offset:.3g} with spread {spread:.3g} at {d}: error in units of a faithful two-pass "
                 f"bound — the target {target:.3g}, a one-pass emulation {one_pass:.3g}")
        if not one_pass > 4:
            return self.add(name, "extreme", "skip", numbers, None, 4.0,
                            f"{where}; the two algorithms do not separate beyond noise here, nothing to tell apart")
        if spec.variance_algorithm == "two_pass":
            ok = target <= 1
            return self.add(name, "extreme", "pass" if ok else "fail", target, "≤ 1 (two-pass)", 1.0,
                            f"{where}; a two-pass variance stays within the bound"
                            + ("" if ok else ", this target does not (one-pass cancellation?)"))
        ok = target > 1
        inside = 1 / target if target > 0 else math.inf  # ≤ 1: the target leaves the two-pass bound
        return self.add(name, "extreme", "pass" if ok else "fail", inside, "< 1 (one-pass cancels)", 1.0,
                        f"{where}; a one-pass variance cancels and leaves the bound (measured: the bound over the "
                        "target's error)"
                        + ("" if ok else ", this target stays within it as a two-pass one does"))

    def nonfinite(self):
        g, d = self.groups, self.dtype
        x = self.pattern() * 3
        y0 = self.t(x, d)
        p = tuple(0 for _ in self.shape)
        own = g.labels == g.labels[p]
        floor = self.noise_floor(float(np.max(np.abs(y0))))
        for bad in (math.nan, math.inf):
            xb = x.copy()
            xb[p] = bad
            try:
                y = self.t(xb, d)
            except TargetError as exc:  # validation that refuses non-finite input, by design
                self.add(f"{bad} confined to its group", "extreme", "skip", None, 0, 0,
                         f"the target refuses an input holding {bad} (it raised: {exc}); nothing to confine")
                continue
            outside = ~own
            with np.errstate(invalid="ignore"):
                moved = ~np.isfinite(y[outside]) | (np.abs(y[outside] - y0[outside]) > floor)
            leaked = int(moved.sum())
            self.add(f"{bad} confined to its group", "extreme", "pass" if leaked == 0 else "fail", leaked, 0, 0,
                     f"one {bad} input changed {leaked} outputs outside its normalization group"
                     + (f" (by more than the call-to-call noise {floor:.3g})" if floor else ""))

    # -------------------------------------------------------------- 4. dependency
    def dependency(self):
        g, d = self.groups, self.dtype
        p = tuple(0 for _ in self.shape)
        own = g.labels == g.labels[p]
        x = self.pattern() * 3
        for axis, label in ((0, "other batch items"), (self.ndim - 2, "other tokens")):
            if axis < 0 or self.shape[axis] < 2 or (axis == 0 and label == "other tokens"):
                self.add(f"{label} changed", "dependency", "skip", why=f"axis {axis} has size 1 at this shape")
                continue
            x2 = x.copy()
            idx = np.indices(self.shape)[axis]
            change_mask = idx != 0
            x2[change_mask] = self.rng.normal(size=int(change_mask.sum())) * 3
            moved = float(np.max(np.abs(self.t(x2, d)[own] - self.t(x, d)[own])))
            ref_moved = float(np.max(np.abs(self.ref(x2)[own] - self.ref(x)[own])))
            scale = float(np.max(np.abs(self.ref(x))))
            tol = 0.01 * ref_moved + self.atol(d, scale) + self.noise_floor(scale)
            dev = abs(moved - ref_moved)
            self.add(f"{label} changed", "dependency", "pass" if dev <= tol else "fail", dev, 0.0, tol,
                     f"changing {label} (axis {axis}) moved the fixed position's group by {moved:.3g}; the contract "
                     f"moves it by {ref_moved:.3g}")

    # -------------------------------------------------------------- 5. affine broadcast
    def affine(self):
        spec = self.spec
        if not (spec.gamma or spec.beta):
            self.add("γ/β broadcast", "affine", "skip", why="the contract has no affine parameters")
            return
        pshape = reference.param_shape(self.shape, spec)
        expected_axes = list(spec.resolve_param_axes(self.ndim))
        with self.t.perturbed_parameters(self.rng) as values:
            if values:
                source = "distinct random γ/β in a private copy"
                truth = {f: values[n].reshape(pshape) for f, n in self.param_names.items() if n in values}
                gam, bet = self._affine_full()
            else:
                source = "the target's own γ/β"
                truth = {}
                gam, bet = self._affine_maps
        for field, full in (("gamma", gam), ("beta", bet)):
            if not getattr(spec, field):
                continue
            scale = max(float(np.max(np.abs(full))), 1.0)
            tol = (1e-6 if self.precise == "float64" else self.recovery_tolerance()) * scale
            varies = varying_axes(full, tol)
            offset = spec.gamma_offset if field == "gamma" else 0.0
            extra = sorted(set(varies) - set(expected_axes))
            ok = not extra
            measured: dict[str, Any] = {"varies_along": varies}
            if field in truth and ok:
                take = tuple(slice(None) if a in expected_axes else 0 for a in range(self.ndim))
                err = float(np.max(np.abs(full[take].reshape(pshape) - (truth[field] + offset))))
                measured["max_error_vs_parameter"] = err
                ok = err <= tol
            sym = "γ" if field == "gamma" else "β"
            self.add(f"{sym} along {expected_axes}", "affine", "pass" if ok else "fail", measured,
                     {"varies_along ⊆": expected_axes}, tol,
                     f"{source}: {sym} varies along axes {varies}; the contract indexes it by {expected_axes}")

    # -------------------------------------------------------------- 6. forward / backward
    def shapes(self) -> Iterator[tuple[int, ...]]:
        """The probe shape, leading sizes 1 and odd, and hidden sizes where no parameter fixes them."""
        yield self.shape
        lead = [a for a in range(self.ndim) if a not in self.spec.resolve_axes(self.ndim)]
        if all(a >= 0 for a in self.spec.axes):  # channel-first layouts: only the batch axis is free
            lead = [a for a in lead if a == 0]
        for sizes in ((1,), (3,)) if not self.quick else ((1,),):
            s = list(self.shape)
            for a in lead:
                s[a] = sizes[0]
            if tuple(s) != self.shape:
                yield tuple(s)
        if self.quick:
            return
        fixed = set(self.spec.resolve_param_axes(self.ndim)) | {
            a for a in range(self.ndim) if self.spec.groups is not None and a == self.spec.resolve_group_axis(self.ndim)}
        free = [a for a in self.spec.resolve_axes(self.ndim) if a not in fixed and a != 0]
        if free:
            a = free[-1]
            for h in HIDDEN_SIZES:
                if h == self.shape[a] or (self.spec.center and h == 1):
                    continue
                s = list(self.shape)
                s[a] = h
                yield tuple(s)

    def forward_grid(self):
        dtypes = self.accepted if not self.quick else tuple(dict.fromkeys([self.dtype, *(
            d for d in ("bfloat16",) if d in self.accepted)]))
        skipped_sizes = []
        for shape in self.shapes():
            for d in dtypes:
                x = self.rng.normal(size=shape) * 2 + 0.5
                try:
                    self.compare(f"forward {shape} {d}", "reference", x, d, f"random input of shape {shape}")
                except NormscopeError:  # the target (or the contract's grouping) does not take this shape
                    if shape == self.shape:
                        raise
                    skipped_sizes.append(shape)
                    break
                self.progress(f"forward {shape} {d}")
        if skipped_sizes:
            self.add("other shapes", "reference", "skip", [list(s) for s in dict.fromkeys(skipped_sizes)],
                     why="the target does not accept these shapes (sizes fixed by the implementation)")
        self.add("other ε values", "reference", "skip", expected=self.spec.eps,
                 why="a target's ε is its own and cannot be varied from outside; the tiny-variance findings test "
                     "it where it takes over")
        self.output_dtypes(dtypes)
        if self.t.supports_noncontiguous:
            x = self.rng.normal(size=self.shape)
            for d in dtypes[:2]:
                try:
                    self.compare(f"non-contiguous input {d}", "reference", x, d, "a strided (transposed) view",
                                 run=self.t.call_noncontiguous)
                except Exception as exc:
                    self.add(f"non-contiguous input {d}", "reference", "fail", None, None, None,
                             f"the target failed on a strided view: {type(exc).__name__}: {exc}")
        self.precision_order()

    def output_dtypes(self, dtypes):
        """A normalization returns its input's dtype; a wider one is reported, a narrower one fails."""
        order = ("bfloat16", "float16", "float32", "float64")
        for d in dtypes:
            self.t(self.rng.normal(size=self.shape), d)
            out = self.t.output_dtype
            if out == d:
                self.add(f"output dtype at {d}", "reference", "pass", out, d, None, f"{d} in, {out} out")
            elif out in order and order.index(out) > order.index(d):
                self.add(f"output dtype at {d}", "reference", "skip", out, d, None,
                         f"{d} in, {out} out: promoted (the contract does not fix the output dtype; values were "
                         "compared as returned, and layers after it will compute in the wider dtype)")
            else:
                self.add(f"output dtype at {d}", "reference", "fail", out, d, None,
                         f"{d} in, {out} out: the output lost or changed precision")

    def variants(self, spec: NormSpec) -> tuple[str, ...]:
        """The formulas a faithful kernel of ``spec`` may use: x/σ or x·(1/σ), and a folded affine x·a + b where
        the contract applies γ/β before the one cast (or has none)."""
        folded = spec.affine_order == "scale_then_cast" or not (spec.gamma or spec.beta)
        return reference.FORMULAS if folded else tuple(f for f in reference.FORMULAS if f != "folded")

    def nearest_variant(self, y, x, d, spec) -> float:
        """Mean distance (ulps of ``d``) from ``y`` to the nearest faithful formula of ``spec`` at ``d``."""
        ulp = ulps(y, d)
        best = math.inf
        for formula in self.variants(spec):
            with np.errstate(all="ignore"):
                emul = self.ref(x, d, spec=spec, param_dtype=self.param_dtype, formula=formula)
                best = min(best, float(np.nanmean(np.abs(y - emul) / ulp)))
        return best

    def precision_order(self):
        """At bf16/fp16 the target must sit closer to its contract's rounding than to the other order's.

        Each contract is represented by the nearest of its faithful formulas (x/σ, x·(1/σ), folded affine):
        the contract does not fix that choice, so neither does the rule.
        """
        spec = self.spec
        for d in ("bfloat16", "float16"):
            if d not in self.accepted:
                continue
            # half the groups sit at an offset of 30σ: there statistics held in the input dtype visibly lose
            # the mean, while cast-order differences show everywhere
            g = self.groups
            offset = g.spread(np.where(np.arange(g.count) % 2 == 0, 0.0, 30.0))
            x = Precision(d).round((self.rng.normal(size=self.shape) + offset) * 3).astype(np.float64)
            with self.perturbed() as values:  # distinct γ/β make the order observable
                y = self.t(x, d)
                mine = self.nearest_variant(y, x, d, spec)
                other_stats = "input" if spec.stats_dtype == "float32" else "float32"
                others = {f"statistics in {'the input dtype' if other_stats == 'input' else 'fp32'}":
                          self.nearest_variant(y, x, d, spec.replace(stats_dtype=other_stats))}
                w = self.params.get("gamma")
                identity = w is None or np.allclose(w + spec.gamma_offset, 1.0)
                if spec.stats_dtype == "float32" and (spec.gamma or spec.beta) and not (
                        identity and not np.any(self.params.get("beta", 0))):
                    flip = "scale_then_cast" if spec.affine_order == "cast_then_scale" else "cast_then_scale"
                    others[flip.replace("_", " ")] = self.nearest_variant(y, x, d, spec.replace(affine_order=flip))
            nearest = min(others.values())
            # nearer its own contract than any other, and within a couple of ulps of it on average
            limit = min(nearest + 0.02, 2.0)
            ok = mine <= limit
            self.add(f"rounding at {d}", "reference", "pass" if ok else "fail", mine, others, limit,
                     f"mean distance (ulps) to the contract's {d} rounding {mine:.3g}, to the nearest other "
                     f"contract's {nearest:.3g}; the limit is the smaller of that + 0.02 and 2 ulps"
                     + ("" if values else " (the target's own γ/β)"))

    def backward_grid(self):
        if not self.t.differentiable:
            self.add("backward", "reference", "skip", why=f"{self.t.framework} targets expose no gradients here")
            return
        import torch

        from ..nn import Norm

        dtypes = self.accepted if not self.quick else (self.dtype,)
        x = self.rng.normal(size=self.shape) * 2 + 0.5
        dy = self.rng.normal(size=self.shape)
        spec = self.spec
        kw = {k: self.params.get(k) for k in ("gamma", "beta")}
        pshape = reference.param_shape(self.shape, spec)
        module_shape = pshape if (spec.gamma or spec.beta) else reference.stats_shape(self.shape, spec)
        faithful = Norm(spec, module_shape, momentum=0.0, dtype=torch.float64)
        with torch.no_grad():
            for field, attr in (("gamma", "weight"), ("beta", "bias")):
                if getattr(faithful, attr) is not None and field in self.params:
                    value = np.asarray(self.params[field], dtype=np.float64)  # γ may be a scalar (param_axes=[])
                    getattr(faithful, attr).copy_(torch.from_numpy(value).reshape(getattr(faithful, attr).shape))
            if spec.batch_stats is not None and "running_var" in self.params:
                for field in ("running_mean", "running_var"):
                    buf = getattr(faithful, field)
                    buf.copy_(torch.from_numpy(np.asarray(self.params[field], dtype=np.float64)).reshape(buf.shape))
        faithful.train(spec.batch_stats != "running")
        for d in dtypes:
            xd = Precision(d).round(x).astype(np.float64)
            try:
                dx, pgrads = self.t.gradients(xd, dy, d)
            except Exception as exc:  # a differentiable target whose backward fails fails the finding
                self.add(f"backward {d}", "reference", "fail", None, "gradients", None,
                         f"the target's backward failed: {type(exc).__name__}: {exc}")
                continue
            dx_ref_d = reference.backward(xd, dy, spec, **kw, running_mean=self.params.get("running_mean"),
                                          running_var=self.params.get("running_var"))
            m = copy.deepcopy(faithful).to(getattr(torch, d))  # parameters rounded once, from float64
            xt = torch.from_numpy(xd).to(getattr(torch, d)).requires_grad_(True)
            m.zero_grad()
            m(xt).backward(torch.from_numpy(dy).to(getattr(torch, d)))
            fdx = xt.grad.double().numpy()
            grads = {"dx": (dx, dx_ref_d[0], fdx)}
            for field, attr, ref_g in (("gamma", "weight", dx_ref_d[1]), ("beta", "bias", dx_ref_d[2])):
                name = self.param_names.get(field)
                if ref_g is not None and name in pgrads:
                    grads[f"d{field}"] = (pgrads[name].reshape(ref_g.shape), ref_g,
                                          getattr(m, attr).grad.double().numpy().reshape(ref_g.shape))
            rounding = self.backward_rounding(xd, dy, d)
            for label, (got, exact, faith) in grads.items():
                bound = 2 * np.abs(faith - exact) + rounding[label] + self.atol(d, float(np.max(np.abs(exact))))
                with np.errstate(all="ignore"):
                    err = np.abs(got - exact) if np.all(np.isfinite(got)) else np.full(exact.shape, math.inf)
                    ratio = np.where(err == 0, 0.0, err / bound)
                worst = int(np.argmax(ratio))
                e, b = float(err.ravel()[worst]), float(np.broadcast_to(bound, err.shape).ravel()[worst])
                self.add(f"backward {label} {d}", "reference", "pass" if float(ratio.max()) <= 1 else "fail",
                         e, 0.0, b,
                         f"{label} at {d}: worst element {e:.3g} vs 2 × a faithful {d} module's error + the "
                         f"rounding of its terms ({b:.3g}); largest error {float(err.max()):.3g}")

    def backward_rounding(self, x, dy, dtype) -> dict[str, np.ndarray]:
        """What rounding may add to each gradient at ``dtype``, beyond a faithful module's own error.

        dx = (γ/D)(dy − mean(dy) − x̂·mean(dy·x̂)) subtracts terms of size |γ|·max|dy|/D that cancel (exactly,
        for groups of two): a kernel rounds them in its compute dtype c and in the gradient dtype, so each
        element may err by (k·u(c) + 4·u(dtype))·2·|γ|·max|dy|/D·(1 + max|x|/D) — the last factor for kernels
        that work from x rather than x̂ (torch's GroupNorm backward does). dγ and dβ sum |dy|·(|x̂| + |x|/D) and
        |dy| over the batch positions: k·u(dtype) of those sums.
        """
        spec = self.spec
        cond = self.conditioning(x, dtype, spec)
        g, k, st, gam = cond.groups, cond.k, cond.stats, cond.gamma
        with np.errstate(all="ignore"):
            dymax = g.max(np.abs(dy))
            gain = 1 + cond.gain  # formulas in x rather than x̂ carry |x|/D, as the forward does
            out = {"dx": (k * UNIT_ROUNDOFF[cond.compute] + 4 * UNIT_ROUNDOFF[dtype]) * 2 * gam * g.spread(dymax)
                   / st.denom * gain}
            reduce_axes = tuple(a for a in range(x.ndim) if a not in spec.resolve_param_axes(x.ndim))
            n = int(np.prod([x.shape[a] for a in reduce_axes])) if reduce_axes else 1
            kd = (2 * math.log2(max(n, 2)) + 8) * UNIT_ROUNDOFF[dtype]
            pshape = reference.param_shape(x.shape, spec)
            out["dgamma"] = kd * (np.abs(dy) * (np.abs(st.xhat) + gain)).sum(axis=reduce_axes).reshape(pshape)
            out["dbeta"] = kd * np.abs(dy).sum(axis=reduce_axes).reshape(pshape)
        return out

    # -------------------------------------------------------------- 7. train / eval
    def modes(self):
        spec = self.spec
        if spec.batch_stats is None:
            return
        if not self.t.has_modes:
            self.add("train/eval rules", "modes", "skip", why="the target has no train/eval modes")
            return
        x = self.rng.normal(size=self.shape) * 2 + 1
        with self.t.mode(True):
            self.compare("training uses batch statistics", "modes", x, self.dtype, "train mode",
                         spec=spec.replace(batch_stats="batch"))
        before = self.t.buffers()
        after = self.t.buffers_after_training_step(x)
        if not after or "running_mean" not in after:
            self.add("running statistics update", "modes", "skip", why="the target exposes no running buffers")
        else:
            lay_axes = spec.resolve_axes(self.ndim)
            mean = x.mean(axis=lay_axes)
            var_u = x.var(axis=lay_axes, ddof=1)
            var_b = x.var(axis=lay_axes)
            rm0, rv0 = before["running_mean"].ravel(), before["running_var"].ravel()
            rm1, rv1 = after["running_mean"].ravel(), after["running_var"].ravel()
            with np.errstate(all="ignore"):
                m_mean = np.median((rm1 - rm0) / (mean.ravel() - rm0))
                m_var_u = np.median((rv1 - rv0) / (var_u.ravel() - rv0))
                m_var_b = np.median((rv1 - rv0) / (var_b.ravel() - rv0))
            # the update is checked against the momentum the target states (torch: .momentum), else the mean's
            stated = self.t.momentum
            want = stated if stated is not None else m_mean
            with np.errstate(invalid="ignore"):
                off = float(max(abs(m_mean - want), abs(m_var_u - want)))
            tol = 1e-6 + 1e-4 * abs(want) if np.isfinite(want) else 0.0
            ok = bool(off <= tol) and bool(want > 1e-6)
            if not np.isfinite(off):
                off = math.inf
            source = f"the target's momentum {stated:g}" if stated is not None else "one common momentum"
            why = ("running_mean and running_var must move by " + source + ", the variance unbiased (÷(n−1))"
                   f"; measured {m_mean:.4g} (mean), {m_var_u:.4g} (unbiased variance), {m_var_b:.4g} (biased)")
            if not want > 1e-6:
                why = f"the running statistics did not move in a training step (momentum {m_mean:.3g}); " + why
            self.add("running statistics update", "modes", "pass" if ok else "fail",
                     {"momentum_from_mean": m_mean, "momentum_from_var_unbiased": m_var_u,
                      "momentum_from_var_biased": m_var_b, "largest_departure": off},
                     {"momentum": stated if stated is not None else "equal for mean and unbiased variance"}, tol,
                     why)
        if "running_var" in self.params or "running_var" in before:
            eval_spec = spec.replace(batch_stats="running")
            saved = dict(self.params)
            self.params.update({k: before[k] for k in ("running_mean", "running_var") if k in before})
            with self.t.mode(False):
                self.compare("evaluation uses running statistics", "modes", x, self.dtype, "eval mode",
                             spec=eval_spec)
            self.params = saved


@quiet
def check(
    target,
    *,
    expect,
    shape,
    framework: str | None = None,
    dtypes=None,
    quick: bool = False,
    eps: float | None = None,
    seed: int = 0,
    explain_failures: bool = True,
    progress: Progress | None = None,
) -> Report:
    """Run the acceptance battery of ``target`` against the expected contract.

    ``expect``: a NormSpec, a preset name or a spec JSON path (``eps`` overrides its ε). Returns a
    :class:`Report`; when a finding fails, the report also carries the inferred contract and its
    differences from the expected one, in plain words.
    """
    started = time.perf_counter()
    shape = probe_shape(shape)
    spec = resolve_expected(expect, eps, shape)
    t = as_target(target, framework)
    calls_before = t.calls
    mode = {"batch": True, "running": False}.get(spec.batch_stats or "", t.training)
    b = _Battery(t, spec, shape, check_dtype_list(dtypes), quick, seed, progress)
    sections = [("determinism", b.determinism), ("parameters", b.resolve_params),
                ("hand case", b.hand_case), ("invariances", b.invariances),
                ("degenerate and extreme inputs", b.extremes), ("dependency", b.dependency),
                ("affine broadcast", b.affine), ("forward vs reference", b.forward_grid),
                ("backward vs reference", b.backward_grid)]
    with t.mode(bool(mode)):
        for label, step in sections:
            b.progress(label)
            step()
    b.progress("train/eval rules")
    b.modes()
    report = Report(target=t.description, expected=spec, shape=shape, dtypes=b.tried, dtypes_run=b.accepted,
                    findings=b.findings,
                    params_source=b.params_source, calls=t.calls - calls_before,
                    seconds=time.perf_counter() - started, quick=quick)
    if not report.ok and explain_failures:
        b.progress("a finding failed: inferring the contract to explain it")
        from .infer import infer

        try:
            inferred = infer(t, shape=shape, dtypes=dtypes, seed=seed)
            report.inferred = inferred.spec
            report.differences = differences(inferred.spec, spec, len(shape), shape=shape)
        except (NotANormalization, NormscopeError) as exc:
            report.inference_error = str(exc)
        report.calls = t.calls - calls_before
        report.seconds = time.perf_counter() - started
    return report
