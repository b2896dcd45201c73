"""Drifts: series growing step after step towards a level where they become dangerous (attention logits, a norm's
scale γ, the residual stream), with their slope; flagged when they crossed it or, at their slope, will within as many
steps as the run has recorded. Never an incident's cause."""

from __future__ import annotations

import math

import numpy as np

from ...report.numbers import sig
from ..trend import fit, log_values
from .incidents import ENTROPY_COLLAPSE
from .results import Drift
from .rules import Rule
from .series import RunView, fmt


def drifts(view: RunView) -> list[Drift]:
    s, T = view.s, view.T
    if T < view.min_history + 1:
        return []
    out = []
    horizon = max(T, 1)
    w = min(view.window, T)
    for r, key in enumerate(s.keys):
        stage, layer, site, head, metric = key
        d = view.danger_of(key)
        if d is None:
            continue
        what, danger = d
        v = float(s.values[r, -1])
        if not math.isfinite(v) or v <= 0:
            continue
        y = log_values(s.values[r, T - w:])
        f = fit(y[None, :], view.min_history, view.floor / 4)
        slope, noise = (float(f.slope[0]), float(f.scale[0])) if f.ok[0] else (0.0, math.inf)
        k = max(1, w // 3)
        growing = slope > 0 and slope * (w - k) >= 3 * noise
        # a head's softmax entropy beside its max logit: the series, and its value at the last recorded step
        ent = view.context_row(key, "entropy") if metric == "max_logit" else None
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
            before = (f" (from {fmt(row[below[-1]])} the step before" if below.size
                      and math.isfinite(row[below[-1]]) else "")
            if before and ent is not None and math.isfinite(ent[below[-1]]):
                before += f", its entropy {fmt(ent[below[-1]])} nats"
            ev = (f"{what} {fmt(v)}, past the danger level {fmt(danger)} since step {since}"
                  + (before + ")" if before else "")
                  + (f"; its softmax entropy {fmt(spread)} nats (collapsed: ≤ {ENTROPY_COLLAPSE})"
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
        ev = (f"{what} {fmt(v)}, ×{sig(math.exp(slope))} per recorded step over the last {w}; "
              f"reaches the danger level {fmt(danger)} in ~{steps:.0f} recorded steps at this rate"
              + (f" (its softmax entropy now {fmt(spread)} nats; collapsed at ≤ {ENTROPY_COLLAPSE})"
                 if spread is not None else ""))
        out.append(Drift(stage, layer, site, head, metric, int(s.steps[-1]), v, slope, danger, steps,
                         "on course", ev))
    return sorted(out, key=lambda d: d.steps_to_danger)


#: the drifts' rules: each series with a danger level (the settings that set it)
DRIFT_RULES = (
    Rule("drift: attention logits", "drift", "each head's max attention logit, with its softmax entropy", "up",
         f"`logit_danger`, in the collapse regime only (its entropy ≤ {ENTROPY_COLLAPSE:g} nats)",
         "crossed, or on course: its slope and the steps left to the danger level"),
    Rule("drift: norm scale", "drift", "each norm's γ RMS", "up", "`scale_danger`",
         "crossed, or on course: its slope and the steps left to the danger level"),
    Rule("drift: residual stream", "drift", "the stream's RMS (a block's input, a residual sum no block reads)", "up",
         "`stream_danger`", "crossed, or on course: its slope and the steps left to the danger level"),
)
