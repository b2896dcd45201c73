"""Localization: for each incident, every series scored against its own trend at each of the ``lookback`` recorded
steps before it and at its step; the cause is the earliest link of the chain whose series left its range in a
direction where a move is a failure (:data:`.series.DIRECTIONS`) and that can reach the incident."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...report.numbers import sig
from .advice import next_check
from .incidents import DANGER_JUMP, Trigger
from .results import Anomaly, Incident
from .rules import Rule
from .series import CONTEXT, COUNT, DIRECTIONS, RunView, fmt, sample_ids_of


def departures_in(view: RunView, t0: int, t1: int) -> list[Anomaly]:
    """Every series that left its range at a column in [t0, t1]."""
    s = view.s
    found: list[Anomaly] = []
    thr = view.loc_threshold
    for r, key in enumerate(s.keys):
        stage, layer, site, head, metric = key
        if metric in CONTEXT:
            continue
        row = s.values[r]
        for t in range(t0, t1 + 1):
            v = row[t]
            if math.isnan(v) and metric not in COUNT:
                continue
            hit = None
            if metric in COUNT:
                prior = row[:t][np.isfinite(row[:t])]
                if v > 0 and (prior.size == 0 and t == 0 or prior.size and np.all(prior == 0)):
                    hit = (math.inf, 0.0, f"{metric} = {sig(v, 4)} after {prior.size} recorded steps at 0")
            elif not math.isfinite(v):
                hit = (math.inf, None, f"{metric} is {v}")
            elif "up" in DIRECTIONS.get(metric, ()) and view.up[r, t] >= thr:
                b = math.exp(view.base_up[r, t])
                hit = (float(view.up[r, t]), b, f"{metric} {fmt(v)} vs its trend {fmt(b)} "
                                                f"(×{sig(v / b)}, +{view.up[r, t]:.1f} robust σ)")
            elif "down" in DIRECTIONS.get(metric, ()) and view.down[r, t] >= thr:
                b = math.exp(view.base_down[r, t])
                hit = (float(view.down[r, t]), b, f"{metric} {fmt(v)} vs its trend {fmt(b)} "
                                                  f"(÷{sig(b / v)}, −{view.down[r, t]:.1f} robust σ)")
            elif "down" in DIRECTIONS.get(metric, ()) and v <= 0 and (b := view.positive_level(r, t)):
                hit = (math.inf, b, f"{metric} {fmt(v)} from {fmt(b)} (the median of the steps before)")
            if hit is not None:
                step = int(s.steps[t])
                found.append(Anomaly(step, stage, layer, head, metric, float(v), hit[1], hit[2],
                                     next_check(stage, metric, layer, site, head, None), site=site,
                                     score=hit[0], order=(step, *s.order[r])))
                break  # a series' first departure in the window
    found.extend(view.sample_departures(t0, t1))
    return _every_head(found, view.heads)


def localize(view: RunView, trig: Trigger) -> Incident:
    """The incident of ``trig``: its first cause (the earliest link that left its range and can reach it) and every
    departure of the ``lookback`` window, farthest first."""
    view.scores()
    t0 = max(0, trig.t - view.lookback)
    deps = _reaching(view, departures_in(view, t0, trig.t), trig)
    if trig.kind == "loss_spike" and trig.sample_ids is None:
        trig.sample_ids, named = _loss_samples(view, trig.t)
        trig.evidence += named
    own = _own_anomaly(view, trig)
    if own is not None:
        same = [a for a in deps if a.order[:1] == own.order[:1] and (a.stage, a.layer, a.site, a.metric)
                == (own.stage, own.layer, own.site, own.metric)]
        if trig.kind == "update_spike":  # judged per learning rate: that, not the raw ratio, is its evidence
            deps = [a for a in deps if a not in same] + [own]
        elif not same:
            deps.append(own)
    if not deps:  # non-finite values that no series holds (only per-sample values): the symptom itself
        step = int(view.s.steps[trig.t])
        deps = [Anomaly(step, "loss", None, None, trig.metric, trig.value, trig.baseline, trig.evidence,
                        next_check("loss", trig.metric, None, "", None, None), order=(step, math.inf, 9, -1))]
    if trig.kind == "lr_jump" and own is not None:
        cause = own  # the learning rate itself: the updates it scaled follow from it
    else:  # the earliest link; at the same link, the incident's own series (the metric it was judged on)
        causes = _can_make_nonfinite(deps) if trig.kind == "nonfinite" else deps
        cause = _one_head(min(causes, key=lambda a: (a.order, a is not own)), deps)
    if cause not in deps:  # one head named for its layer's non-finite logits: it stands for its own departure
        same = (cause.step, cause.stage, cause.layer, cause.site, cause.head, cause.metric)
        deps = [a for a in deps if (a.step, a.stage, a.layer, a.site, a.head, a.metric) != same] + [cause]
    if trig.kind == "nonfinite" and cause.sample_ids is None and cause.step == int(view.s.steps[trig.t]):
        cause.sample_ids = _nonfinite_sample_ids(view, trig.t)
    ranked = sorted(deps, key=lambda a: (-a.score if math.isfinite(a.score) else -math.inf, a.order))
    step = int(view.s.steps[trig.t])
    return Incident(step, trig.kind, trig.metric, trig.value, trig.baseline, trig.evidence, cause, ranked)


def _nonfinite_sample_ids(view: RunView, t: int) -> list | None:
    """The ids of the samples that hold the non-finite values of column ``t`` when they are some of the batch,
    not all (a layer's non-finite fraction says how much, these say which: e.g. an embedding hook that wrote a
    NaN after the data stage was read)."""
    bad, losses = view.sample_nonfinite(t), view.sample_losses()[t]
    if not bad or losses is None or len(bad) >= losses.size:
        return None
    return sample_ids_of(view.records[t], sorted(bad))


def _reaching(view: RunView, deps: list[Anomaly], trig: Trigger) -> list[Anomaly]:
    """The departures that can have caused an incident at column ``trig.t``: all of its own step's; from an
    earlier step only what carries over into a later one: an update (the parameters the next forward uses) at
    the step before, or one of a run of updates out of range up to it; a gradient at a step whose update
    reaches; and a forward series out of range at every step since and at the incident's step no further out
    than it was (a γ written and kept — not a series a new fault moved again: its move is the incident's own
    step's). A batch's activations or loss at an earlier step reach a later one only through that step's
    update. Masked rows and non-finite values are where they first appear: their cause is at their own step."""
    step = int(view.s.steps[trig.t])
    if trig.kind in ("nonfinite", "masked_rows"):
        return [a for a in deps if a.step == step]
    moved = {a.step for a in deps if a.stage == "update" and a.step != step and _carries(view, a, trig.t)}
    out = []
    for a in deps:
        if (a.step == step or (a.stage == "update" and a.step in moved) or (a.stage == "grad" and a.step in moved)
                or (a.stage not in ("grad", "update") and _carries(view, a, trig.t))):
            out.append(a)
    return out


def _carries(view: RunView, a: Anomaly, t: int) -> bool:
    """Does ``a`` (at an earlier step) carry into column ``t``? An update acts on the next forward: its series
    must be out of range at every column after its own up to ``t`` (none, for the step before). A forward
    series must be out at every column after its own through ``t``, and at ``t`` no more than twice as far
    out as it was: a γ written and kept stays where it was put."""
    c0 = view.col_of.get(a.step)
    if c0 is None or c0 >= t:
        return False
    if a.stage == "update":
        return all(_still_out(view, a, c) for c in range(c0 + 1, t))
    if not all(_still_out(view, a, c) for c in range(c0 + 1, t + 1)):
        return False
    r = view.row_of.get((a.stage, a.layer, a.site, a.head, a.metric))
    if r is None or a.metric in COUNT:
        return r is not None
    v, was = view.s.values[r, t], a.value
    if not (math.isfinite(v) and math.isfinite(was)):
        return True
    if _downward(a):
        return v >= was / 2
    return abs(v) <= 2 * abs(was)


def _still_out(view: RunView, a: Anomaly, t: int) -> bool:
    """Is ``a``'s series still out of its range at column ``t``?"""
    key = (a.stage, a.layer, a.site, a.head, a.metric)
    r = view.row_of.get(key)
    if r is None or a.sample_ids is not None:
        return False
    v = view.s.values[r, t]
    if a.metric in COUNT:
        return bool(v > 0)
    if not math.isfinite(v):
        return not math.isnan(v)
    if _downward(a):
        return bool(v <= 0 or view.down[r, t] >= view.loc_threshold)
    return bool(a.metric in DIRECTIONS and view.up[r, t] >= view.loc_threshold)


def _own_anomaly(view: RunView, trig: Trigger) -> Anomaly | None:
    """The incident's own series as an anomaly (the cause when nothing earlier in the chain left its range)."""
    step = int(view.s.steps[trig.t])
    if trig.key is None:  # the global gradient norm, or non-finite values: their series speak for them
        if trig.kind != "grad_spike":
            return None
        grads = [i for i, k in enumerate(view.s.keys) if k[0] == "grad" and k[4] == "rms"]
        return Anomaly(step, "grad", None, None, "grad_norm", trig.value, trig.baseline, trig.evidence,
                       next_check("grad", "rms", None, "all layers", None, None), site="all layers",
                       score=trig.score, order=(step, min(view.s.order[i][0] for i in grads), 9, -1))
    stage, layer, site, head, metric = trig.key
    r = view.row_of.get(trig.key)
    order = (step, *view.s.order[r]) if r is not None else (step, math.inf, 9, -1)
    metric = {"lr_jump": "lr", "weights_written": "written"}.get(trig.kind, metric)
    return Anomaly(step, stage, layer, head, metric, trig.value,
                   trig.baseline, trig.evidence, next_check(stage, metric, layer, site, head, trig.sample_ids),
                   site=site, sample_ids=trig.sample_ids, score=trig.score, order=order)



def _loss_samples(view: RunView, t: int) -> tuple[list | None, str]:
    """The samples that carry a loss spike at column ``t`` (far above their batch against the recent steps'
    spread), and the evidence."""
    vals = view.sample_losses()
    ids, z, ratio = view.sample_outliers(t, vals, view.loc_threshold)
    if ids is None:
        return None, ""
    sids = sample_ids_of(view.records[t], ids)
    return sids, f"; samples {sids} carry it (up to ×{sig(float(np.max(ratio)))} their batch's median loss)"


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
                                             f"({cause.metric} = {fmt(cause.value)})", order=cause.order)


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
                                           f"{top.evidence}", next_check=next_check(stage, metric, layer, site, None,
                                                                                     None),
                                           order=top.order[:-1] + (-1,)))
        else:
            out.extend(members)
    return out


#: localization's rules: each metric judged in the directions where its move is a failure
LOCALIZATION_RULES = tuple(
    Rule(f"departure: {metric}", "localization", f"every `{metric}` series, at each of the `lookback` recorded steps "
         "before an incident and at its step", " and ".join(directions),
         "`z` robust σ of its own spread, raised for the series × directions × steps judged"
         + ("; a series that falls to exactly 0 after positive values" if "down" in directions else ""),
         "a departure; the earliest link of the chain that can reach the incident is its cause")
    for metric, directions in DIRECTIONS.items()) + (
    Rule("departure: counts", "localization", "counts of non-finite values, masked rows and masked samples",
         "appears", "always: a count above 0 after recorded steps at 0", "a departure at its place"),
    Rule("departure: samples", "localization", "each sample's input RMS, max |x| and non-finite count at the data "
         "stage", "up", "`z` robust σ of the recent steps' samples", "the samples' ids"),
)
