"""``normscope.diagnose(run_dir)``: the incidents of a traced run, the first link of the chain behind each, and the
drifts that have not hurt yet.

**Incidents first.** An incident is what a user would call a problem:

- a non-finite value anywhere (an activation, a logit, the loss, a gradient, an update), or query rows whose keys
  are all masked appearing after a history of none;
- a loss spike: the log of the loss above its own robust local trend (:mod:`.trend`), for the step's mean loss or
  for single samples (their log-loss against the step's mean, pooled over the recent steps);
- a gradient-norm spike: the log of the global gradient norm above its trend;
- an update out of proportion to the learning rate: the log of RMS(Δparameter)/RMS(parameter) divided by the
  recorded learning rate of the group, above its trend; or a learning rate that jumps past every value the schedule
  reached before (warm-up, decay and restarts stay below it: they are context, not faults).

The thresholds account for how many series are judged: an incident needs ``z`` robust σ, raised to the Gaussian
tail quantile that leaves an expected ``false_alarms`` false incidents over the whole run.

**Then localization.** For each incident, every recorded series (activations per layer and site, attention heads,
per-sample data, the loss, gradients and updates per layer and group) is scored against its own trend over a
``lookback`` window before the incident. The cause is the earliest step, and within it the earliest link of the
chain (data → layer input → norm input/output → attention logits → sublayer output → residual sum → loss →
gradients in backward order → updates), whose series left its normal range (a non-finite value always does);
the other departures are listed with it, ranked by how far they left it. ``Diagnosis.first`` is the first
incident's cause.

**Drifts** are listed apart: attention logits, a norm's scale γ or the residual stream growing step after step,
with their slope and the level where they become dangerous; flagged when they crossed it or, at their slope, will
within as many steps as the run has recorded. They are never ``first``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from ..errors import InputError
from ..jsonable import jsonable
from ..report.numbers import sig
from ..results.verdict import Verdict, verdict_of
from .store import is_number, read_run
from .trend import departures, fit, gaussian_tail_quantile, log_values

DIAGNOSIS_SCHEMA = "normscope.diagnosis/2"
STAGES = ("data", "layer_input", "norm_input", "norm_output", "attention_logits", "sublayer_output", "residual_sum",
          "loss", "grad", "update")
_ACT = ("layer_input", "norm_input", "norm_output", "sublayer_output", "residual_sum")
# at one step, the first kind in this order is the incident and the others its symptoms: a write of the weights is the
# incident only where nothing it caused is (a change the forward and the loss absorbed)
INCIDENT_KINDS = ("nonfinite", "masked_rows", "danger_jump", "collapse", "loss_spike", "grad_spike", "update_spike",
                  "lr_jump", "weights_written")
# parameters written outside the optimizer step: the least relative change of their size that no recorded update
# explains (5 %: updates move a group's size by a fraction of its update ratio, ~1e-3 a step), and the least factor
# over the largest such change of the steps before (code that edits weights every step sets its own level); a clean
# run's unexplained change is rounding, ~1e-7
WRITE_FLOOR, WRITE_FACTOR = 0.05, 10.0
DANGER_JUMP = 5.0  # the least one-step factor of a jump into (or towards) the danger zone; drifts move a few % a step
# a head's mean softmax entropy (nats) at or below which its attention has collapsed onto one or two keys: large
# logits are the collapse regime only with it (an additive positional bias such as ALiBi's makes logits of tens
# whose softmax still spreads over many keys)
ENTROPY_COLLAPSE = 0.5
# a residual stream's RMS leaping this many times the largest of its recent steps is a danger jump at any level:
# the most it moved in one step over the largest of its 20 before, in the clean runs of GPT-2, Llama, Post-LN and ViT
# on real signals, 3 seeds each: 12 runs), was ×1.51; a sublayer's output ×1000 leaps it ×270 (StableLM, Falcon)
STREAM_JUMP = DANGER_JUMP ** 2


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
                         "run": self.run, "runs": self.runs,
                         "first": self.first.to_dict() if self.first else None,
                         "incidents": [i.to_dict() for i in self.incidents],
                         "drifts": [d.to_dict() for d in self.drifts]})

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


# ---------------------------------------------------------------------- metrics of one entry
def rms(sumsq, n) -> float | None:
    return math.sqrt(sumsq / n) if n else None


def entry_metrics(e: dict[str, Any]) -> dict[str, Any]:
    st = e["stage"]
    if st in _ACT or st == "grad":
        out = {"rms": rms(e["sumsq"], e["n"]), "max": e["max"], "nonfinite": e["nonfinite"] / max(e["n"], 1)}
        if "max_scale_rms" in e:
            out["scale_rms"] = e["max_scale_rms"]
        if "min_row_rms" in e:
            out["min_row_rms"] = e["min_row_rms"]
        return out
    if st == "attention_logits":
        ent = [s / r if r else None for s, r in zip(e["entropy_sum"], e["entropy_rows"], strict=False)]
        heads = e.get("nonfinite_heads")  # per head where recorded (a run written before: one count for all)
        ok = isinstance(heads, list) and len(heads) == len(e["max_logit"]) and all(map(is_number, heads))
        out = {"max_logit": e["max_logit"], "masked_rows": e["masked_rows"], "entropy": ent,
               "nonfinite": heads if ok else e["nonfinite"]}
        if "masked_samples" in e:  # samples whose every query row is masked (a run written before: not recorded)
            out["masked_samples"] = e["masked_samples"]
        return out
    if st == "loss":
        return {"loss": e["sum"] / max(e["count"], 1), "nonfinite": e["nonfinite"]}
    if st == "update":
        u, p = rms(e["sumsq"], e["n"]), rms(e["param_sumsq"], e["n"])
        out = {"ratio": (u / p if p else (math.inf if u else 0.0)) if u is not None else None,
               "nonfinite": e["nonfinite"] / max(e["n"], 1)}
        if "max_lr" in e:
            out["lr"] = e["max_lr"]
            if is_number(e["max_lr"]) and e["max_lr"] > 0 and is_number(e.get("max")):
                out["step_lr"] = e["max"] / e["max_lr"]  # the largest parameter step, in learning rates
        return out
    return {}


#: the directions in which a series' move is a failure, by metric: a stream or a sublayer's output growing or
#: collapsing, γ growing or written towards 0, gradients exploding or vanishing, a head's entropy collapsing onto
#: one key or rising to uniform; logits, maxima, the loss and the updates upward
DIRECTIONS = {"rms": ("up", "down"), "scale_rms": ("up", "down"), "entropy": ("down", "up"), "max": ("up",),
              "max_logit": ("up",), "loss": ("up",), "ratio": ("up",)}
#: collapses, an incident however little the loss moved: (stage, metric, direction, what collapses); a series that
#: leaves its range this way and stays out for ``COLLAPSE_HOLD`` recorded steps
COLLAPSES = (("layer_input", "rms", "down", "the residual stream's RMS"),
             ("residual_sum", "rms", "down", "the residual stream's RMS"),
             ("norm_output", "scale_rms", "down", "a norm's scale γ"),
             ("grad", "rms", "down", "a layer's gradients"),
             ("attention_logits", "entropy", "up", "an attention head's focus (its entropy rising to uniform)"))
COLLAPSE_HOLD = 3
#: sustained rises of the activations, held and measured like a collapse: a note with its place where no incident,
#: weight write or unusual input explains it (a sublayer's output ×5 from one step on, that a pre-norm stream and
#: the loss absorb)
RISES = tuple((stage, "rms", "up", f"the {stage.replace('_', ' ')} RMS") for stage in
              ("layer_input", "norm_input", "sublayer_output", "residual_sum"))
# and beyond its own volatility: a collapse moves a series at least this many times the largest one-step move of the
# window before it (a clean run's gradients move ÷1.6 in one step during warm-up), and at least ×2 either way
COLLAPSE_OVER_VOLATILITY, COLLAPSE_LEAST = 3.0, math.log(2.0)
_COUNT = {"nonfinite", "masked_rows", "masked_samples"}
_CONTEXT = {"min_row_rms", "lr", "step_lr"}  # recorded, not judged on their own
# within one entry, the metric that explains the others first: a norm's γ before its output's RMS
_METRIC_ORDER = {"nonfinite": 0, "masked_samples": 1, "masked_rows": 2, "scale_rms": 3, "max_logit": 4, "max": 5,
                 "rms": 6, "entropy": 7, "loss": 8, "ratio": 9}


def _next_check(stage: str, metric: str, layer, site: str, head, ids) -> str:
    L = f"layer {layer}" if layer is not None else "the model"
    if stage == "data":
        who = f"samples {ids}" if ids else "the samples of this batch"
        what = (f"inspect {who}: their raw tokens/values and source shard; if they are corrupt, drop them and "
                "re-run this step")
        if site == "embedding":  # the lookup's output: the table's rows are parameters
            what += ("; if their ids are in range, the rows of the embedding table these ids select (a non-finite "
                     "or huge row reads here like a corrupt sample)")
        return what
    if metric == "masked_samples":
        return (f"the attention mask of this batch at {L}: a sample with every key of every query masked (an all-zero "
                "attention mask: an empty or all-padding sample) attends to nothing; check how its mask was built")
    if metric == "masked_rows":
        return (f"the attention mask at {L}: a query row with every key masked makes softmax 0/0 = NaN; check "
                "padding and sequence packing (a row of padding queries), or mask with a finite value")
    if stage == "attention_logits":
        h = f"head {head}" if head is not None else "its heads"
        if metric == "entropy":
            return f"{L} {h} collapsed onto few keys: look at its max logit and at the query/key projections"
        return (f"the query/key projections of {L} {h} (their update ratio and weight norms) and the norm feeding "
                "them; QK-norm or logit soft-capping bound this")
    if stage == "loss":
        who = f"samples {ids}" if ids else "the samples with the largest per-sample loss"
        return (f"earlier stages were within their range at this step: look at the targets/labels of {who}, at "
                "the loss computation (scaling, reduction, ignore_index), and at the learning rate of the steps "
                "before (one too high for this point of training makes the loss climb while no link leaves its "
                "range)")
    if stage == "grad":
        if metric == "nonfinite":
            return (f"the backward of {L} ({site}): re-run this step under torch.autograd.detect_anomaly() to name the "
                    "op; under float16 AMP check the loss scaler")
        return (f"the gradient of {L} ({site}) while the forward and the loss were in range: the backward itself "
                "(gradient accumulation and its scaling, zero_grad, a hook that edits gradients)")
    if stage == "update" and metric == "written":
        return (f"the code that writes the parameters of {L} ({site}) outside optimizer.step(): a checkpoint or "
                "adapter merged into the live model, an initialisation by name run again, an EMA or weight-averaging "
                "swap, a manual edit; compare its weights before and after this step")
    if stage == "update":
        what = (f"the optimizer's param group for {L} ({site}): its learning rate at this step (scheduler, warmup, a "
                "per-layer multiplier), Adam ε and second-moment state, and any code that writes the parameters")
        if metric == "nonfinite":  # the gradients were finite when the backward ended
            what += ("; and code that changes the gradients between backward() and step() (a hook, a loss scaler, "
                     "clipping, which spreads one non-finite gradient to every group it clips)")
        return what
    if stage == "norm_output" and metric == "scale_rms":
        return f"the scale γ of {site} in {L}: what wrote it (a checkpoint load, its updates, weight decay)"
    if stage in ("norm_input", "layer_input"):
        return f"the stream entering {L}: the residual sum of the layer before and the data at this step"
    if stage == "norm_output":
        return f"{site} in {L}: its input's per-row RMS (a collapsing σ/RMS amplifies) and its scale γ"
    return f"the {site or stage} sublayer of {L}: its weights (update stage), its precision, and the norm that feeds it"


# ---------------------------------------------------------------------- the run as series
@dataclasses.dataclass
class _Series:
    """Every scalar series of a run as rows of one matrix (steps as columns), with what each row is."""
    steps: np.ndarray
    keys: list[tuple]  # (stage, layer, site, head, metric)
    order: list[tuple]  # chain position of each row: (entry position, metric order, head)
    values: np.ndarray  # (rows, steps), NaN where not recorded


_BEFORE_FORWARD = 1 << 30  # subtracted from a parameter series' chain position: before any entry of its step


def _collect(records: list[dict[str, Any]]) -> _Series:
    rows: dict[tuple, int] = {}
    order: list[tuple] = []
    cols: list[dict[int, float]] = []
    for t, rec in enumerate(records):
        entries = rec["entries"]
        loss_pos = next((i for i, e in enumerate(entries) if e["stage"] == "loss"), len(entries))
        for pos, e in enumerate(entries):
            try:
                metrics = entry_metrics(e)
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                continue
            if e["stage"] == "loss":
                pos = loss_pos
            for metric, v in metrics.items():
                for head, vh in (enumerate(v) if isinstance(v, list) else ((None, v),)):
                    key = (e["stage"], e["layer"], e["site"], head, metric)
                    r = rows.get(key)
                    if r is None:
                        r = rows[key] = len(order)
                        # a norm's γ is a parameter: its value at a step was set before that step's forward began
                        # (by the last update, or a write), so it precedes the step's data in the chain
                        at = pos - _BEFORE_FORWARD if metric == "scale_rms" else pos
                        order.append((at, _METRIC_ORDER.get(metric, 9), -1 if head is None else head))
                        cols.append({})
                    if isinstance(vh, int | float):
                        cols[r][t] = float(vh)
    values = np.full((len(order), len(records)), np.nan)
    for r, c in enumerate(cols):
        if c:
            idx = np.fromiter(c.keys(), int)
            values[r, idx] = np.fromiter(c.values(), float)
    return _Series(np.array([r["step"] for r in records], int), list(rows), order, values)


def _samples(records: list[dict[str, Any]], name: str, metric: str) -> list[np.ndarray | None]:
    """The per-sample values of ``samples[name][metric]`` at each step (None where absent or malformed)."""
    out: list[np.ndarray | None] = []
    for rec in records:
        d = (rec.get("samples") or {}).get(name)
        try:
            if metric == "rms":
                v = [math.sqrt(s / n) if n else 0.0 for s, n in zip(d["sumsq"], d["n"], strict=False)]
            else:
                v = d[metric]
            out.append(np.asarray(v, float).reshape(-1))
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            out.append(None)
    return out


def _ids(rec: dict[str, Any], idx) -> list:
    ids = rec.get("sample_ids")
    return [ids[i] if isinstance(ids, list) and i < len(ids) else i for i in idx]


# ---------------------------------------------------------------------- the detector
@dataclasses.dataclass
class _Trigger:
    t: int  # column
    kind: str
    metric: str
    value: float
    baseline: float | None
    evidence: str
    key: tuple | None  # the incident series' own row key, the cause when nothing before it left its range
    sample_ids: list | None = None
    score: float = math.inf


def _fmt(v: float) -> str:
    return sig(v, 4)


def _group(key: tuple | None) -> str:
    """A parameter group as the evidence names it: "layer 1 (attn)", or the module outside the blocks."""
    if not key:
        return "all parameters"
    return f"layer {key[1]} ({key[2]})" if key[1] is not None else key[2]


def _unusual(a: Anomaly, factor: float) -> bool:
    """Is a sample's input departure ``a`` (RMS or max |x| at the data stage) ``factor`` × above the recent
    samples' median: an unusual or corrupt input?"""
    return a.metric in ("rms", "max") and bool(a.baseline) and math.isfinite(a.value) and a.value >= factor * a.baseline


def _can_make_nonfinite(deps: list[Anomaly]) -> list[Anomaly]:
    """The departures that can be a non-finite incident's cause: the non-finite ones, and before the first of them
    in the chain only a finite value far from its range (× ``DANGER_JUMP`` or more either way: a γ written ×50 that
    overflows downstream), not a gradient ×1.8 that the backward happened to finish first."""
    bad = [a for a in deps if a.metric == "nonfinite" or not math.isfinite(a.value)]
    if not bad:
        return deps
    first = min(a.order for a in bad)

    def far(a: Anomaly) -> bool:
        v, b = abs(a.value), abs(a.baseline) if a.baseline is not None and math.isfinite(a.baseline) else 0.0
        return not (v > 0 and b > 0) or max(v / b, b / v) >= DANGER_JUMP

    return bad + [a for a in deps if a not in bad and a.order < first and far(a)]


def _lr_jump_triggers(jumps: list[tuple], groups: int) -> list[_Trigger]:
    """One ``lr_jump`` per step and factor from the groups' jumps ``(column, key, lr, highest before, update
    ratio)``: several groups jumping at one step by one factor are one jump (a schedule or an ``lr`` set for the
    whole optimizer is not a jump of its first group's)."""
    out: list[_Trigger] = []
    by_step: dict[int, list[tuple]] = {}
    for j in jumps:
        by_step.setdefault(j[0], []).append(j)
    for same in by_step.values():
        while same:
            t, key, lr, highest, ratio = same[0]
            alike = [j for j in same if math.isclose(j[2] / j[3], lr / highest, rel_tol=1e-3)]
            same = [j for j in same if j not in alike]
            who = _group(key)
            if len(alike) > 1:
                # the traced groups are the tracer's own (per block and sublayer), not the optimizer's
                who = (f"the parameters of every traced layer and module ({len(alike)})" if len(alike) == groups else
                       f"the parameters of {len(alike)} of the {groups} traced layers and modules "
                       f"({', '.join(_group(j[1]) for j in alike)})") + f" ({who} shown)"
            out.append(_Trigger(t, "lr_jump", "lr", lr, highest,
                                f"learning rate {_fmt(lr)} for {who} is ×{sig(lr / highest)} the highest its schedule "
                                f"reached before ({_fmt(highest)}); update ratio {_fmt(ratio)}", key))
    return out


def _where(key: tuple) -> str:
    """A series' place in words: layer, site and head where it has them."""
    where = f"layer {key[1]}" if key[1] is not None else "the model"
    where += f" · {key[2]}" if key[2] else ""
    return where + (f" · head {key[3]}" if key[3] is not None else "")


def _largest_before(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column t: the largest finite value of ``row`` over the columns before t (-inf where none) and how many
    finite values there were — running values, one pass for a whole run."""
    finite = np.isfinite(row)
    running = np.maximum.accumulate(np.where(finite, row, -np.inf)) if row.size else row
    largest = np.concatenate(([-np.inf], running[:-1]))[:row.size]
    count = np.concatenate(([0], np.cumsum(finite)[:-1]))[:row.size]
    return largest, count


class _Detector:
    def __init__(self, records, *, window, min_history, z, lookback, floor, false_alarms, lr_jump, grad_factor,
                 update_factor, sample_factor, dangers=None):
        self.records = records
        self.dangers = dangers or {}  # "logit", "scale", "stream" → the level where each becomes dangerous
        self.factors = {"grad_spike": grad_factor, "update_spike": update_factor, "sample": sample_factor}
        self.window, self.min_history, self.z = window, min_history, z
        self.lookback, self.floor, self.false_alarms, self.lr_jump = lookback, floor, false_alarms, lr_jump
        self.s = _collect(records)
        self.row_of = {k: i for i, k in enumerate(self.s.keys)}
        self.col_of = {int(step): t for t, step in enumerate(self.s.steps)}
        self.T = len(records)
        self._losses: list[np.ndarray | None] | None = None  # per-sample losses per column, read on first use
        self._rel: list[np.ndarray | None] | None = None  # per-sample relative log-losses, made on first use
        self.notes: dict[int, str] = {}  # step → what was seen there and judged not an incident

    def threshold(self, tests: int) -> float:
        """z raised so that ``tests`` Gaussian tests leave ``false_alarms`` expected false alarms."""
        return max(self.z, gaussian_tail_quantile(self.false_alarms / max(tests, 1)))

    # ------------------------------------------------------------------ incidents
    def rows(self, pred) -> list[int]:
        return [i for i, k in enumerate(self.s.keys) if pred(k)]

    def incident_triggers(self) -> list[_Trigger]:
        s, T = self.s, self.T
        out: list[_Trigger] = []
        # non-finite values and masked rows after none
        bad_prev = False
        for t in range(T):
            col = s.values[:, t]
            bad_rows = [i for i, k in enumerate(s.keys) if k[4] not in _COUNT and k[4] not in _CONTEXT
                        and not math.isnan(col[i]) and not math.isfinite(col[i])]
            counts = [i for i, k in enumerate(s.keys) if k[4] == "nonfinite" and col[i] > 0]
            sample_bad = len(self._sample_nonfinite(t))
            bad = bool(bad_rows or counts or sample_bad)
            if bad and not bad_prev:
                n = len(set(bad_rows) | set(counts))
                where = f"{n} series" + (f" and {sample_bad} sample{'s' if sample_bad > 1 else ''}" if sample_bad
                                         else "")
                out.append(_Trigger(t, "nonfinite", "nonfinite", math.nan, 0.0, f"non-finite values in {where}", None))
            bad_prev = bad
        # fully masked query rows, or samples whose every query row is masked (where padding queries are masked as
        # well as padding keys, DeBERTa's, a head has masked rows at every step: a fully masked sample is new)
        masked = self.rows(lambda k: k[4] in ("masked_rows", "masked_samples"))
        if masked:
            m = s.values[masked]
            for r, row in zip(masked, m, strict=True):
                for t in range(1, T):
                    prior = row[:t]
                    fin = prior[np.isfinite(prior)]
                    if row[t] > 0 and fin.size and np.all(fin == 0):
                        k = s.keys[r]
                        n = int(row[t])
                        what = (f"fully masked query row{'s' * (n > 1)}" if k[4] == "masked_rows" else
                                f"sample{'s' * (n > 1)} with every query row masked")
                        out.append(_Trigger(t, "masked_rows", k[4], float(row[t]), 0.0,
                                            f"{n} {what} at layer {k[1]} after {fin.size} recorded steps with none", k))
                        break
        out.extend(self._danger_jumps())
        out.extend(self._outside_writes())
        out.extend(self._collapses())
        # trend departures of the loss, the gradient norm and the updates (each against its lr)
        judged: list[tuple[str, str, np.ndarray, tuple | None]] = []
        loss = self.rows(lambda k: k[0] == "loss" and k[4] == "loss")
        if loss:
            judged.append(("loss_spike", "loss", s.values[loss[0]], s.keys[loss[0]]))
        grads = self.rows(lambda k: k[0] == "grad" and k[4] == "rms")
        if grads:
            total = np.full(T, np.nan)
            for t, rec in enumerate(self.records):
                ss = [e["sumsq"] for e in rec["entries"] if e["stage"] == "grad"]
                if ss:
                    total[t] = math.sqrt(sum(ss))
            judged.append(("grad_spike", "grad_norm", total, None))
        gates: dict[int, np.ndarray] = {}
        jumps: list[tuple] = []
        for r in self.rows(lambda k: k[0] == "update" and k[4] == "ratio"):
            k = s.keys[r]
            lr = self._context_row(k, "lr")
            ratio = s.values[r]
            per_lr = np.where(np.isfinite(lr) & (lr > 0), ratio / np.where(lr > 0, lr, 1.0), ratio)
            gates[len(judged)] = self._step_beyond_recent(self._context_row(k, "step_lr"))
            judged.append(("update_spike", "ratio", per_lr, k))
            if np.isfinite(lr).any():
                jumps.extend(self._lr_jumps(k, lr, ratio))
        out.extend(_lr_jump_triggers(jumps, len(gates)))
        if judged:
            out.extend(self._spikes(judged, self.threshold(len(judged) * T), gates))
        out.extend(self._sample_spikes())
        return self._without_hard_samples(out)

    def _outside_writes(self) -> list[_Trigger]:
        """Parameter groups whose size changed between two consecutive recorded steps by more than that step's
        update can explain: ‖w_t‖ − ‖w_{t−1}‖ ≤ ‖Δ_update‖ + ‖e‖ for a write e made outside the optimizer step (a
        checkpoint merged into the live model, an initialisation by name run again, a manual edit). The
        forward that follows may absorb it (a pre-norm stream, a loss that does not move): it is an incident on its
        own, the group its place. Recorded steps that are not consecutive (``every`` > 1) are not judged."""
        out = []
        steps = self.s.steps
        for key, (sizes, moves) in self._update_rows().items():
            largest = 0.0
            for t in range(1, self.T):
                if int(steps[t]) != int(steps[t - 1]) + 1:
                    continue
                before, after, move = sizes[t - 1], sizes[t], moves[t]
                if not (math.isfinite(before) and math.isfinite(after) and math.isfinite(move) and before > 0):
                    continue
                excess = (abs(after - before) - move) / before
                if excess >= max(WRITE_FLOOR, WRITE_FACTOR * largest):
                    factor = after / before
                    change = f"×{sig(factor)}" if factor >= 1 else f"÷{sig(1 / factor) if factor > 0 else '∞'}"
                    out.append(_Trigger(t, "weights_written", "written", float(after), float(before),
                                        f"the parameters of {_group(key)} changed {change} in size (‖w‖ "
                                        f"{_fmt(before)} → {_fmt(after)}) while the optimizer's update at this step "
                                        f"moved them by {_fmt(move)}: written outside the optimizer step by at "
                                        f"least {sig(excess)} of their size (a checkpoint merge, an initialisation "
                                        "by name, a manual edit)", key, score=math.inf))
                    break
                largest = max(largest, excess)
        return out

    def _positive_level(self, r: int, t: int) -> float | None:
        """The median of row ``r``'s positive values over the ``window`` columns before ``t`` (at least
        ``min_history`` of them), or None: the level a series that fell to 0 fell from."""
        past = self.s.values[r, max(0, t - self.window):t]
        past = past[np.isfinite(past) & (past > 0)]
        return float(np.median(past)) if past.size >= self.min_history else None

    def _collapses(self) -> list[_Trigger]:
        """Series of :data:`COLLAPSES` that leave their range in their failure direction and stay out for
        ``COLLAPSE_HOLD`` recorded steps, each judged against its own trend before the change (its own spread sets
        the threshold, raised for the number of series and steps judged): the stream shrinking, γ written to 0,
        gradients vanishing, a head going uniform. The loss may not move (a layer that stops contributing)."""
        return self._held_changes(COLLAPSES, "collapse")

    def sustained_rises(self, explained: set[int]) -> None:
        """Notes for :data:`RISES` at columns no incident explains (``explained``) and without an unusual input:
        a series that stepped up and stayed there, which nothing recorded accounts for."""
        for trig in self._held_changes(RISES, "rise"):
            step = int(self.s.steps[trig.t])
            if any(abs(trig.t - c) <= self.lookback for c in explained) or step in self.notes:
                continue
            if self._unusual_input_at(trig.t):
                continue
            self.notes[step] = (f"step {step}: {trig.evidence}; no weight write, update spike or unusual input "
                                "explains it and the loss absorbed it: a change in the forward itself (a module's code "
                                "or a hook), not an incident")

    def _held_changes(self, table, kind: str) -> list[_Trigger]:
        """The first change of each series of ``table`` ((stage, metric, direction, what) rows) that leaves its
        range in its direction and stays out for ``COLLAPSE_HOLD`` columns, each against the trend of the window
        before it (all series fitted at once per column; the volatility test only where the trend test holds)."""
        rules = {(stage, metric): (direction, what) for stage, metric, direction, what in table}
        rows = [r for r, k in enumerate(self.s.keys) if (k[0], k[4]) in rules]
        if not rows or self.T <= self.min_history + COLLAPSE_HOLD:
            return []
        thr = self.threshold(len(rows) * self.T)
        values = self.s.values[rows]
        y = log_values(values)
        zero = np.isfinite(values) & (values <= 0)
        down = np.array([rules[(self.s.keys[r][0], self.s.keys[r][4])][0] == "down" for r in rows])
        found: dict[int, _Trigger] = {}
        for t in range(self.min_history, self.T - COLLAPSE_HOLD + 1):
            open_rows = np.array([i not in found for i in range(len(rows))])
            if not open_rows.any():
                break
            f = fit(y[:, max(0, t - self.window):t], self.min_history, self.floor)
            held = y[:, t:t + COLLAPSE_HOLD]
            z_down, base_down = f.down(held.T)
            z_up, base_up = f.up(held.T)
            z, base = np.where(down, z_down, z_up).T, np.where(down, base_down, base_up)  # base: one per series
            gone = zero[:, t:t + COLLAPSE_HOLD] & down[:, None]
            with np.errstate(invalid="ignore"):
                beyond = gone | (np.isfinite(z) & (z >= thr))
            for i in np.flatnonzero(open_rows & f.ok & beyond.all(axis=1)):
                past = y[i, max(0, t - self.window):t]
                steps = np.abs(np.diff(past[np.isfinite(past)]))
                least = max(COLLAPSE_LEAST, COLLAPSE_OVER_VOLATILITY * (float(steps.max()) if steps.size else 0.0))
                with np.errstate(invalid="ignore"):
                    moved = np.abs(held[i] - base[i]) >= least
                if not np.all(gone[i] | (np.isfinite(z[i]) & (z[i] >= thr) & moved)):
                    continue
                r = rows[i]
                key = self.s.keys[r]
                direction, what = rules[(key[0], key[4])]
                b, v = math.exp(float(base[i])), float(self.s.values[r, t])
                change = (f"×{sig(v / b)}" if direction == "up" else f"÷{sig(b / v)}" if v > 0 else "to 0")
                found[i] = _Trigger(t, kind, key[4], v, b,
                                    f"{what} ({_where(key)}): {key[4]} {_fmt(v)} from its trend {_fmt(b)} ({change}) "
                                    f"and out of its range for the {COLLAPSE_HOLD} recorded steps from here (threshold "
                                    f"{thr:.1f} robust σ of its own spread, and ×{sig(math.exp(least))} either way: "
                                    f"{COLLAPSE_OVER_VOLATILITY:g} × its largest one-step move before)", key,
                                    score=math.inf if gone[i, 0] else float(z[i, 0]))
        return [found[i] for i in sorted(found)]

    def _update_rows(self) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
        """Per update group (its ``ratio`` row's key): its parameters' norm after each recorded step and the norm
        of that step's update (NaN where not recorded)."""
        index = {(k[1], k[2]): k for k in self.s.keys if k[0] == "update" and k[4] == "ratio"}
        out: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        for t, rec in enumerate(self.records):
            for e in rec["entries"]:
                key = index.get((e["layer"], e["site"])) if e["stage"] == "update" else None
                if key is None or not (is_number(e.get("param_sumsq")) and is_number(e.get("sumsq"))):
                    continue
                sizes, moves = out.setdefault(key, (np.full(self.T, np.nan), np.full(self.T, np.nan)))
                sizes[t], moves[t] = math.sqrt(e["param_sumsq"]), math.sqrt(e["sumsq"])
        return out

    def _without_hard_samples(self, triggers: list[_Trigger]) -> list[_Trigger]:
        """Loss spikes carried by a few samples whose inputs are in range are notes, not incidents.

        Late in a classifier's training most samples' losses are near 0 and a batch that holds one the model has
        not learned yet (a hard or mislabelled example) has a loss ×2–4 its trend, that sample ×10–30 its batch's
        median (a fine-tuned MiniLM, measured): what such a sample looks like, and the loss alone cannot tell it
        from a corrupt label. A corrupt input is another matter: its own per-sample statistics at the data stage
        leave their range, and the spike stays an incident. A spike is carried by its samples when the batch's
        loss without them is back within its range."""
        vals = self._sample_losses()
        n = sum(v.size for v in vals if v is not None)
        if not n:
            return triggers
        thr = self.threshold(n)
        kept = []
        for trig in triggers:
            if trig.kind != "loss_spike":
                kept.append(trig)
                continue
            idx, _, ratio = self._sample_outliers(trig.t, vals, thr)
            v = vals[trig.t]
            if idx is None or v is None or not np.all(np.isfinite(v)):
                kept.append(trig)
                continue
            if trig.sample_ids is None:  # the batch's loss: carried by its outliers when the rest is in range
                rest = np.delete(v, idx)
                if not rest.size or not trig.baseline or not math.isfinite(trig.score) or trig.score <= 0:
                    kept.append(trig)
                    continue
                sigma = (math.log(trig.value) - math.log(trig.baseline)) / trig.score
                if sigma <= 0 or (math.log(max(float(rest.mean()), 1e-300)) - math.log(trig.baseline)) / sigma >= thr:
                    kept.append(trig)
                    continue
            ids = _ids(self.records[trig.t], idx)
            if self._inputs_out_of_range(trig.t, ids):
                kept.append(trig)
                continue
            step = int(self.s.steps[trig.t])
            if step in self.notes:  # the batch's spike and its samples' are one note
                continue
            who = (f"samples {', '.join(map(str, ids))} at up to" if len(ids) > 1 else f"sample {ids[0]} at")
            self.notes[step] = (
                f"step {step}: {who} ×{sig(float(np.max(ratio)))} the batch's median loss ({_fmt(float(np.max(v[idx])))}"
                f" against {_fmt(float(np.median(v)))}) with inputs in range"
                + (f"; the batch's loss {_fmt(trig.value)} (×{sig(trig.value / trig.baseline)} its trend) is back in "
                   f"range without {'them' if len(ids) > 1 else 'it'}" if trig.sample_ids is None else "")
                + ": a hard or mislabelled example, not an incident")
        return kept

    def unusual_inputs(self, explained: set[int], rewritten: set[int] = frozenset()) -> None:
        """Notes for samples whose input statistics (RMS or max |x| at the data stage) sit ``sample_factor`` times
        above the recent samples' median and far outside their spread, at steps no incident explains: no
        incident, but a user should know (a ViT image replaced by noise ×100 while the model was still at chance
        level: no loss could move). Each note also says what moved downstream at its step. Not where every sample
        of the batch moved within ``window`` steps after an incident that rewrote parameters (``rewritten``: a
        learning rate ×1000 rewrites the embedding table, and the embedded inputs of the next ten steps each read
        as a whole batch of corrupt inputs)."""
        if not any(r.get("samples") for r in self.records):
            return
        self.scores()
        factor = self.factors["sample"]
        for t in range(self.T):
            step = int(self.s.steps[t])
            if t in explained or step in self.notes:
                continue
            batch = self._batch_size(t) if any(t - self.window <= c < t for c in rewritten) else None
            for a in self._sample_departures(t, t):
                if batch and len(a.sample_ids or ()) >= batch:
                    continue
                if _unusual(a, factor):
                    who = f"sample {a.sample_ids[0]}" if len(a.sample_ids or ()) == 1 else f"samples {a.sample_ids}"
                    self.notes[step] = (f"step {step}: {who}: input ({a.site}) {a.metric} up to {_fmt(a.value)}, "
                                        f"×{sig(a.value / a.baseline)} the recent samples' median {_fmt(a.baseline)}, "
                                        f"{self._downstream(t)}: an unusual or corrupt input, not an incident")
                    break

    def _batch_size(self, t: int) -> int | None:
        """The number of samples column ``t`` recorded per-sample statistics for (None where it recorded none)."""
        sizes = [len(v) for d in (self.records[t].get("samples") or {}).values() if isinstance(d, dict)
                 for v in d.values() if isinstance(v, list)]
        return max(sizes) if sizes else None

    def _downstream(self, t: int) -> str:
        """What the forward did after an unusual input at column ``t``, as the note states it: the series past the
        data stage that left their range there (a BatchNorm spreads one sample's input over the whole batch), or
        that none did."""
        moved = [a for a in self.departures_in(t, t) if a.stage not in ("data", "loss") and a.sample_ids is None]
        if not moved:
            return "while nothing downstream left its range"
        top = max(moved, key=lambda a: a.score)
        return (f"and {len(moved)} series downstream left their range at this step (the furthest out of its range: "
                f"{top.where()} · {top.evidence})")

    def _inputs_out_of_range(self, t: int, ids: list) -> bool:
        """Did any of these samples' own statistics at the data stage leave their range at column ``t``?"""
        if not hasattr(self, "loc_threshold"):
            self.scores()
        return any(set(a.sample_ids or ()) & set(ids) for a in self._sample_departures(t, t))

    def danger_of(self, key: tuple) -> tuple[str, float] | None:
        """(what, danger level) of a series that has one: max attention logits, a norm's γ RMS, the stream's RMS."""
        stage, _, _, _, metric = key
        if metric == "max_logit" and "logit" in self.dangers:
            return "attention logits", self.dangers["logit"]
        if metric == "scale_rms" and "scale" in self.dangers:
            return "norm scale γ RMS", self.dangers["scale"]
        if metric == "rms" and "stream" in self.dangers and (
                stage == "layer_input" or (stage == "residual_sum" and key in self._unread_sums())):
            return "residual stream RMS", self.dangers["stream"]
        return None

    def _unread_sums(self) -> set[tuple]:
        """The residual sums' RMS series that no block reads as its input: a post-norm block normalizes its sum
        before the next block reads it (and the last block's sum goes to the final norm), so the stream's own size
        is seen only there. A pre-norm block's last sum is the next one's ``layer_input``, the same values: judged
        once, there."""
        if not hasattr(self, "_unread"):
            keys, vals = self.s.keys, self.s.values
            inputs = [vals[r] for r, k in enumerate(keys) if k[0] == "layer_input" and k[4] == "rms"]
            self._unread = {k for r, k in enumerate(keys) if k[0] == "residual_sum" and k[4] == "rms"
                            and not any(np.array_equal(vals[r], v, equal_nan=True) for v in inputs)}
        return self._unread

    def _danger_jumps(self) -> list[_Trigger]:
        """Series that jump at least ``DANGER_JUMP`` × the step before in one step, landing past their danger level
        or within ``DANGER_JUMP`` of it: a γ written ×50, a query projection scaled ×30 (one head's max logit 0.77 →
        24.9, its entropy 3.1 → 1.4). Clean runs move these series a few % a step, never like this."""
        out = []
        for r, key in enumerate(self.s.keys):
            d = self.danger_of(key)
            if d is None:
                continue
            what, danger = d
            row = self.s.values[r]
            stream = what == "residual stream RMS"
            for t in range(1, self.T):
                a, b = row[t - 1], row[t]
                if stream and self._stream_leaps(row, t):
                    out.append(_Trigger(t, "danger_jump", key[4], float(b), float(a),
                                        f"{what} ({_where(key)}) {_fmt(b)} from {_fmt(a)} the step before (×{sig(b / a)}"
                                        f"), ×{STREAM_JUMP:g} or more the largest of the {self.window} steps before "
                                        f"in one step (its danger level is {_fmt(danger)})", key))
                    break
                if (math.isfinite(a) and math.isfinite(b) and 0 <= a < danger and b >= danger / DANGER_JUMP
                        and b >= DANGER_JUMP * a):
                    out.append(_Trigger(t, "danger_jump", key[4], float(b), float(a),
                                        f"{what} ({_where(key)}) {_fmt(b)} from {_fmt(a)} the step before (×{sig(b / a)}), "
                                        + (f"past the danger level {_fmt(danger)} in one step" if b >= danger else
                                           f"in one step, within ×{sig(danger / b, 2)} of the danger level "
                                           f"{_fmt(danger)}"), key))
                    break
        if "logit" in self.dangers:
            out.extend(self._entropy_collapses())
        return out

    def _stream_leaps(self, row: np.ndarray, t: int) -> bool:
        """Does the stream's RMS at column ``t`` reach ``STREAM_JUMP`` × the largest of the ``window`` columns
        before it (at least ``min_history`` of them recorded)? Its danger level is absolute, and a stream of RMS 0.4
        that leaps ×270 to 100 stays under it while a sublayer's output ×1000 passes through (loss 3.0 → 4.5)."""
        past = row[max(0, t - self.window):t]
        past = past[np.isfinite(past)]
        b = row[t]
        return bool(past.size >= self.min_history and math.isfinite(b) and past.max() > 0
                    and b >= STREAM_JUMP * past.max() and not self._unusual_input_at(t))

    def _unusual_input_at(self, t: int) -> bool:
        """Does a sample's input at column ``t`` sit ``sample_factor`` × above the recent samples' median (what
        :meth:`unusual_inputs` notes)? A stream that leaps with it carries that input, which alone is a note: only
        a loss that moves makes it an incident."""
        if not any(r.get("samples") for r in self.records):
            return False
        self.scores()
        return any(_unusual(a, self.factors["sample"]) for a in self._sample_departures(t, t))

    def _entropy_collapses(self) -> list[_Trigger]:
        """Heads whose mean softmax entropy falls ≥ ``DANGER_JUMP`` × in one step into the collapse regime (≤
        ``ENTROPY_COLLAPSE``): a query head scaled ×30 where a positional bias already puts the logits past their
        danger level (BLOOM's ALiBi: max logit 66 → 229, entropy 1.15 → 0.06), so the logits cannot jump into it."""
        out = []
        for r, key in enumerate(self.s.keys):
            if key[4] != "entropy":
                continue
            row = self.s.values[r]
            for t in range(1, self.T):
                a, b = row[t - 1], row[t]
                if (math.isfinite(a) and math.isfinite(b) and a > ENTROPY_COLLAPSE and 0 <= b <= ENTROPY_COLLAPSE
                        and b * DANGER_JUMP <= a):
                    out.append(_Trigger(t, "danger_jump", "entropy", float(b), float(a),
                                        f"attention entropy ({_where(key)}) {_fmt(b)} nats from {_fmt(a)} the step before "
                                        f"(÷{sig(a / max(b, 1e-12))}): collapsed onto one or two keys in one step",
                                        key))
                    break
        return out

    def _sample_spikes(self) -> list[_Trigger]:
        """Steps where single samples' losses sit far above the rest of their batch, beyond the recent steps' spread
        of the same ratio and at least ``sample_factor`` times the batch's median (a corrupt sample hurts its own
        loss long before it moves the mean)."""
        vals = self._sample_losses()
        n = sum(v.size for v in vals if v is not None)
        if not n:
            return []
        thr, factor = self.threshold(n), self.factors["sample"]
        out = []
        for t in range(self.T):
            ids, z, ratio = self._sample_outliers(t, vals, thr)
            if ids is None:
                continue
            keep = [i for i, r in zip(ids, ratio, strict=True) if r >= factor]
            if keep:
                v = vals[t]
                top = max(keep, key=lambda i: v[i])
                sids = _ids(self.records[t], keep)
                med = float(np.median(v[np.isfinite(v)]))
                out.append(_Trigger(t, "loss_spike", "loss", float(v[top]), med,
                                    f"per-sample loss {_fmt(v[top])} of sample {sids[keep.index(top)]} is "
                                    f"×{sig(v[top] / med)} its batch's median {_fmt(med)} (+{z[top]:.1f} robust σ "
                                    f"over the recent steps' spread; thresholds {thr:.1f} and ×{factor:g}); "
                                    f"{len(keep)} of {v.size} samples", ("loss", None, "", None, "loss"),
                                    sample_ids=sids, score=float(z[top])))
        return out

    def _sample_outliers(self, t: int, vals, thr: float):
        """(indices, robust σ, ratio to the batch median) of the samples of column ``t`` whose log-loss minus the
        batch's median log-loss is ``thr`` robust σ above the same of the recent steps' samples."""
        rel = self._relative_log_losses(vals)
        past = [r for r in rel[max(0, t - self.window):t] if r is not None]
        cur = rel[t]
        if cur is None or len(past) < self.min_history:
            return None, None, None
        a = np.concatenate(past)
        m = float(np.median(a))
        sc = max(1.4826 * float(np.median(np.abs(a - m))), self.floor)
        z = (cur - m) / sc
        hit = np.flatnonzero(np.isfinite(z) & (z >= thr))
        if not hit.size:
            return None, None, None
        return hit.tolist(), z, np.exp(cur[hit])

    def _context_row(self, key: tuple, metric: str) -> np.ndarray:
        """The series of ``metric`` recorded beside ``key``'s (NaN where it was not)."""
        k = key[:4] + (metric,)
        r = self.row_of.get(k)
        return self.s.values[r] if r is not None else np.full(self.T, np.nan)

    def _step_beyond_recent(self, step_lr: np.ndarray) -> np.ndarray:
        """Per column: may an update spike be called there? Not where the group's largest parameter step (in
        learning rates) stays below ``update_factor`` times the largest of every recorded step before: an
        adaptive optimizer moves each parameter by at most a few learning rates (Adam ≈ 3.2 with its default
        betas, sign methods 1), and its update RMS can grow ×5 in a few steps while no parameter moves further
        than before, as its directions align (seen on a ViT at the end of warm-up); a step that moves a parameter
        several times further than any before it is not that. Not only the recent steps: a group whose gradients
        were near zero for a while moves its parameters a small fraction of a learning rate (Adam's momentum
        decaying), and the first real gradient after that moves one a normal learning rate again, ×6 the recent
        steps (a clean OPT run, post-LN). True where the step was not recorded."""
        largest, count = _largest_before(step_lr)
        judged = (count > 0) & np.isfinite(step_lr)
        allowed = np.ones(self.T, bool)
        allowed[judged] = step_lr[judged] >= self.factors["update_spike"] * largest[judged]
        return allowed

    def _lr_jumps(self, key, lr, ratio) -> list[tuple]:
        """The first step where group ``key``'s learning rate passes ``lr_jump`` × the highest before it, as
        ``(column, key, lr, highest before, update ratio)`` (none or one)."""
        for t in range(self.min_history, self.T):
            before = lr[:t][np.isfinite(lr[:t])]
            if before.size >= self.min_history and np.isfinite(lr[t]) and lr[t] > self.lr_jump * before.max() > 0:
                return [(t, key, float(lr[t]), float(before.max()), float(ratio[t]))]
        return []

    def _spikes(self, judged, thr, gates: dict[int, np.ndarray] | None = None) -> list[_Trigger]:
        """Upward departures of the judged series from their trends (all series at once, step by step), the
        flagged values kept out of later baselines; a series reports the first step of each run of departures.
        ``gates``: per judged row, the columns where it may be called at all (others judged as usual)."""
        y = log_values(np.array([series for _, _, series, _ in judged], float))
        allowed = np.ones(y.shape, bool)
        for r, gate in (gates or {}).items():
            allowed[r] = gate
        hist = y.copy()
        factors = np.log(np.array([self.factors.get(kind, 1.0) for kind, _, _, _ in judged], float))
        out: list[_Trigger] = []
        prev = np.zeros(len(judged), bool)
        for t in range(1, self.T):
            f = fit(hist[:, max(0, t - self.window):t], self.min_history, self.floor)
            z, base = f.up(y[:, t])
            with np.errstate(invalid="ignore"):
                hit = np.isfinite(z) & (z >= thr) & (y[:, t] - base >= factors) & allowed[:, t]
            hist[hit, t] = np.nan
            for r in np.flatnonzero(hit & ~prev):
                kind, metric, series, key = judged[r]
                factor = self.factors.get(kind, 1.0)
                what = {"loss_spike": "loss", "grad_spike": "global gradient norm",
                        "update_spike": f"update ratio per unit of learning rate, {_group(key)}"}[kind]
                b = math.exp(base[r])
                out.append(_Trigger(t, kind, metric, float(series[t]), b,
                                    f"{what} {_fmt(series[t])} vs its trend {_fmt(b)} (×{sig(series[t] / b)}, "
                                    f"+{z[r]:.1f} robust σ; threshold {thr:.1f}"
                                    + (f" and ×{factor:g})" if factor > 1 else ")")
                                    + (self._step_evidence(key, t) if kind == "update_spike" else ""), key,
                                    score=float(z[r])))
            prev = hit
        return out

    def _step_evidence(self, key: tuple, t: int) -> str:
        step = self._context_row(key, "step_lr")
        largest, count = _largest_before(step)
        if not count[t] or not math.isfinite(step[t]):
            return ""
        return (f"; its largest parameter step {_fmt(step[t])} learning rates, ×{sig(step[t] / max(largest[t], 1e-300))}"
                f" the largest of the {count[t]} steps before")

    def _sample_nonfinite(self, t: int) -> set[int]:
        """The samples (batch indices) of column ``t`` that hold a non-finite value, whatever holds it."""
        bad: set[int] = set()
        for name in (self.records[t].get("samples") or {}):
            if name == "tokens":
                continue
            for metric in ("loss", "rms", "max", "nonfinite"):
                v = _samples(self.records[t:t + 1], name, metric)[0]
                if v is not None:
                    bad.update(np.flatnonzero(v > 0 if metric == "nonfinite" else ~np.isfinite(v)).tolist())
        return bad

    def _loss_samples(self, t: int) -> tuple[list | None, str]:
        """The samples that carry a loss spike at column ``t`` (far above their batch against the recent steps'
        spread), and the evidence."""
        vals = self._sample_losses()
        ids, z, ratio = self._sample_outliers(t, vals, self.loc_threshold)
        if ids is None:
            return None, ""
        sids = _ids(self.records[t], ids)
        return sids, f"; samples {sids} carry it (up to ×{sig(float(np.max(ratio)))} their batch's median loss)"

    def _sample_losses(self) -> list[np.ndarray | None]:
        """Each column's per-sample losses (None where not recorded), read from the records once per run."""
        if self._losses is None:
            self._losses = _samples(self.records, "loss", "loss")
        return self._losses

    def _relative_log_losses(self, vals) -> list[np.ndarray | None]:
        """Each step's per-sample log-losses minus their median (computed once per run)."""
        if self._rel is None:
            self._rel = [self._relative_log_loss(v) for v in vals]
        return self._rel

    @staticmethod
    def _relative_log_loss(v: np.ndarray | None) -> np.ndarray | None:
        if v is None or not v.size:
            return None
        lv = log_values(v)
        fin = lv[np.isfinite(lv)]
        if not fin.size:
            return None
        return lv - float(np.median(fin))

    # ------------------------------------------------------------------ localization
    def scores(self):
        if hasattr(self, "loc_threshold"):  # computed once per run
            return
        s = self.s
        logv = log_values(s.values)
        self.up, self.down, self.base_up, self.base_down = departures(logv, self.window, self.min_history,
                                                                      self.floor)
        judged = sum(len(DIRECTIONS.get(k[4], ())) for k in s.keys)
        self.loc_threshold = self.threshold(max(judged, 1) * (self.lookback + 1))

    def departures_in(self, t0: int, t1: int) -> list[Anomaly]:
        """Every series that left its range at a column in [t0, t1]."""
        s = self.s
        found: list[Anomaly] = []
        thr = self.loc_threshold
        for r, key in enumerate(s.keys):
            stage, layer, site, head, metric = key
            if metric in _CONTEXT:
                continue
            row = s.values[r]
            for t in range(t0, t1 + 1):
                v = row[t]
                if math.isnan(v) and metric not in _COUNT:
                    continue
                hit = None
                if metric in _COUNT:
                    prior = row[:t][np.isfinite(row[:t])]
                    if v > 0 and (prior.size == 0 and t == 0 or prior.size and np.all(prior == 0)):
                        hit = (math.inf, 0.0, f"{metric} = {sig(v, 4)} after {prior.size} recorded steps at 0")
                elif not math.isfinite(v):
                    hit = (math.inf, None, f"{metric} is {v}")
                elif "up" in DIRECTIONS.get(metric, ()) and self.up[r, t] >= thr:
                    b = math.exp(self.base_up[r, t])
                    hit = (float(self.up[r, t]), b, f"{metric} {_fmt(v)} vs its trend {_fmt(b)} "
                                                    f"(×{sig(v / b)}, +{self.up[r, t]:.1f} robust σ)")
                elif "down" in DIRECTIONS.get(metric, ()) and self.down[r, t] >= thr:
                    b = math.exp(self.base_down[r, t])
                    hit = (float(self.down[r, t]), b, f"{metric} {_fmt(v)} vs its trend {_fmt(b)} "
                                                      f"(÷{sig(b / v)}, −{self.down[r, t]:.1f} robust σ)")
                elif "down" in DIRECTIONS.get(metric, ()) and v <= 0 and (b := self._positive_level(r, t)):
                    hit = (math.inf, b, f"{metric} {_fmt(v)} from {_fmt(b)} (the median of the steps before)")
                if hit is not None:
                    step = int(s.steps[t])
                    found.append(Anomaly(step, stage, layer, head, metric, float(v), hit[1], hit[2],
                                         _next_check(stage, metric, layer, site, head, None), site=site,
                                         score=hit[0], order=(step, *s.order[r])))
                    break  # a series' first departure in the window
        found.extend(self._sample_departures(t0, t1))
        return _every_head(found, self.heads)

    @property
    def heads(self) -> dict[tuple, int]:
        """(stage, layer, site, metric) → the number of heads of a per-head series."""
        out: dict[tuple, int] = {}
        for stage, layer, site, head, metric in self.s.keys:
            if head is not None:
                k = (stage, layer, site, metric)
                out[k] = max(out.get(k, 0), head + 1)
        return out

    def _sample_departures(self, t0: int, t1: int) -> list[Anomaly]:
        out = []
        names = sorted({n for r in self.records for n in (r.get("samples") or {}) if n not in ("tokens", "loss")})
        thr = self.loc_threshold
        for name in names:
            for metric in ("nonfinite", "rms", "max"):
                vals = _samples(self.records, name, metric)
                for t in range(t0, t1 + 1):
                    v = vals[t]
                    if v is None or not v.size:
                        continue
                    if metric == "nonfinite":
                        bad = np.flatnonzero(v > 0)
                        z = np.where(v > 0, math.inf, 0.0)
                        base, ev = 0.0, f"non-finite values in {bad.size} of {v.size} samples"
                    else:
                        past = [log_values(p) for p in vals[max(0, t - self.window):t] if p is not None]
                        past = [p[np.isfinite(p)] for p in past]
                        if len(past) < self.min_history:
                            continue
                        a = np.concatenate(past)
                        if not a.size:
                            continue
                        m = float(np.median(a))
                        sc = max(1.4826 * float(np.median(np.abs(a - m))), self.floor)
                        lv = log_values(v)
                        z = np.where(np.isfinite(lv), (lv - m) / sc, np.where(np.isnan(v), 0.0, math.inf))
                        bad = np.flatnonzero(z >= thr)
                        base = math.exp(m)
                        if bad.size:
                            top = float(np.max(v[bad]))
                            ev = (f"per-sample {metric} up to {_fmt(top)} vs median {_fmt(base)} of {a.size} samples of "
                                  f"the last {len(past)} recorded steps (+{float(np.max(z[bad])):.1f} robust σ); "
                                  f"{bad.size} of {v.size} samples")
                    if bad.size:
                        ids = _ids(self.records[t], bad.tolist())
                        step = int(self.s.steps[t])
                        value = float(np.max(v[bad])) if np.isfinite(v[bad]).any() else float(v[bad][0])
                        out.append(Anomaly(step, "data", None, None, metric, value, base, f"{name}: {ev}",
                                           _next_check("data", metric, None, name, None, ids), site=name,
                                           sample_ids=ids, score=float(np.max(z[bad])),
                                           order=(step, -1, _METRIC_ORDER.get(metric, 9), -1)))
                        break
        return out

    def localize(self, trig: _Trigger) -> Incident:
        t0 = max(0, trig.t - self.lookback)
        deps = self._reaching(self.departures_in(t0, trig.t), trig)
        if trig.kind == "loss_spike" and trig.sample_ids is None:
            trig.sample_ids, named = self._loss_samples(trig.t)
            trig.evidence += named
        own = self._own_anomaly(trig)
        if own is not None:
            same = [a for a in deps if a.order[:1] == own.order[:1] and (a.stage, a.layer, a.site, a.metric)
                    == (own.stage, own.layer, own.site, own.metric)]
            if trig.kind == "update_spike":  # judged per learning rate: that, not the raw ratio, is its evidence
                deps = [a for a in deps if a not in same] + [own]
            elif not same:
                deps.append(own)
        if not deps:  # non-finite values that no series holds (only per-sample values): the symptom itself
            step = int(self.s.steps[trig.t])
            deps = [Anomaly(step, "loss", None, None, trig.metric, trig.value, trig.baseline, trig.evidence,
                            _next_check("loss", trig.metric, None, "", None, None), order=(step, math.inf, 9, -1))]
        if trig.kind == "lr_jump" and own is not None:
            cause = own  # the learning rate itself: the updates it scaled follow from it
        else:  # the earliest link; at the same link, the incident's own series (the metric it was judged on)
            causes = _can_make_nonfinite(deps) if trig.kind == "nonfinite" else deps
            cause = _one_head(min(causes, key=lambda a: (a.order, a is not own)), deps)
        if cause not in deps:  # one head named for its layer's non-finite logits: it stands for its own departure
            same = (cause.step, cause.stage, cause.layer, cause.site, cause.head, cause.metric)
            deps = [a for a in deps if (a.step, a.stage, a.layer, a.site, a.head, a.metric) != same] + [cause]
        if trig.kind == "nonfinite" and cause.sample_ids is None and cause.step == int(self.s.steps[trig.t]):
            cause.sample_ids = self._nonfinite_sample_ids(trig.t)
        ranked = sorted(deps, key=lambda a: (-a.score if math.isfinite(a.score) else -math.inf, a.order))
        step = int(self.s.steps[trig.t])
        return Incident(step, trig.kind, trig.metric, trig.value, trig.baseline, trig.evidence, cause, ranked)

    def _nonfinite_sample_ids(self, t: int) -> list | None:
        """The ids of the samples that hold the non-finite values of column ``t`` when they are some of the batch,
        not all (a layer's non-finite fraction says how much, these say which: e.g. an embedding hook that wrote a
        NaN after the data stage was read)."""
        bad, losses = self._sample_nonfinite(t), self._sample_losses()[t]
        if not bad or losses is None or len(bad) >= losses.size:
            return None
        return _ids(self.records[t], sorted(bad))

    def _reaching(self, deps: list[Anomaly], trig: _Trigger) -> list[Anomaly]:
        """The departures that can have caused an incident at column ``trig.t``: all of its own step's; from an
        earlier step only what carries over into a later one: an update (the parameters the next forward uses) at
        the step before, or one of a run of updates out of range up to it; a gradient at a step whose update
        reaches; and a forward series out of range at every step since and at the incident's step no further out
        than it was (a γ written and kept — not a series a new fault moved again: its move is the incident's own
        step's). A batch's activations or loss at an earlier step reach a later one only through that step's
        update. Masked rows and non-finite values are where they first appear: their cause is at their own step."""
        step = int(self.s.steps[trig.t])
        if trig.kind in ("nonfinite", "masked_rows"):
            return [a for a in deps if a.step == step]
        moved = {a.step for a in deps if a.stage == "update" and a.step != step and self._carries(a, trig.t)}
        out = []
        for a in deps:
            if (a.step == step or (a.stage == "update" and a.step in moved) or (a.stage == "grad" and a.step in moved)
                    or (a.stage not in ("grad", "update") and self._carries(a, trig.t))):
                out.append(a)
        return out

    def _carries(self, a: Anomaly, t: int) -> bool:
        """Does ``a`` (at an earlier step) carry into column ``t``? An update acts on the next forward: its series
        must be out of range at every column after its own up to ``t`` (none, for the step before). A forward
        series must be out at every column after its own through ``t``, and at ``t`` no more than twice as far
        out as it was: a γ written and kept stays where it was put."""
        c0 = self.col_of.get(a.step)
        if c0 is None or c0 >= t:
            return False
        if a.stage == "update":
            return all(self._still_out(a, c) for c in range(c0 + 1, t))
        if not all(self._still_out(a, c) for c in range(c0 + 1, t + 1)):
            return False
        r = self.row_of.get((a.stage, a.layer, a.site, a.head, a.metric))
        if r is None or a.metric in _COUNT:
            return r is not None
        v, was = self.s.values[r, t], a.value
        if not (math.isfinite(v) and math.isfinite(was)):
            return True
        if _downward(a):
            return v >= was / 2
        return abs(v) <= 2 * abs(was)

    def _still_out(self, a: Anomaly, t: int) -> bool:
        """Is ``a``'s series still out of its range at column ``t``?"""
        key = (a.stage, a.layer, a.site, a.head, a.metric)
        r = self.row_of.get(key)
        if r is None or a.sample_ids is not None:
            return False
        v = self.s.values[r, t]
        if a.metric in _COUNT:
            return bool(v > 0)
        if not math.isfinite(v):
            return not math.isnan(v)
        if _downward(a):
            return bool(v <= 0 or self.down[r, t] >= self.loc_threshold)
        return bool(a.metric in DIRECTIONS and self.up[r, t] >= self.loc_threshold)

    def _own_anomaly(self, trig: _Trigger) -> Anomaly | None:
        """The incident's own series as an anomaly (the cause when nothing earlier in the chain left its range)."""
        step = int(self.s.steps[trig.t])
        if trig.key is None:  # the global gradient norm, or non-finite values: their series speak for them
            if trig.kind != "grad_spike":
                return None
            grads = [i for i, k in enumerate(self.s.keys) if k[0] == "grad" and k[4] == "rms"]
            return Anomaly(step, "grad", None, None, "grad_norm", trig.value, trig.baseline, trig.evidence,
                           _next_check("grad", "rms", None, "all layers", None, None), site="all layers",
                           score=trig.score, order=(step, min(self.s.order[i][0] for i in grads), 9, -1))
        stage, layer, site, head, metric = trig.key
        r = self.row_of.get(trig.key)
        order = (step, *self.s.order[r]) if r is not None else (step, math.inf, 9, -1)
        metric = {"lr_jump": "lr", "weights_written": "written"}.get(trig.kind, metric)
        return Anomaly(step, stage, layer, head, metric, trig.value,
                       trig.baseline, trig.evidence, _next_check(stage, metric, layer, site, head, trig.sample_ids),
                       site=site, sample_ids=trig.sample_ids, score=trig.score, order=order)

    # ------------------------------------------------------------------ drifts
    def drifts(self) -> list[Drift]:
        s, T = self.s, self.T
        if T < self.min_history + 1:
            return []
        out = []
        horizon = max(T, 1)
        w = min(self.window, T)
        for r, key in enumerate(s.keys):
            stage, layer, site, head, metric = key
            d = self.danger_of(key)
            if d is None:
                continue
            what, danger = d
            v = float(s.values[r, -1])
            if not math.isfinite(v) or v <= 0:
                continue
            y = log_values(s.values[r, T - w:])
            f = fit(y[None, :], self.min_history, self.floor / 4)
            slope, noise = (float(f.slope[0]), float(f.scale[0])) if f.ok[0] else (0.0, math.inf)
            k = max(1, w // 3)
            growing = slope > 0 and slope * (w - k) >= 3 * noise
            # a head's softmax entropy beside its max logit: the series, and its value at the last recorded step
            ent = self._context_row(key, "entropy") if metric == "max_logit" else None
            spread = float(ent[-1]) if ent is not None and math.isfinite(ent[-1]) else None
            if v >= danger:  # in the danger zone, however it got there (a jump stays there without growing)
                if spread is not None and spread > ENTROPY_COLLAPSE:
                    continue  # large logits whose softmax still spreads: not the collapse regime
                row = s.values[r]
                zone = row >= danger
                if ent is not None:  # the collapse regime: large logits with collapsed entropy (unknown: counted)
                    zone &= ~(ent > ENTROPY_COLLAPSE)
                below = np.flatnonzero(~zone)
                since = int(s.steps[below[-1] + 1]) if below.size else int(s.steps[0])
                before = (f" (from {_fmt(row[below[-1]])} the step before" if below.size
                          and math.isfinite(row[below[-1]]) else "")
                if before and ent is not None and math.isfinite(ent[below[-1]]):
                    before += f", its entropy {_fmt(ent[below[-1]])} nats"
                ev = (f"{what} {_fmt(v)}, past the danger level {_fmt(danger)} since step {since}"
                      + (before + ")" if before else "")
                      + (f"; its softmax entropy {_fmt(spread)} nats (collapsed: ≤ {ENTROPY_COLLAPSE})"
                         if spread is not None else "")
                      + (f"; ×{sig(math.exp(slope))} per recorded step over the last {w}" if growing else ""))
                out.append(Drift(stage, layer, site, head, metric, int(s.steps[-1]), v, slope, danger, 0.0,
                                 "crossed", ev))
                continue
            if not growing:
                continue  # not growing beyond its noise
            steps = (math.log(danger) - math.log(v)) / slope
            if steps > horizon:
                continue
            ev = (f"{what} {_fmt(v)}, ×{sig(math.exp(slope))} per recorded step over the last {w}; "
                  f"reaches the danger level {_fmt(danger)} in ~{steps:.0f} recorded steps at this rate"
                  + (f" (its softmax entropy now {_fmt(spread)} nats; collapsed at ≤ {ENTROPY_COLLAPSE})"
                     if spread is not None else ""))
            out.append(Drift(stage, layer, site, head, metric, int(s.steps[-1]), v, slope, danger, steps,
                             "on course", ev))
        return sorted(out, key=lambda d: d.steps_to_danger)


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
    det = _Detector(run.records, window=window, min_history=min_history, z=z, lookback=lookback, floor=floor,
                    false_alarms=false_alarms, lr_jump=lr_jump, grad_factor=grad_factor,
                    update_factor=update_factor, sample_factor=sample_factor,
                    dangers={"logit": logit_danger, "scale": scale_danger, "stream": stream_danger})
    incidents: list[Incident] = []
    if run.records:
        triggers = sorted(det.incident_triggers(), key=lambda tr: (tr.t, INCIDENT_KINDS.index(tr.kind)))
        if triggers:
            det.scores()
        for trig in triggers:
            last = incidents[-1] if incidents else None
            if last is not None and trig.t - _col(det, last.step) <= lookback:
                last.symptoms.append(f"step {int(det.s.steps[trig.t])}: {trig.kind}: {trig.evidence}")
                continue
            incidents.append(det.localize(trig))
        explained = {_col(det, i.step) for i in incidents} | {_col(det, a.step) for i in incidents for a in i.departures}
        det.unusual_inputs(explained,
                           {_col(det, i.step) for i in incidents if i.cause is not None and i.cause.stage == "update"})
        det.sustained_rises(explained)
    drifts = det.drifts() if run.records else []
    disabled = sorted({p for e in run.ends for p in e.get("disabled", []) if isinstance(p, str)}
                      | {p for r in run.records for p in (r.get("disabled") or []) if isinstance(p, str)})
    errors = [x for e in run.ends for x in (e.get("errors") or []) if isinstance(x, dict)]
    complete = bool(run.ends) and len(run.ends) >= len(run.headers)
    undecided = _undecided(run, errors, min_history)
    return Diagnosis(str(run.path.parent), incidents, drifts, [r["step"] for r in run.records], run.headers[-1],
                     disabled, errors, settings, complete, run.damaged, run.records, undecided,
                     [det.notes[k] for k in sorted(det.notes)], run.runs, run.number)


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


def _downward(a: Anomaly) -> bool:
    """Did ``a``'s series leave its range downward (below its baseline)?"""
    return a.baseline is not None and math.isfinite(a.baseline) and math.isfinite(a.value) and a.value < a.baseline


def _one_head(cause: Anomaly, deps: list[Anomaly]) -> Anomaly:
    """An attention entry's non-finite count is one number for all heads; when only some heads' own series left
    their range at that step, the first of them is the cause (the others' logits were fine)."""
    if cause.stage != "attention_logits" or cause.head is not None:
        return cause
    heads = [a for a in deps if a.stage == cause.stage and a.layer == cause.layer and a.site == cause.site
             and a.step == cause.step and a.head is not None]
    if not heads:
        return cause
    top = max(heads, key=lambda a: a.score)
    return dataclasses.replace(top, evidence=f"{top.evidence}; the layer's logits hold non-finite values "
                                             f"({cause.metric} = {_fmt(cause.value)})", order=cause.order)


def _every_head(found: list[Anomaly], heads: dict[tuple, int]) -> list[Anomaly]:
    """Departures of every head of one entry at one step become one anomaly of the layer (``head=None``): a mask
    or an input that all heads share, not one head's weights."""
    groups: dict[tuple, list[Anomaly]] = {}
    for a in found:
        if a.head is not None:
            groups.setdefault((a.step, a.stage, a.layer, a.site, a.metric), []).append(a)
    out = [a for a in found if a.head is None]
    for (_, stage, layer, site, metric), members in groups.items():
        n = heads.get((stage, layer, site, metric), 0)
        if n > 1 and len(members) == n:
            top = max(members, key=lambda a: a.score)
            out.append(dataclasses.replace(top, head=None, evidence=f"all {n} heads; largest in head {top.head}: "
                                           f"{top.evidence}", next_check=_next_check(stage, metric, layer, site, None,
                                                                                     None),
                                           order=top.order[:-1] + (-1,)))
        else:
            out.extend(members)
    return out


def _col(det: _Detector, step: int) -> int:
    return int(np.searchsorted(det.s.steps, step))


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
