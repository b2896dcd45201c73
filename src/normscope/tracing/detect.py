"""``normscope.diagnose(run_dir)``: find the first link of the residual chain that broke.

Every recorded statistic is a *series* (stage, layer, site, head, metric) over the recorded steps. A value breaks
its series when

- it is non-finite, or the series' non-finite count / fully masked query rows turn positive after a history of
  zeros (no history needed: a NaN is never normal);
- it jumps relative to the series' own recent history: with ``m`` and ``MAD`` the median and median absolute
  deviation of the last ``window`` finite values and ``s = max(1.4826·MAD, floor·|m|)``, an upward metric breaks
  at ``v ≥ m + z·s`` (with the defaults at least twice its median) and a downward one (attention entropy) at
  ``v ≤ m − z·s'`` with ``s' = max(1.4826·MAD, floor_down·|m|)`` (at least halved). Jumps are judged only once a
  series has ``min_history`` values: the early transient of training (fast-falling loss, large first Adam
  updates) is learned, not flagged.

Per-sample series (``data``, per-sample ``loss``) pool the values of every sample of the recent steps; the samples
over the threshold are named by their ``sample_ids``. Each series reports its first break only. Anomalies are
ordered by step and, within a step, in chain order: data, then per block the order in which the forward computed
the statistics (layer input, norm input/output, attention logits, sublayer output, residual sum), loss, gradients
in backward order (last layer first), updates. ``Diagnosis.first`` is the first of them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import deque
from typing import Any

import numpy as np

from ..jsonable import jsonable
from .store import read_run, trace_path

DIAGNOSIS_SCHEMA = "normscope.diagnosis/1"
STAGES = ("data", "layer_input", "norm_input", "norm_output", "attention_logits", "sublayer_output", "residual_sum",
          "loss", "grad", "update")
_ACT = ("layer_input", "norm_input", "norm_output", "sublayer_output", "residual_sum")


@dataclasses.dataclass
class Anomaly:
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
class Diagnosis:
    run_dir: str
    anomalies: list[Anomaly]
    steps: list[int]
    header: dict[str, Any]
    disabled: list[str]
    errors: list[dict[str, Any]]
    settings: dict[str, Any]
    complete: bool  # the tracer closed the run (an end line); False while it is still written or after a crash
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list, repr=False)

    @property
    def first(self) -> Anomaly | None:
        return self.anomalies[0] if self.anomalies else None

    @property
    def ok(self) -> bool:
        return not self.anomalies

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
                    v = v[head or 0] if v else None
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
                         "errors": self.errors, "settings": self.settings,
                         "first": self.first.to_dict() if self.first else None,
                         "anomalies": [a.to_dict() for a in self.anomalies]})

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
        return {"max_logit": e["max_logit"], "masked_rows": e["masked_rows"], "entropy": ent,
                "nonfinite": e["nonfinite"]}
    if st == "loss":
        return {"loss": e["sum"] / max(e["count"], 1), "nonfinite": e["nonfinite"]}
    if st == "update":
        u, p = rms(e["sumsq"], e["n"]), rms(e["param_sumsq"], e["n"])
        return {"ratio": (u / p if p else (math.inf if u else 0.0)) if u is not None else None,
                "nonfinite": e["nonfinite"] / max(e["n"], 1)}
    return {}


_UP = {"rms", "max", "max_logit", "loss", "ratio", "scale_rms"}
_DOWN = {"entropy"}
_COUNT = {"nonfinite", "masked_rows"}
_METRIC_ORDER = {"nonfinite": 0, "masked_rows": 1, "max_logit": 2, "max": 3, "rms": 4, "entropy": 5, "loss": 6,
                 "ratio": 7, "scale_rms": 8}


def _next_check(stage: str, metric: str, layer, site: str, head, ids) -> str:
    L = f"layer {layer}" if layer is not None else "the model"
    if stage == "data":
        who = f"samples {ids}" if ids else "the samples of this batch"
        return (f"inspect {who}: their raw tokens/values and source shard; if they are corrupt, drop them and "
                "re-run this step")
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
        return ("earlier stages were clean at this step: look at the targets/labels of the samples with the "
                "largest per-sample loss and at the loss computation (scaling, ignore_index)")
    if stage == "grad":
        if metric == "nonfinite":
            return (f"the backward of {L} ({site}): re-run this step under torch.autograd.detect_anomaly() to name the "
                    "op; under float16 AMP check the loss scaler")
        return f"the gradient of {L} ({site}): the loss and batch of this step, and gradient clipping"
    if stage == "update":
        return (f"the optimizer's param group for {L} ({site}): its learning rate at this step (scheduler, warmup, a "
                "per-layer multiplier), Adam ε and second-moment state")
    if stage == "norm_output" and metric == "scale_rms":
        return f"the scale γ of {site} in {L}: its updates and weight decay"
    if stage in ("norm_input", "layer_input"):
        return f"the stream entering {L}: the residual sum of the layer before and the data at this step"
    if stage == "norm_output":
        return f"{site} in {L}: its input's per-row RMS (a collapsing σ/RMS amplifies) and its scale γ"
    return f"the {site or stage} sublayer of {L}: its weights (update stage) and the norm that feeds it"


class _Series:
    __slots__ = ("hist", "broken", "zeros")

    def __init__(self, window: int):
        self.hist: deque = deque(maxlen=window)
        self.broken = False
        self.zeros = True


def _baseline(hist, z: float, floor: float) -> tuple[float, float]:
    a = np.fromiter(hist, float)
    m = float(np.median(a))
    mad = float(np.median(np.abs(a - m)))
    return m, max(1.4826 * mad, floor * abs(m), 1e-12)


def diagnose(run_dir: str | os.PathLike, *, window: int = 20, min_history: int = 8, z: float = 10.0,
             floor: float = 0.1, floor_down: float = 0.05) -> Diagnosis:
    """Read ``run_dir`` (also while it is being written) and localize the first anomaly of the chain."""
    headers, records, ends = read_run(run_dir)
    settings = {"window": window, "min_history": min_history, "z": z, "floor": floor, "floor_down": floor_down}
    series: dict[tuple, _Series] = {}
    pooled: dict[str, deque] = {}
    pooled_broken: set[str] = set()
    found: list[Anomaly] = []

    def judge(key, v, metric, step) -> tuple[bool, float | None, str] | None:
        s = series.get(key)
        if s is None:
            s = series[key] = _Series(window)
        if v is None or s.broken:
            if v is not None and metric not in _COUNT and math.isfinite(v):
                s.hist.append(v)
            return None
        verdict = None
        if metric in _COUNT:
            if v > 0 and s.zeros:
                verdict = (True, 0.0, f"{metric} = {v:.4g} after {len(s.hist)} recorded steps at 0")
            s.zeros = s.zeros and v == 0
            s.hist.append(v)
        elif not math.isfinite(v):
            base = float(np.median(np.fromiter(s.hist, float))) if s.hist else None
            verdict = (True, base, f"{metric} is {v}" + (f" (median of the last {len(s.hist)}: {base:.4g})"
                                                         if base is not None else ""))
        else:
            if len(s.hist) >= min_history:
                m, sc = _baseline(s.hist, z, floor)
                if metric in _UP and v >= m + z * sc:
                    verdict = (True, m, f"{metric} {v:.4g} vs median {m:.4g} of the last {len(s.hist)} recorded "
                                        f"steps (+{(v - m) / sc:.1f} robust σ, ×{v / m:.3g})" if m else
                                        f"{metric} {v:.4g} vs median 0")
                elif metric in _DOWN:
                    m, sd = _baseline(s.hist, z, floor_down)
                    if v <= m - z * sd:
                        verdict = (True, m, f"{metric} {v:.4g} vs median {m:.4g} of the last {len(s.hist)} recorded "
                                            f"steps (−{(m - v) / sd:.1f} robust σ, ×{v / m:.3g})")
            s.hist.append(v)
        if verdict:
            s.broken = True
        return verdict

    for rec in records:
        step = rec["step"]
        ids = rec.get("sample_ids")
        entries = rec["entries"]
        loss_pos = next((i for i, e in enumerate(entries) if e["stage"] == "loss"), len(entries))
        # per-sample series, pooled over samples
        for name, d in (rec.get("samples") or {}).items():
            if name == "tokens":
                continue
            stage, pos = ("loss", loss_pos - 0.5) if name == "loss" else ("data", -1)
            if name == "loss":
                vals = {"loss": d["loss"]}
            else:
                vals = {"rms": [math.sqrt(s / n) if n else 0.0 for s, n in zip(d["sumsq"], d["n"], strict=False)],
                        "max": d["max"], "nonfinite": d["nonfinite"]}
            for metric, vs in vals.items():
                key = f"{name}:{metric}"
                hist = pooled.setdefault(key, deque(maxlen=window))
                arr = np.asarray(vs, float)
                flagged, base, ev = [], None, ""
                if key not in pooled_broken and arr.size:
                    if metric == "nonfinite" or not np.all(np.isfinite(arr)):
                        bad = np.flatnonzero(arr > 0) if metric == "nonfinite" else np.flatnonzero(~np.isfinite(arr))
                        if bad.size:
                            flagged, base = bad.tolist(), 0.0
                            ev = f"{metric} non-finite/positive in {bad.size} of {arr.size} samples"
                    elif len(hist) >= min_history and metric != "nonfinite":
                        pool = np.concatenate(list(hist))
                        m, sc = _baseline(pool, z, floor)
                        bad = np.flatnonzero(arr >= m + z * sc)
                        if bad.size:
                            flagged, base = bad.tolist(), m
                            top = float(arr[bad].max())
                            ev = (f"per-sample {metric} up to {top:.4g} vs median {m:.4g} of {pool.size} samples of the "
                                  f"last {len(hist)} recorded steps (+{(top - m) / sc:.1f} robust σ); "
                                  f"{bad.size} of {arr.size} samples")
                if flagged:
                    pooled_broken.add(key)
                    sids = [ids[i] if ids and i < len(ids) else i for i in flagged]
                    found.append(Anomaly(step, stage, None, None, metric, float(np.nanmax(arr[flagged])) if
                                         np.any(np.isfinite(arr[flagged])) else float(arr[flagged][0]), base,
                                         f"{name}: {ev}", _next_check(stage, metric, None, name, None, sids),
                                         site=name, sample_ids=sids, order=(step, pos, _METRIC_ORDER.get(metric, 9), -1)))
                fin = arr[np.isfinite(arr)]
                if fin.size:
                    hist.append(fin)
        for pos, e in enumerate(entries):
            stage, layer, site = e["stage"], e["layer"], e["site"]
            for metric, v in entry_metrics(e).items():
                if metric == "min_row_rms" or (stage == "norm_output" and metric == "scale_rms" and v is None):
                    continue
                if isinstance(v, list):
                    hits = []
                    for h, vh in enumerate(v):
                        r = judge((stage, layer, site, h, metric), vh, metric, step)
                        if r:
                            hits.append((h, vh, r))
                    if not hits:
                        continue
                    if len(v) > 1 and len(hits) == len(v):  # every head: one anomaly for the layer
                        h0 = max(hits, key=lambda t: t[1] if math.isfinite(t[1]) else math.inf)
                        found.append(Anomaly(step, stage, layer, None, metric, h0[1], h0[2][1],
                                             f"all {len(v)} heads; largest in head {h0[0]}: {h0[2][2]}",
                                             _next_check(stage, metric, layer, site, None, None), site=site,
                                             order=(step, pos, _METRIC_ORDER.get(metric, 9), -1)))
                    else:
                        for h, vh, r in hits:
                            found.append(Anomaly(step, stage, layer, h, metric, vh, r[1], r[2],
                                                 _next_check(stage, metric, layer, site, h, None), site=site,
                                                 order=(step, pos, _METRIC_ORDER.get(metric, 9), h)))
                else:
                    r = judge((stage, layer, site, None, metric), v, metric, step)
                    if r:
                        found.append(Anomaly(step, stage, layer, None, metric, v, r[1], r[2],
                                             _next_check(stage, metric, layer, site, None, None), site=site,
                                             order=(step, pos, _METRIC_ORDER.get(metric, 9), -1)))
    found.sort(key=lambda a: a.order)
    disabled = sorted({p for e in ends for p in e.get("disabled", [])} | {p for r in records
                                                                           for p in r.get("disabled", [])})
    errors = [x for e in ends for x in e.get("errors", [])]
    last = headers[-1]
    complete = bool(ends) and len(ends) >= len(headers)
    return Diagnosis(str(trace_path(run_dir).parent), found, [r["step"] for r in records], last, disabled, errors,
                     settings, complete, records)
