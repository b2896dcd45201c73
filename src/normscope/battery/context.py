"""The battery's context: everything a section reads, and the few values earlier sections establish.

A section is a function of a :class:`Context` yielding findings (:mod:`normscope.battery.registry` lists them
in order). The context is built once per :func:`~normscope.battery.check.check` from the target, the expected
spec and the shape; two sections fill in what later ones rely on, each in one documented field:

- ``determinism`` sets :attr:`Context.call_noise` (findings that compare two calls allow for it);
- ``parameters`` sets :attr:`Context.params` (γ/β and running statistics as a
  :class:`~normscope.results.params.NormParams`), :attr:`Context.param_names`, :attr:`Context.params_source`,
  :attr:`Context.recovered` / :attr:`Context.recovery_noise` (γ/β probed, with the probe's noise) and
  :attr:`Context.affine_maps` (the probed γ/β maps, for the affine-broadcast section).

A section that evaluates under other parameters (random γ/β in a private copy, running statistics after a
training step) works on :meth:`Context.with_params`, a copy; nothing is swapped on the context itself.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference
from ..errors import InputError, NormscopeError, TargetError
from ..groups import Groups
from ..layout import Layout
from ..numerics import constants as C
from ..numerics import tolerance
from ..precision import Precision
from ..report.numbers import sig
from ..results.check import Finding, Status
from ..results.params import NormParams
from ..spec import NormSpec
from ..targets import Target
from ..targets.base import no_dtype_error

Progress = Callable[[str], None]

#: The dtypes tried when none are asked for; float64 only as a last resort (see :meth:`Context.build`).
DEFAULT_DTYPES = ("float32", "float16", "bfloat16")


class NonFiniteOutput(TargetError):
    """The target ran at every dtype tried and returned non-finite values on ordinary inputs: a failed check (the
    target's fault), not a usage error."""

    def __init__(self, description: str, dtypes) -> None:
        super().__init__(f"{description} returned non-finite values on an ordinary input at every dtype tried "
                         f"({', '.join(dtypes)})")
        self.dtypes = tuple(dtypes)


@dataclasses.dataclass
class Context:
    """What the battery's sections share (see the module docstring for the fields sections fill in)."""

    target: Target
    spec: NormSpec
    shape: tuple[int, ...]
    quick: bool
    rng: np.random.Generator
    progress: Progress
    asked: tuple[str, ...] | None  # the dtypes the caller asked for (None: the defaults)
    tried: tuple[str, ...]  # every dtype tried, in the report's order
    accepted: tuple[str, ...]  # the dtypes the target runs at
    dtype: str  # the lead dtype: float32 where accepted
    precise: str  # where γ/β are measured: float32, else float64, accepted or not asked for
    layout: Layout  # axes, parameter shape and grouping of the probe shape
    groups: Groups
    findings: list[Finding] = dataclasses.field(default_factory=list)  # the sink the registry walk fills
    # set by the determinism section
    call_noise: float = 0.0  # relative call-to-call variation of the output (non-deterministic targets)
    # set by the parameters section
    params: NormParams = dataclasses.field(default_factory=NormParams)
    param_names: dict[str, str] = dataclasses.field(default_factory=dict)  # field → the target's parameter
    params_source: str = ""
    recovered: bool = False  # γ/β measured by probing (the bound adds the probe's noise)
    recovery_noise: tuple[float, float] = (0.0, 0.0)  # the two probe patterns' disagreement (γ, β)
    affine_maps: tuple[np.ndarray, np.ndarray] | None = None  # probed γ, β at every position

    @classmethod
    def build(cls, target: Target, spec: NormSpec, shape, dtypes: tuple[str, ...] | None, quick: bool, seed: int,
              progress: Progress | None) -> Context:
        """The context of one check: the dtypes the target runs at, the lead and precise dtypes, the groups."""
        shape = tuple(shape)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InputError(f"seed must be an integer ≥ 0; got {seed!r}")
        allowed = dtypes or DEFAULT_DTYPES
        accepted = tuple(d for d in allowed if target.accepts(d, shape))
        if not accepted and dtypes is None and target.accepts("float64", shape):
            accepted = ("float64",)
        if not accepted:
            if all(target.rejection(d) == "output was not finite" for d in allowed):
                raise NonFiniteOutput(target.description, allowed)
            raise no_dtype_error(target, allowed)
        # every dtype tried is in the report: one that cannot run is a finding, never an omission
        tried = tuple(dict.fromkeys((*allowed, *accepted)))
        # Contracts are stated for the dtypes models run in: float32 leads; float64 only when asked for
        # (some implementations change at float64, e.g. torch RMSNorm's eps=None becomes finfo(float64).eps).
        lead = "float32" if "float32" in accepted else ("float64" if "float64" in accepted else accepted[0])
        try:
            layout = Layout.of(spec, shape)
            groups = Groups.of(spec, shape)
        except NormscopeError as exc:
            raise InputError(f"the expected contract does not fit shape {shape}: {exc}") from None
        if groups.size < 2 and spec.center:
            raise InputError(
                f"at shape {shape} each statistic covers one element: a centred norm outputs β whatever the "
                "input, so nothing can be checked; use a shape with at least 2 elements per group")
        # γ/β are measured at a precise dtype the target accepts, asked for or not: at bf16/fp16 the ±u
        # experiment's own rounding would hide them
        precise = next((d for d in ("float32", "float64") if d in accepted or target.accepts(d, shape)), lead)
        return cls(target, spec, shape, quick, np.random.default_rng(seed), progress or (lambda _m: None),
                   dtypes, tried, accepted, lead, precise, layout, groups)

    # ------------------------------------------------------------------ derived
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def with_params(self, params: NormParams, *, recovered: bool | None = None,
                    recovery_noise: tuple[float, float] | None = None) -> Context:
        """A copy of this context evaluating under ``params`` (the target, rng and sink are shared)."""
        out = copy.copy(self)
        out.params = params
        if recovered is not None:
            out.recovered = recovered
        if recovery_noise is not None:
            out.recovery_noise = recovery_noise
        return out

    # ------------------------------------------------------------------ findings
    def finding(self, id: str, name: str, status: Status | str, measured: Any = None, expected: Any = None,
                tolerance: Any = None, why: str = "", **params: Any) -> Finding:
        """A finding with a stable ``id`` (``"section.check"``), its display ``name`` and its ``params``."""
        return Finding(name, id.split(".", 1)[0], Status(status), measured, expected, tolerance, why, id, params)

    # ------------------------------------------------------------------ the reference
    def ref(self, x, dtype: str | None = None, spec: NormSpec | None = None, **kw) -> np.ndarray:
        """The reference under the context's parameters: exact (float64) or emulated at ``dtype``."""
        with np.errstate(all="ignore"):
            return reference.forward(x, spec or self.spec, **self.params.kwargs(),
                                     dtype=None if dtype in (None, "float64") else dtype, **kw)

    def emulate(self, x, dtype: str, spec: NormSpec | None = None) -> np.ndarray:
        """The faithful output at ``dtype`` (γ/β stored at the input dtype, as a module cast with ``.to``)."""
        if dtype == "float64":
            return self.ref(x, spec=spec)
        return self.ref(x, dtype, spec=spec)

    def pattern(self) -> np.ndarray:
        """A zero-mean, unit-variance input per group with no entry near 0 (consumes the rng)."""
        return self.groups.pattern(self.rng)

    def noise_floor(self, scale: float) -> float:
        """What two calls on one input may differ by at outputs up to ``scale``."""
        return tolerance.noise_floor(self.call_noise, scale)

    def recovery_tolerance(self) -> float:
        """The resolution of γ/β recovered by probing at the precise dtype."""
        return tolerance.recovery_tolerance(self.precise, self.recovery_noise)

    def compare(self, id: str, name: str, x, dtype: str, why: str, run=None, spec: NormSpec | None = None,
                **where: Any) -> Finding:
        """Target vs reference at ``dtype``, element by element within :func:`tolerance.forward_bound`."""
        spec = spec or self.spec
        where = {**where, "dtype": dtype}  # the finding's params: where it was made
        x = Precision(dtype).round(x).astype(np.float64)
        y = (run or self.target)(x, dtype)
        exact = self.ref(x, spec=spec)
        emul = self.emulate(x, dtype, spec=spec)
        if not np.all(np.isfinite(emul)) or not np.all(np.isfinite(exact)):
            if np.array_equal(np.isfinite(y), np.isfinite(emul)):
                return self.finding(id, name, "skip", None, None, None,
                                    f"{why}: the contract itself is not finite here at {dtype}; the target agrees",
                                    **where)
            return self.finding(id, name, "skip", int((~np.isfinite(y)).sum()), int((~np.isfinite(emul)).sum()),
                                None, f"{why}: the contract itself overflows or is undefined at {dtype}", **where)
        faithful = useless_emulation(exact, emul)
        if faithful is not None and dtype != "float64":
            return self.finding(id, name, "skip", None, faithful, None,
                                f"{why}: a faithful {dtype} implementation itself errs by {sig(faithful)} here", **where)
        bound = tolerance.forward_bound(x, spec, dtype, self.params, exact=exact, emulated=emul,
                                        recovery_noise=self.recovery_noise if self.recovered else None)
        c = tolerance.compare(y, exact, emul, bound)
        if c.nonfinite:
            return self.finding(id, name, "fail", float("inf"), 0.0, float(bound.max()),
                                f"{why} at {dtype}: {c.nonfinite} non-finite outputs where the contract is finite",
                                **where)
        # measured and tolerance are the same element's pair (the worst ratio), so they agree with the verdict
        return self.finding(id, name, "pass" if c.ok else "fail", c.worst_error, 0.0, c.worst_bound,
                            f"{why} ({dtype}; worst element {sig(c.worst_error)} vs its bound {sig(c.worst_bound)}: "
                            f"2 × a faithful emulation's error there (pairwise sums {sig(c.worst_faithful, 2)}, or "
                            f"sequential) + the accumulation bound; largest error {sig(c.max_error)})",
                            **where)


def useless_emulation(exact: np.ndarray, emulated: np.ndarray) -> float | None:
    """The largest error of a faithful emulation against the exact output where it passes ``FAITHFUL_USELESS`` ×
    the output's scale (nothing to compare a target with there: a one-pass variance in the input dtype at a large
    offset cancels to noise); None where the emulation is useful. A non-finite error counts as useless."""
    with np.errstate(all="ignore"):
        scale = float(np.nanmax(np.abs(exact))) if np.isfinite(exact).any() else 1.0
        err = np.abs(emulated - exact)
    worst = float(err.max()) if err.size else 0.0
    return worst if not np.all(np.isfinite(err)) or worst > C.FAITHFUL_USELESS * max(scale, 1e-300) else None

