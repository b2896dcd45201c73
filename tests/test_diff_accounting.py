"""``diff`` accounts for every discrepancy, held as one property over generated cases (:mod:`diff_cases`:
architectures from the installed transformers × fault kinds × sites chosen by structure):

- a fault that moves the output (or, with ``grad=True``, a gradient) beyond its bound is never a PASS;
- a FAIL names the injected module, or the ancestor whose own code holds it;
- a clean copy (float32, bfloat16, autocast) is a PASS, or INCONCLUSIVE with its reasons — never a FAIL.

A fixed sample runs in ``make test``; every case (233) with ``NORMSCOPE_SLOW_TESTS=1``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

import diff_cases  # noqa: E402
from diff_cases import CLEAN, GRAD_FAULTS, Case  # noqa: E402

from normscope.divergence import diff  # noqa: E402
from normscope.divergence.execution import primary  # noqa: E402

SLOW = os.environ.get("NORMSCOPE_SLOW_TESTS") == "1"
SAMPLE = 40  # cases in the default run: every architecture's clean copy, then faults spread over the rest


def _sample(cases: list[Case]) -> list[Case]:
    if SLOW:
        return cases
    first = [c for c in cases if c.fault == "clean"]
    rest = [c for c in cases if c.fault != "clean"]
    step = max(1, len(rest) // (SAMPLE - len(first)))
    return first + rest[::step][:SAMPLE - len(first)]


CASES = _sample(diff_cases.all_cases())


def _moved(ref, cand, kw, grad: bool) -> float:
    """‖Δ‖/‖r‖ of the primary output (grad: of the input-embedding gradient of the output's sum)."""
    if not grad:
        with torch.no_grad():
            r, c = primary(ref(**kw)), primary(cand(**kw))
        return float((c.double() - r.double()).norm() / r.double().norm())
    out = []
    for m in (ref, cand):
        params = [p for p in m.parameters() if p.requires_grad]
        g = torch.autograd.grad(primary(m(**kw)).float().sum(), params, allow_unused=True)
        out.append(torch.cat([x.reshape(-1) for x in g if x is not None]).double())
    return float((out[1] - out[0]).norm() / out[0].norm())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_diff_accounts_for_every_fault(case: Case):
    ref, cand, kw, opts = case.build()
    d = diff(ref, cand, kw, progress=False, **opts)
    text = f"{case.id}: {d.summary()} | {d.inconclusive}"
    if case.fault in CLEAN:
        assert d.verdict in ("pass", "inconclusive"), text
        assert d.verdict == "pass" or d.inconclusive, text
        return
    moved = _moved(ref, cand, kw, case.fault in GRAD_FAULTS)
    if moved > 1e-4:
        assert d.verdict != "pass", f"moved {moved:.3g}; {text}"
    if d.verdict == "fail":
        site = case.site()
        named = d.grad_first_divergence if case.fault in GRAD_FAULTS else d.first_divergence
        assert named is not None, text
        named = named.split("#")[0]
        assert named == site or site.startswith(named + "."), f"injected at {site}; {text}"
