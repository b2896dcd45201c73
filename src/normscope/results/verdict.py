"""The three verdicts every judging result gives — pass (looked, and it holds), fail (looked, and it breaks),
inconclusive (could not look or could not tell) — and what follows from them: an inconclusive result is never ok."""

from __future__ import annotations

from ..exitcodes import EXIT_CRASH, EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_OK

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


def verdict_of(failed: bool, undecided: bool) -> str:
    """A failure decides; without one, anything undecided makes the whole inconclusive."""
    if failed:
        return FAIL
    return INCONCLUSIVE if undecided else PASS


def exit_code(verdict: str, fail: int = EXIT_FAIL) -> int:
    """The command line's exit code for a verdict: pass 0, fail ``fail`` (1; ``diff`` passes 5), inconclusive 6.
    Any other value is a bug in normscope, never a verdict: 70 (``EXIT_CRASH``), so it cannot read as a pass."""
    return {PASS: EXIT_OK, FAIL: fail, INCONCLUSIVE: EXIT_INCONCLUSIVE}.get(verdict, EXIT_CRASH)


class Verdict:
    """Mixed into a result with a ``verdict`` property: ``ok`` and ``conclusive`` follow from it."""

    verdict: str

    @property
    def ok(self) -> bool:
        return self.verdict == PASS

    @property
    def conclusive(self) -> bool:
        return self.verdict != INCONCLUSIVE
