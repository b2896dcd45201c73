"""Plain-text rendering of a check report (what ``assert_conforms`` raises with)."""

from __future__ import annotations

from typing import Any

from ..results.check import Report, Status
from .numbers import sig


def short(v: Any) -> str:
    """A value in a few characters: floats to 4 significant digits, long lists cut after 8."""
    if isinstance(v, float):
        return sig(v, 4)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {short(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(short(x) for x in v[:8]) + (", …" if len(v) > 8 else "") + "]"
    return str(v)


def render(report: Report) -> str:
    """The verdict and one line of counts, one per failed or inconclusive finding with its numbers, one per
    contract difference."""
    c = report.counts()
    undecided = f", {c['inconclusive']} inconclusive" if c["inconclusive"] else ""
    lines = [f"{report.verdict.upper()}: {report.target} vs {report.expected.summary()}: {c['pass']} passed, "
             f"{c['fail']} failed{undecided}, {c['skip']} skipped"]
    for f in report.findings:
        if f.status in (Status.FAIL, Status.INCONCLUSIVE):
            lines.append(f"  {f.status.upper()} {f.section}/{f.name}: {f.why} (measured {short(f.measured)}, "
                         f"expected {short(f.expected)}, tolerance {short(f.tolerance)})")
    for reason in report.undecided:
        lines.append(f"  INCONCLUSIVE: {reason}")
    for d in report.differences:
        lines.append(f"  contract difference: {d}")
    return "\n".join(lines)
