"""Rich rendering of a :class:`~normscope.sites.ModelScan` (sites grouped by identical contract). Computes nothing."""

from __future__ import annotations

import re
from collections import Counter

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..report.console import fmt
from .result import ModelScan, layer_ranges


def _gamma(sites) -> str:
    stats = [s.gamma for s in sites if s.gamma]
    if not stats:
        return "—"
    lo = min(g["min"] for g in stats)
    hi = max(g["max"] for g in stats)
    means = [g["mean"] for g in stats]
    mean = fmt(means[0]) if len(set(means)) == 1 else f"{fmt(min(means))}…{fmt(max(means))}"
    offset = stats[0]["offset"]
    prefix = f"{fmt(offset)} + w, " if offset else ""
    return f"{prefix}w̄ {mean} [{fmt(lo)}, {fmt(hi)}]"


def _names(sites) -> str:
    """The group's names with the layer index as ``*``: model.layers.*.input_layernorm."""
    patterns: list[str] = []
    for s in sites:
        name = s.name if s.layer is None else re.sub(rf"\.{s.layer}(?=[.:#]|$)", ".*", s.name, count=1)
        if name not in patterns:
            patterns.append(name)
    return "\n".join(patterns)


def render_scan(result: ModelScan, console: Console) -> None:
    n = len(result.sites)
    kinds = Counter(s.kind for s in result.sites)
    found = ", ".join(f"{v} by {k}" for k, v in kinds.items())
    blocks = [b for b in result.blocks if b.get("layer") is not None]
    console.print(f"[bold]{escape(result.model)}[/]: {n} norm site{'s' * (n != 1)} ({found or 'none'}), "
                  f"placement [bold]{result.placement}[/] over {len(blocks)} block{'s' * (len(blocks) != 1)}; "
                  f"{result.seconds:.2f} s, {result.stats.get('infer_calls', 0)} probe calls")
    t = Table(show_header=True, header_style="bold")
    t.add_column("sites", justify="right")
    t.add_column("contract", min_width=28)
    t.add_column("role")
    t.add_column("layers")
    t.add_column("γ (stored)")
    t.add_column("real activation", justify="right")
    t.add_column("names", overflow="fold", min_width=24)
    for g in result.groups():
        sites = g["sites"]
        layers = [s.layer for s in sites if s.layer is not None]
        worst = max((s.activation.get("max_relative_error", 0.0) for s in sites if s.activation), default=None)
        ok = all(s.activation.get("ok", False) for s in sites) and g["spec"] is not None
        act = "—" if worst is None else f"{'[green]' if ok else '[red]'}{fmt(worst)}[/]"
        t.add_row(f"{len(sites)} × {escape(g['class'])}" + ("" if g["kind"] == "module" else f" ({g['kind']})"),
                  escape(g["summary"]), g["role"], layer_ranges(layers) if layers else "—", _gamma(sites), act,
                  escape(_names(sites)))
    console.print(t)
    per_block = Counter(b["placement"] for b in result.blocks)
    if per_block:
        console.print("blocks: " + ", ".join(f"{v} × {k}" for k, v in per_block.items()))
    if result.config_eps:
        console.print("config ε: " + ", ".join(f"{k}={v:g}" for k, v in result.config_eps.items()))
    for r in result.rejected:
        if r["kind"] == "behaviour":
            console.print(f"[dim]not a normalization: {escape(r['name'])} ({escape(r['class'])}): "
                          f"{escape(r['reason'])}[/]")
    if result.findings:
        console.print(f"[bold red]{len(result.findings)} finding{'s' * (len(result.findings) != 1)}:[/]")
        for f in result.findings:
            console.print(f"  • {escape(f['message'])}")
    else:
        checked = "every site reproduces its real activation"
        if result.config_eps:
            checked += " and matches the config's ε"
        console.print(f"[green]no findings[/]: {checked}")
