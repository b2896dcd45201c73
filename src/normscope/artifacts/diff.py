"""Every mismatch between two static contracts, site by site, and the verdict they give.

Sites are aligned by canonical name. A field is compared only where both artifacts state it; what cannot be
decided from what the artifacts hold is listed as *unverified*, never as a match or a mismatch: a γ offset
without the weights on both sides, and a site whose artifact holds weights (``ModelContract.weights``) but none
was matched to it. The verdict (:class:`~normscope.results.verdict.Verdict`): fail on a mismatch; else
inconclusive when anything is unverified or nothing was compared; else pass.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..jsonable import jsonable
from ..report.numbers import sig
from ..results.verdict import Verdict, verdict_of
from ..spec import eps_close  # one ε tolerance for the whole project
from .model import ContractSite, ModelContract

SCHEMA = "normscope.contract-diff/1"
EPS_RTOL = 0.01  # the resolution of inference (spec.differences uses the same)
GAMMA_ATOL = 1e-2  # γ statistics of the same weights stored in f16/bf16 agree far closer than this
SHOWN = 4  # unverified sites named in the verdict's reason; the rest are counted
_PLACEMENT = {"inside_sqrt": "ε inside √ (sqrt(var+ε))", "outside_sqrt": "ε outside √ (std+ε)",
              "clamp": "ε as a clamp (max(std, ε))", "none": "no ε"}


@dataclasses.dataclass(frozen=True)
class DiffItem:
    site: str  # canonical site name, or "model" for model-level facts
    field: str
    a: Any
    b: Any
    status: str  # "mismatch" or "unverified"
    message: str

    def to_dict(self) -> dict[str, Any]:
        return jsonable(dataclasses.asdict(self))


@dataclasses.dataclass
class ContractDiff(Verdict):
    a: str
    b: str
    items: list[DiffItem]
    matched: list[str]  # sites present in both
    compared_fields: int

    @property
    def mismatches(self) -> list[DiffItem]:
        return [i for i in self.items if i.status == "mismatch"]

    @property
    def unverified(self) -> list[DiffItem]:
        return [i for i in self.items if i.status == "unverified"]

    @property
    def verdict(self) -> str:
        """``"fail"`` (a mismatch), ``"inconclusive"`` (none, but something is unverified or nothing was compared:
        :attr:`undecided` says what) or ``"pass"``; ``ok`` (from :class:`Verdict`) is the verdict pass."""
        return verdict_of(bool(self.mismatches), bool(self.undecided))

    @property
    def undecided(self) -> list[str]:
        """Why the comparison cannot pass without a mismatch: nothing compared, or the unverified sites (the first
        few by name, then a count). Empty when every site stated on both sides was compared."""
        out = []
        if not self.compared_fields:
            out.append("nothing was compared: the two artifacts state no field in common (no site in both, or "
                       "sites without a stated contract); compare artifacts that state their norms")
        sites = list(dict.fromkeys(i.site for i in self.unverified))
        if sites:
            more = f" and {len(sites) - SHOWN} more" if len(sites) > SHOWN else ""
            out.append(f"{len(sites)} site{'s' * (len(sites) != 1)} unverified: {', '.join(sites[:SHOWN])}{more} — "
                       f"what the artifacts hold cannot decide {'it' if len(sites) == 1 else 'them'} (each item says "
                       "what is missing); each site's weights, read on both sides, would")
        return out

    def to_dict(self) -> dict[str, Any]:
        return jsonable({
            "schema": SCHEMA,
            "a": self.a,
            "b": self.b,
            "verdict": self.verdict,
            "ok": self.ok,
            "undecided": self.undecided,
            "matched_sites": len(self.matched),
            "compared_fields": self.compared_fields,
            "mismatches": len(self.mismatches),
            "unverified": len(self.unverified),
            "items": [i.to_dict() for i in self.items],
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def compare(a: ModelContract, b: ModelContract) -> ContractDiff:
    """Every difference between two contracts: model-level facts, then each site, then missing/extra sites."""
    items: list[DiffItem] = []
    counter = [0]

    def add(site: str, field: str, va, vb, status: str, message: str) -> None:
        items.append(DiffItem(site, field, va, vb, status, message))

    if a.placement and b.placement:
        counter[0] += 1
        if a.placement != b.placement:
            add("model", "placement", a.placement, b.placement, "mismatch",
                f"block design {a.placement} in A, {b.placement} in B")
    if a.n_layers and b.n_layers:
        counter[0] += 1
        if a.n_layers != b.n_layers:
            add("model", "n_layers", a.n_layers, b.n_layers, "mismatch", f"{a.n_layers} blocks in A, {b.n_layers} in B")

    names_b = {s.name: s for s in b.sites}
    matched = []
    for sa in a.sites:
        sb = names_b.get(sa.name)
        if sb is None:
            add(sa.name, "site", sa.source, None, "mismatch", f"{sa.name} ({sa.source}) is in A but not in B")
            continue
        matched.append(sa.name)
        counter[0] += _compare_site(sa, sb, add, (a.weights, b.weights))
    names_a = {s.name for s in a.sites}
    for sb in b.sites:
        if sb.name not in names_a:
            add(sb.name, "site", None, sb.source, "mismatch", f"{sb.name} ({sb.source}) is in B but not in A")
    return ContractDiff(a=a.source, b=b.source, items=items, matched=matched, compared_fields=counter[0])


def _both(sa: ContractSite, sb: ContractSite, field: str) -> bool:
    return getattr(sa, field) is not None and getattr(sb, field) is not None


def _compare_site(sa: ContractSite, sb: ContractSite, add, weights: tuple[bool, bool]) -> int:
    n = 0
    name = sa.name
    if _both(sa, sb, "family"):
        n += 1
        if sa.family != sb.family:
            add(name, "family", sa.family, sb.family, "mismatch", f"{sa.family} in A, {sb.family} in B")
    if _both(sa, sb, "eps_placement"):
        n += 1
        if sa.eps_placement != sb.eps_placement and not (sa.eps == sb.eps == 0):
            add(name, "eps_placement", sa.eps_placement, sb.eps_placement, "mismatch",
                f"{_PLACEMENT[sa.eps_placement]} in A, {_PLACEMENT[sb.eps_placement]} in B")
    if _both(sa, sb, "eps"):
        n += 1
        if not eps_close(sa.eps, sb.eps, EPS_RTOL):
            add(name, "eps", sa.eps, sb.eps, "mismatch", f"ε={sa.eps:g} in A, ε={sb.eps:g} in B")
    if _both(sa, sb, "axes"):
        n += 1
        if sa.axes != sb.axes:
            add(name, "axes", list(sa.axes), list(sb.axes), "mismatch",
                f"statistics over axes {list(sa.axes)} in A, {list(sb.axes)} in B")
    if _both(sa, sb, "size"):
        n += 1
        if sa.size != sb.size:
            add(name, "size", sa.size, sb.size, "mismatch", f"normalizes {sa.size} features in A, {sb.size} in B")
    if _both(sa, sb, "groups"):
        n += 1
        if sa.groups != sb.groups:
            add(name, "groups", sa.groups, sb.groups, "mismatch", f"{sa.groups} groups in A, {sb.groups} in B")
    for field, sym, neutral in (("gamma", "γ", "identity_gamma"), ("beta", "β", "zero_beta")):
        if _both(sa, sb, field):
            n += 1
            if getattr(sa, field) != getattr(sb, field) and not (getattr(sa, neutral) or getattr(sb, neutral)):
                va, vb = getattr(sa, field), getattr(sb, field)
                add(name, field, va, vb, "mismatch",
                    f"{'a learned ' + sym if va else 'no ' + sym} in A, {'a learned ' + sym if vb else 'no ' + sym} in B")
    n += _compare_gamma(sa, sb, add, weights)
    n += _compare_beta(sa, sb, add)
    return n


def _compare_gamma(sa: ContractSite, sb: ContractSite, add, weights: tuple[bool, bool]) -> int:
    """γ as it acts (offset + stored weight). A site whose artifact holds weights but has none for it is
    unverified, as is an offset difference without weights; neither is skipped."""
    if sa.gamma is False or sb.gamma is False:
        return 0  # presence was compared above
    ea, eb = sa.effective_gamma, sb.effective_gamma
    if ea is not None and eb is not None:
        worst = max(abs(ea[k] - eb[k]) for k in ("mean", "min", "max"))
        tol = GAMMA_ATOL * max(1.0, *(abs(v) for v in (*ea.values(), *eb.values())))
        if worst > tol:
            add(sa.name, "gamma", _gamma_text(sa), _gamma_text(sb), "mismatch",
                f"effective γ (offset + w) differs by up to {sig(worst)}{_gamma_hint(ea, eb)}")
        return 1
    lost = [x for x, s, held in (("A", sa, weights[0]), ("B", sb, weights[1])) if held and s.gamma_stats is None]
    if lost:
        where = " and ".join(f"{x} ({s.source})" for x, s in (("A", sa), ("B", sb)) if x in lost)
        add(sa.name, "gamma", _gamma_text(sa), _gamma_text(sb), "unverified",
            f"no weight of {where} was matched to this site although the artifact holds weights: its γ was not "
            "compared")
        return 0
    if _both(sa, sb, "gamma_offset") and sa.gamma_offset != sb.gamma_offset:
        missing = " and ".join(x for x, s in (("A", sa), ("B", sb)) if s.gamma_stats is None)
        add(sa.name, "gamma_offset", sa.gamma_offset, sb.gamma_offset, "unverified",
            f"γ acts as {sa.gamma_offset:g} + w in A, {sb.gamma_offset:g} + w in B; without the weights of {missing} "
            "it cannot be told whether the stored γ carries the offset")
    return 0


def _gamma_hint(ea: dict[str, float], eb: dict[str, float]) -> str:
    """What a γ difference looks like: a side whose γ is 0 everywhere, or a shift by one (a lost offset)."""
    zero = [x for x, e in (("A", ea), ("B", eb)) if e["min"] == e["max"] == 0.0]
    if zero:
        return f"; γ is 0 everywhere in {' and '.join(zero)}: the norm outputs β alone (a zeroed weight?)"
    return "; a lost or doubled γ offset (Gemma's 1 + w)?" if abs(abs(ea["mean"] - eb["mean"]) - 1) < 0.05 else ""


def _compare_beta(sa: ContractSite, sb: ContractSite, add) -> int:
    """β's stored values (mean, min, max), where both artifacts hold them, within the tolerance γ's have."""
    ba, bb = sa.beta_stats, sb.beta_stats
    if ba is None or bb is None or sa.beta is False or sb.beta is False:
        return 0
    worst = max(abs(ba[k] - bb[k]) for k in ("mean", "min", "max"))
    if worst > GAMMA_ATOL * max(1.0, *(abs(v) for v in (*ba.values(), *bb.values()))):
        add(sa.name, "beta_values", dict(ba), dict(bb), "mismatch", f"β differs by up to {sig(worst)}")
    return 1


def _gamma_text(s: ContractSite) -> dict[str, Any]:
    return {"offset": s.gamma_offset, **(s.gamma_stats or {})}
