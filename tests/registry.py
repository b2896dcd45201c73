"""The registry of implementations the check and infer tests run: what to build, the contract it must meet, and the
verdict it must get — the findings that must fail (none: the report passes) and those that must be skips,
named by finding key (``Finding.key``: the stable id with its parameters, e.g.
``"reference.rounding[dtype=bfloat16]"``).

Each entry once got a wrong verdict from ``check``, or is written the way other people write norms. To add
one, append a :class:`Case` to :data:`CHECK_CASES` (names are unique). Inference cases (:data:`INFER_CASES`,
an :class:`InferCase` each) declare the contract and the confidences inference must find.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import zoo
from torch import nn

from normscope import NormSpec
from normscope.probe.infer import infer
from normscope.results.inference import Confidence, Inference

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


# ------------------------------------------------------------------------------------------ inference
# tests/test_infer.py runs every INFER_CASES entry: the contract inference must recover (field by field) and the
# confidences it declares; tests that assert more about one case take the same inference from `inferred`.
@dataclasses.dataclass(frozen=True)
class InferCase:
    """One implementation and the contract inference must recover (the inference half of the registry).

    The contract is ``preset`` with ``overrides``, or ``spec``; with neither only ``confidences`` and the test that
    takes the case from :func:`inferred` say what is expected. ``confidences`` maps evidence fields to the
    confidence they must have; ``exact`` lists fields compared beyond :func:`assert_contract`'s set.
    """

    name: str
    make: Callable[[], Any]
    shape: tuple[int, ...]
    preset: str | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    spec: NormSpec | None = None
    framework: str | None = None
    dtypes: tuple[str, ...] | str | None = None
    confidences: dict[str, Confidence] = dataclasses.field(default_factory=dict)
    exact: tuple[str, ...] = ()

    @property
    def expect(self) -> NormSpec | None:
        if self.spec is not None:
            return self.spec
        return NormSpec.preset(self.preset, **self.overrides) if self.preset else None


def assert_contract(result: Inference, expected: NormSpec, ndim: int, exact: tuple[str, ...] = ()) -> None:
    """Every field of ``result.spec`` equals ``expected``'s (axes modulo ndim, ε within 1%)."""
    from normscope.spec import differences

    found = result.spec
    diff = differences(found, expected, ndim)
    assert not diff, f"{found.summary()}\n vs {expected.summary()}: {diff}"
    assert found.equivalent(expected, ndim, eps_rtol=0.01)
    for field in ("center", "groups", "eps_placement", "variance", "variance_algorithm", "gamma", "beta",
                  "stats_dtype", "batch_stats", *exact):
        assert getattr(found, field) == getattr(expected, field), field
    assert found.resolve_axes(ndim) == expected.resolve_axes(ndim)
    if found.gamma or found.beta:
        assert found.resolve_param_axes(ndim) == expected.resolve_param_axes(ndim)
    if expected.eps:
        assert abs(found.eps / expected.eps - 1) <= 0.01
    else:
        assert found.eps == 0


# ------------------------------------------------------------------------------------------ builders
def batchnorm_three_steps() -> torch.nn.BatchNorm2d:
    """A BatchNorm2d with random γ/β after three training steps (running statistics away from 0 and 1)."""
    bn = zoo.randomize(torch.nn.BatchNorm2d(4))
    gen = torch.Generator().manual_seed(0)
    bn.train()
    with torch.no_grad():
        for _ in range(3):
            bn(torch.randn(8, 4, 5, 5, generator=gen) * 2 + 1)
    return bn


def hugging_face(name: str):
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    cls = {"llama": LlamaRMSNorm, "gemma": GemmaRMSNorm, "t5": T5LayerNorm}[name]
    return zoo.randomize(cls(H, eps=1e-6))


def flax(name: str):
    """A flax.linen LayerNorm/RMSNorm with random parameters, as a jax callable."""
    jax = pytest.importorskip("jax")
    fnn = pytest.importorskip("flax.linen")
    import jax.numpy as jnp

    m = getattr(fnn, name)()
    params = m.init(jax.random.PRNGKey(0), jnp.ones(SHAPE))
    params = jax.tree_util.tree_map(lambda a: a + jax.random.uniform(jax.random.PRNGKey(1), a.shape), params)
    return lambda x: m.apply(params, x)


def onnx_model(op: str, opset: int, bias: bool = True, dims=("b", "s", 64)):
    """A one-node ONNX model (LayerNormalization/RMSNormalization over the last axis, ε = 1e-5)."""
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 1.5, 64).astype(np.float32), "scale")]
    names = ["x", "scale"]
    if bias:
        inits.append(numpy_helper.from_array(rng.uniform(-1, 1, 64).astype(np.float32), "B"))
        names.append("B")
    node = helper.make_node(op, names, ["y"], axis=-1, epsilon=1e-5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(dims))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


FROM_PARAMETERS, DECISIVE = Confidence.FROM_PARAMETERS, Confidence.DECISIVE

INFER_CASES: list[InferCase] = [
    # real ones
    InferCase("torch-layernorm", lambda: zoo.randomize(torch.nn.LayerNorm(H)), SHAPE, "torch_layernorm"),
    # γ=1, β=0 are invisible from outside; the private copy with random parameters reveals them
    InferCase("torch-layernorm-default-init", lambda: torch.nn.LayerNorm(H), SHAPE, "torch_layernorm",
              confidences={"gamma": FROM_PARAMETERS, "beta": FROM_PARAMETERS, "param_axes": FROM_PARAMETERS}),
    InferCase("torch-layernorm-2d", lambda: zoo.randomize(torch.nn.LayerNorm([8, H])), SHAPE, "torch_layernorm",
              {"normalized_dims": 2}),
    InferCase("torch-rmsnorm", lambda: zoo.randomize(torch.nn.RMSNorm(H)), SHAPE, "torch_rmsnorm"),
    InferCase("torch-groupnorm", lambda: zoo.randomize(torch.nn.GroupNorm(2, 4)), IMAGE, "torch_groupnorm",
              {"groups": 2}, exact=("group_axis",)),
    InferCase("torch-batchnorm-train", batchnorm_three_steps, IMAGE, "torch_batchnorm"),
    InferCase("torch-batchnorm-eval", lambda: batchnorm_three_steps().eval(), IMAGE, "torch_batchnorm_eval"),
    InferCase("torch-instancenorm", lambda: torch.nn.InstanceNorm2d(4), IMAGE, "torch_instancenorm"),
    # Hugging Face: γ's offset is read from the weights in a private copy
    *(InferCase(f"hf-{name}", functools.partial(hugging_face, name), SHAPE, preset,
                exact=("affine_order", "gamma_offset"), confidences={"gamma_offset": FROM_PARAMETERS})
      for name, preset in (("llama", "llama_rmsnorm"), ("gemma", "gemma_rmsnorm"), ("t5", "t5_layernorm"))),
    InferCase("flax-layernorm", functools.partial(flax, "LayerNorm"), SHAPE, "flax_layernorm", framework="jax",
              confidences={"variance_algorithm": DECISIVE}),
    InferCase("flax-rmsnorm", functools.partial(flax, "RMSNorm"), SHAPE, "flax_rmsnorm", framework="jax"),
    InferCase("onnx-rmsnormalization-23", lambda: onnx_model("RMSNormalization", 23, bias=False), SHAPE,
              "onnxruntime_rmsnorm"),
    InferCase("numpy-seed-layer-norm", lambda: zoo.seed_layer_norm, SHAPE, framework="numpy",
              spec=NormSpec(center=True, axes=[-1], eps=1e-6, eps_placement="outside_sqrt", gamma=False,
                              beta=False, stats_dtype="input")),
    *(InferCase(f"torch-layernorm-hidden-{h}", functools.partial(lambda h: zoo.randomize(torch.nn.LayerNorm(h)), h),
                (2, 8, h), "torch_layernorm") for h in (3, 7, 65)),
    # wrong ones: each keeps shapes right and produces finite numbers
    InferCase("wrong-unbiased-variance", lambda: zoo.randomize(zoo.UnbiasedLayerNorm()), SHAPE, "torch_layernorm",
              {"variance": "unbiased", "stats_dtype": "input"}),
    InferCase("wrong-sequence-axis", lambda: zoo.sequence_axis_layernorm, SHAPE, framework="torch",
              spec=NormSpec(center=True, axes=[-2], eps=1e-5, gamma=False, beta=False, stats_dtype="input")),
    InferCase("wrong-batch-axis", lambda: zoo.batch_axis_layernorm, SHAPE, framework="torch",
              spec=NormSpec(center=True, axes=[0], eps=1e-5, gamma=False, beta=False, stats_dtype="input")),
    InferCase("wrong-bf16-statistics", lambda: zoo.randomize(zoo.InputDtypeStatsRMSNorm()), SHAPE, "llama_rmsnorm",
              {"stats_dtype": "input"}, confidences={"stats_dtype": DECISIVE}),
    # odd targets: in-place writes, non-determinism
    InferCase("modifies-input", lambda: zoo.randomize(zoo.ZeroesInputLayerNorm()), SHAPE, "torch_layernorm",
              confidences={"modifies_input": DECISIVE}),
    InferCase("non-deterministic", lambda: zoo.randomize(zoo.NondeterministicLayerNorm()), SHAPE,
              "torch_layernorm", confidences={"determinism": DECISIVE}),
]
assert len({c.name for c in INFER_CASES}) == len(INFER_CASES), "registry names must be unique"
INFER_BY_NAME = {c.name: c for c in INFER_CASES}


@functools.cache
def inferred(name: str) -> tuple[Any, Inference]:
    """The target of case ``name`` and its inference (run once per session, shared by every test of the case)."""
    case = INFER_BY_NAME[name]
    target = case.make()
    kw = {k: v for k, v in (("framework", case.framework), ("dtypes", case.dtypes)) if v is not None}
    return target, infer(target, shape=case.shape, **kw)
