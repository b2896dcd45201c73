"""Rich tables for static contracts and their differences. Nothing here computes a verdict."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..report.console import fmt
from .diff import ContractDiff
from .model import ContractSite, ModelContract
from .names import slot_of

_PLACEMENT = {"inside_sqrt": "inside √", "outside_sqrt": "outside √ (std+ε)", "clamp": "clamp", "none": "none"}
_UNKNOWN = "[dim]?[/]"


def _v(value: Any, text: str | None = None) -> str:
    return _UNKNOWN if value is None else escape(text if text is not None else str(value))


def _key(s: ContractSite) -> tuple:
    return (slot_of(s.name), s.role, s.family, s.eps, s.eps_placement, s.axes, s.size, s.param_shape, s.gamma,
            s.beta, s.gamma_offset, s.groups)


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
    return f"layers {g[0].layer}–{g[-1].layer} {slot}"


def _gamma(g: list[ContractSite]) -> tuple[str, str]:
    stats = [s.gamma_stats for s in g if s.gamma_stats]
    if not stats:
        return _UNKNOWN, _UNKNOWN
    means = [st["mean"] for st in stats]
    mean = fmt(means[0]) if len(set(means)) == 1 else f"{fmt(min(means))} … {fmt(max(means))}"
    lo, hi = min(st["min"] for st in stats), max(st["max"] for st in stats)
    return mean, f"{fmt(lo)} … {fmt(hi)}"


def render_contract(c: ModelContract, console: Console) -> None:
    head = [f"[bold]{escape(c.source)}[/] ({c.kind})"]
    if c.architecture:
        head.append(f"architecture {escape(c.architecture)}")
    if c.placement:
        head.append(f"placement {c.placement}")
    if c.eps is not None:
        head.append(f"ε = {c.eps:g}" + (f" ({escape(c.eps_key)})" if c.eps_key else ""))
    if c.n_layers:
        head.append(f"{c.n_layers} blocks")
    console.print(", ".join(head))
    t = Table(title=f"{len(c.sites)} norm sites", title_justify="left")
    for col, just in (("sites", "left"), ("n", "right"), ("role", "left"), ("family", "left"), ("ε", "right"),
                      ("ε placement", "left"), ("axes", "left"), ("size", "right"), ("β", "left"),
                      ("γ offset", "right"), ("γ mean", "right"), ("γ min … max", "right")):
        t.add_column(col, justify=just)
    for g in _groups(c.sites):
        s = g[0]
        mean, span = _gamma(g)
        t.add_row(
            escape(_layers(g)), str(len(g)), _v(s.role), _v(s.family), _v(s.eps, None if s.eps is None else f"{s.eps:g}"),
            _v(s.eps_placement, _PLACEMENT.get(s.eps_placement or "", s.eps_placement)),
            _v(s.axes, None if s.axes is None else str(list(s.axes))),
            _v(s.size), _v(s.beta, None if s.beta is None else ("yes" if s.beta else "no")),
            _v(s.gamma_offset, None if s.gamma_offset is None else f"{s.gamma_offset:g}"), mean, span,
        )
    console.print(t)
    for note in c.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    for s in c.sites:
        for note in s.notes:
            console.print(f"[dim]{escape(s.name)}: {escape(note)}[/]")


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict) and "offset" in v:  # γ: stored statistics and the offset they act with
        off = v["offset"] or 0.0
        stored = f"w̄ {fmt(v['mean'])} ({fmt(v['min'])} … {fmt(v['max'])})" if "mean" in v else "w"
        return f"{fmt(off)} + {stored}" if off else stored
    return escape(str(v))


def _sites(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{len(names)} sites: {names[0]} … {names[-1]}"


def render_diff(diff: ContractDiff, console: Console) -> None:
    console.print(f"A = [bold]{escape(diff.a)}[/]\nB = [bold]{escape(diff.b)}[/]")
    if diff.items:
        t = Table(title="differences", title_justify="left")
        for col in ("site", "field", "A", "B", "verdict", "detail"):
            t.add_column(col)
        rows: list[tuple[list[str], Any]] = []  # identical differences at several sites share one row
        fields = list(dict.fromkeys(i.field for i in diff.items))
        for i in sorted(diff.items, key=lambda i: fields.index(i.field)):
            if rows and (rows[-1][1].field, rows[-1][1].a, rows[-1][1].b, rows[-1][1].message) == \
                    (i.field, i.a, i.b, i.message):
                rows[-1][0].append(i.site)
            else:
                rows.append(([i.site], i))
        for sites, i in rows:
            verdict = "[red]mismatch[/]" if i.status == "mismatch" else "[yellow]unverified[/]"
            t.add_row(escape(_sites(sites)), i.field, _cell(i.a), _cell(i.b), verdict, escape(i.message))
        console.print(t)
    summary = (f"{len(diff.matched)} sites in both, {diff.compared_fields} fields compared: "
               f"{len(diff.mismatches)} mismatches, {len(diff.unverified)} unverified")
    colour = "green" if diff.ok else "red"
    console.print(f"[bold {colour}]{'no mismatch' if diff.ok else 'MISMATCH'}[/] — {summary}")
