"""A rule of ``diagnose`` as data: what it reads, in which direction a move is a failure, how its threshold is
derived, and what it reports. Each stage of the pipeline (:mod:`.incidents`, :mod:`.localize`, :mod:`.drifts`,
:mod:`.notes`) keeps its rules in a table of these; :data:`normscope.tracing.diagnosis.RULES` lists them all, and
:func:`markdown` writes the table docs/trace.md shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str  # the incident kind it raises, or the rule's own name for the other stages
    stage: str  # "incident", "localization", "drift" or "note"
    reads: str  # the series it reads
    direction: str  # where a move is a failure: "up", "down", "both", "non-finite", "appears"
    threshold: str  # how its threshold is derived (the settings it uses by name)
    reports: str  # what it reports, and where
    # the stage's finder for this rule (several rules may share one finder, run once: they share a threshold)
    find: Callable[..., Any] | None = dataclasses.field(default=None, compare=False, repr=False)


def markdown(rules: Iterable[Rule]) -> str:
    """The rules as a Markdown table, in pipeline order (what docs/trace.md shows)."""
    out = ["| stage | rule | reads | direction | threshold | reports |", "|---|---|---|---|---|---|"]
    for r in rules:
        cells = (r.stage, f"`{r.name}`", r.reads, r.direction, r.threshold, r.reports)
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)
