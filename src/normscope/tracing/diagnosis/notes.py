"""Notes: what was seen and judged not to be an incident, each with why — a loss spike carried by hard samples
whose inputs are in range, an unusual input that hurt nothing, a sustained rise that nothing recorded explains."""

from __future__ import annotations

import math

import numpy as np

from ...report.numbers import sig
from .incidents import COLLAPSE_HOLD, Trigger, held_changes
from .localize import departures_in
from .rules import Rule
from .series import RunView, fmt, sample_ids_of, unusual

#: sustained rises of the activations, held and measured like a collapse: a note with its place where no incident,
#: weight write or unusual input explains it (a sublayer's output ×5 from one step on, that a pre-norm stream and
#: the loss absorb)
RISES = tuple((stage, "rms", "up", f"the {stage.replace('_', ' ')} RMS") for stage in
              ("layer_input", "norm_input", "sublayer_output", "residual_sum"))


def hard_samples(view: RunView, triggers: list[Trigger]) -> list[Trigger]:
    """Loss spikes carried by a few samples whose inputs are in range are notes, not incidents.

    Late in a classifier's training most samples' losses are near 0 and a batch that holds one the model has
    not learned yet (a hard or mislabelled example) has a loss ×2–4 its trend, that sample ×10–30 its batch's
    median (a fine-tuned MiniLM, measured): what such a sample looks like, and the loss alone cannot tell it
    from a corrupt label. A corrupt input is another matter: its own per-sample statistics at the data stage
    leave their range, and the spike stays an incident. A spike is carried by its samples when the batch's
    loss without them is back within its range."""
    vals = view.sample_losses()
    n = sum(v.size for v in vals if v is not None)
    if not n:
        return triggers
    thr = view.threshold(n)
    kept = []
    for trig in triggers:
        if trig.kind != "loss_spike":
            kept.append(trig)
            continue
        idx, _, ratio = view.sample_outliers(trig.t, vals, thr)
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
        ids = sample_ids_of(view.records[trig.t], idx)
        if view.inputs_out_of_range(trig.t, ids):
            kept.append(trig)
            continue
        step = int(view.s.steps[trig.t])
        if step in view.notes:  # the batch's spike and its samples' are one note
            continue
        who = (f"samples {', '.join(map(str, ids))} at up to" if len(ids) > 1 else f"sample {ids[0]} at")
        view.notes[step] = (
            f"step {step}: {who} ×{sig(float(np.max(ratio)))} the batch's median loss ({fmt(float(np.max(v[idx])))}"
            f" against {fmt(float(np.median(v)))}) with inputs in range"
            + (f"; the batch's loss {fmt(trig.value)} (×{sig(trig.value / trig.baseline)} its trend) is back in "
               f"range without {'them' if len(ids) > 1 else 'it'}" if trig.sample_ids is None else "")
            + ": a hard or mislabelled example, not an incident")
    return kept


def unusual_inputs(view: RunView, explained: set[int], rewritten: set[int] = frozenset()) -> None:
    """Notes for samples whose input statistics (RMS or max |x| at the data stage) sit ``sample_factor`` times
    above the recent samples' median and far outside their spread, at steps no incident explains: no
    incident, but a user should know (a ViT image replaced by noise ×100 while the model was still at chance
    level: no loss could move). Each note also says what moved downstream at its step. Not where every sample
    of the batch moved within ``window`` steps after an incident that rewrote parameters (``rewritten``: a
    learning rate ×1000 rewrites the embedding table, and the embedded inputs of the next ten steps each read
    as a whole batch of corrupt inputs)."""
    if not any(r.get("samples") for r in view.records):
        return
    view.scores()
    factor = view.factors["sample"]
    for t in range(view.T):
        step = int(view.s.steps[t])
        if t in explained or step in view.notes:
            continue
        batch = view.batch_size(t) if any(t - view.window <= c < t for c in rewritten) else None
        for a in view.sample_departures(t, t):
            if batch and len(a.sample_ids or ()) >= batch:
                continue
            if unusual(a, factor):
                who = f"sample {a.sample_ids[0]}" if len(a.sample_ids or ()) == 1 else f"samples {a.sample_ids}"
                view.notes[step] = (f"step {step}: {who}: input ({a.site}) {a.metric} up to {fmt(a.value)}, "
                                    f"×{sig(a.value / a.baseline)} the recent samples' median {fmt(a.baseline)}, "
                                    f"{_downstream(view, t)}: an unusual or corrupt input, not an incident")
                break


def _downstream(view: RunView, t: int) -> str:
    """What the forward did after an unusual input at column ``t``, as the note states it: the series past the
    data stage that left their range there (a BatchNorm spreads one sample's input over the whole batch), or
    that none did."""
    moved = [a for a in departures_in(view, t, t) if a.stage not in ("data", "loss") and a.sample_ids is None]
    if not moved:
        return "while nothing downstream left its range"
    top = max(moved, key=lambda a: a.score)
    return (f"and {len(moved)} series downstream left their range at this step (the furthest out of its range: "
            f"{top.where()} · {top.evidence})")


def sustained_rises(view: RunView, explained: set[int]) -> None:
    """Notes for :data:`RISES` at columns no incident explains (``explained``) and without an unusual input:
    a series that stepped up and stayed there, which nothing recorded accounts for."""
    for trig in held_changes(view, RISES, "rise")[0]:
        step = int(view.s.steps[trig.t])
        if any(abs(trig.t - c) <= view.lookback for c in explained) or step in view.notes:
            continue
        if view.unusual_input_at(trig.t):
            continue
        view.notes[step] = (f"step {step}: {trig.evidence}; no weight write, update spike or unusual input "
                            "explains it and the loss absorbed it: a change in the forward itself (a module's code "
                            "or a hook), not an incident")


#: the notes' rules
NOTE_RULES = (
    Rule("hard_samples", "note", "a loss spike's samples: their per-sample losses and their inputs' statistics",
         "up", "the batch's loss back in range without them, and their inputs in range",
         "the samples' ids: a hard or mislabelled example, not an incident"),
    Rule("unusual_input", "note", "each sample's input RMS and max |x| at the data stage", "up",
         "`sample_factor` × the recent samples' median and `z` robust σ of their spread, at a step no incident "
         "explains", "the samples, and what moved downstream at that step"),
    Rule("sustained_rise", "note", "; ".join(f"{what} ({stage})" for stage, _, _, what in RISES), "up",
         f"as `collapse`: out of range for {COLLAPSE_HOLD} recorded steps beyond its spread and its volatility, at a "
         "step no incident, weight write or unusual input explains", "its place: a change in the forward itself"),
)
