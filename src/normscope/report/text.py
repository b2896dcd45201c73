"""Plain-text rendering of a check report (what ``assert_conforms`` raises with)."""

from __future__ import annotations

from typing import Any

from ..results.check import Report, Status


def short(v: Any) -> str:
    """A value in a few characters: floats to 4 significant digits, long lists cut after 8."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {short(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(short(x) for x in v[:8]) + (", …" if len(v) > 8 else "") + "]"
    return str(v)


def render(report: Report) -> str:
    """One line of counts, one per failed finding with its numbers, one per contract difference."""
    c = report.counts()
    lines = [f"{report.target} vs {report.expected.summary()}: {c['pass']} passed, {c['fail']} failed, "
             f"{c['skip']} skipped"]
    for f in report.findings:
        if f.status == Status.FAIL:
            lines.append(f"  FAIL {f.section}/{f.name}: {f.why} (measured {short(f.measured)}, expected "
                         f"{short(f.expected)}, tolerance {short(f.tolerance)})")
    for d in report.differences:
        lines.append(f"  contract difference: {d}")
    return "\n".join(lines)
