"""The acceptance battery's results: findings with stable ids, and the report that holds them.

A :class:`Finding` is one verdict: a stable ``id`` (``"extreme.tiny_variance"``: section, then check) and
structured ``params`` (the dtype, shape, variance … it was made at) identify it; ``name`` is the display title
a person reads. ``status`` is a :class:`Status`. Every finding carries what it measured, what it expected
and the tolerance it used. A :class:`Report` serialises as ``"schema": "normscope.check/1"`` and loads back
(:meth:`Report.from_dict`). Rendering lives in :mod:`normscope.report`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Any

from ..jsonable import document, jsonable
from ..loading import read_json_file
from ..spec import NormSpec
from .verdict import Verdict, verdict_of

__all__ = ["SCHEMA", "Status", "Finding", "Report"]

SCHEMA = "normscope.check/1"


class Status(enum.StrEnum):
    """A finding's verdict. String-valued: ``Status.PASS == "pass"`` and JSON holds ``"pass"``."""

    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"  # the finding does not apply here (it decides nothing about this contract)
    INCONCLUSIVE = "inconclusive"  # it decides the contract, and could not tell: never a pass


def _param_text(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list | tuple):
        return "(" + ", ".join(_param_text(x) for x in v) + ")"
    return str(v)


def _restore(v: Any) -> Any:
    """JSON values back to Python: the strings ``jsonable`` wrote for non-finite floats become floats again."""
    if isinstance(v, dict):
        return {k: _restore(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_restore(x) for x in v]
    if v in ("inf", "-inf", "nan"):
        return float(v)
    return v


@dataclasses.dataclass
class Finding:
    """One check: pass, fail or skip, with the numbers behind the verdict.

    ``id`` names the check whatever its parameters; ``params`` says where it was made (dtype, shape, …);
    ``name`` and ``section`` are for display (``section`` is the id's first part).
    """

    name: str
    section: str
    status: Status
    measured: Any = None
    expected: Any = None
    tolerance: Any = None
    why: str = ""
    id: str = ""
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.status = Status(self.status)

    @property
    def key(self) -> str:
        """The id with its parameters, ``"reference.rounding[dtype=bfloat16]"``: one finding of a report."""
        if not self.params:
            return self.id
        return f"{self.id}[" + "; ".join(f"{k}={_param_text(v)}" for k, v in self.params.items()) + "]"

    def to_dict(self) -> dict[str, Any]:
        return {k: jsonable(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: _restore(v) for k, v in data.items() if k in fields})


@dataclasses.dataclass
class Report(Verdict):
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
    def verdict(self) -> str:
        """``"fail"`` (a finding failed), ``"inconclusive"`` (none failed, but one that decides the contract could
        not tell — its ``why`` says what would decide it — or nothing was tested: :attr:`undecided`) or
        ``"pass"``."""
        return verdict_of(any(f.status == Status.FAIL for f in self.findings),
                          any(f.status == Status.INCONCLUSIVE for f in self.findings) or bool(self.undecided))

    @property
    def undecided(self) -> list[str]:
        """Why the report is inconclusive where no finding says it: every finding is a skip (or there is none), so
        nothing was tested — a report without one comparison is never a pass. Empty otherwise."""
        if any(f.status != Status.SKIP for f in self.findings):
            return []
        n = len(self.findings)
        what = f"all {n} findings are skips" if n > 1 else "its one finding is a skip" if n else "it has no findings"
        return [f"nothing was tested: {what}, so the target was never compared with the contract; a run in which a "
                "check applies decides it — a shape and dtypes the target accepts, and what each skip says is "
                "missing"]

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.status == Status.FAIL]

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in Status}
        for f in self.findings:
            out[f.status.value] += 1
        return out

    def find(self, id: str, **params) -> list[Finding]:
        """The findings with this ``id`` whose params include ``params``."""
        return [f for f in self.findings if f.id == id and all(f.params.get(k) == v for k, v in params.items())]

    def keys(self, status: Status | str | None = None) -> set[str]:
        """The keys (:attr:`Finding.key`) of the findings, or of those with ``status``."""
        return {f.key for f in self.findings if status is None or f.status == status}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "target": self.target,
            "verdict": self.verdict,
            "ok": self.ok,
            "expected": self.expected.to_dict(),
            "expected_summary": self.expected.summary(),
            "shape": list(self.shape),
            "dtypes": list(self.dtypes),
            "dtypes_run": list(self.dtypes_run),
            "params_source": self.params_source,
            "counts": self.counts(),
            "undecided": self.undecided,
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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """A report loaded back from :meth:`to_dict` (``verdict``, ``ok``, ``counts`` and ``undecided`` are derived,
        not read)."""

        data = document(data, SCHEMA, "check report")
        seconds = data.get("seconds", 0.0)
        return cls(
            target=data["target"],
            expected=NormSpec.from_dict(data["expected"]),
            shape=tuple(data["shape"]),
            dtypes=tuple(data["dtypes"]),
            findings=[Finding.from_dict(f) for f in data["findings"]],
            params_source=data.get("params_source", ""),
            calls=int(data.get("calls", 0)),
            seconds=float(seconds) if math.isfinite(float(seconds)) else 0.0,
            quick=bool(data.get("quick", False)),
            differences=list(data.get("differences") or []),
            inferred=NormSpec.from_dict(data["inferred"]) if data.get("inferred") else None,
            inference_error=data.get("inference_error", ""),
            dtypes_run=tuple(data.get("dtypes_run") or ()),
        )

    @classmethod
    def load(cls, path: str | Path) -> Report:
        """A report from a JSON file written by ``to_json`` (``normscope check --json``)."""
        return cls.from_dict(read_json_file(path, "a check report JSON (normscope check --json)", need_object=True))

    # rendering lives in normscope.report; these stay as the report's own shortcuts
    def text(self) -> str:
        """Plain-text report (what ``assert_conforms`` raises with)."""
        from ..report.text import render

        return render(self)

    def to_junit(self, path: str | Path) -> None:
        """JUnit XML, one testcase per finding, for CI systems."""
        from ..report.junit import write

        write(self, path)
