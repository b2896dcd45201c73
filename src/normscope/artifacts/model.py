"""ModelContract and ContractSite: the static contract a model artifact carries, as data.

A site lists the contract fields of one norm; ``known`` names the fields this artifact actually states
(a GGUF file states ε and the γ tensor but not how ε is placed — llama.cpp's convention does; an ONNX
``LayerNormalization`` states its axis and ε; a decomposed subgraph states where ε sits). Fields that are
not known are None and are never compared.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from ..errors import InputError
from ..jsonable import document, jsonable, parse
from .names import canonicalize, placement_of, stream_prefixes, structural_names

SCHEMA = "normscope.contract/1"

FAMILIES = ("layernorm", "rmsnorm", "groupnorm", "batchnorm", "instancenorm")
SITE_FIELDS = ("family", "center", "eps", "eps_placement", "axes", "size", "gamma", "beta", "gamma_offset",
               "gamma_stats", "beta_stats", "param_shape", "groups")


@dataclasses.dataclass
class ContractSite:
    """One norm of a model: its canonical name, where it sits, and the contract fields the artifact states."""

    name: str
    source: str
    layer: int | None = None
    role: str | None = None
    family: str | None = None
    center: bool | None = None
    eps: float | None = None
    eps_placement: str | None = None
    axes: tuple[int, ...] | None = None
    size: int | None = None
    gamma: bool | None = None
    beta: bool | None = None
    gamma_offset: float | None = None
    gamma_stats: dict[str, float] | None = None
    beta_stats: dict[str, float] | None = None
    param_shape: tuple[int, ...] | None = None
    groups: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.family is not None and self.family not in FAMILIES:
            raise InputError(f"site {self.name}: family must be one of {', '.join(FAMILIES)}; got {self.family!r}")
        if self.family is not None and self.center is None and self.family != "groupnorm":
            self.center = self.family != "rmsnorm"
        if self.axes is not None:
            self.axes = tuple(int(a) for a in self.axes)
        if self.param_shape is not None:
            self.param_shape = tuple(int(a) for a in self.param_shape)
        if self.eps is not None:
            self.eps = float(self.eps)
        if self.gamma_offset is not None:
            self.gamma_offset = float(self.gamma_offset)

    @property
    def known(self) -> tuple[str, ...]:
        """The contract fields this artifact states for the site."""
        return tuple(f for f in SITE_FIELDS if getattr(self, f) is not None)

    @property
    def identity_gamma(self) -> bool:
        """γ is stated and acts as exactly 1 everywhere (as good as no γ)."""
        e = self.effective_gamma
        return e is not None and e["min"] == e["max"] == 1.0

    @property
    def zero_beta(self) -> bool:
        """β is stated and is exactly 0 everywhere (as good as no β)."""
        b = self.beta_stats
        return b is not None and b["min"] == b["max"] == 0.0

    @property
    def effective_gamma(self) -> dict[str, float] | None:
        """γ as it multiplies x̂ (offset + stored weight): mean/min/max, where weights and offset are known."""
        if self.gamma_stats is None or self.gamma_offset is None:
            return None
        return {k: self.gamma_offset + v for k, v in self.gamma_stats.items() if k in ("mean", "min", "max")}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "source": self.source, "layer": self.layer, "role": self.role}
        for f in SITE_FIELDS:
            value = getattr(self, f)
            out[f] = list(value) if isinstance(value, tuple) else value
        out["known"] = list(self.known)
        out["notes"] = list(self.notes)
        return jsonable(out)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ContractSite:
        if not isinstance(data, dict) or "name" not in data:
            raise InputError(f"a contract site must be an object with a name; got {data!r:.80}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"known"})
        if unknown:
            raise InputError(f"site {data['name']}: unknown fields {unknown}")
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass
class ModelContract:
    """Every norm site of one artifact (HF config/model, GGUF, ONNX, or a live-model scan)."""

    source: str
    kind: str
    sites: list[ContractSite]
    architecture: str | None = None
    eps: float | None = None
    eps_key: str | None = None
    n_layers: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    stated_placement: str | None = None  # measured from a dataflow or stated by the file; else from the names
    # the artifact holds its norms' weights (a checkpoint, a GGUF, an ONNX graph, a scan of a loaded model): a site
    # with a γ but no γ statistics then lost its weight on the way, and a comparison counts it unverified
    weights: bool = False

    @property
    def placement(self) -> str | None:
        """The block design: as measured (a scan's dataflow) or stated (a file's flag), else what the sites'
        canonical slots describe (pre, post, sandwich, reordered, parallel, mixed)."""
        return self.stated_placement or placement_of(s.name for s in self.sites)

    def without_weights(self) -> ModelContract:
        """The contract with no γ/β statistics stated (itself, changed): for one read from a model whose weights
        were drawn here (a config built to read its structure), not loaded from a checkpoint."""
        for s in self.sites:
            s.gamma_stats = s.beta_stats = None
        self.weights = False
        return self

    def site(self, name: str) -> ContractSite | None:
        return next((s for s in self.sites if s.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return jsonable({
            "schema": SCHEMA,
            "source": self.source,
            "kind": self.kind,
            "architecture": self.architecture,
            "placement": self.placement,
            "eps": self.eps,
            "eps_key": self.eps_key,
            "n_layers": self.n_layers,
            "weights": self.weights,
            "notes": list(self.notes),
            "sites": [s.to_dict() for s in self.sites],
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelContract:
        data = document(data, SCHEMA, "normscope contract JSON")
        sites = data.get("sites")
        if not isinstance(sites, list):
            raise InputError("a contract JSON needs a list of sites")
        out = cls(source=data.get("source", "?"), kind=data.get("kind", "?"),
                  sites=[ContractSite.from_dict(s) for s in sites], architecture=data.get("architecture"),
                  eps=data.get("eps"), eps_key=data.get("eps_key"), n_layers=data.get("n_layers"),
                  notes=list(data.get("notes") or []), stated_placement=data.get("placement"))
        weights = data.get("weights")  # absent in a file written before it was stated: what the kind implies
        out.weights = weights if isinstance(weights, bool) else (
            out.kind in ("hf-model", "gguf", "onnx") or any(s.gamma_stats for s in out.sites))
        return out

    @classmethod
    def from_json(cls, text: str) -> ModelContract:
        return cls.from_dict(parse(text, "normscope contract JSON"))

    @classmethod
    def from_scan(cls, scan: Any, source: str | None = None) -> ModelContract:
        """The contract a live-model scan measured: every site's inferred NormSpec and its γ statistics.

        ``scan`` needs ``.sites``, each with ``name`` (module path), ``layer``, ``role``, ``spec`` (a
        NormSpec) and ``gamma`` (a dict with mean/min/max, or None); ``shape`` (the input shape at the
        site) gives the normalized size where present. Sites measured more than once keep their first
        application; later ones are named ``name#2``, ``name#3``.
        """
        if not hasattr(scan, "sites"):
            raise InputError("from_scan needs a scan result with .sites")
        found = list(getattr(scan, "sites", None) or [])
        raw = [s for s in found if getattr(s, "spec", None) is not None]
        notes = [f"{s.name}: a norm site whose contract could not be inferred, left out "
                 f"({getattr(s, 'error', None) or 'no contract'})" for s in found if getattr(s, "spec", None) is None]
        notes += [n["message"] for n in getattr(scan, "notes", None) or [] if n.get("kind") == "not_called"]
        paths = [_scan_path(s.name) for s in raw]
        prefixes = stream_prefixes(list(getattr(scan, "streams", None) or []))
        names = structural_names([(p, getattr(s, "layer", None), getattr(s, "role", None),
                                   prefixes.get(getattr(s, "stream", None), "")) for p, s in zip(paths, raw, strict=True)])
        if names is None:
            names = canonicalize(paths, {p: getattr(s, "role", None) for p, s in zip(paths, raw, strict=True)})
        seen: dict[str, int] = {}
        sites = []
        for path, s in zip(paths, raw, strict=True):
            name, layer, role = names[path]
            suffix = s.name[len(path):] if s.name.startswith(path) else ""
            name = name + suffix
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name = f"{name}#{seen[name]}"
            spec = s.spec
            layer = getattr(s, "layer", None) if getattr(s, "layer", None) is not None else layer
            shape = getattr(s, "shape", None)
            size = None
            axes = spec.axes
            if shape is not None:
                size = 1
                resolved = spec.resolve_axes(len(shape))
                for a in resolved:
                    size *= int(shape[a])
                axes = tuple(a - len(shape) for a in resolved)  # counted from the end, as files state them
            gamma = getattr(s, "gamma", None)
            stats = None
            if isinstance(gamma, dict) and all(k in gamma for k in ("mean", "min", "max")):
                stats = {k: float(gamma[k]) for k in ("mean", "min", "max")}
            sites.append(ContractSite(
                name=name, source=s.name, layer=layer, role=getattr(s, "role", None) or role, family=spec.kind,
                center=spec.center, eps=spec.eps, eps_placement=spec.eps_placement, axes=axes, size=size,
                gamma=spec.gamma, beta=spec.beta, gamma_offset=spec.gamma_offset if spec.gamma else None,
                gamma_stats=stats, groups=spec.groups,
            ))
        config_eps = getattr(scan, "config_eps", None)
        placement = getattr(scan, "placement", None)
        return cls(source=source or str(getattr(scan, "source", None) or "scan"), kind="scan", sites=sites,
                   architecture=getattr(scan, "architecture", None),
                   eps=float(config_eps) if isinstance(config_eps, int | float) else None,
                   n_layers=_n_layers(sites), stated_placement=placement if isinstance(placement, str) else None,
                   weights=True, notes=notes)  # the scanned model's own weights; without_weights() where drawn


def value_stats(values: Any) -> dict[str, float] | None:
    """mean/min/max of a parameter's values (None when there are none)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return None
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}


def _scan_path(name: str) -> str:
    """The module part of a scan site name: ``blocks.0:layer_norm#0`` → ``blocks.0``."""
    return name.split(":", 1)[0]


def _n_layers(sites: list[ContractSite]) -> int | None:
    layers = [s.layer for s in sites if s.layer is not None]
    return max(layers) + 1 if layers else None
