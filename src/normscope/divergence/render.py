"""Rendering of a :class:`~normscope.divergence.result.Diff`: a rich table (own vs propagated error per site) and a
PNG of the errors against depth (matplotlib, imported here only). Computes nothing."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..report.console import fold_dotted, name_width
from ..report.numbers import sig
from .result import Diff

_STYLE = {"within": "green", "regrouped": "cyan", "diverged": "bold red", "raised": "bold red", "shape": "bold red",
          "propagated": "dim", "unmatched": "yellow", "reference_not_finite": "yellow"}


_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _e(v) -> str:
    return "—" if v is None else sig(v)


def _pair(a: float, b: float) -> str:
    """An error and its bound, as ``a/b``."""
    return f"{sig(a)}/{sig(b)}"


def _table(console: Console, cols: tuple[str, ...], rows: list[tuple[str, ...]], right: set[str],
           title: str | None = None) -> Table:
    """A table whose ``site`` column folds each name only after a dot, at the width the other columns leave."""
    i = cols.index("site")
    width = name_width(console.width, [[c, *(r[j] for r in rows)] for j, c in enumerate(cols) if j != i])
    names = [fold_dotted(r[i], width) for r in rows]
    widest = max((len(line) for n in names for line in n.split("\n")), default=4)
    t = Table(show_lines=False, header_style="bold", title=title)
    for col in cols:  # the other columns wrap at spaces, or fold, to leave the names their width
        t.add_column(col, justify="right" if col in right else "left", overflow="fold",
                     min_width=min(widest, width) if col == "site" else None)
    for r, name in zip(rows, names, strict=True):
        t.add_row(*r[:i], escape(name), *r[i + 1:])
    return t


def _db(m) -> str:
    if not m or "sqnr_db" not in m:
        return "—"
    v = m["sqnr_db"]
    return "∞" if v == math.inf else f"{v:.1f}"


def render_diff(d: Diff, console: Console, *, all_sites: bool = False) -> None:
    """The table; by default the sites with a measured own error, the culprit and anything not compared; with
    ``grad=True`` the gradient table after it."""
    _render_forward(d, console, all_sites)
    if d.grad:
        _render_grad(d, console, all_sites)


def _render_grad(d: Diff, console: Console, all_sites: bool) -> None:
    rows = []
    for s in d.grad_sites:
        if not (all_sites or s.own is not None or s.status != "propagated"):
            continue
        style = _STYLE.get(s.status, "")
        status = s.status + (" ◀ first" if s.name == d.grad_first_divergence else "")
        bound = _e(s.bound) if s.elementwise is None else \
            f"{s.elementwise['gradient']} {_pair(s.elementwise['worst_error'], s.elementwise['worst_bound'])}"
        rows.append((str(s.order), s.name, escape(s.cls), _e(s.judged_error), bound, _e(s.propagated_error),
                     f"[{style}]{status}[/]" if style else status))
    t = _table(console, ("#", "site", "class", "own dx err", "bound", "propagated dy", "status"), rows,
               {"#", "own dx err", "bound", "propagated dy"}, title="gradients (backward order)")
    console.print(t)
    if d.grad_first_divergence is None:
        console.print(f"[green]gradients: no divergence ({sum(s.own is not None for s in d.grad_sites)} sites' own "
                      f"gradient errors within the bound)[/]")
    else:
        console.print(f"[bold red]gradients, first divergence:[/] {escape(d.grad_first_divergence)} — "
                      f"{escape((d.grad_divergence or {}).get('reason', ''))}")


SHOWN = 7  # rows of the default table: the culprit and the sites before it, what was not compared, the closest


def _render_forward(d: Diff, console: Console, all_sites: bool) -> None:
    """The verdict and its evidence first; then the sites that tell it (the culprit and the two sites before it,
    sites not compared, or the sites nearest their bound), names shortened by their common prefix; ``all_sites``:
    every site, as before."""
    at = "" if d.autocast else f" ({d.candidate_dtype})"  # the candidate's description names its autocast
    console.print(f"[bold]{escape(d.reference)}[/] ({d.reference_dtype}) vs [bold]{escape(d.candidate)}[/]"
                  f"{at}: {len(d.sites)} sites, alignment by {d.stats.get('alignment', '?')}")
    _verdict(d, console)
    shown = _rows(d) if not all_sites else [s for s in d.sites if s.own is not None or s.status != "propagated"
                                             or s.name == d.first_divergence or s.own_missing]
    prefix = "" if all_sites else _common_prefix([s.name for s in shown])
    # under autocast each site runs at its own dtype: the column says which one it was judged at
    # a quantized candidate: what its dequantized weights explain of each site's error, beside what they do not
    quantized = any(s.beyond_twin is not None for s in d.sites)
    cols = (("#", "site", "class") if all_sites else ("site",)) + (("ran at",) if d.autocast else ()) + (
        ("quantized", "beyond") if quantized else ("own err",)) + ("bound", "propagated") + (
        ("SQNR dB",) if all_sites else ()) + ("status",)
    rows = []
    for s in shown:
        style = _STYLE.get(s.status, "")
        status = s.status + (" ◀ first" if s.name == d.first_divergence else "")
        if s.own_missing:  # a site that would get an own error and could not: the row says why
            status += f" (own n/a — {escape(s.own_missing)})"
        bound = _e(s.bound) if s.elementwise is None else \
            _pair(s.elementwise["worst_error"], s.elementwise["worst_bound"])
        ran = ((_SHORT.get(s.dtype, s.dtype or "—"),) if d.autocast else ())
        own = "n/a" if s.own_missing else _e(s.judged_error)
        if quantized:  # a norm keeps its float weights: its row is judged on its contract, as ever
            own = (_e(s.twin) if s.beyond_twin is not None else "—", own)
        else:
            own = (own,)
        head = (str(s.order), s.name, escape(s.cls)) if all_sites else (s.name[len(prefix):],)
        rows.append((*head, *ran, *own, bound, _e(s.propagated_error), *((_db(s.propagated),) if all_sites else ()),
                     f"[{style}]{status}[/]" if style else status))
    t = _table(console, cols, rows, {"#", "own err", "quantized", "beyond", "bound", "propagated", "SQNR dB"})
    if prefix:
        console.print(f"[dim]sites under {escape(prefix)}[/]")
    console.print(t)
    if not all_sites:
        console.print(f"[dim]{len(shown)} of {len(d.sites)} sites shown (--all: every site; --json: everything). "
                      "err = ‖c − r‖/‖r‖; own: the candidate's module on the reference's input; at norm sites the "
                      "bound is a/b: the worst element's distance a from the contract's float64 value, its bound b[/]")
    else:
        console.print("[dim]err = ‖candidate − reference‖ / ‖reference‖ at the site; own = the candidate's module on "
                      "the reference's input; propagated = the candidate's own forward; at norm sites the bound column "
                      "is a/b: the worst element's distance a from the site contract's float64 value, and its bound b "
                      "under that contract's error model[/]")
    if quantized:
        console.print("[dim]quantized = ‖t − r‖/‖r‖, t the reference's module run with the candidate's own dequantized "
                      "weights on the reference's input: the error its quantization explains; beyond = ‖c − t‖/‖t‖, "
                      "what it does not explain, held to the bound[/]")
    for s in [s for s in d.sites if s.status == "regrouped"][:3]:
        console.print(f"[cyan]regrouped:[/] {escape(s.name)}: {escape(s.note)}")
    for n in d.notes[:5]:
        console.print(f"[yellow]note:[/] {escape(n)}")
    if len(d.notes) > 5:
        console.print(f"[dim]… {len(d.notes) - 5} more notes (--json lists all)[/]")


def _verdict(d: Diff, console: Console) -> None:
    if d.first_divergence is None:
        if d.failed:
            console.print(f"[bold red]FAIL[/] — {escape(d._forward_summary())}")
        elif d.inconclusive:
            console.print("[bold yellow]INCONCLUSIVE[/] — the comparison could not tell, so this is not a pass:")
            for why in d.inconclusive:
                console.print(f"  [yellow]•[/] {escape(why)}")
        else:
            console.print(f"[green]PASS[/] — {escape(d._forward_summary())}")
        return
    v = d.divergence or {}
    console.print(f"[bold red]FAIL — first divergence:[/] {escape(d.first_divergence)} ({escape(v.get('class', ''))}) "
                  f"— {escape(v.get('reason', ''))}")
    for line in v.get("differences", []):
        console.print(f"  contract: {escape(line)}")
    if v.get("differences_note"):
        console.print(f"  contract: {escape(v['differences_note'])}")
    for key in ("offset_note", "stated_note"):
        if v.get(key):
            console.print(f"  contract: {escape(v[key])}")
    if v.get("contracts_error"):
        console.print(f"  [yellow]contracts not inferred:[/] {escape(v['contracts_error'])}")


def _ratio(s) -> float:
    """How near its bound a site's own error came (0 without one)."""
    if s.elementwise is not None:
        return float(s.elementwise.get("max_ratio") or 0.0)
    if s.own_error is None or not s.bound:
        return 0.0
    return float(s.judged_error) / float(s.bound)


def _rows(d: Diff) -> list:
    """The sites that tell the verdict, in execution order: the first divergence and the two compared sites before
    it; every site not compared (up to a few); without a divergence, the sites whose own error came nearest their
    bound."""
    picked: dict[int, object] = {}
    if d.first_divergence is not None:
        culprit = d.site(d.first_divergence)
        before = [s for s in d.sites if s.order < culprit.order and s.own is not None][-2:]
        for s in [*before, culprit]:
            picked[s.order] = s
    for s in [s for s in d.sites if s.status in ("unmatched", "raised", "shape", "regrouped")
              or s.own_missing][:SHOWN // 2]:
        picked[s.order] = s
    if d.first_divergence is None:  # the evidence of a pass: the compared sites nearest their bound
        for s in sorted((s for s in d.sites if s.own is not None), key=_ratio, reverse=True)[:max(3, SHOWN -
                                                                                                   len(picked))]:
            picked[s.order] = s
    return [picked[k] for k in sorted(picked)]


def _common_prefix(names: list[str]) -> str:
    """The dotted prefix every name shares (``model.layers.``), leaving each name at least one part."""
    if len(names) < 2:
        return ""
    parts = [n.split(".") for n in names]
    common = []
    for group in zip(*(p[:-1] for p in parts), strict=False):
        if len(set(group)) != 1:
            break
        common.append(group[0])
    return ".".join(common) + "." if common else ""


def plot_diff(d: Diff, path: str | Path) -> Path:
    """Own and propagated error against site order (log scale), the bounds, the first divergence marked."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    try:
        def series(get):
            xs, ys = [], []
            for s in d.sites:
                v = get(s)
                if v is not None and isinstance(v, float) and math.isfinite(v) and v > 0:
                    xs.append(s.order)
                    ys.append(v)
            return xs, ys
        ax.plot(*series(lambda s: s.propagated_error), "-", color="tab:blue", lw=1, label="propagated")
        ax.plot(*series(lambda s: s.own_error), ".", color="tab:orange", ms=4, label="own (teacher-forced)")
        ax.plot(*series(lambda s: s.bound), "_", color="tab:gray", ms=6, label="bound")
        if d.first_divergence is not None:
            s = d.site(d.first_divergence)
            ax.axvline(s.order, color="tab:red", lw=1, ls="--", label=f"first divergence: {s.name}")
        ax.set_yscale("log")
        ax.set_xlabel("site (execution order)")
        ax.set_ylabel("‖c − r‖ / ‖r‖")
        ax.set_title(f"{d.reference} ({d.reference_dtype}) vs {d.candidate} ({d.candidate_dtype})", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path
