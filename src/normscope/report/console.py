"""Rich console rendering of results computed elsewhere. Nothing here computes a verdict."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table


def fmt(v: float, digits: int = 4) -> str:
    """A number the way a person writes it: 4 decimals, −0 shown as 0, tiny or huge in e-notation."""
    if v != v:  # NaN
        return "nan"
    if v in (math.inf, -math.inf):
        return "∞" if v > 0 else "−∞"
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        mantissa, exponent = f"{v:.{digits - 1}e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exponent)}".replace("-", "−")
    text = f"{v:.{digits}f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "0") else text.replace("-", "−")


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


def render_presets(rows: list[tuple[str, Any, str]], console: Console) -> None:
    t = Table(title="Presets: NormSpec.preset(name, **overrides)", title_justify="left")
    t.add_column("name", style="bold")
    t.add_column("kind")
    t.add_column("contract")
    t.add_column("implementation")
    for name, spec, origin in rows:
        t.add_row(name, spec.kind, escape(spec.summary()), escape(origin))
    console.print(t)


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


def render_inference(inf, console: Console) -> None:
    spec = inf.spec
    console.print(f"[bold]{escape(inf.target)}[/] at shape {tuple(inf.shape)}: probed in {inf.probe_dtype}, "
                  f"accepts {', '.join(inf.dtypes)}; {inf.calls} calls, {inf.seconds:.2f} s")
    console.print(f"[bold]contract:[/] {escape(spec.summary())}")
    t = Table(show_lines=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    t.add_column("experiment and measured numbers", overflow="fold")
    t.add_column("confidence")
    values = {
        "axes": f"{list(spec.axes)}" + (f", groups={spec.groups} on axis {spec.group_axis}" if spec.groups else ""),
        "eps": f"{spec.eps:g}",
        "param_axes": f"{list(spec.param_axes)}",
    }
    # findings about the target itself (determinism, an input modified in place) follow the contract's fields
    for field in FIELD_ORDER + tuple(k for k in inf.evidence if k not in FIELD_ORDER):
        ev = inf.evidence.get(field)
        value = values.get(field, str(getattr(spec, field, "")))
        if ev is None:
            t.add_row(field, escape(value), "", "")
            continue
        text = ev.experiment
        if ev.measured:
            text += " — " + compact(ev.measured)
        if ev.note:
            text += f" [italic]({escape(ev.note)})[/]"
        style = _CONFIDENCE_STYLE.get(ev.confidence, "")
        t.add_row(field, escape(value), text if ev.note else escape(text), f"[{style}]{ev.confidence}[/]")
    console.print(t)
    for name, values_ in inf.params.items():
        arr = list(values_.ravel()) if hasattr(values_, "ravel") else list(values_)
        console.print(f"{name} {tuple(getattr(values_, 'shape', ()))}: {vec(arr[:8])}{' …' if len(arr) > 8 else ''}")
    v = inf.validation
    checks = {k: val for k, val in v.items() if k not in ("tolerance", "max_relative_error", "dtype", "eval")}
    console.print(
        f"validation at {v.get('dtype')}: max relative error {fmt(v['max_relative_error'])} ≤ {fmt(v['tolerance'])} "
        f"on fresh inputs ({escape(compact(checks))})")


_STATUS_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow"}


def render_check(report, console: Console, verbose: bool = False) -> None:
    c = report.counts()
    console.print(f"[bold]{escape(report.target)}[/] at shape {tuple(report.shape)}, dtypes "
                  f"{', '.join(report.dtypes)}; {report.calls} calls, {report.seconds:.2f} s")
    console.print(f"[bold]expected:[/] {escape(report.expected.summary())}")
    console.print(f"[bold]parameters:[/] {escape(report.params_source)}")
    t = Table()
    t.add_column("section")
    t.add_column("finding")
    t.add_column("", justify="center")
    t.add_column("measured", justify="right")
    t.add_column("tolerance", justify="right")
    t.add_column("why", overflow="fold")
    for f in report.findings:
        if f.status == "pass" and not verbose and f.grid:
            continue
        t.add_row(f.section, escape(f.name), f"[{_STATUS_STYLE[f.status]}]{f.status}[/]", _cell(f.measured),
                  _cell(f.tolerance), escape(f.why))
    console.print(t)
    hidden = sum(1 for f in report.findings if f.status == "pass" and f.grid)
    if hidden and not verbose:
        console.print(f"[dim]{hidden} passing forward/backward grid points not shown (--verbose shows them)[/]")
    verdict = "[bold green]PASS[/]" if report.ok else "[bold red]FAIL[/]"
    console.print(f"{verdict}: {c['pass']} passed, {c['fail']} failed, {c['skip']} skipped")
    if report.differences:
        console.print("[bold]the target's inferred contract differs:[/]")
        for d in report.differences:
            console.print(f"  • {escape(d)}")
        if report.inferred is not None:
            console.print(f"  inferred: {escape(report.inferred.summary())}")
    elif report.inference_error:
        console.print(f"[bold]inference could not explain the failure:[/] {escape(report.inference_error)}")


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return fmt(v)
    return escape(compact(v, 4))
