"""NormSpec: construction, validation, JSON, derived views, presets, canonical form and differences."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import normscope
from normscope import NormSpec, SpecError
from normscope.presets import PRESETS
from normscope.spec import (
    AFFINE_ORDERS,
    BATCH_STATS,
    EPS_PLACEMENTS,
    SCHEMA,
    STATS_DTYPES,
    VARIANCE_ALGORITHMS,
    VARIANCES,
    differences,
)

PRESET_NAMES = sorted(PRESETS)

EXPECTED_KIND = {
    "torch_layernorm": "layernorm",
    "torch_rmsnorm": "rmsnorm",
    "torch_groupnorm": "groupnorm",
    "torch_batchnorm": "batchnorm",
    "torch_batchnorm_eval": "batchnorm",
    "torch_instancenorm": "instancenorm",
    "llama_rmsnorm": "rmsnorm",
    "gemma_rmsnorm": "rmsnorm",
    "t5_layernorm": "rmsnorm",
    "bert_layernorm": "layernorm",
    "gpt2_layernorm": "layernorm",
    "flax_layernorm": "layernorm",
    "flax_rmsnorm": "rmsnorm",
    "keras_layernorm": "layernorm",
    "onnx_layernorm": "layernorm",
    "onnx_rmsnorm": "rmsnorm",
    "onnxruntime_layernorm": "layernorm",
    "onnxruntime_rmsnorm": "rmsnorm",
}


# ------------------------------------------------------------------------------------------ strategies
@st.composite
def valid_specs(draw) -> NormSpec:
    """Any valid NormSpec (fields drawn jointly so that every cross-field rule holds)."""
    center = draw(st.booleans())
    axes = draw(st.lists(st.integers(-4, 3), min_size=1, max_size=4, unique=True))
    grouped = draw(st.booleans())
    groups = draw(st.integers(1, 16)) if grouped else None
    group_axis = draw(st.sampled_from(axes)) if grouped else None
    placement = draw(st.sampled_from(EPS_PLACEMENTS))
    if placement == "none":
        eps = 0.0
    else:
        eps = draw(
            st.one_of(
                st.just(0.0),
                st.sampled_from([1e-12, 1e-6, 1e-5, 1.1920928955078125e-07, 1e-3]),
                st.floats(min_value=1e-30, max_value=10.0, allow_nan=False, allow_infinity=False),
            )
        )
    variance = draw(st.sampled_from(VARIANCES))
    algorithm = draw(st.sampled_from(VARIANCE_ALGORITHMS)) if center else "two_pass"
    gamma = draw(st.booleans())
    beta = draw(st.booleans())
    if gamma or beta:
        param_axes = draw(st.one_of(st.none(), st.lists(st.integers(-4, 3), max_size=3, unique=True)))
    else:
        param_axes = draw(st.sampled_from([None, []]))
    gamma_offset = draw(st.sampled_from([0.0, 1.0, -0.5, 0.125])) if gamma else 0.0
    return NormSpec(
        center=center,
        axes=axes,
        groups=groups,
        group_axis=group_axis,
        eps=eps,
        eps_placement=placement,
        variance=variance,
        variance_algorithm=algorithm,
        gamma=gamma,
        beta=beta,
        param_axes=param_axes,
        gamma_offset=gamma_offset,
        stats_dtype=draw(st.sampled_from(STATS_DTYPES)),
        affine_order=draw(st.sampled_from(AFFINE_ORDERS)),
        batch_stats=draw(st.sampled_from((None, *BATCH_STATS))),
    )


# ------------------------------------------------------------------------------------------ construction
def test_construction_by_keyword_and_defaults():
    spec = NormSpec(center=False, axes=[-1], eps=1e-6, beta=False)
    assert spec.center is False
    assert spec.axes == (-1,)
    assert spec.eps == 1e-6
    assert spec.gamma is True and spec.beta is False
    assert spec.param_axes == (-1,)  # defaults to the reduced axes when there is an affine
    default = NormSpec()
    assert (default.center, default.axes, default.eps, default.eps_placement) == (True, (-1,), 1e-5, "inside_sqrt")
    assert (default.variance, default.variance_algorithm) == ("biased", "two_pass")
    assert (default.stats_dtype, default.affine_order, default.batch_stats) == ("float32", "scale_then_cast", None)
    assert default.groups is None and default.group_axis is None and default.gamma_offset == 0.0


def test_lists_are_stored_as_tuples_and_spec_is_hashable():
    spec = NormSpec(axes=[1, 2, 3], groups=2, group_axis=1, param_axes=[1])
    assert spec.axes == (1, 2, 3) and type(spec.axes) is tuple
    assert spec.param_axes == (1,) and type(spec.param_axes) is tuple
    assert hash(spec) == hash(NormSpec(axes=(1, 2, 3), groups=2, group_axis=1, param_axes=(1,)))
    assert NormSpec(axes=-1) == NormSpec(axes=[-1])  # a single int is accepted as one axis
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.eps = 1.0  # type: ignore[misc]


def test_no_affine_gives_empty_param_axes():
    spec = NormSpec(gamma=False, beta=False)
    assert spec.param_axes == ()
    assert NormSpec(gamma=False, beta=False, param_axes=[]) == spec


def test_numbers_are_normalised():
    spec = NormSpec(eps=0, gamma_offset=1)
    assert isinstance(spec.eps, float) and spec.eps == 0.0
    assert isinstance(spec.gamma_offset, float) and spec.gamma_offset == 1.0


def test_replace_revalidates():
    spec = NormSpec.preset("torch_layernorm")
    assert spec.replace(eps=1e-3).eps == 1e-3
    with pytest.raises(SpecError, match="eps"):
        spec.replace(eps=-1.0)


# ------------------------------------------------------------------------------------------ JSON
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_json_round_trip_presets(name):
    spec = NormSpec.preset(name)
    text = spec.to_json()
    data = json.loads(text)
    assert data["schema"] == SCHEMA == "normscope.spec/1"
    assert data["kind"] == spec.kind
    assert isinstance(data["axes"], list)
    back = NormSpec.from_json(text)
    assert back == spec
    assert NormSpec.from_json(spec.to_json(indent=None)) == spec


@given(valid_specs())
def test_json_round_trip_random_specs(spec):
    text = spec.to_json()
    data = json.loads(text)
    assert data["schema"] == SCHEMA
    assert data["kind"] == spec.kind
    back = NormSpec.from_json(text)
    assert back == spec
    assert back.kind == spec.kind
    assert back.summary() == spec.summary()
    # without the derived "kind" field the file is still accepted
    del data["kind"]
    assert NormSpec.from_dict(data) == spec


def _preset_dict(**changes):
    data = NormSpec.preset("torch_layernorm").to_dict()
    data.update(changes)
    return data


@pytest.mark.parametrize(
    "text, fragment",
    [
        (json.dumps(_preset_dict(schema="normscope.spec/2")), "schema"),
        (json.dumps({k: v for k, v in _preset_dict().items() if k != "schema"}), "schema"),
        (json.dumps(_preset_dict(epsilon=1e-5)), "epsilon"),
        ("{not json", "JSON"),
        ("", "JSON"),
        ("[1, 2, 3]", "object"),
        (json.dumps(_preset_dict(kind="rmsnorm")), "kind"),
        (json.dumps(_preset_dict(eps=-1.0)), "eps"),
    ],
    ids=["wrong-schema", "missing-schema", "unknown-field", "bad-json", "empty", "not-object", "kind-mismatch",
         "invalid-field-value"],
)
def test_from_json_rejects(text, fragment):
    with pytest.raises(SpecError, match=fragment):
        NormSpec.from_json(text)


def test_from_json_kind_mismatch_names_both_kinds():
    with pytest.raises(SpecError) as info:
        NormSpec.from_json(json.dumps(_preset_dict(kind="rmsnorm")))
    assert "rmsnorm" in str(info.value) and "layernorm" in str(info.value)


def test_spec_error_is_a_value_error():
    assert issubclass(SpecError, ValueError)
    assert issubclass(SpecError, normscope.NormscopeError)


# ------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(eps=-1e-5), "eps must be finite and ≥ 0"),
        (dict(eps=float("nan")), "eps must be finite"),
        (dict(eps=float("inf")), "eps must be finite"),
        (dict(eps="tiny"), "eps must be a number"),
        (dict(eps=True), "eps must be a number"),
        (dict(axes=[1, 2, 3], groups=2), "groups and group_axis go together"),
        (dict(axes=[1, 2, 3], group_axis=1), "groups and group_axis go together"),
        (dict(axes=[2, 3], groups=2, group_axis=1), "group_axis 1 must be one of the reduced axes"),
        (dict(axes=[1, 2, 3], groups=0, group_axis=1), "groups must be a positive integer"),
        (dict(axes=[1, 2, 3], groups=True, group_axis=1), "groups must be a positive integer"),
        (dict(axes=[1, 2, 3], groups=2.5, group_axis=1), "groups must be a positive integer"),
        (dict(eps_placement="none", eps=1e-5), "eps_placement='none'"),
        (dict(axes=[-1, -1]), "repeats an axis"),
        (dict(axes=[]), "axes must name at least one axis"),
        (dict(axes=["a"]), "axes must be a list of integers"),
        (dict(axes=[1.5]), "axes must be a list of integers"),
        (dict(param_axes=[1, 1]), "param_axes .* repeats an axis"),
        (dict(gamma=False, beta=False, param_axes=[-1]), "neither gamma nor beta"),
        (dict(gamma=False, gamma_offset=1.0), "gamma_offset is set but the spec has no gamma"),
        (dict(gamma_offset=float("nan")), "gamma_offset must be finite"),
        (dict(center=False, variance_algorithm="one_pass"), "one_pass"),
        (dict(eps_placement="inside"), "eps_placement must be one of"),
        (dict(variance="sample"), "variance must be one of"),
        (dict(variance_algorithm="welford"), "variance_algorithm must be one of"),
        (dict(stats_dtype="bfloat16"), "stats_dtype must be one of"),
        (dict(affine_order="scale"), "affine_order must be one of"),
        (dict(batch_stats="train"), "batch_stats must be one of"),
        (dict(center=1), "center must be true or false"),
        (dict(center="yes"), "center must be true or false"),
        (dict(gamma=None), "gamma must be true or false"),
        (dict(beta=0), "beta must be true or false"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_validation_errors(kwargs, fragment):
    with pytest.raises(SpecError, match=fragment):
        NormSpec(**kwargs)


def test_bad_enum_message_lists_options_and_value():
    with pytest.raises(SpecError) as info:
        NormSpec(eps_placement="inside")
    message = str(info.value)
    for option in EPS_PLACEMENTS:
        assert repr(option) in message
    assert "'inside'" in message


@pytest.mark.parametrize("field", ["axes", "param_axes"])
def test_bool_axes_rejected(field):
    with pytest.raises(SpecError):
        NormSpec(**{field: [True]})


def test_unknown_override_is_a_spec_error():
    with pytest.raises(SpecError, match="epsilon"):
        NormSpec.preset("torch_layernorm", epsilon=1)


def test_preset_suggests_by_prefix():
    with pytest.raises(SpecError, match="llama_rmsnorm"):
        NormSpec.preset("llama")


def test_eps_zero_allowed_with_every_placement():
    for placement in EPS_PLACEMENTS:
        assert NormSpec(eps=0.0, eps_placement=placement).eps == 0.0


# ------------------------------------------------------------------------------------------ kind / summary
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_kind_of_presets(name):
    assert NormSpec.preset(name).kind == EXPECTED_KIND[name]


def test_every_preset_has_an_expected_kind():
    assert set(EXPECTED_KIND) == set(PRESETS) == set(normscope.presets())


def test_kind_derivation_from_fields():
    assert NormSpec(center=False).kind == "rmsnorm"
    assert NormSpec(axes=[-2, -1]).kind == "layernorm"
    assert NormSpec(axes=[1, 2, 3], groups=1, group_axis=1, param_axes=[1]).kind == "groupnorm"
    assert NormSpec(axes=[0, 2, 3], param_axes=[1], batch_stats="running").kind == "batchnorm"
    assert NormSpec(axes=[2, 3], gamma=False, beta=False).kind == "instancenorm"
    # groups win over batch statistics, batch statistics over centring
    assert NormSpec(axes=[1, 2], groups=2, group_axis=1, batch_stats="batch").kind == "groupnorm"
    assert NormSpec(center=False, axes=[0], batch_stats="batch").kind == "batchnorm"


def test_summary_torch_layernorm_exact():
    expected = "LayerNorm over [-1], ε=1e-05 inside √, biased two-pass, γ β over [-1], fp32 statistics, scale then cast"
    spec = NormSpec.preset("torch_layernorm")
    assert spec.summary() == expected
    assert str(spec) == expected


def test_summary_mentions_distinguishing_fields():
    assert "no ε" in NormSpec(eps=0, eps_placement="none").summary()
    assert "outside √" in NormSpec(eps_placement="outside_sqrt").summary()
    assert "one-pass" in NormSpec.preset("flax_layernorm").summary()
    assert "(γ acts as 1+w)" in NormSpec.preset("gemma_rmsnorm").summary()
    assert "cast then scale" in NormSpec.preset("llama_rmsnorm").summary()
    assert "in 4 groups along axis 1" in NormSpec.preset("torch_groupnorm", groups=4).summary()
    assert "running statistics" in NormSpec.preset("torch_batchnorm_eval").summary()
    assert "no affine" in NormSpec.preset("torch_instancenorm").summary()
    assert "input-dtype statistics" in NormSpec(stats_dtype="input").summary()
    assert "unbiased two-pass" in NormSpec(variance="unbiased").summary()


def test_summary_titles_follow_the_statistics_not_the_family_alone():
    """A BatchNorm without running statistics (torch's track_running_stats=False) reduces over the batch axis:
    not an InstanceNorm; a grouped norm without centring (Mamba2's gated RMSNorm) is an RMSNorm in groups."""
    assert NormSpec(axes=[0, 2, 3], param_axes=[1]).summary().startswith("BatchNorm over [0, 2, 3]")
    assert NormSpec(axes=[2, 3], param_axes=[1]).summary().startswith("InstanceNorm over [2, 3]")
    grouped = NormSpec(center=False, axes=[2], groups=4, group_axis=2, beta=False)
    assert grouped.kind == "groupnorm" and grouped.summary().startswith("RMSNorm over [2] in 4 groups along axis 2")
    assert NormSpec(axes=[1, 2, 3], groups=4, group_axis=1, param_axes=[1]).summary().startswith("GroupNorm")


def test_summary_marks_undecided_precision_fields_instead_of_stating_them():
    """A field the evidence did not decide is not stated as if measured (a float32-only target's statistics dtype
    read "fp32 statistics, scale then cast", the values inference reports when its experiment cannot run)."""
    spec = NormSpec.preset("torch_layernorm")
    assert spec.summary({"affine_order"}).endswith("γ β over [-1], fp32 statistics")
    assert spec.summary({"stats_dtype"}).endswith("γ β over [-1], statistics dtype undecided")
    both = spec.replace(param_dtype="float32").summary({"stats_dtype", "affine_order", "param_dtype"})
    assert both.endswith("γ β over [-1], statistics and γ/β dtypes undecided"), both
    assert spec.replace(param_dtype="float32").summary({"param_dtype"}).endswith("scale then cast, γ/β dtype undecided")
    assert NormSpec(gamma=False, beta=False).summary({"stats_dtype", "param_dtype"}).endswith(
        "no affine, statistics dtype undecided")


def test_a_float32_only_targets_contract_line_leaves_its_precision_undecided():
    def f32_only(x):
        if x.dtype != torch.float32:
            raise TypeError("float32 only")
        return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5)

    from normscope import infer

    inf = infer(f32_only, shape=(4, 64), framework="torch")
    assert inf.evidence["stats_dtype"].confidence == "not probed"
    assert inf.summary.endswith("no affine, statistics dtype undecided"), inf.summary
    assert inf.to_dict()["summary"] == inf.summary and "fp32 statistics" not in inf.summary


# ------------------------------------------------------------------------------------------ presets
def test_preset_values():
    p = NormSpec.preset
    torch_rms = p("torch_rmsnorm")
    assert torch_rms.eps == 1.1920928955078125e-07
    assert torch_rms.center is False and torch_rms.beta is False

    llama = p("llama_rmsnorm")
    assert llama.eps == 1e-6
    assert llama.affine_order == "cast_then_scale"
    assert llama.stats_dtype == "float32"
    assert llama.beta is False and llama.gamma is True and llama.center is False

    gemma = p("gemma_rmsnorm")
    assert gemma.gamma_offset == 1.0
    assert gemma.affine_order == "scale_then_cast"
    assert gemma.center is False

    t5 = p("t5_layernorm")
    assert t5.center is False and t5.beta is False and t5.eps == 1e-6

    assert p("bert_layernorm").eps == 1e-12
    assert p("gpt2_layernorm").eps == 1e-5
    flax = p("flax_layernorm")
    assert flax.eps == 1e-6 and flax.variance_algorithm == "one_pass" and flax.center is True
    assert p("keras_layernorm").eps == 1e-3
    assert p("onnx_layernorm").kind == "layernorm" and p("onnx_layernorm").affine_order == "cast_then_scale"
    assert p("onnx_rmsnorm").kind == "rmsnorm" and p("onnx_rmsnorm").beta is False

    tln = p("torch_layernorm")
    assert (tln.axes, tln.param_axes, tln.eps, tln.gamma, tln.beta) == ((-1,), (-1,), 1e-5, True, True)
    bn = p("torch_batchnorm")
    assert (bn.axes, bn.param_axes, bn.batch_stats) == ((0, 2, 3), (1,), "batch")
    assert p("torch_batchnorm_eval").batch_stats == "running"
    inst = p("torch_instancenorm")
    assert (inst.axes, inst.gamma, inst.beta, inst.param_axes) == ((2, 3), False, False, ())


def test_presets_function_lists_all_defaults():
    table = normscope.presets()
    assert set(table) >= {"onnx_layernorm", "onnx_rmsnorm", "torch_layernorm", "llama_rmsnorm"}
    for name, spec in table.items():
        assert isinstance(spec, NormSpec)
        assert spec == NormSpec.preset(name)


def test_preset_knob_overrides():
    assert NormSpec.preset("llama_rmsnorm", eps=1e-5) == NormSpec.preset("llama_rmsnorm").replace(eps=1e-5)
    assert NormSpec.preset("torch_layernorm", normalized_dims=2).axes == (-2, -1)
    assert NormSpec.preset("torch_layernorm", normalized_dims=2).param_axes == (-2, -1)
    no_affine = NormSpec.preset("torch_layernorm", affine=False)
    assert (no_affine.gamma, no_affine.beta, no_affine.param_axes) == (False, False, ())
    assert NormSpec.preset("torch_layernorm", bias=False).beta is False
    assert NormSpec.preset("torch_groupnorm", spatial_dims=1).axes == (1, 2)
    assert NormSpec.preset("torch_batchnorm", spatial_dims=1).axes == (0, 2)


def test_preset_field_overrides():
    spec = NormSpec.preset("torch_layernorm", stats_dtype="input", variance="unbiased", eps=1e-3)
    base = NormSpec.preset("torch_layernorm")
    assert spec.stats_dtype == "input" and spec.variance == "unbiased" and spec.eps == 1e-3
    assert spec == base.replace(stats_dtype="input", variance="unbiased", eps=1e-3)
    assert NormSpec.preset("gemma_rmsnorm", affine_order="cast_then_scale").gamma_offset == 1.0
    with pytest.raises(SpecError, match="eps"):
        NormSpec.preset("torch_layernorm", eps=-1.0)
    with pytest.raises(SpecError, match="normalized_dims"):
        NormSpec.preset("torch_layernorm", normalized_dims=0)


def test_preset_name_is_normalised():
    assert NormSpec.preset(" Torch-LayerNorm ") == NormSpec.preset("torch_layernorm")


@pytest.mark.parametrize("typo, suggestion", [("torch_layernrom", "torch_layernorm"), ("lama_rmsnorm", "llama_rmsnorm"),
                                              ("torch_groupnom", "torch_groupnorm")])
def test_unknown_preset_suggests_close_names(typo, suggestion):
    with pytest.raises(SpecError) as info:
        NormSpec.preset(typo)
    message = str(info.value)
    assert repr(typo) in message
    assert "Did you mean" in message
    hint = message.split("Did you mean", 1)[1].split("?", 1)[0]
    assert suggestion in hint


# ------------------------------------------------------------------------------------------ groupnorm / canonical
def test_groupnorm_preset_and_equivalence():
    spec = NormSpec.preset("torch_groupnorm", groups=4)
    assert spec.axes == (1, 2, 3)
    assert spec.group_axis == 1
    assert spec.groups == 4
    assert spec.param_axes == (1,)
    other = NormSpec(axes=[-3, -2, -1], groups=4, group_axis=-3, param_axes=[-3])
    assert spec != other
    assert spec.equivalent(other, 4)
    assert other.equivalent(spec, 4)
    assert differences(other, spec, 4) == []
    assert not spec.equivalent(other.replace(groups=2), 4)
    assert not spec.equivalent(other, 5)  # at 5-d, [-3, -2, -1] are the spatial axes 2, 3, 4


def test_canonical_resolves_axes():
    canon = NormSpec(axes=[-3, -2, -1], groups=4, group_axis=-3, param_axes=[-3]).canonical(4)
    assert canon.axes == (1, 2, 3) and canon.group_axis == 1 and canon.param_axes == (1,)
    assert NormSpec(axes=[-1]).equivalent(NormSpec(axes=[2], param_axes=[2]), 3)
    assert not NormSpec(axes=[-1]).equivalent(NormSpec(axes=[2], param_axes=[2]), 4)
    with pytest.raises(SpecError, match="does not exist"):
        NormSpec(axes=[3]).canonical(2)
    with pytest.raises(SpecError, match="same axis twice"):
        NormSpec(axes=[-1, 1]).canonical(2)


@pytest.mark.parametrize("a", EPS_PLACEMENTS)
@pytest.mark.parametrize("b", EPS_PLACEMENTS)
def test_canonical_eps_zero_makes_placements_equivalent(a, b):
    sa, sb = NormSpec(eps=0.0, eps_placement=a), NormSpec(eps=0.0, eps_placement=b)
    assert sa.canonical() == sb.canonical()
    assert sa.canonical().eps_placement == "none"
    assert sa.equivalent(sb, 3)
    if a != b and "none" not in (a, b):
        assert not NormSpec(eps=1e-5, eps_placement=a).equivalent(NormSpec(eps=1e-5, eps_placement=b), 3)


def test_canonical_affine_order_only_matters_with_fp32_stats_and_affine():
    cast, scale = "cast_then_scale", "scale_then_cast"
    assert not NormSpec(affine_order=cast).equivalent(NormSpec(affine_order=scale), 2)
    assert NormSpec(affine_order=cast, stats_dtype="input").equivalent(
        NormSpec(affine_order=scale, stats_dtype="input"), 2)
    assert NormSpec(affine_order=cast, gamma=False, beta=False).equivalent(
        NormSpec(affine_order=scale, gamma=False, beta=False), 2)


def test_canonical_is_identity_when_already_canonical():
    spec = NormSpec.preset("torch_layernorm")
    assert spec.canonical() is spec


@given(valid_specs())
def test_canonical_is_idempotent_and_equivalent(spec):
    canon = spec.canonical()
    assert canon.canonical() == canon
    if spec.eps == 0.0:
        assert canon.eps_placement == "none"
    else:
        assert canon.eps_placement == spec.eps_placement
    assert canon.kind == spec.kind


# ------------------------------------------------------------------------------------------ differences
def test_differences_empty_when_equivalent():
    spec = NormSpec.preset("torch_layernorm")
    assert differences(spec, spec, 3) == []
    assert differences(NormSpec(eps=0, eps_placement="clamp"), NormSpec(eps=0), 3) == []


def test_differences_eps_placement():
    found = NormSpec.preset("torch_layernorm", eps_placement="outside_sqrt")
    expected = NormSpec.preset("torch_layernorm")
    diffs = differences(found, expected, 3)
    assert diffs == ["expected ε inside √ (sqrt(var+ε)); found ε outside √ (std+ε)"]


def test_differences_never_state_an_undecided_field_as_found():
    """A field inference assumed or could not probe differs from the expected one only by convention: the line
    says it was not decided ("found biased" was printed for an unbiased target whose estimator is confounded with
    its γ's scale). Where γ/β are stored is compared only where × γ runs in fp32 before the one cast."""
    found = NormSpec(variance="biased", stats_dtype="input")
    expected = NormSpec(variance="unbiased", stats_dtype="float32")
    assert differences(found, expected, 3, undecided={"variance": "assumed"}) == [
        "expected unbiased variance (÷d−1); not decided by inference (assumed)",
        "expected fp32 statistics; found statistics in the input dtype"]
    kept = NormSpec(stats_dtype="input", output_dtype="float32", param_dtype="float32")
    assert differences(kept.replace(param_dtype="input"), kept, 3) == []  # input-dtype statistics: not applicable
    fp32 = NormSpec(param_dtype="float32")
    assert differences(fp32.replace(param_dtype="input"), fp32, 3) == [
        "expected γ/β kept in fp32; found γ/β stored at the input's dtype"]


def test_a_target_as_far_from_every_rounding_as_from_its_own_is_undecided_not_failed():
    """A NumPy LayerNorm on bfloat16 arrays accumulates its statistics in bfloat16: at the rounding finding's 30σ
    offset it is ~340 ulps from its contract and as far from every other, so the finding said FAIL although the
    contract (statistics in the input dtype) says nothing of how they accumulate: inconclusive, with both
    distances and what would decide it; nothing else fails."""
    np = pytest.importorskip("numpy")
    from normscope import check

    g = np.linspace(0.5, 1.5, 64).astype(np.float32)

    def annotated(x):  # the Annotated Transformer's LayerNorm: unbiased std, ε outside the root
        mu = x.mean(-1, keepdims=True)
        sd = x.std(-1, ddof=1, keepdims=True)
        return g * (x - mu) / (sd + 1e-6)

    spec = NormSpec(eps=1e-6, eps_placement="outside_sqrt", variance="unbiased", beta=False, stats_dtype="input",
                    output_dtype="float32", param_dtype="float32")
    r = check(annotated, expect=spec, shape=(2, 8, 64), framework="numpy")
    bad = {f.key: f.status for f in r.findings if f.status in ("fail", "inconclusive")}
    assert bad == {"reference.rounding[dtype=bfloat16]": "inconclusive"}, r.text()
    assert r.verdict == "inconclusive" and "as far from every contract as from its own" in r.text()
    assert r.differences == ["expected unbiased variance (÷d−1); not decided by inference (assumed)"]


def test_differences_axes():
    diffs = differences(NormSpec(axes=[-2]), NormSpec(axes=[-1]), 3)
    assert "statistics reduce over [-2], expected [-1]" in diffs
    assert "γ/β indexed by axes [-2], expected [-1]" in diffs
    assert len(diffs) == 2


def test_differences_many_fields_in_plain_words():
    found = NormSpec(center=False, eps=1e-6, variance="unbiased", beta=False, stats_dtype="input",
                     gamma_offset=1.0, batch_stats="batch", axes=[0, 2, 3], param_axes=[1])
    expected = NormSpec(eps=1e-5, axes=[0, 2, 3], param_axes=[1], batch_stats="running")
    diffs = differences(found, expected, 4)
    text = "\n".join(diffs)
    assert "found no mean subtraction (RMS); expected centred" in diffs
    assert "expected ε=1e-05; found ε=1e-06" in diffs
    assert any(d.startswith("expected biased variance") and d.endswith("found unbiased") for d in diffs)
    beta_lines = [d for d in diffs if "β" in d and "γ" not in d]
    assert len(beta_lines) == 1 and beta_lines[0].startswith("expected a") and "found none" in beta_lines[0]
    assert not any("γ" in d and "offset" not in d for d in diffs)  # both have γ: no γ line besides the offset
    assert "expected γ offset 0; found 1" in diffs
    assert "expected fp32 statistics; found statistics in the input dtype" in diffs
    assert "expected running statistics; found batch statistics" in diffs
    # plain words: no Python field names or reprs
    for word in ("eps_placement", "stats_dtype", "gamma_offset", "batch_stats", "NormSpec(", "True", "False"):
        assert word not in text


def test_differences_groups_and_algorithm_and_order():
    gn = NormSpec.preset("torch_groupnorm", groups=4)
    diffs = differences(gn.replace(groups=2), gn, 4)
    assert diffs == ["statistics reduce over [1, 2, 3] in 2 groups, expected [1, 2, 3] in 4 groups"]
    diffs = differences(NormSpec(variance_algorithm="one_pass"), NormSpec(), 2)
    assert diffs == ["expected two-pass variance; found one-pass"]
    diffs = differences(NormSpec(affine_order="cast_then_scale"), NormSpec(), 2)
    assert diffs == ["expected scale then cast; found cast then scale"]


@given(valid_specs())
def test_differences_of_a_spec_with_itself_is_empty(spec):
    ndim = 4
    try:
        spec.canonical(ndim)
    except SpecError:
        return  # axes that collide at this ndim (e.g. [-1, 3]) cannot be resolved
    assert differences(spec, spec, ndim) == []
    assert spec.equivalent(spec, ndim)


def test_eps_json_round_trip_is_exact():
    for eps in (1.1920928955078125e-07, 1e-12, math.ulp(1.0), 0.1):
        spec = NormSpec(eps=eps)
        assert NormSpec.from_json(spec.to_json()).eps == eps


def test_degenerate_groupings_are_equivalent_given_the_shape():
    gn1 = NormSpec.preset("torch_groupnorm", groups=1)
    ln_chw = NormSpec(center=True, axes=[1, 2, 3], param_axes=[1])
    assert not gn1.equivalent(ln_chw, 4)
    assert gn1.equivalent(ln_chw, 4, shape=(2, 4, 5, 5))
    gn_c = NormSpec.preset("torch_groupnorm", groups=4)
    instance = NormSpec(center=True, axes=[2, 3], param_axes=[1])
    assert gn_c.equivalent(instance, 4, shape=(2, 4, 5, 5))
    assert differences(instance, gn_c, 4, shape=(2, 4, 5, 5)) == []
    assert not gn_c.equivalent(instance, 4, shape=(2, 8, 5, 5))


def test_differences_name_the_group_axis_when_it_differs():
    gn = NormSpec(axes=[1, 2, 3], groups=2, group_axis=1, param_axes=[1])
    diffs = differences(gn.replace(group_axis=2), gn, 4)
    assert diffs == ["statistics reduce over [1, 2, 3] in 2 groups along axis 2, expected [1, 2, 3] in 2 groups "
                     "along axis 1"]


def test_per_head_layernorm_is_not_called_instancenorm():
    # statistics over head_dim of a (B, S, H, D) tensor, γ per head and channel (reported channel-style)
    per_head = NormSpec(axes=[3], param_axes=[2, 3])
    assert per_head.kind == "layernorm" and per_head.summary().startswith("LayerNorm over [3]")
    assert NormSpec(axes=[2], gamma=False, beta=False).kind == "instancenorm"  # InstanceNorm1d over NCL
    assert NormSpec(axes=[2, 3, 4], gamma=False, beta=False).kind == "instancenorm"
    assert NormSpec(axes=[3, 4], gamma=False, beta=False).kind == "layernorm"
