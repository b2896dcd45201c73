"""Rich console rendering of results computed elsewhere. Nothing here computes a verdict."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .numbers import fmt


def fold_dotted(name: str, width: int) -> str:
    """A dotted name on lines of at most ``width``, broken only after a dot (a part longer than ``width`` keeps its
    own line): how every table shows a module path, so a narrow terminal never splits a word."""
    lines: list[str] = []
    for part in (p + "." for p in name.split(".")):
        if lines and len(lines[-1]) + len(part) <= width:
            lines[-1] += part
        else:
            lines.append(part)
    return "\n".join(lines)[:-1]


def name_width(console_width: int, other_columns: Iterable[Iterable[str]]) -> int:
    """The width a table's name column can claim: the console's width less the table's borders and padding and,
    per other column, its longest word (rich markup counted as printed), the least it takes without cutting a
    word, since the rest of its text wraps at spaces."""
    others = [max((max((len(w) for w in Text.from_markup(c).plain.split()), default=0) for c in col), default=0)
              for col in other_columns]
    return max(16, console_width - sum(others) - 3 * (len(others) + 1) - 1)


def vec(values: Iterable[float]) -> str:
    return "[" + ", ".join(fmt(v) for v in values) + "]"


def render_explain(data: dict[str, Any], console: Console) -> None:
    x = data["input"]
    eps = data["eps"]
    eps_text = "ε ignored (0)" if eps == 0 else f"ε = {fmt(eps)}"
    affine = []
    if data.get("gamma") is not None:
        affine.append(f"γ = {vec(data['gamma'])}")
    if data.get("beta") is not None:
        affine.append(f"β = {vec(data['beta'])}")
    console.print(f"[bold]x = {vec(x)}[/], d = {len(x)}, {eps_text}" + (", " + ", ".join(affine) if affine else ""))

    if "layernorm" in data:
        ln = data["layernorm"]
        t = Table(title=f"LayerNorm  {ln['formula']}", title_justify="left", show_header=True)
        t.add_column("step")
        t.add_column("formula")
        t.add_column("value", justify="right")
        t.add_row("1. mean", "μ = (1/d)Σxᵢ", f"μ = {fmt(ln['mean'])}")
        t.add_row("2. deviations", "x − μ", vec(ln["deviations"]))
        t.add_row("3. variance", "σ² = (1/d)Σ(xᵢ − μ)²", f"σ² = {fmt(ln['variance'])}")
        t.add_row("4. standard deviation", "σ = √(σ² + ε)", f"σ = {fmt(ln['std'])}")
        t.add_row("5. normalized", "(x − μ)/σ", vec(ln["normalized"]))
        if data.get("gamma") is not None or data.get("beta") is not None:
            t.add_row("6. affine", "γ·x̂ + β", vec(ln["output"]))
        t.add_row("output", "", f"[bold]{vec(ln['output'])}[/]")
        t.add_row("check", "mean, mean square of output", f"{fmt(ln['output_mean'])}, {fmt(ln['output_mean_square'])}")
        console.print(t)
    if "rmsnorm" in data:
        rn = data["rmsnorm"]
        t = Table(title=f"RMSNorm  {rn['formula']}", title_justify="left")
        t.add_column("step")
        t.add_column("formula")
        t.add_column("value", justify="right")
        t.add_row("1. squares", "xᵢ²", vec(rn["squares"]))
        t.add_row("2. mean square", "(1/d)Σxᵢ²", fmt(rn["mean_square"]))
        t.add_row("3. RMS", "√((1/d)Σxᵢ² + ε)", f"RMS = {fmt(rn['rms'])}")
        t.add_row("4. normalized", "x / RMS", vec(rn["normalized"]))
        if data.get("gamma") is not None:
            t.add_row("5. affine", "γ·x̂", vec(rn["output"]))
        t.add_row("output", "", f"[bold]{vec(rn['output'])}[/]")
        t.add_row("check", "mean, mean square of output", f"{fmt(rn['output_mean'])}, {fmt(rn['output_mean_square'])}")
        console.print(t)

    t = Table(title="Invariances (max |change| of the output; unchanged means ≤ 1e-9)", title_justify="left")
    t.add_column("transform")
    kinds = [k for k in ("layernorm", "rmsnorm") if k in data]
    for k in kinds:
        t.add_column("LayerNorm" if k == "layernorm" else "RMSNorm", justify="right")
    for row in data["invariances"]:
        cells = [row["transform"] + " (ε = 0)"]
        for k in kinds:
            cells.append(_verdict(row[f"{k}_max_change"], row[f"{k}_unchanged"]))
        t.add_row(*cells)
        if "eps" in row:
            cells = [f"{row['transform']} (ε = {fmt(row['eps'])})"]
            for k in kinds:
                cells.append(_verdict(row[f"{k}_max_change_with_eps"], row[f"{k}_unchanged_with_eps"], nearly=True))
            t.add_row(*cells)
    console.print(t)

    g = data["eps_gain"]
    console.print(
        Panel(
            f"A near-constant vector with variance {fmt(g['variance'])} (σ = {fmt(g['variance'] ** 0.5)}):\n"
            f"  gain without ε:                {fmt(g['gain_without_eps'])}\n"
            f"  gain with ε = {fmt(g['eps'])} inside √:  {fmt(g['gain_eps_inside_sqrt'], 5)}"
            f"  (cap 1/√ε = {fmt(g['cap_inside_sqrt'], 5)})\n"
            f"  gain with ε = {fmt(g['eps'])} outside √: {fmt(g['gain_eps_outside_sqrt'], 5)}"
            f"  (1/(σ + ε); cap 1/ε = {fmt(1 / g['eps'])})\n"
            "ε sets the largest gain a norm applies; where it sits changes that cap.",
            title="ε caps the gain",
            title_align="left",
        )
    )


def _verdict(change: float, unchanged: bool, nearly: bool = False) -> str:
    if unchanged:
        return f"[green]unchanged[/] ({fmt(change)})"
    if nearly and change < 1e-3:
        return f"[yellow]nearly unchanged[/] ({fmt(change)}, the ε effect)"
    return f"[red]changed[/] ({fmt(change)})"


def indented(console: Console, text: str, indent: int, hang: int = 0) -> None:
    """Plain text wrapped at the console's width under an indent (continuation lines ``hang`` further in), with
    no trailing padding (CI logs)."""
    import textwrap

    width = max(console.width, indent + hang + 30)
    lines = textwrap.wrap(text, width, initial_indent=" " * indent, subsequent_indent=" " * (indent + hang),
                          break_long_words=False, break_on_hyphens=False) or [""]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def render_presets(rows: list[tuple[str, Any, str, dict[str, Any]]], console: Console) -> None:
    """One block per preset: name and origin, its knobs with defaults, the contract it states."""
    console.print("[bold]Presets[/]: --expect NAME or NAME:knob=value,… on the command line; "
                  "NormSpec.preset(name, **knobs or fields) in Python")
    for name, spec, origin, knobs in rows:
        console.print(f"\n[bold]{name}[/]  {escape(origin)}")
        indented(console, "knobs: " + ", ".join(f"{k}={v}" for k, v in knobs.items()), 2)
        indented(console, spec.summary(), 2)


FIELD_ORDER = ("center", "axes", "eps", "eps_placement", "variance", "variance_algorithm", "gamma", "beta",
               "param_axes", "gamma_offset", "stats_dtype", "affine_order", "batch_stats")

_CONFIDENCE_STYLE = {"decisive": "green", "from parameters": "green", "weak": "yellow", "assumed": "yellow",
                     "ambiguous": "yellow", "not probed": "dim"}


def compact(measured: Any, limit: int = 6) -> str:
    """A short one-line rendering of an evidence dict: key numbers, lists truncated."""
    if isinstance(measured, dict):
        parts = []
        for k, v in measured.items():
            if isinstance(v, dict):
                inner = compact(v, limit)
                parts.append(f"{k}: {{{inner}}}")
            else:
                parts.append(f"{k}={compact(v, limit)}")
        return ", ".join(parts)
    if isinstance(measured, list | tuple):
        items = [compact(v, limit) for v in measured[:limit]]
        return "[" + ", ".join(items) + (", …" if len(measured) > limit else "") + "]"
    if isinstance(measured, float):
        return fmt(measured)
    return str(measured)


def render_inference(inf, console: Console, brief: bool = False) -> None:
    """The inferred contract first, then (unless ``brief``) each field's experiment and numbers."""
    spec = inf.spec
    indented(console, f"{inf.target} at shape {tuple(inf.shape)}: probed in {inf.probe_dtype}, accepts "
                      f"{', '.join(inf.dtypes)}; {inf.calls} calls, {inf.seconds:.2f} s", 0)
    indented(console, f"contract: {inf.summary}", 0)
    if brief:
        levels: dict[str, list[str]] = {}
        for field, ev in inf.evidence.items():
            levels.setdefault(ev.confidence, []).append(field)
        decisive = levels.pop("decisive", [])
        rest = "; ".join(f"{level}: {', '.join(fields)}" for level, fields in levels.items())
        indented(console, f"evidence: {len(decisive)} fields decisive" + (f"; {rest}" if rest else "")
                 + " (without --brief: each field's experiment and numbers)", 0)
        _validation_line(inf, console)
        return
    values = {
        "axes": f"{list(spec.axes)}" + (f", groups={spec.groups} on axis {spec.group_axis}" if spec.groups else ""),
        "eps": f"{spec.eps:g}",
        "param_axes": f"{list(spec.param_axes)}",
    }
    # one line per field (value, confidence), its experiment and numbers wrapped beneath: readable at any
    # width and in CI logs, where a four-column table folds every cell into a narrow strip
    # findings about the target itself (determinism, an input modified in place) follow the contract's fields
    fields = FIELD_ORDER + tuple(k for k in inf.evidence if k not in FIELD_ORDER)
    width = max(len(f) for f in fields)
    for field in fields:
        ev = inf.evidence.get(field)
        value = values.get(field, str(getattr(spec, field, "")))
        confidence = ""
        if ev is not None:
            style = _CONFIDENCE_STYLE.get(ev.confidence, "")
            confidence = f"  [{style}]{ev.confidence}[/]" if style else f"  {escape(ev.confidence)}"
        console.print(f"[bold]{field:<{width}}[/]  {escape(value)}{confidence}")
        if ev is not None:
            text = ev.experiment + (" — " + compact(ev.measured) if ev.measured else "")
            indented(console, text + (f" ({ev.note})" if ev.note else ""), 4)
    for name, values_ in inf.params.items():
        arr = list(values_.ravel()) if hasattr(values_, "ravel") else list(values_)
        console.print(f"{name} {tuple(getattr(values_, 'shape', ()))}: {vec(arr[:8])}{' …' if len(arr) > 8 else ''}")
    _validation_line(inf, console)


def _validation_line(inf, console: Console) -> None:
    v = inf.validation
    checks = {k: val for k, val in v.items() if k not in ("tolerance", "max_relative_error", "dtype", "eval")}
    console.print(
        f"validation at {v.get('dtype')}: max relative error {fmt(v['max_relative_error'])} ≤ {fmt(v['tolerance'])} "
        f"on fresh inputs ({escape(compact(checks))})")


_STATUS_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow", "inconclusive": "bold yellow"}


def render_check(report, console: Console, verbose: bool = False, brief: bool = False) -> None:
    """The check report: the verdict and what explains it first, then counts per section, every failure and skip
    in full, passes folded.

    ``verbose`` lists every finding; ``brief`` stops after the verdict. Plain lines that wrap at the console's
    width, so it reads the same in a narrow terminal and in a CI log.
    """
    indented(console, f"{report.target} at shape {tuple(report.shape)}, dtypes {', '.join(report.dtypes)}; "
                      f"{report.calls} calls, {report.seconds:.2f} s", 0)
    indented(console, f"expected: {report.expected.summary()}", 0)
    _check_verdict(report, console, verbose or brief)
    if brief:
        return
    indented(console, f"parameters: {report.params_source}", 0)
    sections: dict[str, dict[str, int]] = {}
    for f in report.findings:
        sections.setdefault(f.section, {"pass": 0, "fail": 0, "skip": 0, "inconclusive": 0})[f.status] += 1
    width = max((len(s) for s in sections), default=7)
    console.print()
    for section, n in sections.items():
        parts = [f"{n['pass']} passed"] + [f"[{_STATUS_STYLE[k]}]{n[k]} {w}[/]" for k, w in
                                          (("fail", "failed"), ("inconclusive", "inconclusive"),
                                           ("skip", "skipped")) if n[k]]
        console.print(f"  {escape(section):<{width}}  " + ", ".join(parts))
    shown = [f for f in report.findings if verbose or f.status != "pass"]
    if shown:
        console.print()
    for f in shown:
        numbers = ", ".join(f"{label} {_plain(v)}" for label, v in
                            (("measured", f.measured), ("expected", f.expected), ("tolerance", f.tolerance))
                            if v is not None)
        indented(console, f"{f.status.upper()} {f.section} / {f.name}" + (f": {numbers}" if numbers else ""), 0)
        if f.why:
            indented(console, f.why, 5)
    console.print()
    _verdict_line(report, console, True)  # the counts again last, where a CI log's reader looks


def _verdict_line(report, console: Console, folded_said: bool) -> None:
    c = report.counts()
    folded = "" if folded_said or not c["pass"] else " (passes folded; --verbose lists every finding)"
    undecided = f", {c['inconclusive']} inconclusive" if c["inconclusive"] else ""
    indented(console, f"{report.verdict.upper()}: {c['pass']} passed, {c['fail']} failed{undecided}, "
                      f"{c['skip']} skipped{folded}", 0)


def _check_verdict(report, console: Console, folded_said: bool) -> None:
    """The verdict, why it is undecided where it is, and the inferred contract's differences from the expected."""
    _verdict_line(report, console, folded_said)
    for reason in report.undecided:
        indented(console, reason, 5)
    if report.differences:
        console.print("[bold]the target's inferred contract differs:[/]")
        for d in report.differences:
            console.print(f"  • {escape(d)}")
        if report.inferred is not None:
            console.print(f"  inferred: {escape(report.inferred.summary())}")
    elif report.inference_error:
        console.print(f"[bold]inference could not explain the failure:[/] {escape(report.inference_error)}")


def _plain(v) -> str:
    return fmt(v) if isinstance(v, float) else compact(v, 4)
