"""Plain-text rendering of static contracts and their differences. Nothing here computes a verdict."""

from __future__ import annotations

import re
from typing import Any

from rich.console import Console

from ..report.console import fmt, indented
from ..sites.result import layer_ranges
from .diff import ContractDiff
from .model import ContractSite, ModelContract
from .names import slot_of, stream_of

_PLACEMENT = {"inside_sqrt": "inside √", "outside_sqrt": "outside √ (std+ε)", "clamp": "clamp", "none": "none"}
_UNKNOWN = "?"


def _v(value: Any, text: str | None = None) -> str:
    return _UNKNOWN if value is None else (text if text is not None else str(value))


def _key(s: ContractSite) -> tuple:
    return (stream_of(s.name), slot_of(s.name), s.role, s.family, s.eps, s.eps_placement, s.axes, s.size,
            s.param_shape, s.gamma, s.beta, s.gamma_offset, s.groups)


def _groups(sites: list[ContractSite]) -> list[list[ContractSite]]:
    """Sites of consecutive layers with the same slot and contract, as one row each."""
    groups: list[list[ContractSite]] = []
    for s in sites:
        for g in groups:
            last = g[-1]
            if s.layer is not None and last.layer is not None and _key(g[0]) == _key(s) \
                    and s.layer == last.layer + 1:
                g.append(s)
                break
        else:
            groups.append([s])
    return groups


def _layers(g: list[ContractSite]) -> str:
    if g[0].layer is None:
        return g[0].name
    slot = slot_of(g[0].name)
    if len(g) == 1:
        return g[0].name
    return f"{stream_of(g[0].name)}layers {g[0].layer}–{g[-1].layer} {slot}"


def _gamma(g: list[ContractSite]) -> tuple[str, str]:
    stats = [s.gamma_stats for s in g if s.gamma_stats]
    if not stats:
        return _UNKNOWN, _UNKNOWN
    means = [st["mean"] for st in stats]
    mean = fmt(means[0]) if len(set(means)) == 1 else f"{fmt(min(means))}…{fmt(max(means))}"
    lo, hi = min(st["min"] for st in stats), max(st["max"] for st in stats)
    return mean, f"{fmt(lo)}…{fmt(hi)}"


def _fields(s: ContractSite, g: list[ContractSite]) -> str:
    """One site group's contract as a line of text (? where the artifact does not say)."""
    mean, span = _gamma(g)
    eps = "?" if s.eps is None else f"{s.eps:g}"
    placement = "" if s.eps_placement is None else " " + _PLACEMENT.get(s.eps_placement, s.eps_placement)
    parts = [f"role {_v(s.role)}", _v(s.family), f"ε={eps}{placement}",
             f"axes {_v(s.axes, None if s.axes is None else str(list(s.axes)))}", f"size {_v(s.size)}",
             f"β {_v(s.beta, None if s.beta is None else ('yes' if s.beta else 'no'))}",
             f"γ offset {_v(s.gamma_offset, None if s.gamma_offset is None else f'{s.gamma_offset:g}')}"]
    if s.groups:
        parts.append(f"{s.groups} groups")
    if mean != "?":
        parts.append(f"γ mean {mean}, range {span}")
    return ", ".join(parts)


def render_contract(c: ModelContract, console: Console) -> None:
    """Plain lines wrapped at the console's width (a terminal of 80 columns, a CI log): a header, then one line per
    run of consecutive layers with the same slot and contract, the contract beneath it; ? = not stated."""
    head = [f"{c.source} ({c.kind})"]
    if c.architecture:
        head.append(f"architecture {c.architecture}")
    if c.placement:
        head.append(f"placement {c.placement}")
    if c.eps is not None:
        head.append(f"ε={c.eps:g}" + (f" ({c.eps_key})" if c.eps_key else ""))
    if c.n_layers:
        head.append(f"{c.n_layers} blocks")
    head.append(f"{len(c.sites)} norm site{'s' * (len(c.sites) != 1)}")
    indented(console, ", ".join(head), 0)
    for g in _groups(c.sites):
        indented(console, _layers(g) + (f" ({len(g)} sites)" if len(g) > 1 else ""), 2)
        indented(console, _fields(g[0], g), 4)
    for note in c.notes:
        indented(console, f"note: {note}", 0)
    for s in c.sites:
        for note in s.notes:
            indented(console, f"{s.name}: {note}", 2)


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict) and "offset" in v:  # γ: stored statistics and the offset they act with
        off = v["offset"] or 0.0
        stored = f"w̄ {fmt(v['mean'])} ({fmt(v['min'])}…{fmt(v['max'])})" if "mean" in v else "w"
        return f"{fmt(off)} + {stored}" if off else stored
    if isinstance(v, dict) and set(v) == {"mean", "min", "max"}:  # β's stored statistics
        return f"mean {fmt(v['mean'])} ({fmt(v['min'])}…{fmt(v['max'])})"
    return str(v)


def _sites(names: list[str]) -> str:
    """Every site name, consecutive layers of one slot folded: 'attn_norm in layers 0–3, 5; final_norm'."""
    slots: dict[str, list[int]] = {}
    for name in names:
        m = re.fullmatch(r"(.*?)layers\.(\d+)\.(.+)", name)
        if m:
            slots.setdefault((m.group(1), m.group(3)), []).append(int(m.group(2)))
        else:
            slots.setdefault(("", name), [])
    parts = []
    for (stream, slot), layers in slots.items():
        if len(layers) == 1:
            parts.append(f"{stream}layers.{layers[0]}.{slot}")
        else:
            parts.append(f"{stream}{slot} in layers {layer_ranges(layers)}" if layers else slot)
    return "; ".join(parts)


def render_diff(diff: ContractDiff, console: Console) -> None:
    """Every difference as plain lines (verdict, field, where, A and B, then the reason), wrapped at the console's
    width; identical differences at several sites share one entry that names every site."""
    indented(console, f"A = {diff.a}", 0)
    indented(console, f"B = {diff.b}", 0)
    rows: list[tuple[list[str], Any]] = []
    fields = list(dict.fromkeys(i.field for i in diff.items))
    for i in sorted(diff.items, key=lambda i: fields.index(i.field)):
        if rows and (rows[-1][1].field, rows[-1][1].a, rows[-1][1].b, rows[-1][1].message) == \
                (i.field, i.a, i.b, i.message):
            rows[-1][0].append(i.site)
        else:
            rows.append(([i.site], i))
    for sites, i in rows:
        where = f"{len(sites)} sites: {_sites(sites)}" if len(sites) > 1 else sites[0]
        indented(console, f"{i.status.upper()} {i.field} at {where}", 2)
        indented(console, f"A: {_cell(i.a)}; B: {_cell(i.b)}; {i.message}", 4)
    summary = (f"{len(diff.matched)} sites in both, {diff.compared_fields} fields compared: "
               f"{len(diff.mismatches)} mismatches, {len(diff.unverified)} unverified")
    head, colour = {"pass": ("no mismatch", "green"), "fail": ("MISMATCH", "red"),
                    "inconclusive": ("INCONCLUSIVE", "yellow")}.get(diff.verdict, (diff.verdict.upper(), "red"))
    console.print(f"[bold {colour}]{head}[/] — {summary}")
    for reason in diff.undecided:
        indented(console, reason, 2)
