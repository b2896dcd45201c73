"""``normscope.diagnose(run_dir)``: the incidents of a traced run, the first link of the chain behind each, the
drifts that have not hurt yet, and the notes — a pipeline a reader can follow, each stage its own module with its
rules as data:

1. **series** (:mod:`.series`): every recorded statistic as a series over the recorded steps, keyed by (stage,
   layer, site, head, metric), each judged against its own robust local trend (:mod:`normscope.tracing.trend`);
2. **incidents** (:mod:`.incidents`): what a user would call a problem — a non-finite value, masked rows, a jump
   into the danger zone, a collapse, a loss / gradient / update spike, a learning-rate jump, weights written
   outside the optimizer; thresholds from each series' own spread, raised for how many series are judged;
3. **localization** (:mod:`.localize`): for each incident, the earliest link of the chain (data → layer input →
   norm → attention logits → sublayer output → residual sum → loss → gradients → updates) whose series left its
   range in a failure direction and can reach the incident;
4. **drifts** (:mod:`.drifts`): series growing towards a danger level; never a cause;
5. **notes** (:mod:`.notes`): what was seen and judged not an incident (hard samples, unusual inputs, sustained
   rises), each with why; a loss spike carried by hard samples is taken out of the incidents before localization.

:data:`RULES` lists every rule of every stage (:class:`.rules.Rule`); docs/trace.md shows them
(:func:`.rules.markdown`).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ...errors import InputError
from ..store import read_run
from .drifts import DRIFT_RULES, drifts
from .incidents import COLLAPSE_HOLD, INCIDENT_KINDS, INCIDENT_RULES, triggers
from .localize import LOCALIZATION_RULES, localize
from .metrics import entry_metrics, rms
from .notes import NOTE_RULES, hard_samples, sustained_rises, unusual_inputs
from .results import DIAGNOSIS_SCHEMA, Anomaly, Diagnosis, Drift, Incident
from .rules import Rule, markdown
from .series import DIRECTIONS, STAGES, RunView

#: every rule of every stage, in pipeline order
RULES: tuple[Rule, ...] = (*INCIDENT_RULES, *LOCALIZATION_RULES, *DRIFT_RULES, *NOTE_RULES)

__all__ = ["DIAGNOSIS_SCHEMA", "DIRECTIONS", "INCIDENT_KINDS", "RULES", "STAGES", "Anomaly", "Diagnosis", "Drift",
           "Incident", "Rule", "diagnose", "entry_metrics", "markdown", "rms"]


def diagnose(run_dir: str | os.PathLike, *, window: int = 20, min_history: int = 8, z: float = 8.0,
             lookback: int = 3, floor: float = 0.05, false_alarms: float = 0.01, lr_jump: float = 2.0,
             grad_factor: float = 100.0, update_factor: float = 5.0, sample_factor: float = 10.0,
             logit_danger: float = 30.0,
             scale_danger: float = 10.0, stream_danger: float = 1000.0, run: int | None = None) -> Diagnosis:
    """Read ``run_dir`` (also while it is being written): its incidents, the first link behind each, and drifts.

    ``run``: which training run of a folder that holds several (a tracer opened on it again with its steps
    starting over): 1 the oldest, None or -1 the latest (the default); :attr:`Diagnosis.runs` lists them all.

    ``window``: recorded values a trend is fitted to; ``min_history``: values a series needs before it is judged
    (at most ``window``); ``z``: the least robust σ of an incident or a departure, raised for the number of series
    judged so that a clean run expects ``false_alarms`` false incidents in all; ``lookback``: recorded steps before an
    incident searched for its cause; ``floor``: the least noise a series is credited with (natural log: 0.05 ≈ 5 %);
    ``lr_jump``: a learning rate this many times the highest one before is a jump; ``grad_factor``,
    ``update_factor``: the least factor over its trend of a gradient-norm spike and of an update per unit of learning
    rate (single-batch gradient spikes of ×10–40 and update wobbles of ×2.5 are ordinary in real runs, measured);
    ``sample_factor``: the least factor of a sample's loss over its batch's median for a per-sample loss spike;
    ``logit_danger``, ``scale_danger``, ``stream_danger``: where a drift becomes dangerous, for the max attention
    logit (the collapse regime: logits of tens), a norm's scale γ RMS and the residual stream's RMS.
    """
    settings = {"window": window, "min_history": min_history, "z": z, "lookback": lookback, "floor": floor,
                "false_alarms": false_alarms, "lr_jump": lr_jump, "grad_factor": grad_factor,
                "update_factor": update_factor, "sample_factor": sample_factor, "logit_danger": logit_danger,
                "scale_danger": scale_danger, "stream_danger": stream_danger}
    _check_settings(settings)
    chosen = run
    run = read_run(run_dir, chosen)
    view = RunView(run.records, window=window, min_history=min_history, z=z, lookback=lookback, floor=floor,
                   false_alarms=false_alarms, lr_jump=lr_jump, grad_factor=grad_factor,
                   update_factor=update_factor, sample_factor=sample_factor,
                   dangers={"logit": logit_danger, "scale": scale_danger, "stream": stream_danger})
    incidents: list[Incident] = []
    if run.records:
        # incidents, in priority order within a step (a loss spike carried by hard samples leaves them as a note)
        found = hard_samples(view, triggers(view))
        # localization: each incident's first cause; triggers within lookback of one are its symptoms
        for trig in found:
            last = incidents[-1] if incidents else None
            if last is not None and trig.t - _col(view, last.step) <= lookback:
                last.symptoms.append(f"step {int(view.s.steps[trig.t])}: {trig.kind}: {trig.evidence}")
                continue
            incidents.append(localize(view, trig))
    found_drifts = drifts(view) if run.records else []
    if run.records:  # notes: at the steps no incident explains
        explained = ({_col(view, i.step) for i in incidents}
                     | {_col(view, a.step) for i in incidents for a in i.departures})
        rewritten = {_col(view, i.step) for i in incidents if i.cause is not None and i.cause.stage == "update"}
        unusual_inputs(view, explained, rewritten)
        sustained_rises(view, explained)
    else:
        explained = set()
    disabled = sorted({p for e in run.ends for p in e.get("disabled", []) if isinstance(p, str)}
                      | {p for r in run.records for p in (r.get("disabled") or []) if isinstance(p, str)})
    errors = [x for e in run.ends for x in (e.get("errors") or []) if isinstance(x, dict)]
    complete = bool(run.ends) and len(run.ends) >= len(run.headers)
    undecided = _undecided(run, errors, min_history)
    undecided += [f"{trig.evidence}: a collapse needs it out of its range for {COLLAPSE_HOLD} recorded steps; record "
                  "more steps (or diagnose again as the run goes on) to decide"
                  for trig in view.pending_collapses if not any(abs(trig.t - c) <= lookback for c in explained)]
    return Diagnosis(str(run.path.parent), incidents, found_drifts, [r["step"] for r in run.records], run.headers[-1],
                     disabled, errors, settings, complete, run.damaged, run.records, undecided,
                     [view.notes[k] for k in sorted(view.notes)], run.runs, run.number, _limits(run))


def _limits(run) -> list[str]:
    """What the way ``run`` was recorded leaves unjudged, whatever its verdict."""
    every = run.headers[-1].get("every") if run.headers else None
    if isinstance(every, int) and every > 1:
        return [f"parameters written outside the optimizer between recorded steps: with every={every} the updates of "
                f"the {every - 1} steps between two records are not known, so a change of the weights' size cannot be "
                "told from them (`weights_written` is judged between consecutive recorded steps only; its effect on "
                "the forward is still judged); trace with every=1 to judge it"]
    return []


def _undecided(run, errors: list[dict[str, Any]], min_history: int) -> list[str]:
    """What keeps a run without incidents from being called clean, each with what would decide it."""
    out = []
    n = len(run.records)
    if n == 0:
        out.append("no step was recorded: call tr.step(...) once per optimizer step inside the trace, and diagnose "
                   "after at least one recorded step")
    elif n <= min_history:
        out.append(f"only {n} recorded step(s): a series is judged against its trend after {min_history} values, so "
                   f"only non-finite values were looked for; record more steps or lower --min-history")
    blocks = run.headers[-1].get("blocks") if run.headers else None
    if n and not blocks:
        out.append("no repeated blocks were found, so no layer of the residual chain was recorded: pass the block "
                   "modules to trace(..., layers=...)")
    elif n and not any(e.get("stage") in ("layer_input", "residual_sum")
                       for rec in run.records for e in rec.get("entries", ())):
        out.append(f"no block's input or residual sum was recorded: the blocks found ({', '.join(map(str, blocks[:3]))}"
                   f"{', …' if len(blocks) > 3 else ''}) never ran during a recorded forward, or their input was not "
                   "a tensor the tracer could follow; pass the modules that run as the model's layers to "
                   "trace(..., layers=...)")
    for e in errors:
        probe = str(e.get("probe", "?"))
        if probe.startswith("sink"):  # a sink's failure loses a copy, not a measurement
            continue
        out.append(f"probe {probe} failed at step {e.get('step')} and recorded nothing after it ({e.get('error')}): "
                   f"steps from there on were judged without it; fix the error and trace again")
    if run.damaged:
        out.append(f"{len(run.damaged)} line(s) of the trace file could not be read, so their steps were not judged: "
                   f"the file was cut or overwritten; trace again into a fresh run_dir")
    return out


def _col(view: RunView, step: int) -> int:
    return int(np.searchsorted(view.s.steps, step))


def _check_settings(st: dict[str, Any]) -> None:
    def positive_int(name):
        v = st[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be a positive integer, got {v!r}")

    for name in ("window", "min_history"):
        positive_int(name)
    if isinstance(st["lookback"], bool) or not isinstance(st["lookback"], int) or st["lookback"] < 0:
        raise InputError(f"lookback must be a non-negative integer, got {st['lookback']!r}")
    if st["window"] < 3:
        raise InputError(f"window must be at least 3 (a trend needs a first and a last third), got {st['window']}")
    if st["min_history"] > st["window"]:
        raise InputError(f"min_history ({st['min_history']}) must not exceed window ({st['window']}): a series holds "
                         f"at most window values, so no value would ever be judged; raise window or lower min_history")
    for name in ("z", "floor", "lr_jump", "grad_factor", "update_factor", "sample_factor", "logit_danger",
                 "scale_danger",
                 "stream_danger"):
        v = st[name]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise InputError(f"{name} must be a positive number, got {v!r}")
    for name in ("lr_jump", "grad_factor", "update_factor", "sample_factor"):
        if st[name] < 1:
            raise InputError(f"{name} is a factor of at least 1, got {st[name]!r}")
    fa = st["false_alarms"]
    if isinstance(fa, bool) or not isinstance(fa, int | float) or not 0 < fa < 1:
        raise InputError(f"false_alarms must be in (0, 1): the expected false incidents over a clean run, got {fa!r}")
