"""Rich rendering of a :class:`~normscope.sites.ModelScan` (sites grouped by identical contract). Computes nothing."""

from __future__ import annotations

import re
from collections import Counter

from rich.console import Console
from rich.markup import escape

from ..report.console import fmt, indented
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


def _activation(sites, spec) -> str:
    """The worst real-activation error of a group against its tolerance, and whether the contract reproduces it."""
    measured = [s.activation for s in sites if s.activation and "max_relative_error" in s.activation]
    if not measured:
        return "not measured"
    worst = max(measured, key=lambda a: a["max_relative_error"])
    ok = spec is not None and all(a.get("ok", False) for a in measured) and len(measured) == len(sites)
    verdict = "reproduced" if ok else "NOT reproduced"
    return (f"{verdict}, max relative error {fmt(worst['max_relative_error'])} "
            f"(tolerance {fmt(worst['tolerance'])}, {worst.get('dtype', '?')})")


def render_scan(result: ModelScan, console: Console) -> None:
    """Plain lines wrapped at the console's width, one paragraph per group of sites with the same contract: every
    field and every name stays readable in a narrow terminal and in a CI log (a wide table drops columns)."""
    n = len(result.sites)
    kinds = Counter(s.kind for s in result.sites)
    found = ", ".join(f"{v} by {k}" for k, v in kinds.items())
    blocks = [b for b in result.blocks if b.get("layer") is not None]
    console.print(f"[bold]{escape(result.model)}[/]: {n} norm site{'s' * (n != 1)} ({found or 'none'}), "
                  f"placement [bold]{result.placement}[/] over {len(blocks)} block{'s' * (len(blocks) != 1)}; "
                  f"{result.seconds:.2f} s, {result.stats.get('infer_calls', 0)} probe calls")
    for g in result.groups():
        sites = g["sites"]
        layers = [s.layer for s in sites if s.layer is not None]
        kind = "" if g["kind"] == "module" else f" ({g['kind']})"
        where = f", layers {layer_ranges(layers)}" if layers else ""
        console.print()
        console.print(f"[bold]{len(sites)} × {escape(g['class'])}[/]{escape(kind)}: role {g['role']}{where}")
        for name in _names(sites).split("\n"):
            indented(console, name, 2)
        indented(console, f"contract: {g['summary']}", 4)
        indented(console, f"γ (stored): {_gamma(sites)}", 4)
        indented(console, f"real activation: {_activation(sites, g['spec'])}", 4)
    console.print()
    per_block = Counter(b["placement"] for b in result.blocks)
    if per_block:
        console.print("blocks: " + ", ".join(f"{v} × {k}" for k, v in per_block.items()))
    if result.config_eps:
        console.print("config ε: " + ", ".join(f"{k}={v:g}" for k, v in result.config_eps.items()))
    for r in result.rejected:
        if r["kind"] == "behaviour":
            indented(console, f"not a normalization: {r['name']} ({r['class']}): {r['reason']}", 0)
    if result.findings:
        console.print(f"[bold red]{len(result.findings)} finding{'s' * (len(result.findings) != 1)}:[/]")
        for f in result.findings:
            indented(console, f"• {f['message']}", 2)
    else:
        checked = "every site reproduces its real activation"
        if result.config_eps:
            checked += " and matches the config's ε"
        console.print(f"[green]no findings[/]: {checked}")
