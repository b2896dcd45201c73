"""NormSpec: the contract of a normalization layer, as data.

A NormSpec states everything a checkpoint silently depends on: which axes the statistics reduce over,
whether the mean is subtracted, ε and where it sits, the variance estimator and algorithm, the learnable
affine parameters and the axes they are indexed by, and how low-precision inputs are handled.

This module imports nothing else of normscope except its errors, so every other part can depend on it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from .errors import SpecError

SCHEMA = "normscope.spec/1"

EPS_PLACEMENTS = ("inside_sqrt", "outside_sqrt", "clamp", "none")
VARIANCES = ("biased", "unbiased")
VARIANCE_ALGORITHMS = ("two_pass", "one_pass")
STATS_DTYPES = ("float32", "input")
OUTPUT_DTYPES = ("input", "float32")  # the output at the input's dtype, or promoted to fp32
PARAM_DTYPES = ("input", "float32")  # γ/β stored at the input's dtype (a module cast whole), or kept in fp32
AFFINE_ORDERS = ("cast_then_scale", "scale_then_cast")
BATCH_STATS = ("batch", "running", "frozen")  # frozen: the running statistics in both modes, never updated
KINDS = ("layernorm", "rmsnorm", "groupnorm", "batchnorm", "instancenorm")

_KIND_TITLES = {
    "layernorm": "LayerNorm",
    "rmsnorm": "RMSNorm",
    "groupnorm": "GroupNorm",
    "batchnorm": "BatchNorm",
    "instancenorm": "InstanceNorm",
}

_PLACEMENT_WORDS = {
    "inside_sqrt": "inside √",
    "outside_sqrt": "outside √",
    "clamp": "as a clamp on √",
    "none": "none",
}


def _int_tuple(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, int | str) or value is None:
        value = [] if value is None else [value]
    try:
        items = list(value)
    except TypeError:
        raise SpecError(f"{name} must be a list of integers, got {value!r}") from None
    out = []
    for item in items:
        if isinstance(item, bool):
            raise SpecError(f"{name} must be a list of integers, got {value!r}")
        if not isinstance(item, int):
            try:
                as_int = int(item)
            except (TypeError, ValueError):
                raise SpecError(f"{name} must be a list of integers, got {value!r}") from None
            if as_int != item:
                raise SpecError(f"{name} must be a list of integers, got {value!r}")
            item = as_int
        out.append(int(item))
    return tuple(out)


def _choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise SpecError(f"{name} must be one of {', '.join(repr(o) for o in options)}; got {value!r}")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"{name} must be true or false; got {value!r}")


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """The contract of a normalization: what it computes, exactly.

    y = (γ_offset + γ) · (x − μ) / D(σ²) + β, with μ and σ² reduced over ``axes`` (μ = 0 when
    ``center`` is false) and D the denominator given by ``eps`` and ``eps_placement``.

    Construct by keyword (``NormSpec(center=False, axes=[-1], eps=1e-6, beta=False)``) or from a preset
    (``NormSpec.preset("llama_rmsnorm")``). Lists are stored as tuples; ``to_json``/``from_json`` round-trip.
    """

    center: bool = True
    axes: tuple[int, ...] = (-1,)
    groups: int | None = None
    group_axis: int | None = None
    eps: float = 1e-5
    eps_placement: str = "inside_sqrt"
    variance: str = "biased"
    variance_algorithm: str = "two_pass"
    gamma: bool = True
    beta: bool = True
    param_axes: tuple[int, ...] | None = None
    gamma_offset: float = 0.0
    stats_dtype: str = "float32"
    affine_order: str = "scale_then_cast"
    batch_stats: str | None = None
    output_dtype: str = "input"
    param_dtype: str = "input"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        _bool("center", self.center)
        _bool("gamma", self.gamma)
        _bool("beta", self.beta)

        axes = _int_tuple("axes", self.axes)
        if not axes:
            raise SpecError("axes must name at least one axis to reduce over, e.g. axes=[-1]")
        if len(set(axes)) != len(axes):
            raise SpecError(f"axes {list(axes)} repeats an axis; list each axis once")
        set_(self, "axes", axes)

        if self.param_axes is None:
            param_axes: tuple[int, ...] = axes if (self.gamma or self.beta) else ()
        else:
            param_axes = _int_tuple("param_axes", self.param_axes)
        if len(set(param_axes)) != len(param_axes):
            raise SpecError(f"param_axes {list(param_axes)} repeats an axis; list each axis once")
        if param_axes and not (self.gamma or self.beta):
            raise SpecError(
                f"param_axes {list(param_axes)} given but the spec has neither gamma nor beta; "
                "set gamma=True or beta=True, or param_axes=[]"
            )
        set_(self, "param_axes", param_axes)

        if (self.groups is None) != (self.group_axis is None):
            raise SpecError(
                "groups and group_axis go together: GroupNorm(G) over NCHW is "
                "groups=G, group_axis=1, axes=[1, 2, 3]"
            )
        if self.groups is not None:
            if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
                raise SpecError(f"groups must be a positive integer; got {self.groups!r}")
            if isinstance(self.group_axis, bool) or not isinstance(self.group_axis, int):
                raise SpecError(f"group_axis must be an integer axis; got {self.group_axis!r}")
            if self.group_axis not in axes:
                raise SpecError(
                    f"group_axis {self.group_axis} must be one of the reduced axes {list(axes)}: the "
                    "groups restrict the reduction over that axis"
                )

        if isinstance(self.eps, bool):
            raise SpecError(f"eps must be a number; got {self.eps!r}")
        try:
            eps = float(self.eps)
        except (TypeError, ValueError):
            raise SpecError(f"eps must be a number; got {self.eps!r}") from None
        if not math.isfinite(eps) or eps < 0:
            raise SpecError(f"eps must be finite and ≥ 0; got {self.eps!r}")
        set_(self, "eps", eps)
        _choice("eps_placement", self.eps_placement, EPS_PLACEMENTS)
        if self.eps_placement == "none" and eps > 0:
            raise SpecError(
                f"eps_placement='none' means no ε, but eps={eps!r}; set eps=0 or choose a placement "
                "('inside_sqrt', 'outside_sqrt', 'clamp')"
            )

        _choice("variance", self.variance, VARIANCES)
        _choice("variance_algorithm", self.variance_algorithm, VARIANCE_ALGORITHMS)
        if self.variance_algorithm == "one_pass" and not self.center:
            raise SpecError(
                "variance_algorithm='one_pass' (E[x²]−E[x]²) only differs from two-pass when the mean "
                "is subtracted; with center=False use 'two_pass'"
            )

        try:
            gamma_offset = float(self.gamma_offset)
        except (TypeError, ValueError):
            raise SpecError(f"gamma_offset must be a number; got {self.gamma_offset!r}") from None
        if not math.isfinite(gamma_offset):
            raise SpecError(f"gamma_offset must be finite; got {self.gamma_offset!r}")
        if gamma_offset != 0.0 and not self.gamma:
            raise SpecError("gamma_offset is set but the spec has no gamma; set gamma=True")
        set_(self, "gamma_offset", gamma_offset)

        _choice("stats_dtype", self.stats_dtype, STATS_DTYPES)
        _choice("affine_order", self.affine_order, AFFINE_ORDERS)
        if self.batch_stats is not None:
            _choice("batch_stats", self.batch_stats, BATCH_STATS)
        _choice("output_dtype", self.output_dtype, OUTPUT_DTYPES)
        _choice("param_dtype", self.param_dtype, PARAM_DTYPES)

    # ------------------------------------------------------------------ derived views
    @property
    def uses_running_statistics(self) -> bool:
        """Normalizes with given running statistics (``batch_stats`` "running", or "frozen": in both modes)."""
        return self.batch_stats in ("running", "frozen")

    @property
    def kind(self) -> str:
        """The family name, derived from the fields (never stored)."""
        if self.groups is not None:
            return "groupnorm"
        if self.batch_stats is not None:
            return "batchnorm"
        if not self.center:
            return "rmsnorm"
        positive = all(a >= 0 for a in self.axes)
        # instance statistics cover every axis after (N, C): 2, 3, … contiguously; [3] alone is a per-head
        # LayerNorm over head_dim of (B, S, H, D), not an InstanceNorm
        if positive and sorted(self.axes) == list(range(2, 2 + len(self.axes))):
            return "instancenorm"
        if self.param_axes and not set(self.param_axes) & set(self.axes) and positive:
            return "instancenorm"
        return "layernorm"

    def summary(self, undecided: Collection[str] = ()) -> str:
        """One line a person can read, e.g. ``LayerNorm over [-1], ε=1e-05 inside √, ...``.

        ``undecided``: fields whose value the evidence did not decide (a float32-only target's statistics dtype);
        the line says so instead of stating the field's default as if it were measured."""
        title = _KIND_TITLES[self.kind]
        if self.kind == "groupnorm" and not self.center:
            title = "RMSNorm"  # per group, no mean subtracted (Mamba2's gated norm): "in G groups" follows
        elif self.kind == "instancenorm" and 0 in self.axes:
            title = "BatchNorm"  # statistics over the batch axis, per input (a BatchNorm without running ones)
        parts = [f"{title} over {list(self.axes)}"]
        if self.groups is not None:
            parts[0] += f" in {self.groups} groups along axis {self.group_axis}"
        if self.eps_placement == "none":
            parts.append("no ε")
        else:
            parts.append(f"ε={self.eps:g} {_PLACEMENT_WORDS[self.eps_placement]}")
        if self.center:
            algo = "two-pass" if self.variance_algorithm == "two_pass" else "one-pass (E[x²]−E[x]²)"
            parts.append(f"{self.variance} {algo}")
        elif self.variance == "unbiased":
            parts.append("mean square ÷(d−1)")
        affine = [name for name, on in (("γ", self.gamma), ("β", self.beta)) if on]
        if affine:
            text = " ".join(affine) + f" over {list(self.param_axes)}"
            if self.gamma_offset:
                text += f" (γ acts as {self.gamma_offset:g}+w)"
            parts.append(text)
        else:
            parts.append("no affine")
        if "stats_dtype" in undecided:
            both = "param_dtype" in undecided and (self.gamma or self.beta)
            parts.append("statistics and γ/β dtypes undecided" if both else "statistics dtype undecided")
        else:
            parts.append("fp32 statistics" if self.stats_dtype == "float32" else "input-dtype statistics")
        if self.stats_dtype == "float32" and (self.gamma or self.beta) and not {"stats_dtype", "affine_order"} & set(
                undecided):
            parts.append(self.affine_order.replace("_", " "))
        if self.batch_stats == "frozen":
            parts.append("frozen running statistics (both modes, never updated)")
        elif self.batch_stats is not None:
            parts.append(f"{self.batch_stats} statistics")
        if self.output_dtype == "float32":
            parts.append("fp32 output")
        if "param_dtype" in undecided and (self.gamma or self.beta):
            if "stats_dtype" not in undecided:
                parts.append("γ/β dtype undecided")
        elif self.param_dtype == "float32" and (self.gamma or self.beta):
            parts.append("fp32 γ/β")
        return ", ".join(parts)

    def __str__(self) -> str:
        return self.summary()

    def replace(self, **changes: Any) -> NormSpec:
        """A copy with some fields changed (validated again)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise SpecError(f"unknown NormSpec fields {unknown}; valid fields are {sorted(names)}")
        gamma, beta = changes.get("gamma", self.gamma), changes.get("beta", self.beta)
        if not (gamma or beta) and "param_axes" not in changes:
            changes["param_axes"] = ()  # no affine left: nothing is indexed
        return dataclasses.replace(self, **changes)

    def without_affine(self) -> NormSpec:
        """The same normalization with no γ, β or γ offset: what produces x̂."""
        return self.replace(gamma=False, beta=False, param_axes=(), gamma_offset=0.0)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["kind"] = self.kind
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NormSpec:
        if not isinstance(data, dict):
            raise SpecError(f"a NormSpec JSON must be an object; got {type(data).__name__}")
        schema = data.get("schema")
        if schema != SCHEMA:
            raise SpecError(f"expected schema {SCHEMA!r}, got {schema!r}; is this a normscope spec file?")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"schema", "kind"})
        if unknown:
            raise SpecError(f"unknown NormSpec fields {unknown}; valid fields are {sorted(names)}")
        if "eps" not in data:  # a file that forgets ε would silently get 1e-5: say so instead
            raise SpecError('the spec JSON has no "eps"; state it, e.g. "eps": 1e-5 (0 with "eps_placement": "none")')
        if isinstance(data["eps"], bool) or not isinstance(data["eps"], int | float):
            raise SpecError(f'"eps" must be a JSON number, e.g. 1e-5; got {data["eps"]!r}')
        spec = cls(**{k: v for k, v in data.items() if k in names})
        if "kind" in data and data["kind"] != spec.kind:
            raise SpecError(f"the file says kind {data['kind']!r} but its fields describe {spec.kind!r}")
        return spec

    @classmethod
    def from_json(cls, text: str) -> NormSpec:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(f"not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> NormSpec:
        """A well-known implementation's contract, e.g. ``NormSpec.preset("llama_rmsnorm", eps=1e-5)``."""
        from .presets import preset

        return preset(name, **overrides)

    # ------------------------------------------------------------------ axis arithmetic
    def resolve_axes(self, ndim: int) -> tuple[int, ...]:
        """``axes`` as sorted non-negative indices for an input of ``ndim`` dimensions."""
        return _resolve("axes", self.axes, ndim)

    def resolve_param_axes(self, ndim: int) -> tuple[int, ...]:
        return _resolve("param_axes", self.param_axes or (), ndim)

    def resolve_group_axis(self, ndim: int) -> int | None:
        if self.group_axis is None:
            return None
        return _resolve("group_axis", (self.group_axis,), ndim)[0]

    def same_axes(self, other: NormSpec, ndim: int) -> bool:
        return self.resolve_axes(ndim) == other.resolve_axes(ndim)

    def canonical(self, ndim: int | None = None, shape: tuple[int, ...] | None = None) -> NormSpec:
        """An equivalent spec in canonical form, for comparing contracts.

        ε = 0 makes every placement the same (``none``); the affine order only matters with fp32 statistics
        and an affine; with ``ndim`` given, axes become non-negative; with the input ``shape`` given, one
        group is no grouping and one channel per group drops the channel axis from the reduction.
        """
        if shape is not None and self.groups is not None:
            ga = self.resolve_group_axis(len(shape))
            if self.groups == 1:
                return self.replace(groups=None, group_axis=None).canonical(ndim, shape)
            if self.groups == shape[ga]:
                axes = [a for a in self.resolve_axes(len(shape)) if a != ga]
                if axes:
                    return self.replace(axes=axes, groups=None, group_axis=None).canonical(ndim, shape)
        changes: dict[str, Any] = {}
        if self.eps == 0.0:
            changes["eps_placement"] = "none"
        if self.stats_dtype == "input" or not (self.gamma or self.beta):
            changes["affine_order"] = "scale_then_cast"  # the order cannot matter then
        if ndim is not None:
            changes["axes"] = self.resolve_axes(ndim)
            changes["param_axes"] = self.resolve_param_axes(ndim)
            if self.group_axis is not None:
                changes["group_axis"] = self.resolve_group_axis(ndim)
        return self.replace(**changes) if changes else self

    def equivalent(self, other: NormSpec, ndim: int, eps_rtol: float = 0.0,
                   shape: tuple[int, ...] | None = None) -> bool:
        """True when both specs compute the same function on inputs of ``ndim`` dimensions.

        ``eps_rtol`` accepts ε values that agree to that relative tolerance (a measured ε never matches
        a stated one to the last bit); ``shape`` lets degenerate groupings compare equal.
        """
        a, b = self.canonical(ndim, shape), other.canonical(ndim, shape)
        if eps_rtol and eps_close(a.eps, b.eps, eps_rtol):
            a = a.replace(eps=b.eps)
        return a == b


def _resolve(name: str, axes: Iterable[int], ndim: int) -> tuple[int, ...]:
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise SpecError(f"{name} contains axis {a}, which does not exist for a {ndim}-d input")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise SpecError(f"{name} {list(axes)} names the same axis twice for a {ndim}-d input")
    return tuple(sorted(out))


def eps_close(a: float, b: float, rtol: float) -> bool:
    return a == b or (b != 0 and abs(a / b - 1) <= rtol)


def differences(found: NormSpec, expected: NormSpec, ndim: int, eps_rtol: float = 0.01,
                shape: tuple[int, ...] | None = None, undecided: Mapping[str, str] | None = None) -> list[str]:
    """Plain-words differences between two contracts (empty when equivalent).

    ε values within ``eps_rtol`` (1%, the resolution of inference) count as equal; with the input
    ``shape``, degenerate groupings (one group, or one channel per group) compare as what they compute.
    ``undecided``: fields of ``found`` that inference did not decide (field → why, e.g. "assumed"): where such a
    field differs, the line says it was not decided instead of stating the reported value as found.
    """
    a, b = found.canonical(ndim, shape), expected.canonical(ndim, shape)
    out: list[str] = []
    undecided = undecided or {}

    def say(field: str, wanted: str, got: str) -> None:
        if field in undecided:
            out.append(f"expected {wanted}; not decided by inference ({undecided[field]})")
        else:
            out.append(f"expected {wanted}; found {got}")

    if a.center != b.center:
        out.append(
            "found the mean subtracted (centred)" if a.center else "found no mean subtraction (RMS)"
        )
        out[-1] += "; expected " + ("centred" if b.center else "no mean subtraction")
    if a.axes != b.axes or a.groups != b.groups or a.group_axis != b.group_axis:
        name_axis = a.group_axis != b.group_axis  # the same axes and groups can differ only in the group axis
        text = f"statistics reduce over {list(found.axes)}"
        if a.groups is not None:
            text += f" in {a.groups} groups" + (f" along axis {found.group_axis}" if name_axis else "")
        text += f", expected {list(expected.axes)}"
        if b.groups is not None:
            text += f" in {b.groups} groups" + (f" along axis {expected.group_axis}" if name_axis else "")
        out.append(text)
    formulas = {
        "inside_sqrt": "ε inside √ (sqrt(var+ε))",
        "outside_sqrt": "ε outside √ (std+ε)",
        "clamp": "ε as a clamp (max(std, ε))",
        "none": "no ε",
    }
    if a.eps_placement != b.eps_placement:
        say("eps_placement", formulas[b.eps_placement], formulas[a.eps_placement])
    if not eps_close(a.eps, b.eps, eps_rtol) and a.eps_placement == b.eps_placement:
        say("eps", f"ε={b.eps:g}", f"ε={a.eps:g}")
    if a.variance != b.variance:
        say("variance", f"{b.variance} variance (÷{'d' if b.variance == 'biased' else 'd−1'})", a.variance)
    if a.variance_algorithm != b.variance_algorithm:
        say("variance_algorithm", f"{b.variance_algorithm.replace('_', '-')} variance",
            a.variance_algorithm.replace('_', '-'))
    identity = {"gamma": "γ ≡ 1", "beta": "β ≡ 0"}
    for name, sym in (("gamma", "γ"), ("beta", "β")):
        if getattr(a, name) and not getattr(b, name):
            out.append(f"expected no {sym}; found a learned {sym}")
        elif getattr(b, name) and not getattr(a, name):
            out.append(f"expected a learned {sym}; found none ({identity[name]})")
    if (a.gamma or a.beta) and (b.gamma or b.beta) and a.param_axes != b.param_axes:
        out.append(f"γ/β indexed by axes {list(found.param_axes)}, expected {list(expected.param_axes)}")
    if a.gamma_offset != b.gamma_offset:
        say("gamma_offset", f"γ offset {b.gamma_offset:g}", f"{a.gamma_offset:g}")
    if a.stats_dtype != b.stats_dtype:
        words = {"float32": "fp32 statistics", "input": "statistics in the input dtype"}
        say("stats_dtype", words[b.stats_dtype], words[a.stats_dtype])
    if a.affine_order != b.affine_order and a.stats_dtype == b.stats_dtype == "float32":
        say("affine_order", b.affine_order.replace('_', ' '), a.affine_order.replace('_', ' '))
    if a.batch_stats != b.batch_stats:
        words = {None: "statistics of each input (no train/eval modes)", "batch": "batch statistics",
                 "running": "running statistics", "frozen": "frozen running statistics (both modes, never updated)"}
        out.append(f"expected {words[b.batch_stats]}; found {words[a.batch_stats]}")
    if a.output_dtype != b.output_dtype:
        words = {"input": "the output at the input's dtype", "float32": "an fp32 output"}
        say("output_dtype", words[b.output_dtype], words[a.output_dtype])
    # where γ/β are stored shows only where × γ runs in fp32 before the one cast: elsewhere neither contract says
    applies = all(c.stats_dtype == "float32" and c.affine_order == "scale_then_cast" and (c.gamma or c.beta)
                  for c in (a, b))
    if a.param_dtype != b.param_dtype and applies:
        words = {"input": "γ/β stored at the input's dtype", "float32": "γ/β kept in fp32"}
        say("param_dtype", words[b.param_dtype], words[a.param_dtype])
    return out
