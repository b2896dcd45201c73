"""Incidents: what a user would call a problem, each found by a rule of :data:`INCIDENT_RULES`. A rule's finder reads
the run's series (:class:`.RunView`) and returns a :class:`Trigger` at each column where its series crosses its
threshold; at one step the first kind in the table's order is the incident and the later ones its symptoms."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...report.numbers import sig
from ..store import is_number
from ..trend import fit, log_values
from .rules import Rule
from .series import CONTEXT, COUNT, RunView, fmt, group_name, sample_ids_of, where_of

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

#: collapses, an incident however little the loss moved: (stage, metric, direction, what collapses); a series that
#: leaves its range this way and stays out for ``COLLAPSE_HOLD`` recorded steps
COLLAPSES = (("layer_input", "rms", "down", "the residual stream's RMS"),
             ("residual_sum", "rms", "down", "the residual stream's RMS"),
             ("norm_output", "scale_rms", "down", "a norm's scale γ"),
             ("grad", "rms", "down", "a layer's gradients"),
             ("attention_logits", "entropy", "up", "an attention head's focus (its entropy rising to uniform)"),
             ("attention_logits", "focus", "down", "an attention head's focus (its distance from uniform attention)"))
COLLAPSE_HOLD = 3
# a collapse of these metrics is judged only from at least this level: a head within 0.05 nats of uniform attention
# (a fresh model's, a character model's early on) has no focus to lose, and its focus is float noise (clean ViT and
# Llama runs: ÷2 moves of a 5e-4 focus)
COLLAPSE_FROM = {"focus": 0.05}
# and beyond its own volatility: a collapse moves a series at least this many times the largest one-step move of the
# window before it (a clean run's gradients move ÷1.6 in one step during warm-up), and at least ×2 either way
COLLAPSE_OVER_VOLATILITY, COLLAPSE_LEAST = 3.0, math.log(2.0)


@dataclasses.dataclass
class Trigger:
    t: int  # column
    kind: str
    metric: str
    value: float
    baseline: float | None
    evidence: str
    key: tuple | None  # the incident series' own row key, the cause when nothing before it left its range
    sample_ids: list | None = None
    score: float = math.inf


def _lr_jump_triggers(jumps: list[tuple], groups: int) -> list[Trigger]:
    """One ``lr_jump`` per step and factor from the groups' jumps ``(column, key, lr, highest before, update
    ratio)``: several groups jumping at one step by one factor are one jump (a schedule or an ``lr`` set for the
    whole optimizer is not a jump of its first group's)."""
    out: list[Trigger] = []
    by_step: dict[int, list[tuple]] = {}
    for j in jumps:
        by_step.setdefault(j[0], []).append(j)
    for same in by_step.values():
        while same:
            t, key, lr, highest, ratio = same[0]
            alike = [j for j in same if math.isclose(j[2] / j[3], lr / highest, rel_tol=1e-3)]
            same = [j for j in same if j not in alike]
            who = group_name(key)
            if len(alike) > 1:
                # the traced groups are the tracer's own (per block and sublayer), not the optimizer's
                who = (f"the parameters of every traced layer and module ({len(alike)})" if len(alike) == groups else
                       f"the parameters of {len(alike)} of the {groups} traced layers and modules "
                       f"({', '.join(group_name(j[1]) for j in alike)})") + f" ({who} shown)"
            out.append(Trigger(t, "lr_jump", "lr", lr, highest,
                                f"learning rate {fmt(lr)} for {who} is ×{sig(lr / highest)} the highest its schedule "
                                f"reached before ({fmt(highest)}); update ratio {fmt(ratio)}", key))
    return out


def _largest_before(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column t: the largest finite value of ``row`` over the columns before t (-inf where none) and how many
    finite values there were — running values, one pass for a whole run."""
    finite = np.isfinite(row)
    running = np.maximum.accumulate(np.where(finite, row, -np.inf)) if row.size else row
    largest = np.concatenate(([-np.inf], running[:-1]))[:row.size]
    count = np.concatenate(([0], np.cumsum(finite)[:-1]))[:row.size]
    return largest, count


# ---------------------------------------------------------------------- the finders, one per rule (or group of rules)
def find_nonfinite(view: RunView) -> list[Trigger]:
    """A non-finite value anywhere (a series, a count of them, a per-sample value) after a column without."""
    s, T = view.s, view.T
    out: list[Trigger] = []
    bad_prev = False
    for t in range(T):
        col = s.values[:, t]
        bad_rows = [i for i, k in enumerate(s.keys) if k[4] not in COUNT and k[4] not in CONTEXT
                    and not math.isnan(col[i]) and not math.isfinite(col[i])]
        counts = [i for i, k in enumerate(s.keys) if k[4] == "nonfinite" and col[i] > 0]
        sample_bad = len(view.sample_nonfinite(t))
        bad = bool(bad_rows or counts or sample_bad)
        if bad and not bad_prev:
            n = len(set(bad_rows) | set(counts))
            where = f"{n} series" + (f" and {sample_bad} sample{'s' if sample_bad > 1 else ''}" if sample_bad
                                     else "")
            out.append(Trigger(t, "nonfinite", "nonfinite", math.nan, 0.0, f"non-finite values in {where}", None))
        bad_prev = bad
    return out


def find_masked(view: RunView) -> list[Trigger]:
    """Fully masked query rows, or samples whose every query row is masked, in a series that had none before
    (where padding queries are masked as well as padding keys, DeBERTa's, a head has masked rows at every step: a
    fully masked sample is new)."""
    s, T = view.s, view.T
    out: list[Trigger] = []
    masked = view.rows(lambda k: k[4] in ("masked_rows", "masked_samples"))
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
                    out.append(Trigger(t, "masked_rows", k[4], float(row[t]), 0.0,
                                        f"{n} {what} at layer {k[1]} after {fin.size} recorded steps with none", k))
                    break
    return out


def find_trend_spikes(view: RunView) -> list[Trigger]:
    """Upward departures from their trends of the loss, the global gradient norm and each group's update ratio
    per unit of learning rate (the update gated by its largest parameter step), judged together: one threshold for
    all of them."""
    s, T = view.s, view.T
    judged: list[tuple[str, str, np.ndarray, tuple | None]] = []
    loss = view.rows(lambda k: k[0] == "loss" and k[4] == "loss")
    if loss:
        judged.append(("loss_spike", "loss", s.values[loss[0]], s.keys[loss[0]]))
    grads = view.rows(lambda k: k[0] == "grad" and k[4] == "rms")
    if grads:
        total = np.full(T, np.nan)
        for t, rec in enumerate(view.records):
            ss = [e["sumsq"] for e in rec["entries"] if e["stage"] == "grad"]
            if ss:
                total[t] = math.sqrt(sum(ss))
        judged.append(("grad_spike", "grad_norm", total, None))
    gates: dict[int, np.ndarray] = {}
    for r in view.rows(lambda k: k[0] == "update" and k[4] == "ratio"):
        k = s.keys[r]
        lr = view.context_row(k, "lr")
        ratio = s.values[r]
        per_lr = np.where(np.isfinite(lr) & (lr > 0), ratio / np.where(lr > 0, lr, 1.0), ratio)
        gates[len(judged)] = _step_beyond_recent(view, view.context_row(k, "step_lr"))
        judged.append(("update_spike", "ratio", per_lr, k))
    if not judged:
        return []
    return _spikes(view, judged, view.threshold(len(judged) * T), gates)


def find_lr_jumps(view: RunView) -> list[Trigger]:
    """Groups whose learning rate passes ``lr_jump`` × the highest it reached before (several groups at one step
    by one factor: one jump)."""
    jumps: list[tuple] = []
    groups = view.rows(lambda k: k[0] == "update" and k[4] == "ratio")
    for r in groups:
        k = view.s.keys[r]
        lr = view.context_row(k, "lr")
        if np.isfinite(lr).any():
            jumps.extend(_lr_jumps(view, k, lr, view.s.values[r]))
    return _lr_jump_triggers(jumps, len(groups))


def find_weights_written(view: RunView) -> list[Trigger]:
    """Parameter groups whose size changed between two consecutive recorded steps by more than that step's
    update can explain: ‖w_t‖ − ‖w_{t−1}‖ ≤ ‖Δ_update‖ + ‖e‖ for a write e made outside the optimizer step (a
    checkpoint merged into the live model, an initialisation by name run again, a manual edit). The
    forward that follows may absorb it (a pre-norm stream, a loss that does not move): it is an incident on its
    own, the group its place. Recorded steps that are not consecutive (``every`` > 1) are not judged."""
    out = []
    steps = view.s.steps
    for key, (sizes, moves) in _update_rows(view).items():
        largest = 0.0
        for t in range(1, view.T):
            if int(steps[t]) != int(steps[t - 1]) + 1:
                continue
            before, after, move = sizes[t - 1], sizes[t], moves[t]
            if not (math.isfinite(before) and math.isfinite(after) and math.isfinite(move) and before > 0):
                continue
            excess = (abs(after - before) - move) / before
            if excess >= max(WRITE_FLOOR, WRITE_FACTOR * largest):
                factor = after / before
                change = f"×{sig(factor)}" if factor >= 1 else f"÷{sig(1 / factor) if factor > 0 else '∞'}"
                out.append(Trigger(t, "weights_written", "written", float(after), float(before),
                                    f"the parameters of {group_name(key)} changed {change} in size (‖w‖ "
                                    f"{fmt(before)} → {fmt(after)}) while the optimizer's update at this step "
                                    f"moved them by {fmt(move)}: written outside the optimizer step by at "
                                    f"least {sig(excess)} of their size (a checkpoint merge, an initialisation "
                                    "by name, a manual edit)", key, score=math.inf))
                break
            largest = max(largest, excess)
    return out


def find_collapses(view: RunView) -> list[Trigger]:
    """Series of :data:`COLLAPSES` that leave their range in their failure direction and stay out for
    ``COLLAPSE_HOLD`` recorded steps, each judged against its own trend before the change (its own spread sets
    the threshold, raised for the number of series and steps judged): the stream shrinking, γ written to 0,
    gradients vanishing, a head going uniform. The loss may not move (a layer that stops contributing). One that
    begins too near the run's end to have held yet is kept on the view (``pending_collapses``): undecided."""
    found, view.pending_collapses = held_changes(view, COLLAPSES, "collapse")
    return found


def held_changes(view: RunView, table, kind: str) -> tuple[list[Trigger], list[Trigger]]:
    """The first change of each series of ``table`` ((stage, metric, direction, what) rows) that leaves its
    range in its direction and stays out for ``COLLAPSE_HOLD`` columns, each against the trend of the window
    before it (all series fitted at once per column; the volatility test only where the trend test holds); and,
    apart, the changes that begin in the run's last ``COLLAPSE_HOLD`` − 1 columns and stay out to its end: too
    few steps recorded after them to tell a held change from a passing one."""
    rules = {(stage, metric): (direction, what) for stage, metric, direction, what in table}
    rows = [r for r, k in enumerate(view.s.keys) if (k[0], k[4]) in rules]
    if not rows or view.T <= view.min_history + COLLAPSE_HOLD:
        return [], []
    thr = view.threshold(len(rows) * view.T)
    values = view.s.values[rows]
    y = log_values(values)
    zero = np.isfinite(values) & (values <= 0)
    down = np.array([rules[(view.s.keys[r][0], view.s.keys[r][4])][0] == "down" for r in rows])
    least_level = np.log([COLLAPSE_FROM.get(view.s.keys[r][4], 0.0) or np.nan for r in rows])  # NaN: none
    found: dict[int, Trigger] = {}
    pending: dict[int, Trigger] = {}
    for t in range(view.min_history, view.T):
        open_rows = np.array([i not in found and i not in pending for i in range(len(rows))])
        if not open_rows.any():
            break
        f = fit(y[:, max(0, t - view.window):t], view.min_history, view.floor)
        held = y[:, t:t + COLLAPSE_HOLD]
        z_down, base_down = f.down(held.T)
        z_up, base_up = f.up(held.T)
        z, base = np.where(down, z_down, z_up).T, np.where(down, base_down, base_up)  # base: one per series
        gone = zero[:, t:t + COLLAPSE_HOLD] & down[:, None]
        with np.errstate(invalid="ignore"):
            beyond = gone | (np.isfinite(z) & (z >= thr))
        with np.errstate(invalid="ignore"):
            judged = f.ok & ~(base < least_level)  # NaN (no least level) compares false: judged
        for i in np.flatnonzero(open_rows & judged & beyond.all(axis=1)):
            past = y[i, max(0, t - view.window):t]
            steps = np.abs(np.diff(past[np.isfinite(past)]))
            least = max(COLLAPSE_LEAST, COLLAPSE_OVER_VOLATILITY * (float(steps.max()) if steps.size else 0.0))
            with np.errstate(invalid="ignore"):
                moved = np.abs(held[i] - base[i]) >= least
            if not np.all(gone[i] | (np.isfinite(z[i]) & (z[i] >= thr) & moved)):
                continue
            r = rows[i]
            key = view.s.keys[r]
            direction, what = rules[(key[0], key[4])]
            b, v = math.exp(float(base[i])), float(view.s.values[r, t])
            change = (f"×{sig(v / b)}" if direction == "up" else f"÷{sig(b / v)}" if v > 0 else "to 0")
            if held.shape[1] < COLLAPSE_HOLD:
                pending[i] = Trigger(t, kind, key[4], v, b,
                                     f"{what} ({where_of(key)}): {key[4]} {fmt(v)} from its trend {fmt(b)} ({change})"
                                     f" at step {int(view.s.steps[t])}, out of its range in the {held.shape[1]} "
                                     f"recorded step(s) the run has from there", key)
                continue
            found[i] = Trigger(t, kind, key[4], v, b,
                                f"{what} ({where_of(key)}): {key[4]} {fmt(v)} from its trend {fmt(b)} ({change}) "
                                f"and out of its range for the {COLLAPSE_HOLD} recorded steps from here (threshold "
                                f"{thr:.1f} robust σ of its own spread, and ×{sig(math.exp(least))} either way: "
                                f"{COLLAPSE_OVER_VOLATILITY:g} × its largest one-step move before)", key,
                                score=math.inf if gone[i, 0] else float(z[i, 0]))
    return [found[i] for i in sorted(found)], [pending[i] for i in sorted(pending)]


def _update_rows(view: RunView) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """Per update group (its ``ratio`` row's key): its parameters' norm after each recorded step and the norm
    of that step's update (NaN where not recorded)."""
    index = {(k[1], k[2]): k for k in view.s.keys if k[0] == "update" and k[4] == "ratio"}
    out: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for t, rec in enumerate(view.records):
        for e in rec["entries"]:
            key = index.get((e["layer"], e["site"])) if e["stage"] == "update" else None
            if key is None or not (is_number(e.get("param_sumsq")) and is_number(e.get("sumsq"))):
                continue
            sizes, moves = out.setdefault(key, (np.full(view.T, np.nan), np.full(view.T, np.nan)))
            sizes[t], moves[t] = math.sqrt(e["param_sumsq"]), math.sqrt(e["sumsq"])
    return out


def find_danger_jumps(view: RunView) -> list[Trigger]:
    """Series that jump at least ``DANGER_JUMP`` × the step before in one step, landing past their danger level
    or within ``DANGER_JUMP`` of it: a γ written ×50, a query projection scaled ×30 (one head's max logit 0.77 →
    24.9, its entropy 3.1 → 1.4). Clean runs move these series a few % a step, never like this."""
    out = []
    for r, key in enumerate(view.s.keys):
        d = view.danger_of(key)
        if d is None:
            continue
        what, danger = d
        row = view.s.values[r]
        stream = what == "residual stream RMS"
        for t in range(1, view.T):
            a, b = row[t - 1], row[t]
            if stream and _stream_leaps(view, row, t):
                out.append(Trigger(t, "danger_jump", key[4], float(b), float(a),
                                    f"{what} ({where_of(key)}) {fmt(b)} from {fmt(a)} the step before (×{sig(b / a)}"
                                    f"), ×{STREAM_JUMP:g} or more the largest of the {view.window} steps before "
                                    f"in one step (its danger level is {fmt(danger)})", key))
                break
            if (math.isfinite(a) and math.isfinite(b) and 0 <= a < danger and b >= danger / DANGER_JUMP
                    and b >= DANGER_JUMP * a):
                out.append(Trigger(t, "danger_jump", key[4], float(b), float(a),
                                    f"{what} ({where_of(key)}) {fmt(b)} from {fmt(a)} the step before (×{sig(b / a)}), "
                                    + (f"past the danger level {fmt(danger)} in one step" if b >= danger else
                                       f"in one step, within ×{sig(danger / b, 2)} of the danger level "
                                       f"{fmt(danger)}"), key))
                break
    if "logit" in view.dangers:
        out.extend(_entropy_collapses(view))
    return out


def _stream_leaps(view: RunView, row: np.ndarray, t: int) -> bool:
    """Does the stream's RMS at column ``t`` reach ``STREAM_JUMP`` × the largest of the ``window`` columns
    before it (at least ``min_history`` of them recorded)? Its danger level is absolute, and a stream of RMS 0.4
    that leaps ×270 to 100 stays under it while a sublayer's output ×1000 passes through (loss 3.0 → 4.5)."""
    past = row[max(0, t - view.window):t]
    past = past[np.isfinite(past)]
    b = row[t]
    return bool(past.size >= view.min_history and math.isfinite(b) and past.max() > 0
                and b >= STREAM_JUMP * past.max() and not view.unusual_input_at(t))


def _entropy_collapses(view: RunView) -> list[Trigger]:
    """Heads whose mean softmax entropy falls ≥ ``DANGER_JUMP`` × in one step into the collapse regime (≤
    ``ENTROPY_COLLAPSE``): a query head scaled ×30 where a positional bias already puts the logits past their
    danger level (BLOOM's ALiBi: max logit 66 → 229, entropy 1.15 → 0.06), so the logits cannot jump into it."""
    out = []
    for r, key in enumerate(view.s.keys):
        if key[4] != "entropy":
            continue
        row = view.s.values[r]
        for t in range(1, view.T):
            a, b = row[t - 1], row[t]
            if (math.isfinite(a) and math.isfinite(b) and a > ENTROPY_COLLAPSE and 0 <= b <= ENTROPY_COLLAPSE
                    and b * DANGER_JUMP <= a):
                out.append(Trigger(t, "danger_jump", "entropy", float(b), float(a),
                                    f"attention entropy ({where_of(key)}) {fmt(b)} nats from {fmt(a)} the step before "
                                    f"(÷{sig(a / max(b, 1e-12))}): collapsed onto one or two keys in one step",
                                    key))
                break
    return out


def find_sample_spikes(view: RunView) -> list[Trigger]:
    """Steps where single samples' losses sit far above the rest of their batch, beyond the recent steps' spread
    of the same ratio and at least ``sample_factor`` times the batch's median (a corrupt sample hurts its own
    loss long before it moves the mean)."""
    vals = view.sample_losses()
    n = sum(v.size for v in vals if v is not None)
    if not n:
        return []
    thr, factor = view.threshold(n), view.factors["sample"]
    out = []
    for t in range(view.T):
        ids, z, ratio = view.sample_outliers(t, vals, thr)
        if ids is None:
            continue
        keep = [i for i, r in zip(ids, ratio, strict=True) if r >= factor]
        if keep:
            v = vals[t]
            top = max(keep, key=lambda i: v[i])
            sids = sample_ids_of(view.records[t], keep)
            med = float(np.median(v[np.isfinite(v)]))
            out.append(Trigger(t, "loss_spike", "loss", float(v[top]), med,
                                f"per-sample loss {fmt(v[top])} of sample {sids[keep.index(top)]} is "
                                f"×{sig(v[top] / med)} its batch's median {fmt(med)} (+{z[top]:.1f} robust σ "
                                f"over the recent steps' spread; thresholds {thr:.1f} and ×{factor:g}); "
                                f"{len(keep)} of {v.size} samples", ("loss", None, "", None, "loss"),
                                sample_ids=sids, score=float(z[top])))
    return out


def _step_beyond_recent(view: RunView, step_lr: np.ndarray) -> np.ndarray:
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
    allowed = np.ones(view.T, bool)
    allowed[judged] = step_lr[judged] >= view.factors["update_spike"] * largest[judged]
    return allowed


def _lr_jumps(view: RunView, key, lr, ratio) -> list[tuple]:
    """The first step where group ``key``'s learning rate passes ``lr_jump`` × the highest before it, as
    ``(column, key, lr, highest before, update ratio)`` (none or one)."""
    for t in range(view.min_history, view.T):
        before = lr[:t][np.isfinite(lr[:t])]
        if before.size >= view.min_history and np.isfinite(lr[t]) and lr[t] > view.lr_jump * before.max() > 0:
            return [(t, key, float(lr[t]), float(before.max()), float(ratio[t]))]
    return []


def _spikes(view: RunView, judged, thr, gates: dict[int, np.ndarray] | None = None) -> list[Trigger]:
    """Upward departures of the judged series from their trends (all series at once, step by step), the
    flagged values kept out of later baselines; a series reports the first step of each run of departures.
    ``gates``: per judged row, the columns where it may be called at all (others judged as usual)."""
    y = log_values(np.array([series for _, _, series, _ in judged], float))
    allowed = np.ones(y.shape, bool)
    for r, gate in (gates or {}).items():
        allowed[r] = gate
    hist = y.copy()
    factors = np.log(np.array([view.factors.get(kind, 1.0) for kind, _, _, _ in judged], float))
    out: list[Trigger] = []
    prev = np.zeros(len(judged), bool)
    for t in range(1, view.T):
        f = fit(hist[:, max(0, t - view.window):t], view.min_history, view.floor)
        z, base = f.up(y[:, t])
        with np.errstate(invalid="ignore"):
            hit = np.isfinite(z) & (z >= thr) & (y[:, t] - base >= factors) & allowed[:, t]
        hist[hit, t] = np.nan
        for r in np.flatnonzero(hit & ~prev):
            kind, metric, series, key = judged[r]
            factor = view.factors.get(kind, 1.0)
            what = {"loss_spike": "loss", "grad_spike": "global gradient norm",
                    "update_spike": f"update ratio per unit of learning rate, {group_name(key)}"}[kind]
            b = math.exp(base[r])
            out.append(Trigger(t, kind, metric, float(series[t]), b,
                                f"{what} {fmt(series[t])} vs its trend {fmt(b)} (×{sig(series[t] / b)}, "
                                f"+{z[r]:.1f} robust σ; threshold {thr:.1f}"
                                + (f" and ×{factor:g})" if factor > 1 else ")")
                                + (_step_evidence(view, key, t) if kind == "update_spike" else ""), key,
                                score=float(z[r])))
        prev = hit
    return out


def _step_evidence(view: RunView, key: tuple, t: int) -> str:
    step = view.context_row(key, "step_lr")
    largest, count = _largest_before(step)
    if not count[t] or not math.isfinite(step[t]):
        return ""
    return (f"; its largest parameter step {fmt(step[t])} learning rates, ×{sig(step[t] / max(largest[t], 1e-300))}"
            f" the largest of the {count[t]} steps before")


# ---------------------------------------------------------------------- the rules
_Z = "`z` robust σ of its own spread, raised for the series × steps judged (`false_alarms` expected in a clean run)"
#: every incident rule, in priority order: at one step the first kind is the incident and the later ones its symptoms
#: (a write of the weights is the incident only where nothing it caused is: a change the forward and the loss absorbed)
INCIDENT_RULES = (
    Rule("nonfinite", "incident", "every series (activations, logits, loss, gradients, updates) and per-sample value",
         "non-finite", "always: a NaN/inf after a recorded step without",
         "the step, and the first link holding a non-finite value", find_nonfinite),
    Rule("masked_rows", "incident", "each head's count of fully masked query rows, and of samples whose every query "
         "row is masked (`masked_samples`)", "appears", "always: after recorded steps with none",
         "the layer and the samples", find_masked),
    Rule("danger_jump", "incident", "a head's max attention logit, a norm's γ RMS, the stream's RMS (a block's input, "
         "a residual sum no block reads)", "up",
         f"×{DANGER_JUMP:g} its value the step before in one step, landing past its danger level (`logit_danger`, "
         f"`scale_danger`, `stream_danger`) or within "
         f"×{DANGER_JUMP:g} of it; the stream also at ×{STREAM_JUMP:g} the largest of its `window` steps before, at "
         "any level, unless a sample's input leapt with it", "the series and its place", find_danger_jumps),
    Rule("danger_jump", "incident", "a head's mean softmax entropy (where the logits have a danger level)", "down",
         f"÷{DANGER_JUMP:g} in one step to ≤ {ENTROPY_COLLAPSE:g} nats", "the head", find_danger_jumps),
    Rule("collapse", "incident", "; ".join(f"{what} ({stage} {metric})" for stage, metric, _, what in COLLAPSES),
         "down (entropy: up)", f"out of range for {COLLAPSE_HOLD} recorded steps: {_Z}, and ≥ "
         f"{COLLAPSE_OVER_VOLATILITY:g} × its largest one-step move before (×2 at least); a focus from "
         f"≥ {COLLAPSE_FROM['focus']:g} nats only",
         "the series and its place; the loss need not move", find_collapses),
    Rule("loss_spike", "incident", "the log of the step's loss against its trend", "up", _Z,
         "the first link that left its range before it", find_trend_spikes),
    Rule("loss_spike", "incident", "each sample's log-loss minus its batch's median, against the recent steps' spread",
         "up", f"{_Z}; and ≥ `sample_factor` × the batch's median", "the samples' ids", find_sample_spikes),
    Rule("grad_spike", "incident", "the log of the global gradient norm against its trend", "up",
         f"{_Z}; and ≥ `grad_factor` × its trend", "the first link that left its range", find_trend_spikes),
    Rule("update_spike", "incident", "each group's update ratio RMS(Δw)/RMS(w) divided by its learning rate, and its "
         "largest parameter step in learning rates", "up", f"{_Z}; and ≥ `update_factor` × its trend, its largest "
         "step ≥ `update_factor` × every step before", "the parameter group", find_trend_spikes),
    Rule("lr_jump", "incident", "each group's recorded learning rate", "up",
         "above `lr_jump` × the highest it reached before", "the groups that jumped (one jump for a common factor)",
         find_lr_jumps),
    Rule("weights_written", "incident", "each group's ‖w‖ between consecutive recorded steps, against the norm of "
         "that step's update", "both", f"a change beyond the update of ≥ {WRITE_FLOOR:.0%} of ‖w‖ and "
         f"≥ {WRITE_FACTOR:g} × the largest such change before (not judged where `every` > 1)",
         "the group, placed where its weights act", find_weights_written),
)
INCIDENT_KINDS = tuple(dict.fromkeys(r.name for r in INCIDENT_RULES))


def triggers(view: RunView) -> list[Trigger]:
    """Every rule's triggers, each finder run once (rules that share a finder share its threshold), ordered by
    column and, within one, by the table's order of their kinds."""
    out: list[Trigger] = []
    for find in dict.fromkeys(r.find for r in INCIDENT_RULES):
        out.extend(find(view))
    kinds = list(dict.fromkeys(r.name for r in INCIDENT_RULES))
    return sorted(out, key=lambda tr: (tr.t, kinds.index(tr.kind)))
