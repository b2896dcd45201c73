"""The result of ``normscope.diff``: one :class:`SiteDiff` per aligned site and the verdict, as data.

JSON: ``"schema": "normscope.diff/1"``; :meth:`Diff.from_dict` reads it back. Rendering (a rich table, a PNG of
error against depth) lives in :mod:`.render` and computes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from ..jsonable import jsonable
from ..report.numbers import sig
from ..results.verdict import Verdict, verdict_of

SCHEMA = "normscope.diff/1"

#: Site statuses. ``diverged``: the site's own error exceeds its bound (or the candidate raised there, or its
#: output has another shape); ``within``: own error measured and within bound; ``propagated``: only the
#: propagated error was measured (no teacher-forced run at this site); ``regrouped``: the candidate's output here is
#: the reference's times a constant and every consumer of it agrees (a scale the candidate applies elsewhere).
STATUSES = ("within", "diverged", "propagated", "raised", "shape", "reference_not_finite", "unmatched", "regrouped")


def _num(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def _unnum(v):
    if v in ("nan", "inf", "-inf"):
        return float(v)
    return v


def _deep(v, f):
    if isinstance(v, dict):
        return {k: _deep(x, f) for k, x in v.items()}
    if isinstance(v, list):
        return [_deep(x, f) for x in v]
    return f(v)


def _metrics_out(d: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if d is None else {k: _num(v) for k, v in d.items()}


def _metrics_in(d: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if d is None else {k: _unnum(v) for k, v in d.items()}


@dataclasses.dataclass
class SiteDiff:
    """One site (a module call, in completion order: a module's children before the module)."""

    name: str
    cls: str
    kind: str  # "norm" | "leaf" | "module"
    order: int
    depth: int
    shape: list[int]
    status: str
    counterpart: str | None = None  # the candidate's site it was aligned with
    own: dict[str, Any] | None = None  # candidate's module on the reference's input vs the reference's output
    propagated: dict[str, Any] | None = None  # candidate's own forward vs the reference's output
    twin: float | None = None  # normalised error of the reference's module at the candidate's dtype
    # a quantized candidate: its own output against the twin's (the reference with the candidate's dequantized
    # weights), ‖c − t‖/‖t‖ — the error its quantization does not explain, which the bound judges; ``twin`` is then
    # what the quantization (and the dtype) explain
    beyond_twin: float | None = None
    bound: float | None = None
    bound_rule: str = ""
    note: str = ""
    # at a norm site judged by the error model: the contract, the worst element's error and bound, elements outside
    elementwise: dict[str, Any] | None = None
    # the dtype the candidate's module ran at on the reference's input, which its bound is taken at (under
    # autocast: the least precise dtype its ops were observed to produce)
    dtype: str | None = None
    # why the own error was not measured where the site would get one (an ONNX site whose subgraph cannot be
    # extracted or fed): the row says "n/a" with it
    own_missing: str = ""
    factor: float | None = None  # the candidate's output is the reference's times this constant (see ``regrouped``)
    # a module's own error isolates its own code: how many of its child calls were replayed with the reference's
    # outputs, and the child sites its teacher-forced run computed itself (no judgement of their own: their error
    # is this module's)
    children_replayed: int = 0
    children_run: list[str] = dataclasses.field(default_factory=list)
    # the worst ‖Δ‖/‖r‖ of the inputs its code handed its children (against the reference's), and to which child
    feeds: float | None = None
    feeds_to: str | None = None
    # its outputs beyond the primary, by name or position: ‖Δ‖/‖r‖ of the candidate's own run (None: the candidate
    # returned no such output — not compared)
    outputs: dict[str, float | None] = dataclasses.field(default_factory=dict)

    @property
    def own_error(self) -> float | None:
        return None if self.own is None else self.own.get("normalized")

    @property
    def judged_error(self) -> float | None:
        """The number its bound was held to: the largest of its own error, what its code handed its children
        (``feeds``) and its other outputs' errors (None without an own error); at a quantized candidate's site its
        error beyond the twin (``beyond_twin``) stands for its own error (what it feeds its children, replayed with
        the reference's outputs, meets no quantized weight: it is held to the reference's as ever)."""
        if self.own_error is None:
            return None
        others = [v for v in (self.feeds, *self.outputs.values()) if v is not None]
        return max([self.own_error if self.beyond_twin is None else self.beyond_twin, *others])

    @property
    def propagated_error(self) -> float | None:
        return None if self.propagated is None else self.propagated.get("normalized")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["own"], d["propagated"] = _metrics_out(self.own), _metrics_out(self.propagated)
        d["twin"], d["bound"], d["feeds"] = _num(self.twin), _num(self.bound), _num(self.feeds)
        d["elementwise"] = _deep(self.elementwise, _num)
        d["outputs"] = {k: _num(v) for k, v in self.outputs.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SiteDiff:
        d = dict(d)
        d["own"], d["propagated"] = _metrics_in(d.get("own")), _metrics_in(d.get("propagated"))
        d["twin"], d["bound"], d["feeds"] = _unnum(d.get("twin")), _unnum(d.get("bound")), _unnum(d.get("feeds"))
        d["elementwise"] = _deep(d.get("elementwise"), _unnum)
        d["outputs"] = {k: _unnum(v) for k, v in (d.get("outputs") or {}).items()}
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclasses.dataclass
class Diff(Verdict):
    """Two executions of one model compared site by site.

    ``first_divergence``: the name of the first site (in completion order) whose own error exceeds what a
    faithful execution at the candidate's dtype is allowed, or where the candidate raised or changed shape;
    None when every measured site is within bounds. ``divergence`` says why, with the numbers, and at a norm
    site the two inferred contracts and their differences in the contract's words.
    """

    reference: str
    candidate: str
    reference_dtype: str
    candidate_dtype: str
    inputs: dict[str, Any]
    sites: list[SiteDiff]
    first_divergence: str | None = None
    divergence: dict[str, Any] | None = None
    unmatched_reference: list[str] = dataclasses.field(default_factory=list)
    unmatched_candidate: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    tensors: dict[str, Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    #: ``grad=True``: the sites in backward order (``propagated``: the gradient w.r.t. the site's output;
    #: ``own``: dx of the candidate's module on the reference's input and output gradient), the first gradient
    #: divergence, and the whole-model parameter gradients by name (reported, not judged)
    grad: bool = False
    grad_sites: list[SiteDiff] = dataclasses.field(default_factory=list)
    grad_first_divergence: str | None = None
    grad_divergence: dict[str, Any] | None = None
    param_grads: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: the autocast dtype the candidate ran under (``candidate_dtype`` is then that dtype too), or None
    autocast: str | None = None
    #: why the comparison could not tell, each with what would decide it (empty: it could)
    inconclusive: list[str] = dataclasses.field(default_factory=list)
    #: a divergence found without a site to name (the candidate raised outside every aligned site)
    failed: bool = False

    @property
    def diverged(self) -> bool:
        return self.first_divergence is not None or self.grad_first_divergence is not None or self.failed

    @property
    def verdict(self) -> str:
        """``"fail"`` (looked, and it breaks: a divergence), ``"inconclusive"`` (could not look or could not tell:
        :attr:`inconclusive` says why and what would decide it) or ``"pass"`` (looked, and every site holds)."""
        return verdict_of(self.diverged, bool(self.inconclusive))

    def site(self, name: str) -> SiteDiff:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(f"no site {name!r}; sites: {', '.join(s.name for s in self.sites[:8])}…")

    def summary(self) -> str:
        text = self._forward_summary()
        if self.grad:
            if self.grad_first_divergence is None:
                measured = sum(s.own is not None for s in self.grad_sites)
                text += (f"; gradients: no divergence ({measured} sites' own gradient errors within the bound, "
                         f"{len(self.grad_sites)} compared)")
            else:
                text += (f"; gradients: first divergence at {self.grad_first_divergence}: "
                         f"{self.grad_divergence.get('reason', '')}")
        return text

    def _forward_summary(self) -> str:
        if self.first_divergence is None and self.failed:
            return f"the candidate failed: {(self.divergence or {}).get('reason', '')}"
        if self.first_divergence is None and self.inconclusive:
            return f"inconclusive: {self.inconclusive[0]}" + (
                f" (and {len(self.inconclusive) - 1} more reasons)" if len(self.inconclusive) > 1 else "")
        if self.first_divergence is None:
            measured = sum(s.own is not None for s in self.sites)
            at = f"autocast {self.autocast}" if self.autocast else self.candidate_dtype
            if self.stats.get("self_candidate"):
                norms = sum(s.kind == "norm" and s.status == "within" for s in self.sites)
                added = self.stats.get("error_added") or []
                most = (f"; the most error is added at {added[0]['site']} ({sig(added[0]['own_roundoffs'])} roundoffs "
                        f"of {added[0]['dtype']}, ×{sig(added[0]['amplification'])} its input's error)") if added else ""
                return (f"no divergence: {norms} norm sites within their contracts at {at}; the other sites are "
                        f"the reference's own operations, faithful by construction ({measured} own errors "
                        f"measured){most}")
            quantized = [s for s in self.sites if s.beyond_twin is not None and s.twin is not None]
            most = ""
            if quantized:  # what the pass is made of: the quantization's share, and the rest within float rounding
                top = max(quantized, key=lambda s: s.twin)
                most = (f"; the quantization explains ‖Δ‖/‖r‖ up to {sig(top.twin)} ({top.name}), and "
                        f"{sum(s.status == 'within' for s in quantized)} quantized sites are within float rounding "
                        "of the reference run with their dequantized weights")
            return (f"no divergence: {measured} sites' own errors within the bound at {at} "
                    f"({len(self.sites)} sites compared){most}")
        return f"first divergence at {self.first_divergence}: {self.divergence.get('reason', '')}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "inconclusive": list(self.inconclusive),
            "failed": self.failed,
            "reference": self.reference, "candidate": self.candidate,
            "reference_dtype": self.reference_dtype, "candidate_dtype": self.candidate_dtype,
            "autocast": self.autocast,
            "inputs": jsonable(self.inputs),
            "first_divergence": self.first_divergence,
            "divergence": jsonable(self.divergence),
            "sites": [s.to_dict() for s in self.sites],
            "unmatched_reference": list(self.unmatched_reference),
            "unmatched_candidate": list(self.unmatched_candidate),
            "notes": list(self.notes),
            "stats": jsonable(self.stats),
            "seconds": self.seconds,
            "grad": self.grad,
            "grad_first_divergence": self.grad_first_divergence,
            "grad_divergence": jsonable(self.grad_divergence),
            "grad_sites": [s.to_dict() for s in self.grad_sites],
            "param_grads": [_metrics_out(p) for p in self.param_grads],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Diff:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} document (schema {d.get('schema')!r})")
        return cls(
            reference=d["reference"], candidate=d["candidate"], reference_dtype=d["reference_dtype"],
            candidate_dtype=d["candidate_dtype"], autocast=d.get("autocast"), inputs=d.get("inputs", {}),
            sites=[SiteDiff.from_dict(s) for s in d["sites"]], first_divergence=d.get("first_divergence"),
            divergence=d.get("divergence"), unmatched_reference=list(d.get("unmatched_reference", [])),
            unmatched_candidate=list(d.get("unmatched_candidate", [])), notes=list(d.get("notes", [])),
            stats=dict(d.get("stats", {})), seconds=float(d.get("seconds", 0.0)), grad=bool(d.get("grad", False)),
            grad_sites=[SiteDiff.from_dict(s) for s in d.get("grad_sites", [])],
            grad_first_divergence=d.get("grad_first_divergence"), grad_divergence=d.get("grad_divergence"),
            param_grads=[_metrics_in(p) for p in d.get("param_grads", [])],
            inconclusive=list(d.get("inconclusive", [])), failed=bool(d.get("failed", False)))

    @classmethod
    def from_json(cls, text: str) -> Diff:
        return cls.from_dict(json.loads(text))
