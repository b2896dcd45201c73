"""The registry of implementations the check tests run: what to build, the contract it must meet, and the
verdict it must get — the findings that must fail (none: the report passes) and those that must be skips,
named by finding key (``Finding.key``: the stable id with its parameters, e.g.
``"reference.rounding[dtype=bfloat16]"``).

Each entry once got a wrong verdict from ``check``, or is written the way other people write norms. To add
one, append a :class:`Case` to :data:`CHECK_CASES` (names are unique).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import zoo
from torch import nn

from normscope import NormSpec

H = zoo.H
SHAPE = (2, 8, H)
IMAGE = (2, 4, 5, 5)


@dataclasses.dataclass(frozen=True)
class Case:
    """One implementation and its verdict. ``preset`` is a preset name; ``overrides`` change its fields."""

    name: str
    make: Callable[[], Any]
    preset: str
    shape: tuple[int, ...]
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    framework: str | None = None
    dtypes: tuple[str, ...] | str | None = None
    fails: frozenset[str] = frozenset()
    skips: frozenset[str] = frozenset()

    @property
    def expect(self) -> NormSpec:
        return NormSpec.preset(self.preset, **self.overrides)

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``check`` beyond target, expect and shape."""
        out: dict[str, Any] = {}
        if self.framework is not None:
            out["framework"] = self.framework
        if self.dtypes is not None:
            out["dtypes"] = self.dtypes
        return out

    @property
    def tried(self) -> list[str]:
        """The dtypes the report must list as tried."""
        if self.dtypes is None:
            return ["float32", "float16", "bfloat16"]
        return self.dtypes.split(",") if isinstance(self.dtypes, str) else list(self.dtypes)


def _llama_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return zoo.randomize(LlamaRMSNorm(H, eps=1e-6))


def runs(*dtypes: str) -> frozenset[str]:
    return frozenset(f"dtypes.runs[dtype={d}]" for d in dtypes)


CHECK_CASES: list[Case] = [
    # a dtype that cannot run is a finding: a failure when asked for or when the target fails on it
    Case("nan-at-half", lambda: zoo.NanAtHalfLayerNorm(H), "torch_layernorm", SHAPE,
         fails=runs("float16", "bfloat16")),
    Case("nan-at-half-asked", lambda: zoo.NanAtHalfLayerNorm(H), "torch_layernorm", SHAPE,
         dtypes="float32,bfloat16", fails=runs("bfloat16")),
    Case("refuses-half", lambda: zoo.RaisesAtHalfLayerNorm(H), "torch_layernorm", SHAPE,
         skips=runs("float16", "bfloat16")),
    Case("refuses-half-asked", lambda: zoo.RaisesAtHalfLayerNorm(H), "torch_layernorm", SHAPE,
         dtypes=("float32", "bfloat16"), fails=runs("bfloat16")),
    # running statistics move by the module's own momentum, and move at all
    Case("momentum-zero", lambda: zoo.MomentumBatchNorm(4, 0.0), "torch_batchnorm", IMAGE,
         fails=frozenset({"modes.running_update"})),
    Case("momentum-0.9", lambda: zoo.MomentumBatchNorm(4, 0.9), "torch_batchnorm", IMAGE,
         fails=frozenset({"modes.running_update"})),
    Case("momentum-0.1", lambda: zoo.MomentumBatchNorm(4, 0.1), "torch_batchnorm", IMAGE),
    # γ/β are measured at a precise dtype even when only half precision is asked for
    Case("layernorm-bf16-only", lambda: zoo.randomize(nn.LayerNorm(H)), "torch_layernorm", SHAPE,
         dtypes=("bfloat16",)),
    Case("rmsnorm-bf16-fp16", lambda: zoo.randomize(nn.RMSNorm(H)), "torch_rmsnorm", SHAPE,
         dtypes=("bfloat16", "float16")),
    Case("bf16-only-target", lambda: zoo.randomize(zoo.BFloat16OnlyLayerNorm(H)), "torch_layernorm", SHAPE,
         skips=runs("float32", "float16")),
    Case("llama-bf16-fp16", _llama_rmsnorm, "llama_rmsnorm", SHAPE, dtypes=("bfloat16", "float16")),
    # running statistics are read in the dtype the module stores them in
    Case("batchnorm-trained-eval", zoo.trained_batchnorm, "torch_batchnorm_eval", IMAGE),
    # a single row: the strided view is normscope's to make
    Case("single-row", lambda: nn.LayerNorm(H), "torch_layernorm", (1, H)),
    Case("single-row-4096", lambda: nn.LayerNorm(4096), "torch_layernorm", (1, 4096)),
    # half-precision statistics accumulate in float32
    Case("input-dtype-statistics", lambda: zoo.randomize(zoo.InputDtypeStatsRMSNorm()), "llama_rmsnorm", SHAPE,
         overrides={"stats_dtype": "input"}),
    # equivalent formulas: rsqrt, folded affine (and a folded affine is not cast-then-scale)
    Case("rsqrt-input-dtype", lambda: zoo.RsqrtLayerNorm(), "torch_layernorm", SHAPE,
         overrides={"stats_dtype": "input", "affine_order": "cast_then_scale"}),
    Case("folded-affine", lambda: zoo.FoldedAffineLayerNorm(), "onnxruntime_layernorm", SHAPE),
    Case("folded-affine-input-dtype", lambda: zoo.FoldedInputDtypeLayerNorm(), "torch_layernorm", SHAPE,
         overrides={"stats_dtype": "input"}),
    Case("folded-affine-vs-cast-then-scale", lambda: zoo.FoldedAffineLayerNorm(), "onnx_layernorm", SHAPE,
         fails=frozenset({"reference.rounding[dtype=bfloat16]", "reference.rounding[dtype=float16]"})),
    # per-group parameters, input validation, a scalar gain, non-determinism
    Case("per-group-affine", lambda: zoo.PerGroupAffineGroupNorm(), "torch_groupnorm", IMAGE,
         overrides={"groups": 2}),
    Case("refuses-non-finite", lambda: zoo.RefusesNonFiniteLayerNorm(H), "torch_layernorm", SHAPE,
         skips=frozenset({"extreme.nonfinite_confined[value=nan; dtype=float32]",
                          "extreme.nonfinite_confined[value=inf; dtype=float32]"})),
    Case("scalar-gain", lambda: zoo.scaled_layer_norm, "torch_layernorm", SHAPE, framework="torch",
         overrides={"affine": False, "gamma": True, "param_axes": [], "affine_order": "cast_then_scale"}),
    Case("non-deterministic", lambda: zoo.NoisyLayerNorm(H), "torch_layernorm", SHAPE,
         skips=frozenset({"determinism.repeated_calls[dtype=float32]"})),
]

assert len({c.name for c in CHECK_CASES}) == len(CHECK_CASES), "registry names must be unique"
