"""What ``diagnose`` returns: the incidents of a run, each with the first link of the chain behind it (an
:class:`Anomaly`), the drifts, and the :class:`Diagnosis` that holds them with what was not judged."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from ...jsonable import jsonable
from ...results.verdict import Verdict, verdict_of
from .metrics import entry_metrics

DIAGNOSIS_SCHEMA = "normscope.diagnosis/2"


@dataclasses.dataclass
class Anomaly:
    """A series that left its normal range at ``step``: a cause or a departure of an incident."""
    step: int
    stage: str
    layer: int | None
    head: int | None
    metric: str
    value: float
    baseline: float | None
    evidence: str
    next_check: str
    site: str = ""
    sample_ids: list | None = None
    score: float = math.inf  # robust σ from its baseline (inf: a non-finite value or a count after zeros)
    order: tuple = ()

    def where(self) -> str:
        parts = [self.stage]
        if self.layer is not None:
            parts.append(f"layer {self.layer}")
        if self.site:
            parts.append(self.site)
        if self.head is not None:
            parts.append(f"head {self.head}")
        return " · ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("order")
        return jsonable(d)


@dataclasses.dataclass
class Incident:
    """A problem at ``step`` (``kind``, with its symptom's numbers) and the first link of the chain behind it."""
    step: int
    kind: str
    metric: str
    value: float
    baseline: float | None
    evidence: str
    cause: Anomaly
    departures: list[Anomaly]  # what else left its range in the window, farthest first (the cause included)
    symptoms: list[str] = dataclasses.field(default_factory=list)  # later triggers folded into this incident

    def to_dict(self) -> dict[str, Any]:
        return jsonable({"step": self.step, "kind": self.kind, "metric": self.metric, "value": self.value,
                         "baseline": self.baseline, "evidence": self.evidence, "cause": self.cause.to_dict(),
                         "departures": [a.to_dict() for a in self.departures], "symptoms": self.symptoms})


@dataclasses.dataclass
class Drift:
    """A series growing step after step towards a level where it becomes dangerous, or already past it."""
    stage: str
    layer: int | None
    site: str
    head: int | None
    metric: str
    step: int  # the last recorded step
    value: float
    slope: float  # ×exp(slope) per recorded step (natural log per step; ≤ 0 for a crossed series that stopped growing)
    danger: float
    steps_to_danger: float  # 0 when crossed
    status: str  # "crossed" or "on course"
    evidence: str

    def where(self) -> str:
        return Anomaly(self.step, self.stage, self.layer, self.head, self.metric, self.value, None, "", "",
                       self.site).where()

    def to_dict(self) -> dict[str, Any]:
        return jsonable(dataclasses.asdict(self))


@dataclasses.dataclass
class Diagnosis(Verdict):
    run_dir: str
    incidents: list[Incident]
    drifts: list[Drift]
    steps: list[int]
    header: dict[str, Any]
    disabled: list[str]
    errors: list[dict[str, Any]]
    settings: dict[str, Any]
    complete: bool  # the tracer closed the run (an end line); False while it is still written or after a crash
    damaged: list[str] = dataclasses.field(default_factory=list)  # lines of the file that could not be read
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list, repr=False)
    # why a run without incidents is not clean: what was not judged, each with what would decide it
    undecided: list[str] = dataclasses.field(default_factory=list)
    # what was seen and judged not to be an incident, each with why (a hard or mislabelled sample)
    notes: list[str] = dataclasses.field(default_factory=list)
    # every training run the folder holds (a folder reused by a later run holds several), oldest first, and the
    # one judged (1-based)
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    run: int = 1
    # what the way the run was recorded leaves unjudged at every step, whatever the verdict (with ``every`` > 1,
    # parameters written between recorded steps), each with what would judge it
    limits: list[str] = dataclasses.field(default_factory=list)

    @property
    def verdict(self) -> str:
        """fail: an incident; inconclusive: none found, but part of the run could not be judged; pass: clean."""
        return verdict_of(bool(self.incidents), bool(self.undecided))

    @property
    def first(self) -> Anomaly | None:
        """The cause of the first incident (None on a clean run)."""
        return self.incidents[0].cause if self.incidents else None

    @property
    def anomalies(self) -> list[Anomaly]:
        """Every incident's departures, in chain order (earliest step first)."""
        seen, out = set(), []
        for inc in self.incidents:
            for a in inc.departures:
                key = (a.step, a.stage, a.layer, a.site, a.head, a.metric)
                if key not in seen:
                    seen.add(key)
                    out.append(a)
        return sorted(out, key=lambda a: a.order)

    def series(self, stage: str, metric: str, layer: int | None = None, site: str | None = None,
               head: int | None = None) -> tuple[list[int], list[float]]:
        """(steps, values) of one series; ``site=None`` takes the first site of that stage and layer."""
        xs, ys = [], []
        for rec in self.records:
            for e in rec["entries"]:
                if e["stage"] != stage or e["layer"] != layer or (site is not None and e["site"] != site):
                    continue
                v = entry_metrics(e).get(metric)
                if isinstance(v, list):
                    v = v[head or 0] if len(v) > (head or 0) else None
                if v is not None:
                    xs.append(rec["step"])
                    ys.append(v)
                break
        return xs, ys

    def to_dict(self) -> dict[str, Any]:
        return jsonable({"schema": DIAGNOSIS_SCHEMA, "run_dir": self.run_dir, "steps_recorded": len(self.steps),
                         "last_step": self.steps[-1] if self.steps else None, "complete": self.complete,
                         "model": self.header.get("model"), "every": self.header.get("every"),
                         "world_size": self.header.get("world_size"), "disabled": self.disabled,
                         "errors": self.errors, "damaged": self.damaged, "settings": self.settings,
                         "verdict": self.verdict, "undecided": self.undecided, "notes": self.notes,
                         "limits": self.limits,
                         "run": self.run, "runs": self.runs,
                         "first": self.first.to_dict() if self.first else None,
                         "incidents": [i.to_dict() for i in self.incidents],
                         "drifts": [d.to_dict() for d in self.drifts]})

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

