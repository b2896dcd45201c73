"""Rich rendering of a :class:`~normscope.sites.ModelScan`. Computes nothing.

The default view is the verdict and its evidence first, then each distinct contract once with the sites that
follow it (one line per role, names folded over the layer index and a common prefix); ``full=True`` is the
complete view, one paragraph per group with γ statistics and each group's real-activation error."""

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


def _names(sites, blocks: list[str]) -> str:
    """The group's names with their block's index as ``*``: model.layers.*.input_layernorm. ``blocks``: the blocks'
    paths; a block's index is the last number of its path (Swin's encoder.layers.1.blocks.*: the layer counts
    blocks across stages, so its number is not in the path)."""
    named = []  # (name, its block's path or None)
    for s in sites:
        name = re.sub(r"#\d+$", "", s.name)  # a shared block's later calls: name#1, name#2
        block = max((b for b in blocks if name.startswith(b) and name[len(b):len(b) + 1] in (".", ":")), key=len,
                    default=None) if s.layer is not None else None
        named.append((name, block))
    # a block's index generalizes only where the group spans several blocks of that path (one shared block called
    # three times, ALBERT's, keeps its one path)
    spans: dict[str, set[str]] = {}
    for _, block in named:
        if block is not None:
            spans.setdefault(re.sub(r"\.\d+$", ".*", block), set()).add(block)
    patterns: list[str] = []
    for (name, block), s in zip(named, sites, strict=True):
        if block is not None:
            general = re.sub(r"\.\d+$", ".*", block)
            if len(spans[general]) > 1:
                name = general + name[len(block):]
        elif s.layer is not None:
            name = re.sub(rf"\.{s.layer}(?=[.:#]|$)", ".*", name, count=1)
        if name not in patterns:
            patterns.append(name)
    return "\n".join(patterns)


def _block_paths(result: ModelScan) -> list[str]:
    return [b["block"] for b in result.blocks if b.get("block")]


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


def _header(result: ModelScan, console: Console) -> None:
    n = len(result.sites)
    kinds = Counter(s.kind for s in result.sites)
    found = ", ".join(f"{v} by {k}" for k, v in kinds.items())
    blocks = [b for b in result.blocks if b.get("layer") is not None]
    console.print(f"[bold]{escape(result.model)}[/]: {n} norm site{'s' * (n != 1)} ({found or 'none'}), "
                  f"placement [bold]{result.placement}[/] over {len(blocks)} block{'s' * (len(blocks) != 1)}; "
                  f"{result.seconds:.2f} s, {result.stats.get('infer_calls', 0)} probe calls")
    if len(result.streams) > 1:
        indented(console, "residual streams: " + "; ".join(
            f"{s['path'] or 'stream ' + str(s['stream'])}: {s['placement']} over {s['blocks']} block"
            f"{'s' * (s['blocks'] != 1)}" for s in result.streams), 0, 2)


def _verdict(result: ModelScan, console: Console, evidence: bool) -> None:
    """The findings, or what was checked and found right — with the worst real-activation error when asked —
    then the notes (facts that are not findings)."""
    _findings(result, console, evidence)
    for note in result.notes:
        indented(console, f"note: {note['message']}", 0, 2)


def _findings(result: ModelScan, console: Console, evidence: bool) -> None:
    if result.findings:
        console.print(f"[bold red]{len(result.findings)} finding{'s' * (len(result.findings) != 1)}:[/]")
        for f in result.findings:
            indented(console, f"• {f['message']}", 2, 2)
        _inconclusive(result, console)
        return
    if result.inconclusive:
        _inconclusive(result, console)
        return
    if not result.sites:
        indented(console, "no norm sites: no module, functional call or inline pattern of this forward was found "
                          "to normalize (what the scan cannot see: docs/scan.md, Limits)", 0, 2)
        return
    measured = [s.activation for s in result.sites if s.activation and "max_relative_error" in s.activation]
    checked = "every site reproduces its real activation" if measured else "every site's contract was inferred"
    if evidence and measured:
        worst = max(measured, key=lambda a: a["max_relative_error"] / a["tolerance"])
        checked += (f" (worst relative error {fmt(worst['max_relative_error'])}, tolerance "
                    f"{fmt(worst['tolerance'])})")
    if result.config_eps:
        checked += " and matches the config's ε where the code reads it" if result.notes else \
            " and matches the config's ε"
        if evidence:
            checked += " (" + ", ".join(f"{k}={v:g}" for k, v in result.config_eps.items()) + ")"
    indented(console, f"no findings: {checked}", 0, 2)


def _inconclusive(result: ModelScan, console: Console) -> None:
    for why in result.inconclusive:
        indented(console, f"inconclusive: {why}", 0, 2)


def _folded(names: list[str]) -> str:
    """Names sharing everything up to their last dot as one: ``a.b.{c, d}``."""
    out: dict[str, list[str]] = {}
    for name in names:
        head, dot, tail = name.rpartition(".")
        out.setdefault(head if dot else "", []).append(tail if dot else name)
    parts = []
    for head, tails in out.items():
        if not head:
            parts.extend(tails)
        elif len(tails) == 1:
            parts.append(f"{head}.{tails[0]}")
        else:
            parts.append(f"{head}.{{{', '.join(tails)}}}")
    return ", ".join(parts)


def render_scan(result: ModelScan, console: Console, full: bool = False) -> None:
    """The verdict first, then each distinct contract once with the roles and names that follow it, in a few lines
    at any width; ``full`` prints the complete view (:func:`render_scan_full`)."""
    if full:
        render_scan_full(result, console)
        return
    _header(result, console)
    per_block = Counter(b["placement"] for b in result.blocks)
    if len(per_block) > 1:
        console.print("blocks: " + ", ".join(f"{v} × {k}" for k, v in per_block.items()))
    _verdict(result, console, evidence=True)
    contracts: dict[str, list[dict]] = {}
    for g in result.groups():
        contracts.setdefault(g["summary"], []).append(g)
    for summary, groups in contracts.items():
        n = sum(len(g["sites"]) for g in groups)
        console.print()
        indented(console, f"{n} site{'s' * (n != 1)}: {summary}", 0, 2)
        for g in groups:
            sites = g["sites"]
            layers = [s.layer for s in sites if s.layer is not None]
            where = f", layers {layer_ranges(layers)}" if layers else ""
            kind = "" if g["kind"] == "module" else f", by {g['kind']}"
            measured = _activation(sites, g["spec"])
            bad = "" if measured.startswith(("reproduced", "not measured")) else " (NOT reproduced)"
            names = _names(sites, _block_paths(result)).split("\n")
            indented(console, f"role {g['role']}{where}{kind}{bad}: {_folded(names)}", 2, 4)
    for r in result.rejected:
        if r["kind"] == "behaviour":
            indented(console, f"not a normalization: {r['name']} ({r['class']}): {r['reason']}", 0, 2)
    console.print()
    console.print("[dim]--all: γ statistics and each group's real-activation error; --json: every field[/]")


def render_scan_full(result: ModelScan, console: Console) -> None:
    """Plain lines wrapped at the console's width, one paragraph per group of sites with the same contract: every
    field and every name stays readable in a narrow terminal and in a CI log (a wide table drops columns)."""
    _header(result, console)
    for g in result.groups():
        sites = g["sites"]
        layers = [s.layer for s in sites if s.layer is not None]
        kind = "" if g["kind"] == "module" else f" ({g['kind']})"
        where = f", layers {layer_ranges(layers)}" if layers else ""
        console.print()
        console.print(f"[bold]{len(sites)} × {escape(g['class'])}[/]{escape(kind)}: role {g['role']}{where}")
        for name in _names(sites, _block_paths(result)).split("\n"):
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
    _verdict(result, console, evidence=False)
