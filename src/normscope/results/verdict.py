"""The three verdicts every judging result gives — pass (looked, and it holds), fail (looked, and it breaks),
inconclusive (could not look or could not tell) — and what follows from them: an inconclusive result is never ok."""

from __future__ import annotations

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


def verdict_of(failed: bool, undecided: bool) -> str:
    """A failure decides; without one, anything undecided makes the whole inconclusive."""
    if failed:
        return FAIL
    return INCONCLUSIVE if undecided else PASS


class Verdict:
    """Mixed into a result with a ``verdict`` property: ``ok`` and ``conclusive`` follow from it."""

    verdict: str

    @property
    def ok(self) -> bool:
        return self.verdict == PASS

    @property
    def conclusive(self) -> bool:
        return self.verdict != INCONCLUSIVE
