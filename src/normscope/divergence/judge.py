"""The per-site judgement of ``diff``: given what was measured at one site, its status and the bound it was held
to. Pure: each function reads its arguments and sets the fields of the one :class:`~.result.SiteDiff` it is given.

- :func:`own_error` — a site with an own error (teacher forcing): within the dtype-derived bound
  (:func:`.metrics.bound`, with the twin's error when one was measured) or diverged;
- :func:`norm_contract` — a norm site: the element-wise bound of its inferred contract (:mod:`.contracts`);
- :func:`composition` — a module without an own error (a block, the model) whose output errs far more than every
  child's output and its input did: the divergence is in its own code between its children;
- :func:`graph_propagated` — a runtime graph's site (ONNX, OpenVINO) without an own error, judged on its
  propagated error;
- :func:`graph_carried` — a quantized runtime graph's site without an own error (its propagated error is mostly
  the quantization's): carried from the judged sites inside it, or born between them;
- :func:`graph_output` — a runtime graph's final output: within its bound, or explained by the sites inside it,
  or born in the model's own code outside them (a divergence), or not explained where sites were not compared.
"""

from __future__ import annotations

from typing import Any

from ..report.numbers import sig
from . import contracts, metrics
from .result import SiteDiff

COMPOSITION = 10.0  # a module whose output errs this many times more than all its children's: its own code diverged


def norm_contract(s: SiteDiff, v: dict[str, Any], site_dtype: str) -> bool:
    """Apply a contract verdict (:func:`.contracts.judge`); False when it could not be made (``v['error']``)."""
    if "error" in v:
        s.note = f"judged by the dtype-derived rule: {v['error']}"
        return False
    s.elementwise = v
    s.bound, s.bound_rule = None, contracts.rule(v, site_dtype)
    s.status = "within" if v["ok"] else "diverged"
    return True


def own_error(s: SiteDiff, *, site_dtype: str, ref_dtype: str, twin: float | None, twin_expected: bool, n: int,
              suffix: str = "") -> None:
    """Hold the site's own error to the bound of a faithful execution at ``site_dtype``. ``twin_expected``: the
    reference's module at that dtype should have been measured; without it the bound says so."""
    s.twin = twin
    s.bound, s.bound_rule = metrics.bound(site_dtype, ref_dtype, twin, n)
    if twin_expected and twin is None and site_dtype != ref_dtype:
        s.bound_rule += " (no faithful twin measured)"
    s.bound_rule += suffix
    # its output, what its code handed its children, and its other outputs
    worst = max(s.own["normalized"], s.feeds or 0.0, *(v for v in s.outputs.values() if v is not None))
    s.status = "diverged" if not worst <= s.bound else "within"


def composition(s: SiteDiff, *, err: float, child_error: float, incoming: float | None, n: int, cand_dtype: str,
                ref_dtype: str) -> bool:
    """True (and the site diverged) when its output errs by more than :data:`COMPOSITION` × the largest error of
    its input and its children's outputs (at least that many times the dtype's own floor)."""
    floor, floor_rule = metrics.bound(cand_dtype, ref_dtype, None, n)
    limit = COMPOSITION * max(child_error, incoming or 0.0, floor)
    if err <= limit:
        return False
    s.status, s.bound = "diverged", limit
    s.bound_rule = (f"{COMPOSITION:g} × the largest error of its input ({sig(incoming or 0.0)}) and its children's "
                    f"outputs ({sig(child_error)}), at least {COMPOSITION:g} × {floor_rule}")
    s.note = (f"its output errs by {sig(err)} while its input and every child's output erred by at most "
              f"{sig(max(child_error, incoming or 0.0))}: the divergence is in this module's own code between its "
              "children")
    return True


def graph_propagated(s: SiteDiff, *, n: int, cand_dtype: str, ref_dtype: str) -> None:
    """A runtime graph's site (ONNX, OpenVINO) without an own error is judged on its propagated error (same dtype:
    16·u·√n); the model's output is judged by :func:`graph_output`."""
    if s.status == "propagated" and s.propagated is not None and s.depth > 0:
        s.bound, s.bound_rule = metrics.bound(cand_dtype, ref_dtype, None, n)
        s.bound_rule += " (on the propagated error" + (
            f"; own error n/a: {s.own_missing})" if s.own_missing else ")")
        if s.propagated["normalized"] > s.bound:
            s.status = "diverged"


def graph_carried(s: SiteDiff, *, n: int, cand_dtype: str, ref_dtype: str, child_error: float) -> None:
    """A quantized runtime graph's site without an own error (llama.cpp's inner model output): its propagated error
    is the quantization's, carried from the sites inside it, each judged against the dequantized twin on its own.
    Within when it errs by at most :data:`COMPOSITION` × the largest error of those sites; beyond that the error is
    born in its own code between them: diverged."""
    if s.status != "propagated" or s.propagated is None or "normalized" not in s.propagated or s.depth == 0:
        return
    err = s.propagated["normalized"]
    floor, floor_rule = metrics.bound(cand_dtype, ref_dtype, None, n)
    s.bound = COMPOSITION * max(child_error, floor)
    s.bound_rule = (f"{COMPOSITION:g} × the largest error of the sites inside it ({sig(child_error)}), at least "
                    f"{COMPOSITION:g} × {floor_rule} (on the propagated error of a quantized candidate; own error "
                    f"n/a{': ' + s.own_missing if s.own_missing else ''})")
    if err <= s.bound:
        s.status = "within"
    else:
        s.status = "diverged"
        s.note = (f"its output errs by {sig(err)} while every site inside it erred by at most {sig(child_error)}: "
                  "the error is born in its own code between them")


def graph_output(s: SiteDiff, *, n: int, cand_dtype: str, ref_dtype: str, child_error: float,
                 not_compared: list[str], hold: str | None = None) -> None:
    """A runtime graph's final output (depth 0), judged on its propagated error e against b = 16·u·√n:

    - e ≤ b: within;
    - b < e ≤ :data:`COMPOSITION` × max(m, b), m the largest error of the sites inside it: the error the sites
      carried to it (each judged on its own), explained — within, when every site inside was compared; else not
      explained, and the output is left undecided with the sites that were not compared named;
    - e beyond that: no site inside explains it, so it is born in the model's own code outside every compared site
      (or in a site that was not compared, named): a divergence at the model.

    ``hold``: why the output cannot be called faithful even when it is within (the candidate's own reason); it is
    then left undecided."""
    if s.status != "propagated" or s.propagated is None or "normalized" not in s.propagated:
        return
    err = s.propagated["normalized"]
    floor, floor_rule = metrics.bound(cand_dtype, ref_dtype, None, n)
    limit = COMPOSITION * max(child_error, floor)
    missing = ""
    if not_compared:
        more = f" and {len(not_compared) - 3} more" if len(not_compared) > 3 else ""
        missing = f"{len(not_compared)} site(s) inside it not compared ({', '.join(not_compared[:3])}{more})"
    if err <= floor:
        s.status, s.bound, s.bound_rule = "within", floor, floor_rule + " (on the model's output)"
    elif err > limit:
        s.status, s.bound = "diverged", limit
        s.bound_rule = (f"{COMPOSITION:g} × the largest error of the sites inside it ({sig(child_error)}), at least "
                        f"{COMPOSITION:g} × {floor_rule}")
        s.note = (f"the model's output errs by {sig(err)} while every site inside it erred by at most "
                  f"{sig(child_error)}: the error is born in the model's own code outside the compared sites"
                  + (f", or in one of the {missing}" if missing else ""))
    else:
        s.bound = limit
        s.bound_rule = (f"{COMPOSITION:g} × the largest error of the sites inside it ({sig(child_error)}): carried "
                        f"from them; {floor_rule} alone is {sig(floor)}")
        if missing:
            s.note = (f"the model's output errs by {sig(err)}, beyond {sig(floor)} ({floor_rule}), and is not explained: "
                      f"{missing}; what would decide it: those sites compared (aligned with the reference's modules)")
        else:
            s.status = "within"
    if hold and s.status == "within":
        s.status, s.note = "propagated", hold
