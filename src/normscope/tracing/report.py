"""The console table and the self-contained HTML page of a :class:`~.diagnosis.Diagnosis`."""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from ..report.console import indented
from ..report.numbers import sig
from .diagnosis import Diagnosis, rms

MAX_ROWS = 25


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return sig(v, 4) if math.isfinite(v) else str(v)
    return str(v)


def summary_line(d: Diagnosis) -> str:
    state = "complete" if d.complete else "still being written or interrupted"
    line = (f"{d.run_dir}: {len(d.steps)} recorded steps (last {d.steps[-1] if d.steps else '—'}, every "
            f"{d.header.get('every')}, {d.header.get('model')}, {len(d.header.get('blocks') or [])} blocks, "
            f"world size {d.header.get('world_size')}), {state}")
    return line


def runs_line(d: Diagnosis) -> str | None:
    """Which run of a reused folder was judged, and the others (None for a folder that holds one run)."""
    if len(d.runs) < 2:
        return None

    def span(r: dict[str, Any]) -> str:
        if r["first_step"] is None:
            return f"run {r['run']}: no recorded step"
        return f"run {r['run']}: steps {r['first_step']}–{r['last_step']} ({r['steps_recorded']} recorded)"

    which = "the latest" if d.run == len(d.runs) else f"run {d.run} of {len(d.runs)}"
    return (f"this folder holds {len(d.runs)} training runs (a tracer opened on it again with its steps starting "
            f"over): judged {which}, {span(d.runs[d.run - 1])}; the others: "
            f"{'; '.join(span(r) for r in d.runs if r['run'] != d.run)}; pick one with --run N "
            "(diagnose(..., run=N))")


def _settings_line(d: Diagnosis) -> str:
    st = d.settings
    return (f"incident threshold ≥ {st['z']} robust σ (raised for the number of series judged), a trend over the last "
            f"{st['window']} recorded values, judged after {st['min_history']}; causes searched {st['lookback']} "
            f"recorded steps back")


def render_diagnosis(d: Diagnosis, console: Console) -> None:
    console.print(f"[dim]{summary_line(d)}[/]")
    if (runs := runs_line(d)) is not None:
        console.print(f"[yellow]{runs}[/]")
    for e in d.errors:
        console.print(f"[yellow]probe {e['probe']} was disabled at step {e['step']}: {e['error']}[/]")
    if d.damaged:
        console.print(f"[yellow]{len(d.damaged)} damaged line(s) of the trace file were skipped:[/]")
        for line in d.damaged[:10]:
            console.print(f"[yellow]  {line}[/]")
    if not d.incidents and d.undecided:
        console.print(f"[bold yellow]inconclusive[/]: no incident in {len(d.steps)} recorded steps, but not all of "
                      f"the run could be judged:")
        for why in d.undecided:
            console.print(f"[yellow]  · {why}[/]")
    elif not d.incidents:
        console.print(f"[green]no incident[/] in {len(d.steps)} recorded steps ({_settings_line(d)})")
    else:
        inc, a = d.incidents[0], d.first
        console.print(f"[bold red]incident[/] at step {inc.step}: {inc.kind} — {inc.evidence}")
        console.print(f"[bold red]first cause[/]: step {a.step} · {a.where()} · {a.metric} = {_fmt(a.value)}"
                      + (f" (baseline {_fmt(a.baseline)})" if a.baseline is not None else ""))
        indented(console, f"evidence: {a.evidence}", 2, 4)
        if a.sample_ids:
            indented(console, f"samples: {a.sample_ids}", 2, 4)
        indented(console, f"next: {a.next_check}", 2, 4)
        t = Table(title=f"{len(d.incidents)} incident(s), each with its first cause", title_justify="left")
        for col in ("step", "incident", "first cause", "value", "samples"):
            t.add_column(col, justify="right" if col in ("step", "value") else "left", overflow="fold")
        for x in d.incidents[:MAX_ROWS]:
            c = x.cause
            t.add_row(str(x.step), x.kind, f"step {c.step} · {c.where()} · {c.metric}", _fmt(c.value),
                      ", ".join(map(str, c.sample_ids[:4])) + ("…" if len(c.sample_ids) > 4 else "")
                      if c.sample_ids else "")
        console.print(t)
        if len(d.incidents) > MAX_ROWS:
            console.print(f"[dim]… {len(d.incidents) - MAX_ROWS} more (--json lists all)[/]")
        deps = [x for x in inc.departures if x is not a][:8]
        if deps:
            console.print("[dim]also left their range before the first incident (farthest first):[/]")
            for x in deps:
                indented(console, f"step {x.step} · {x.where()} · {x.evidence}", 2, 4)
    for why in d.limits:
        indented(console, f"not judged: {why}", 2, 4)
    if d.notes:
        console.print(f"[dim]{len(d.notes)} note(s): seen, and judged not to be incidents[/]")
        for x in d.notes[:MAX_ROWS]:
            indented(console, x, 2, 4)
        if len(d.notes) > MAX_ROWS:
            console.print(f"[dim]… {len(d.notes) - MAX_ROWS} more (--json lists all)[/]")
    if d.drifts:
        console.print(f"[yellow]{len(d.drifts)} drift(s)[/]: at or heading for a dangerous level, not (yet) an incident")
        for x in d.drifts[:MAX_ROWS]:
            indented(console, f"{x.status}: {x.where()} · {x.evidence}", 2, 4)
        if len(d.drifts) > MAX_ROWS:
            console.print(f"[dim]… {len(d.drifts) - MAX_ROWS} more (--json lists all)[/]")


# ---------------------------------------------------------------------- HTML
def _by_layer(d: Diagnosis, stage: str, pick) -> dict[Any, tuple[list[int], list[float]]]:
    """layer → (steps, value) with value = pick(entries of that stage and layer at a step)."""
    out: dict[Any, tuple[list[int], list[float]]] = {}
    for rec in d.records:
        groups: dict[Any, list[dict]] = {}
        for e in rec["entries"]:
            if e["stage"] == stage:
                groups.setdefault(e["layer"], []).append(e)
        for layer, es in groups.items():
            v = pick(es)
            if v is not None:
                xs, ys = out.setdefault(layer, ([], []))
                xs.append(rec["step"])
                ys.append(v)
    return out


def _rms(es) -> float | None:
    """The RMS over several entries (their sums of squares and counts pooled)."""
    return rms(sum(e["sumsq"] for e in es), sum(e["n"] for e in es))


def _figures(d: Diagnosis) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    a = d.first
    inc = d.incidents[0] if d.incidents else None
    figs = []

    from matplotlib.ticker import MaxNLocator

    def finish(fig, ax, title, log=True):
        """``log``: True for a log axis where the values span decades, "positive" wherever they are all positive
        (the loss: one spike on a linear axis flattens the rest of the run)."""
        values = [float(y) for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y)]
        if inc is not None:
            ax.axvline(inc.step, color="red", lw=1.2, ls="--", label=f"incident ({inc.kind}, step {inc.step})")
            if a is not None and a.step != inc.step:
                ax.axvline(a.step, color="darkorange", lw=1.0, ls=":", label=f"first cause (step {a.step})")
        lo, hi = ax.get_ylim()
        if log == "positive" and values and min(values) > 0:
            ax.set_yscale("log")
        elif log is True and lo > 0 and hi / lo > 20:  # a log axis only where the values span decades
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="best")
        ax.set_title(title, fontsize=10)
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        figs.append((title, base64.b64encode(buf.getvalue()).decode()))

    def positive(ys):
        return [y if isinstance(y, float | int) and math.isfinite(y) and y > 0 else float("nan") for y in ys]

    # loss
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    xs, ys = d.series("loss", "loss")
    ax.plot(xs, ys, color="black", lw=1.2, label="loss")
    px, py = [], []
    for rec in d.records:
        ls = (rec.get("samples") or {}).get("loss", {}).get("loss")
        if ls:
            fin = [v for v in ls if math.isfinite(v)]
            if fin:
                px.append(rec["step"])
                py.append(max(fin))
    if px:
        ax.plot(px, py, color="tab:orange", lw=0.8, label="max per-sample loss")
    finish(fig, ax, "loss", log="positive")
    # residual RMS by layer
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for layer, (xs, ys) in sorted(_by_layer(d, "layer_input", _rms).items(), key=lambda t: (t[0] is None, t[0] or 0)):
        ax.plot(xs, positive(ys), lw=1, label=f"layer {layer}")
    finish(fig, ax, "residual stream RMS entering each layer")
    # max logit per head
    att = [a2 for a2 in ([a] if a is not None else []) + d.anomalies + [
        dr for dr in d.drifts if dr.stage == "attention_logits"] if a2.stage == "attention_logits"]
    layers = sorted({e["layer"] for rec in d.records for e in rec["entries"] if e["stage"] == "attention_logits"},
                    key=lambda v: (v is None, v or 0))
    if layers:
        layer = att[0].layer if att and att[0].layer in layers else layers[0]
        if not att:  # the layer with the largest logit
            best = -1.0
            for rec in d.records:
                for e in rec["entries"]:
                    if e["stage"] == "attention_logits" and max(e["max_logit"], default=0) > best:
                        best, layer = max(e["max_logit"]), e["layer"]
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        heads = next((len(e["max_logit"]) for rec in d.records for e in rec["entries"]
                      if e["stage"] == "attention_logits" and e["layer"] == layer), 0)
        marked = att[0].head if att and att[0].layer == layer else None
        for h in range(heads):
            xs, ys = d.series("attention_logits", "max_logit", layer=layer, head=h)
            ax.plot(xs, positive(ys), lw=2.2 if h == marked else 1,
                    label=f"head {h}" + (" (cause)" if h == marked and att[0] is a else ""))
        finish(fig, ax, f"max |attention logit| per head, layer {layer}")
    # gradients and updates by layer
    for stage, title, pick in (
            ("grad", "gradient RMS by layer", _rms),
            ("update", "update RMS / parameter RMS by layer",
             lambda es: (math.sqrt(sum(e["sumsq"] for e in es) / max(sum(e["param_sumsq"] for e in es), 1e-300))))):
        series = _by_layer(d, stage, pick)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        for layer, (xs, ys) in sorted(series.items(), key=lambda t: (t[0] is None, t[0] or 0)):
            ax.plot(xs, positive(ys), lw=1, label="outside blocks" if layer is None else f"layer {layer}")
        finish(fig, ax, title)
    return figs


def render_html(d: Diagnosis) -> str:
    """One self-contained page that opens on the first incident and its cause: then plots (inline PNG) marked at
    the incident, the incidents' table, the departures behind the first, and the drifts in their own section."""
    esc = html.escape
    a = d.first
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>normscope diagnose</title><style>",
             "body{font-family:system-ui,sans-serif;margin:24px;max-width:1400px;color:#222}"
             "h1{font-size:20px}table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}th{background:#f3f3f3}"
             ".first{background:#fde8e8;border:1px solid #e99;padding:10px;margin:12px 0}"
             ".ok{background:#e8f6e8;border:1px solid #9c9;padding:10px;margin:12px 0}"
             ".warn{background:#fff6e0;border:1px solid #e8c46a;padding:10px;margin:12px 0}"
             ".grid{display:flex;flex-wrap:wrap;gap:12px}.grid img{border:1px solid #ddd}",
             "</style></head><body>", "<h1>normscope diagnose</h1>"]
    if a is None and d.undecided:
        parts.append(f"<div class='warn'><b>Inconclusive</b>: no incident in {len(d.steps)} recorded steps, but not "
                     f"all of the run could be judged:<ul>"
                     + "".join(f"<li>{esc(why)}</li>" for why in d.undecided) + "</ul></div>")
    elif a is None:
        parts.append(f"<div class='ok'><b>No incident</b> in {len(d.steps)} recorded steps "
                     f"({esc(_settings_line(d))}).</div>")
    else:
        inc = d.incidents[0]
        parts.append(f"<div class='first'><b>Incident at step {inc.step}: {esc(inc.kind)}</b> — {esc(inc.evidence)}"
                     f"<br><b>First cause: step {a.step} · {esc(a.where())}</b> — {esc(a.metric)} = "
                     f"{esc(_fmt(a.value))} (baseline {esc(_fmt(a.baseline))})<br>evidence: {esc(a.evidence)}<br>"
                     + (f"samples: {esc(', '.join(map(str, a.sample_ids)))}<br>" if a.sample_ids else "")
                     + f"next: {esc(a.next_check)}</div>")
    parts.append(f"<p>{esc(summary_line(d))}</p>")
    for why in d.limits:
        parts.append(f"<p>not judged: {esc(why)}</p>")
    if (runs := runs_line(d)) is not None:
        parts.append(f"<div class='warn'>{esc(runs)}</div>")
    for e in d.errors:
        parts.append(f"<p>probe <b>{esc(e['probe'])}</b> was disabled at step {e['step']}: {esc(e['error'])}</p>")
    if d.damaged:
        parts.append("<div class='warn'><b>Damaged lines skipped</b><br>"
                     + "<br>".join(esc(x) for x in d.damaged[:50]) + "</div>")
    parts.append("<div class='grid'>")
    for title, b64 in _figures(d):
        parts.append(f"<figure><img alt='{esc(title)}' src='data:image/png;base64,{b64}'></figure>")
    parts.append("</div>")
    if d.incidents:
        parts.append(f"<h2>{len(d.incidents)} incident(s)</h2><table><tr>")
        cols = ("step", "incident", "evidence", "cause", "cause evidence", "samples", "next", "folded in")
        parts.append("".join(f"<th>{c}</th>" for c in cols) + "</tr>")
        for x in d.incidents[:200]:
            c = x.cause
            row = (x.step, x.kind, x.evidence, f"step {c.step} · {c.where()} · {c.metric}", c.evidence,
                   ", ".join(map(str, c.sample_ids or [])), c.next_check, "; ".join(x.symptoms))
            parts.append("<tr>" + "".join(f"<td>{esc(str(v))}</td>" for v in row) + "</tr>")
        parts.append("</table>")
        deps = d.incidents[0].departures
        parts.append("<h2>What left its range in the window before the first incident (farthest first)</h2><table><tr>")
        cols = ("step", "stage", "layer", "site", "head", "metric", "value", "baseline", "robust σ", "evidence")
        parts.append("".join(f"<th>{c}</th>" for c in cols) + "</tr>")
        for x in deps[:100]:
            row = (x.step, x.stage, _fmt(x.layer), x.site, _fmt(x.head), x.metric, _fmt(x.value), _fmt(x.baseline),
                   _fmt(x.score), x.evidence)
            parts.append("<tr>" + "".join(f"<td>{esc(str(v))}</td>" for v in row) + "</tr>")
        parts.append("</table>")
    if d.notes:
        parts.append("<h2>Notes</h2><p>Seen, and judged not to be incidents.</p><ul>"
                     + "".join(f"<li>{esc(x)}</li>" for x in d.notes[:200]) + "</ul>")
    parts.append("<h2>Drifts</h2>")
    if d.drifts:
        parts.append("<p>Series growing step after step towards a dangerous level; not incidents.</p><table><tr>")
        cols = ("series", "metric", "value", "×/step", "danger", "steps to danger", "status", "evidence")
        parts.append("".join(f"<th>{c}</th>" for c in cols) + "</tr>")
        for x in d.drifts:
            row = (x.where(), x.metric, _fmt(x.value), f"{sig(math.exp(x.slope))}", _fmt(x.danger),
                   f"{x.steps_to_danger:.0f}", x.status, x.evidence)
            parts.append("<tr>" + "".join(f"<td>{esc(str(v))}</td>" for v in row) + "</tr>")
        parts.append("</table>")
    else:
        parts.append("<p>None.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
