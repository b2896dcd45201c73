"""The result of a scan: one :class:`Site` per norm application and the model-level :class:`ModelScan`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..errors import InputError, SpecError
from ..jsonable import document, jsonable, parse
from ..results.inference import undecided
from ..results.verdict import Verdict, verdict_of
from ..spec import NormSpec

SCHEMA = "normscope.scan/1"
KINDS = ("module", "behaviour", "functional", "inline")


@dataclasses.dataclass
class Site:
    """One application of a normalization in a forward.

    ``kind``: how it was found — ``module`` (a known normalization class), ``behaviour`` (a module of any
    class whose forward behaved as a normalization on its real activation and was confirmed by ``infer``) or
    ``functional`` (a call to ``F.layer_norm``/``rms_norm``/``group_norm``/``batch_norm``/``instance_norm``) or
    ``inline`` (the op pattern of a norm written inside a larger forward, :mod:`normscope.sites.inline`).
    ``gamma``: mean/min/max of the stored γ parameter and the offset the contract applies (``1 + w``).
    ``activation``: the contract against the real activation recorded at the site.
    """

    name: str
    kind: str
    cls: str
    role: str
    role_evidence: str
    layer: int | None
    shape: tuple[int, ...]
    dtype: str
    order: int
    spec: NormSpec | None = None
    gamma: dict[str, float] | None = None
    activation: dict[str, Any] = dataclasses.field(default_factory=dict)
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    calls: int = 0
    seconds: float = 0.0
    error: str | None = None
    stream: int | None = None  # the residual stream it belongs to (an index into ModelScan.streams)
    eps_keys: list[str] | None = None  # the config keys its ε follows ([]: the code's own; None: not told)

    @property
    def summary(self) -> str:
        if self.spec is None:
            return f"not inferred: {self.error}"
        return self.spec.summary(undecided(self.evidence or {}))

    @property
    def eps(self) -> float | None:
        return None if self.spec is None else self.spec.eps

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "class": self.cls, "role": self.role,
            "role_evidence": self.role_evidence, "layer": self.layer, "shape": list(self.shape), "dtype": self.dtype,
            "order": self.order, "spec": None if self.spec is None else self.spec.to_dict(), "summary": self.summary,
            "gamma": jsonable(self.gamma), "activation": jsonable(self.activation), "evidence": jsonable(self.evidence),
            "calls": self.calls, "seconds": round(self.seconds, 4), "error": self.error, "stream": self.stream,
            "eps_keys": self.eps_keys,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Site:
        try:
            return cls(
                name=d["name"], kind=d["kind"], cls=d["class"], role=d["role"], role_evidence=d.get("role_evidence", ""),
                layer=d.get("layer"), shape=tuple(d["shape"]), dtype=d["dtype"], order=d.get("order", 0),
                spec=None if d.get("spec") is None else NormSpec.from_dict(d["spec"]), gamma=d.get("gamma"),
                activation=d.get("activation") or {}, evidence=d.get("evidence") or {}, calls=d.get("calls", 0),
                seconds=d.get("seconds", 0.0), error=d.get("error"), stream=d.get("stream"),
                eps_keys=d.get("eps_keys"))
        except (KeyError, TypeError) as exc:
            raise InputError(f"a site in the scan JSON is missing or has a malformed field ({exc})") from None


@dataclasses.dataclass
class ModelScan(Verdict):
    """Every norm site of a model with its contract, role and placement, and the findings.

    ``placement`` is the model's: its residual streams' one placement, else ``mixed``; ``streams`` states each
    stream's (an encoder's, a decoder's: ``{"stream", "path", "blocks", "placement"}``) and ``blocks`` each
    block's (with the stream it belongs to). ``inconclusive``: why sites could not be judged (a non-finite input
    reaching them), each with what would decide it."""

    model: str
    inputs: dict[str, Any]
    sites: list[Site]
    placement: str
    blocks: list[dict[str, Any]]
    config_eps: dict[str, float]
    findings: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    dtypes: tuple[str, ...] | None
    seconds: float
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    streams: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # facts that are not findings
    inconclusive: list[str] = dataclasses.field(default_factory=list)

    @property
    def verdict(self) -> str:
        """``"fail"`` (a finding), ``"inconclusive"`` (no finding, but sites that could not be judged:
        :attr:`inconclusive` says why) or ``"pass"`` (every site inferred, reproduced on its real activation and
        consistent with the config ε); ``ok`` is a pass."""
        return verdict_of(bool(self.findings), bool(self.inconclusive))

    def site(self, name: str) -> Site:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(f"no site named {name!r}; sites: {', '.join(s.name for s in self.sites)}")

    def groups(self) -> list[dict[str, Any]]:
        """Sites with identical contract, class and role, in order of first appearance."""
        out: dict[tuple, dict[str, Any]] = {}
        for s in self.sites:
            key = (s.cls, s.kind, s.role, json.dumps(s.spec.to_dict(), sort_keys=True) if s.spec else s.error)
            g = out.setdefault(key, {"class": s.cls, "kind": s.kind, "role": s.role, "summary": s.summary,
                                     "spec": s.spec, "sites": []})
            g["sites"].append(s)
        return list(out.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "model": self.model, "inputs": jsonable(self.inputs), "placement": self.placement,
            "blocks": jsonable(self.blocks), "streams": jsonable(self.streams), "config_eps": jsonable(self.config_eps),
            "findings": jsonable(self.findings), "notes": jsonable(self.notes), "ok": self.ok,
            "verdict": self.verdict, "inconclusive": list(self.inconclusive),
            "sites": [s.to_dict() for s in self.sites],
            "rejected": jsonable(self.rejected), "dtypes": None if self.dtypes is None else list(self.dtypes),
            "seconds": round(self.seconds, 4), "stats": jsonable(self.stats),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelScan:
        d = document(d, SCHEMA, "scan JSON")
        try:
            sites = [Site.from_dict(s) for s in d["sites"]]
            return cls(model=d["model"], inputs=d.get("inputs") or {}, sites=sites, placement=d["placement"],
                       blocks=d.get("blocks") or [], config_eps=d.get("config_eps") or {},
                       findings=d.get("findings") or [], rejected=d.get("rejected") or [],
                       dtypes=None if d.get("dtypes") is None else tuple(d["dtypes"]), seconds=d.get("seconds", 0.0),
                       stats=d.get("stats") or {}, streams=d.get("streams") or [],
                       notes=d.get("notes") or [], inconclusive=list(d.get("inconclusive") or []))
        except (KeyError, TypeError) as exc:
            raise InputError(f"the scan JSON is missing or has a malformed field ({exc})") from None
        except SpecError as exc:
            raise InputError(f"a site's spec in the scan JSON is invalid: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> ModelScan:
        return cls.from_dict(parse(text, "scan JSON"))


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 3, 5] → '0–3, 5'."""
    xs = sorted(set(layers))
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}–{xs[j]}")
        i = j + 1
    return ", ".join(parts)
