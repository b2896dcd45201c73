"""The result of inference: the inferred contract, the evidence behind each field, the recovered parameters.

An :class:`Inference` is what :func:`normscope.infer` returns; it is written as JSON with
``"schema": "normscope.inference/1"`` (:meth:`Inference.to_dict`) and loads back from that JSON
(:meth:`Inference.from_dict`). Each field of the contract — and each finding about the target itself, such as
``determinism`` or ``modifies_input`` — has one :class:`Evidence`: the experiment, the numbers it measured,
and a :class:`Confidence` from a closed set.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from ..errors import InputError
from ..jsonable import document, jsonable
from ..spec import NormSpec
from .params import NormParams

__all__ = ["SCHEMA", "Confidence", "Evidence", "Inference", "undecided", "unsettled"]

SCHEMA = "normscope.inference/1"


class Confidence(enum.StrEnum):
    """How sure one field's value is. String-valued: it compares equal to, and serialises as, its text."""

    DECISIVE = "decisive"  # the experiment separates the candidates far beyond its noise
    FROM_PARAMETERS = "from parameters"  # read from the target's own parameters or buffers (a private copy)
    ASSUMED = "assumed"  # not observable from behaviour; the conventional value is reported
    NOT_PROBED = "not probed"  # the experiment could not run (e.g. no bfloat16/float16 inputs)
    WEAK = "weak"  # the winner is ahead, but not by the experiment's margin
    AMBIGUOUS = "ambiguous"  # the candidates do not separate beyond noise (both numbers are in ``measured``)


# the precision fields a contract line states only when an experiment decided them: each has a conventional value
# that inference reports when its experiment cannot run (float32-only inputs) or does not separate the candidates
_PRECISION_FIELDS = frozenset({"stats_dtype", "affine_order", "param_dtype"})
_UNSETTLED = (Confidence.ASSUMED, Confidence.NOT_PROBED, Confidence.AMBIGUOUS)


def unsettled(evidence: dict[str, Any]) -> dict[str, str]:
    """The fields no experiment decided (assumed, not probed, ambiguous), each with that word, from evidence as
    :class:`Evidence` or its dict: values reported by convention, never to be stated as found."""
    out = {}
    for field, ev in evidence.items():
        confidence = ev.get("confidence") if isinstance(ev, dict) else getattr(ev, "confidence", None)
        if confidence in _UNSETTLED:
            out[field] = str(confidence)
    return out


def undecided(evidence: dict[str, Any]) -> frozenset[str]:
    """The precision fields among :func:`unsettled`'s: what :meth:`NormSpec.summary` marks undecided instead of
    stating the reported value as measured."""
    return frozenset(unsettled(evidence)) & _PRECISION_FIELDS


@dataclasses.dataclass
class Evidence:
    """Why one field has its value: the experiment, what it measured, and how sure that is."""

    experiment: str
    measured: dict[str, Any]
    confidence: Confidence = Confidence.DECISIVE
    note: str = ""

    def __post_init__(self) -> None:
        try:
            self.confidence = Confidence(self.confidence)
        except ValueError:
            raise InputError(f"confidence must be one of {', '.join(c.value for c in Confidence)}; "
                             f"got {self.confidence!r}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"experiment": self.experiment, "measured": jsonable(self.measured),
                "confidence": self.confidence.value, "note": self.note}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Evidence:
        return cls(data["experiment"], dict(data.get("measured", {})), data.get("confidence", "decisive"),
                   data.get("note", ""))


@dataclasses.dataclass
class Inference:
    """The inferred contract with its evidence and the recovered parameters."""

    spec: NormSpec
    evidence: dict[str, Evidence]
    params: NormParams
    calls: int
    target: str
    shape: tuple[int, ...]
    probe_dtype: str
    dtypes: tuple[str, ...]
    seconds: float
    validation: dict[str, Any]

    @property
    def summary(self) -> str:
        """The contract's line, its undecided precision fields marked as such."""
        return self.spec.summary(undecided(self.evidence))


    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "target": self.target,
            "shape": list(self.shape),
            "probe_dtype": self.probe_dtype,
            "dtypes": list(self.dtypes),
            "spec": self.spec.to_dict(),
            "summary": self.summary,
            "evidence": {k: v.to_dict() for k, v in self.evidence.items()},
            "params": self.params.to_json(),
            "validation": jsonable(self.validation),
            "calls": self.calls,
            "seconds": round(self.seconds, 4),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Inference:
        """An Inference from its JSON (:meth:`to_dict`); an :class:`InputError` for another schema."""
        data = document(data, SCHEMA, "saved inference")
        if "spec" not in data:  # `normscope infer --json` of a target that is not a normalization
            raise InputError(f"the saved inference of {data.get('target', '?')!r} has no contract: "
                             f"{data.get('not_a_normalization', 'no spec field')}")
        return cls(
            spec=NormSpec.from_dict(data["spec"]),
            evidence={k: Evidence.from_dict(v) for k, v in data.get("evidence", {}).items()},
            params=NormParams.from_dict(data.get("params")),
            calls=int(data.get("calls", 0)),
            target=str(data.get("target", "")),
            shape=tuple(int(s) for s in data.get("shape", ())),
            probe_dtype=str(data.get("probe_dtype", "")),
            dtypes=tuple(data.get("dtypes", ())),
            seconds=float(data.get("seconds", 0.0)),
            validation=dict(data.get("validation", {})),
        )

    @classmethod
    def from_json(cls, text: str) -> Inference:
        return cls.from_dict(json.loads(text))
