"""The run as series: every recorded statistic as a row of one matrix (steps as columns), keyed by (stage, layer,
site, head, metric), and :class:`RunView`, what every stage of ``diagnose`` reads — the series, the settings, the
per-sample values, and each series' departures from its own trend."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ...report.numbers import sig
from ..trend import departures, gaussian_tail_quantile, log_values
from .advice import next_check
from .metrics import entry_metrics
from .results import Anomaly

STAGES = ("data", "layer_input", "norm_input", "norm_output", "attention_logits", "sublayer_output", "residual_sum",
          "loss", "grad", "update")
#: the directions in which a series' move is a failure, by metric: a stream or a sublayer's output growing or
#: collapsing, γ growing or written towards 0, gradients exploding or vanishing, a head's entropy collapsing onto
#: one key or rising to uniform, its focus (distance from uniform attention) falling; logits, maxima, the loss and the
#: updates upward
DIRECTIONS = {"rms": ("up", "down"), "scale_rms": ("up", "down"), "entropy": ("down", "up"), "focus": ("down",),
              "max": ("up",), "max_logit": ("up",), "loss": ("up",), "ratio": ("up",)}
COUNT = {"nonfinite", "masked_rows", "masked_samples"}
CONTEXT = {"min_row_rms", "lr", "step_lr"}  # recorded, not judged on their own
# within one entry, the metric that explains the others first: a norm's γ before its output's RMS, a head's focus
# before its entropy
METRIC_ORDER = {"nonfinite": 0, "masked_samples": 1, "masked_rows": 2, "scale_rms": 3, "max_logit": 4, "max": 5,
                "rms": 6, "focus": 7, "entropy": 8, "loss": 9, "ratio": 10}


# ---------------------------------------------------------------------- the run as series
@dataclasses.dataclass
class Series:
    """Every scalar series of a run as rows of one matrix (steps as columns), with what each row is."""
    steps: np.ndarray
    keys: list[tuple]  # (stage, layer, site, head, metric)
    order: list[tuple]  # chain position of each row: (entry position, metric order, head)
    values: np.ndarray  # (rows, steps), NaN where not recorded


BEFORE_FORWARD = 1 << 30  # subtracted from a parameter series' chain position: before any entry of its step


def collect(records: list[dict[str, Any]]) -> Series:
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
                        at = pos - BEFORE_FORWARD if metric == "scale_rms" else pos
                        order.append((at, METRIC_ORDER.get(metric, 9), -1 if head is None else head))
                        cols.append({})
                    if isinstance(vh, int | float):
                        cols[r][t] = float(vh)
    values = np.full((len(order), len(records)), np.nan)
    for r, c in enumerate(cols):
        if c:
            idx = np.fromiter(c.keys(), int)
            values[r, idx] = np.fromiter(c.values(), float)
    return Series(np.array([r["step"] for r in records], int), list(rows), order, values)


def per_sample(records: list[dict[str, Any]], name: str, metric: str) -> list[np.ndarray | None]:
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


def sample_ids_of(rec: dict[str, Any], idx) -> list:
    ids = rec.get("sample_ids")
    return [ids[i] if isinstance(ids, list) and i < len(ids) else i for i in idx]


def fmt(v: float) -> str:
    return sig(v, 4)


def group_name(key: tuple | None) -> str:
    """A parameter group as the evidence names it: "layer 1 (attn)", or the module outside the blocks."""
    if not key:
        return "all parameters"
    return f"layer {key[1]} ({key[2]})" if key[1] is not None else key[2]


def unusual(a: Anomaly, factor: float) -> bool:
    """Is a sample's input departure ``a`` (RMS or max |x| at the data stage) ``factor`` × above the recent
    samples' median: an unusual or corrupt input?"""
    return a.metric in ("rms", "max") and bool(a.baseline) and math.isfinite(a.value) and a.value >= factor * a.baseline


def where_of(key: tuple) -> str:
    """A series' place in words: layer, site and head where it has them."""
    where = f"layer {key[1]}" if key[1] is not None else "the model"
    where += f" · {key[2]}" if key[2] else ""
    return where + (f" · head {key[3]}" if key[3] is not None else "")


class RunView:
    """One run as every stage of ``diagnose`` reads it: its series (:class:`Series`), the settings, the per-sample
    values, each series' departures from its own trend (:meth:`scores`), and the notes the stages leave."""

    def __init__(self, records, *, window, min_history, z, lookback, floor, false_alarms, lr_jump, grad_factor,
                 update_factor, sample_factor, dangers=None):
        self.records = records
        self.dangers = dangers or {}  # "logit", "scale", "stream" → the level where each becomes dangerous
        self.factors = {"grad_spike": grad_factor, "update_spike": update_factor, "sample": sample_factor}
        self.window, self.min_history, self.z = window, min_history, z
        self.lookback, self.floor, self.false_alarms, self.lr_jump = lookback, floor, false_alarms, lr_jump
        self.s = collect(records)
        self.row_of = {k: i for i, k in enumerate(self.s.keys)}
        self.col_of = {int(step): t for t, step in enumerate(self.s.steps)}
        self.T = len(records)
        self._losses: list[np.ndarray | None] | None = None  # per-sample losses per column, read on first use
        self._rel: list[np.ndarray | None] | None = None  # per-sample relative log-losses, made on first use
        self.notes: dict[int, str] = {}  # step → what was seen there and judged not an incident
        self.pending_collapses: list = []  # collapses that began too near the end to have held yet

    def threshold(self, tests: int) -> float:
        """z raised so that ``tests`` Gaussian tests leave ``false_alarms`` expected false alarms."""
        return max(self.z, gaussian_tail_quantile(self.false_alarms / max(tests, 1)))

    def rows(self, pred) -> list[int]:
        return [i for i, k in enumerate(self.s.keys) if pred(k)]

    def positive_level(self, r: int, t: int) -> float | None:
        """The median of row ``r``'s positive values over the ``window`` columns before ``t`` (at least
        ``min_history`` of them), or None: the level a series that fell to 0 fell from."""
        past = self.s.values[r, max(0, t - self.window):t]
        past = past[np.isfinite(past) & (past > 0)]
        return float(np.median(past)) if past.size >= self.min_history else None

    def batch_size(self, t: int) -> int | None:
        """The number of samples column ``t`` recorded per-sample statistics for (None where it recorded none)."""
        sizes = [len(v) for d in (self.records[t].get("samples") or {}).values() if isinstance(d, dict)
                 for v in d.values() if isinstance(v, list)]
        return max(sizes) if sizes else None

    def inputs_out_of_range(self, t: int, ids: list) -> bool:
        """Did any of these samples' own statistics at the data stage leave their range at column ``t``?"""
        if not hasattr(self, "loc_threshold"):
            self.scores()
        return any(set(a.sample_ids or ()) & set(ids) for a in self.sample_departures(t, t))

    def danger_of(self, key: tuple) -> tuple[str, float] | None:
        """(what, danger level) of a series that has one: max attention logits, a norm's γ RMS, the stream's RMS."""
        stage, _, _, _, metric = key
        if metric == "max_logit" and "logit" in self.dangers:
            return "attention logits", self.dangers["logit"]
        if metric == "scale_rms" and "scale" in self.dangers:
            return "norm scale γ RMS", self.dangers["scale"]
        if metric == "rms" and "stream" in self.dangers and (
                stage == "layer_input" or (stage == "residual_sum" and key in self.unread_sums())):
            return "residual stream RMS", self.dangers["stream"]
        return None

    def unread_sums(self) -> set[tuple]:
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

    def unusual_input_at(self, t: int) -> bool:
        """Does a sample's input at column ``t`` sit ``sample_factor`` × above the recent samples' median (what
        :func:`.notes.unusual_inputs` notes)? A stream that leaps with it carries that input, which alone is a note: only
        a loss that moves makes it an incident."""
        if not any(r.get("samples") for r in self.records):
            return False
        self.scores()
        return any(unusual(a, self.factors["sample"]) for a in self.sample_departures(t, t))

    def sample_outliers(self, t: int, vals, thr: float):
        """(indices, robust σ, ratio to the batch median) of the samples of column ``t`` whose log-loss minus the
        batch's median log-loss is ``thr`` robust σ above the same of the recent steps' samples."""
        rel = self.relative_log_losses(vals)
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

    def context_row(self, key: tuple, metric: str) -> np.ndarray:
        """The series of ``metric`` recorded beside ``key``'s (NaN where it was not)."""
        k = key[:4] + (metric,)
        r = self.row_of.get(k)
        return self.s.values[r] if r is not None else np.full(self.T, np.nan)

    def sample_nonfinite(self, t: int) -> set[int]:
        """The samples (batch indices) of column ``t`` that hold a non-finite value, whatever holds it."""
        bad: set[int] = set()
        for name in (self.records[t].get("samples") or {}):
            if name == "tokens":
                continue
            for metric in ("loss", "rms", "max", "nonfinite"):
                v = per_sample(self.records[t:t + 1], name, metric)[0]
                if v is not None:
                    bad.update(np.flatnonzero(v > 0 if metric == "nonfinite" else ~np.isfinite(v)).tolist())
        return bad

    def sample_losses(self) -> list[np.ndarray | None]:
        """Each column's per-sample losses (None where not recorded), read from the records once per run."""
        if self._losses is None:
            self._losses = per_sample(self.records, "loss", "loss")
        return self._losses

    def relative_log_losses(self, vals) -> list[np.ndarray | None]:
        """Each step's per-sample log-losses minus their median (computed once per run)."""
        if self._rel is None:
            self._rel = [self.relative_log_loss(v) for v in vals]
        return self._rel

    @staticmethod
    def relative_log_loss(v: np.ndarray | None) -> np.ndarray | None:
        if v is None or not v.size:
            return None
        lv = log_values(v)
        fin = lv[np.isfinite(lv)]
        if not fin.size:
            return None
        return lv - float(np.median(fin))


    def scores(self):
        if hasattr(self, "loc_threshold"):  # computed once per run
            return
        s = self.s
        logv = log_values(s.values)
        self.up, self.down, self.base_up, self.base_down = departures(logv, self.window, self.min_history,
                                                                      self.floor)
        judged = sum(len(DIRECTIONS.get(k[4], ())) for k in s.keys)
        self.loc_threshold = self.threshold(max(judged, 1) * (self.lookback + 1))

    @property
    def heads(self) -> dict[tuple, int]:
        """(stage, layer, site, metric) → the number of heads of a per-head series."""
        out: dict[tuple, int] = {}
        for stage, layer, site, head, metric in self.s.keys:
            if head is not None:
                k = (stage, layer, site, metric)
                out[k] = max(out.get(k, 0), head + 1)
        return out

    def sample_departures(self, t0: int, t1: int) -> list[Anomaly]:
        out = []
        names = sorted({n for r in self.records for n in (r.get("samples") or {}) if n not in ("tokens", "loss")})
        thr = self.loc_threshold
        for name in names:
            for metric in ("nonfinite", "rms", "max"):
                vals = per_sample(self.records, name, metric)
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
                            ev = (f"per-sample {metric} up to {fmt(top)} vs median {fmt(base)} of {a.size} samples of "
                                  f"the last {len(past)} recorded steps (+{float(np.max(z[bad])):.1f} robust σ); "
                                  f"{bad.size} of {v.size} samples")
                    if bad.size:
                        ids = sample_ids_of(self.records[t], bad.tolist())
                        step = int(self.s.steps[t])
                        value = float(np.max(v[bad])) if np.isfinite(v[bad]).any() else float(v[bad][0])
                        out.append(Anomaly(step, "data", None, None, metric, value, base, f"{name}: {ev}",
                                           next_check("data", metric, None, name, None, ids), site=name,
                                           sample_ids=ids, score=float(np.max(z[bad])),
                                           order=(step, -1, METRIC_ORDER.get(metric, 9), -1)))
                        break
        return out
