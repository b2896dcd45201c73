"""Inference on the zoo: every field of the contract, for real, wrong and non-normalizations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zoo
from registry import INFER_BY_NAME, assert_contract, batchnorm_three_steps, inferred, onnx_model

import normscope
from normscope import NormSpec, NotANormalization, TargetError
from normscope.probe.infer import infer
from normscope.results.inference import Confidence, Evidence, Inference
from normscope.spec import differences

SHAPE = (2, 8, 64)
IMAGE = (2, 4, 5, 5)


# --------------------------------------------------------------------------------------------- the registry
@pytest.mark.parametrize("name", sorted(INFER_BY_NAME))
def test_registry_case(name):
    """Every INFER_CASES entry of tests/registry.py: its contract, field by field, and the confidences it declares."""
    case = INFER_BY_NAME[name]
    _, r = inferred(name)
    if case.expect is not None:
        assert_contract(r, case.expect, len(case.shape), case.exact)
    for field, confidence in case.confidences.items():
        assert r.evidence[field].confidence is confidence, (field, r.evidence[field])
    assert all(isinstance(e.confidence, Confidence) for e in r.evidence.values())  # the closed set


# --------------------------------------------------------------------------------------------- real ones
def test_torch_layernorm_recovers_contract_and_parameters():
    m, r = inferred("torch-layernorm")
    np.testing.assert_allclose(r.params.gamma, m.weight.detach().double().numpy(), rtol=1e-9)
    np.testing.assert_allclose(r.params.beta, m.bias.detach().double().numpy(), atol=1e-9)
    assert r.calls <= 300
    assert r.validation["max_relative_error"] < 1e-12


def test_torch_layernorm_default_init_still_shows_its_affine():
    # γ=1, β=0 are invisible from outside; the private copy with random parameters reveals them
    _, r = inferred("torch-layernorm-default-init")
    assert r.evidence["gamma"].confidence is Confidence.FROM_PARAMETERS
    np.testing.assert_allclose(r.params.gamma, np.ones(64), atol=1e-9)


def test_torch_layernorm_two_normalized_dims():
    _, r = inferred("torch-layernorm-2d")
    assert r.params.gamma.shape == (8, 64)


def test_torch_rmsnorm_eps_none_is_dtype_dependent():
    _, r = inferred("torch-rmsnorm")
    dep = r.evidence["eps"].measured["dtype_dependent"]
    assert dep["float64"] == pytest.approx(np.finfo(np.float64).eps, rel=0.01)
    assert dep["float32"] == pytest.approx(np.finfo(np.float32).eps, rel=0.01)


def test_torch_groupnorm():
    m, r = inferred("torch-groupnorm")
    assert r.spec.group_axis == 1
    np.testing.assert_allclose(r.params.gamma, m.weight.detach().double().numpy(), rtol=1e-9)


def test_torch_batchnorm_train():
    bn, r = inferred("torch-batchnorm-train")
    assert r.spec.batch_stats == "batch"
    assert bn.training  # untouched


def test_torch_batchnorm_eval_recovers_running_statistics():
    bn, r = inferred("torch-batchnorm-eval")
    np.testing.assert_allclose(r.params.running_mean, bn.running_mean.double().numpy(), rtol=1e-6)
    np.testing.assert_allclose(r.params.running_var, bn.running_var.double().numpy(), rtol=1e-6)
    assert r.validation["eval"]["max_relative_error"] < 1e-6


def test_hugging_face_gamma_offset_is_read_from_the_weights():
    for name, offset in (("hf-llama", 0.0), ("hf-gemma", 1.0), ("hf-t5", 0.0)):
        _, r = inferred(name)
        assert r.spec.gamma_offset == offset, name  # read from the weights in a private copy


def test_flax_layernorm_is_one_pass():
    _, r = inferred("flax-layernorm")
    assert r.spec.variance_algorithm == "one_pass"


def test_onnx_layernormalization_17(tmp_path):
    model = onnx_model("LayerNormalization", 17)
    path = tmp_path / "ln.onnx"
    import onnx

    onnx.save(model, str(path))
    r = infer(str(path), shape=SHAPE)
    assert_contract(r, NormSpec.preset("onnxruntime_layernorm"), 3)
    assert "float16" in r.dtypes


def test_onnx_model_is_not_modified():
    model = onnx_model("LayerNormalization", 17)
    before = model.SerializeToString()
    infer(model, shape=SHAPE)
    assert model.SerializeToString() == before


def test_onnx_fixed_dims_must_match_shape():
    model = onnx_model("LayerNormalization", 17, dims=(2, 8, 64))
    with pytest.raises(TargetError, match="--shape 2,8,64"):
        infer(model, shape=(2, 4, 64))


# --------------------------------------------------------------------------------------------- eps accuracy
@pytest.mark.parametrize("eps", [0.0, 1e-12, 1e-9, 1e-6, 1e-3, 0.1])
def test_eps_value_float64(eps):
    r = infer(lambda x: torch.nn.functional.layer_norm(x, (64,), eps=eps), shape=SHAPE, framework="torch",
              dtypes=["float64"])
    if eps == 0:
        assert r.spec.eps == 0 and r.spec.eps_placement == "none"
    else:
        assert r.spec.eps == pytest.approx(eps, rel=0.01)
        assert r.spec.eps_placement == "inside_sqrt"


@pytest.mark.parametrize("eps", [1e-9, 1e-6, 1e-3])
@pytest.mark.parametrize("placement", ["inside_sqrt", "outside_sqrt", "clamp"])
def test_eps_value_and_placement_float32(eps, placement):
    spec = NormSpec(center=False, axes=[-1], eps=eps, eps_placement=placement, gamma=False, beta=False)
    from normscope import reference

    r = infer(lambda x: reference.forward(x, spec, dtype="float32").astype(np.float32), shape=SHAPE,
              framework="numpy", dtypes=["float32"])
    assert r.spec.eps_placement == placement
    assert r.spec.eps == pytest.approx(eps, rel=0.01)


# --------------------------------------------------------------------------------------------- wrong ones
def test_wrong_unbiased_variance():
    _, r = inferred("wrong-unbiased-variance")
    assert r.spec.variance == "unbiased"
    assert "variance" in " ".join(differences(r.spec, NormSpec.preset("torch_layernorm"), 3))


@pytest.mark.parametrize("name, axes", [("wrong-sequence-axis", [-2]), ("wrong-batch-axis", [0])])
def test_wrong_statistics_axis(name, axes):
    _, r = inferred(name)
    assert list(r.spec.axes) == axes
    assert any("statistics reduce over" in d for d in differences(r.spec, NormSpec.preset("torch_layernorm",
               affine=False), 3))


def test_wrong_gamma_along_sequence():
    r = infer(zoo.SequenceGammaLayerNorm(), shape=SHAPE)
    assert r.spec.resolve_param_axes(3) == (1,)
    assert r.spec.resolve_axes(3) == (2,)
    assert any("γ/β indexed by" in d for d in differences(r.spec, NormSpec.preset("torch_layernorm"), 3))


def test_wrong_eps_outside_sqrt():
    r = infer(zoo.eps_outside_layernorm, shape=SHAPE, framework="torch")
    assert r.spec.eps_placement == "outside_sqrt" and r.spec.eps == pytest.approx(1e-5, rel=0.01)
    assert "expected ε inside √ (sqrt(var+ε)); found ε outside √ (std+ε)" in differences(
        r.spec, NormSpec.preset("torch_layernorm", affine=False), 3)


def test_wrong_one_pass_variance():
    r = infer(zoo.one_pass_layernorm, shape=SHAPE, framework="torch")
    assert r.spec.variance_algorithm == "one_pass"


def test_wrong_cast_order_under_llama_contract():
    r = infer(zoo.randomize(zoo.ScaleThenCastRMSNorm()), shape=SHAPE)
    assert r.spec.affine_order == "scale_then_cast"
    assert "expected cast then scale; found scale then cast" in differences(
        r.spec, NormSpec.preset("llama_rmsnorm"), 3)


def test_wrong_eps_value():
    r = infer(zoo.randomize(torch.nn.LayerNorm(64, eps=1e-3)), shape=SHAPE)
    assert r.spec.eps == pytest.approx(1e-3, rel=0.01)
    assert "expected ε=1e-05; found ε=0.001" in differences(r.spec, NormSpec.preset("torch_layernorm"), 3)


# --------------------------------------------------------------------------------------------- not norms
@pytest.mark.parametrize("fn, framework, words", [
    (zoo.softmax, "torch", "scaling the input by 4"),
    (zoo.numpy_tanh, "numpy", "scaling the input by 4"),
    (zoo.max_abs_scale, "torch", "depends on more than the mean and variance"),
    (zoo.causal_mean_center, "torch", "moved"),
    (lambda x: x * 1.0, "torch", "elementwise"),
])
def test_not_a_normalization(fn, framework, words):
    with pytest.raises(NotANormalization, match=words):
        infer(fn, shape=SHAPE, framework=framework)


def test_linear_layer_is_not_a_normalization():
    lin = torch.nn.Linear(64, 64).double()
    with pytest.raises(NotANormalization):
        infer(lin, shape=SHAPE)


# --------------------------------------------------------------------------------------------- state & api
def _state(m):
    return ({k: v.clone() for k, v in m.state_dict().items()}, m.training,
            {n: p.requires_grad for n, p in m.named_parameters()})


def _same(a, b):
    assert a[1] == b[1] and a[2] == b[2]
    assert a[0].keys() == b[0].keys()
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k


def test_module_state_is_unchanged_after_inference_and_after_failure():
    bn = batchnorm_three_steps()
    bn.weight.requires_grad_(False)
    before = _state(bn)
    infer(bn, shape=IMAGE)
    _same(before, _state(bn))
    with pytest.raises(NormscopeError_or_target()):
        infer(bn, shape=(2, 3, 5, 5))  # wrong channel count: the module itself fails
    _same(before, _state(bn))


def NormscopeError_or_target():
    return normscope.NormscopeError


def test_plain_callable_needs_a_framework():
    with pytest.raises(TargetError, match="framework="):
        infer(zoo.seed_layer_norm, shape=SHAPE)


def test_inference_json_schema():
    import json

    _, r = inferred("torch-layernorm-default-init")
    data = json.loads(r.to_json())
    assert data["schema"] == "normscope.inference/1"
    assert NormSpec.from_dict(data["spec"]) == r.spec
    assert set(data["evidence"]) >= {"center", "axes", "eps", "eps_placement", "variance", "gamma", "beta"}
    assert data["calls"] == r.calls > 0
    assert {e["confidence"] for e in data["evidence"].values()} <= {c.value for c in Confidence}  # plain strings


@pytest.mark.parametrize("name", ["torch-layernorm", "torch-batchnorm-eval", "numpy-seed-layer-norm",
                                  "non-deterministic"])
def test_inference_loads_back_from_its_json(name):
    import json

    _, r = inferred(name)
    text = r.to_json()
    back = Inference.from_json(text)
    assert back.to_json() == text  # the same JSON, key for key
    assert back.spec == r.spec and back.shape == r.shape and back.dtypes == r.dtypes
    assert back.params == r.params  # NormParams, arrays compared exactly
    for field, ev in r.evidence.items():
        assert back.evidence[field].confidence is ev.confidence
    assert Inference.from_dict(json.loads(text)).evidence.keys() == r.evidence.keys()


def test_inference_from_dict_refuses_what_is_not_an_inference():
    from normscope import InputError

    with pytest.raises(InputError, match="normscope.inference/1"):
        Inference.from_dict({"schema": "normscope.check/1"})
    with pytest.raises(InputError, match="no contract: scaling"):  # `normscope infer --json` of a softmax
        Inference.from_dict({"schema": "normscope.inference/1", "target": "softmax",
                             "not_a_normalization": "scaling the input by 4 changed the output"})
    with pytest.raises(InputError, match="confidence must be one of"):
        Evidence("an experiment", {}, "sure")


def test_wrappers_and_dtype_restriction():
    t = normscope.targets.numpy(zoo.seed_layer_norm)
    r = infer(t, shape=SHAPE, dtypes="float32")
    assert r.dtypes == ("float32",) and r.probe_dtype == "float32"


def test_onnx_model_as_bytes():
    model = onnx_model("RMSNormalization", 23, bias=False)
    r = infer(model.SerializeToString(), shape=SHAPE)
    assert r.spec.kind == "rmsnorm" and r.spec.eps == pytest.approx(1e-5, rel=0.01)


def test_missing_extra_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "jax", None)  # import jax now raises ImportError
    with pytest.raises(normscope.MissingExtraError, match=r"pip install 'normscope\[jax\]'"):
        infer(zoo.seed_layer_norm, shape=SHAPE, framework="jax")


def test_float32_inside_a_float64_interface_is_still_two_pass():
    r = infer(zoo.Float32InsideLayerNorm(), shape=SHAPE)
    assert r.spec.variance_algorithm == "two_pass"
    assert r.evidence["variance_algorithm"].measured["effective_precision"] > 1e-9


def test_size_one_axes_are_flagged():
    r = infer(torch.nn.BatchNorm2d(4), shape=(1, 4, 3, 3))
    assert r.evidence["axes"].confidence is Confidence.WEAK  # axis 0 has size 1: whether it is reduced is unseen
    # the same module at a batch of 2: the axes are decided
    assert infer(torch.nn.BatchNorm2d(4), shape=(2, 4, 3, 3)).evidence["axes"].confidence is Confidence.DECISIVE


def test_half_only_dtypes_are_a_clear_error():
    with pytest.raises(TargetError, match="float32 or float64"):
        infer(torch.nn.LayerNorm(64), shape=SHAPE, dtypes="float16")


# --------------------------------------------------------------------------------------------- odd targets
def test_system_exit_in_forward_is_a_target_error():
    t = normscope.targets.torch(zoo.exits_layernorm)
    with pytest.raises(TargetError, match=r"SystemExit\(3\).*sys\.exit"):
        t(np.ones(SHAPE), "float32")
    with pytest.raises(TargetError, match="SystemExit"):
        infer(zoo.exits_layernorm, shape=SHAPE, framework="torch")


def test_system_exit_in_forward_exits_2_with_one_line():
    import subprocess
    import sys
    from pathlib import Path

    src = Path(normscope.__file__).resolve().parents[1]  # this checkout's normscope, whatever is installed
    env = {"PYTHONPATH": f"{src}:{Path(__file__).resolve().parent}", "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "normscope", "infer", "zoo:exits_layernorm", "--shape", "2,8,64",
                        "--framework", "torch"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "SystemExit(3)" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_keyboard_interrupt_in_forward_stays_a_keyboard_interrupt():
    def interrupted(x):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        normscope.targets.torch(interrupted)(np.ones(SHAPE))


@pytest.mark.parametrize("hidden", [16, 64, 128, 512])
def test_stats_dtype_is_never_a_confident_wrong_answer(hidden):
    # An RMSNorm without the fp32 upcast: at bfloat16 both candidates sit within ~0.1 ulp of each other, at
    # float16 they separate. The answer is "input", or "ambiguous" with both numbers; never fp32 as a verdict.
    r = infer(zoo.randomize(zoo.InputDtypeStatsRMSNorm(hidden)), shape=(2, 16, hidden))
    ev = r.evidence["stats_dtype"]
    assert r.spec.stats_dtype == "input" or ev.confidence is Confidence.AMBIGUOUS, ev.measured
    sep = ev.measured["separation"]
    assert set(sep) == {"bfloat16", "float16"}
    for d in sep.values():
        assert d["float32"] >= 0 and d["input"] >= 0  # both numbers are shown
    if ev.confidence is Confidence.AMBIGUOUS:  # with both numbers and the sign test at every dtype
        assert all({"float32", "input", "sign_z", "ratio"} <= set(d) for d in sep.values())
    assert not sep["bfloat16"]["beyond_noise"] or sep["bfloat16"]["winner"] == "input"


def test_stats_dtype_decisive_only_where_candidates_separate():
    r = infer(zoo.randomize(zoo.InputDtypeStatsRMSNorm(512)), shape=(2, 16, 512))
    ev = r.evidence["stats_dtype"]
    assert r.spec.stats_dtype == "input" and ev.confidence is Confidence.DECISIVE
    assert ev.measured["decided_at"] == "float16"  # where 0.2 vs 1.6 ulps, not bfloat16's 0.24 vs 0.27
    sep = ev.measured["separation"]["float16"]
    assert sep["ratio"] > 3 and sep["sign_z"] < -5


@pytest.mark.parametrize("shape", [(2, 4, 5, 5), (8, 4, 3, 3), (2, 4, 16, 16)])
def test_batchnorm_training_statistics_dtype_does_not_flip_with_the_shape(shape):
    r = infer(batchnorm_three_steps(), shape=shape)
    assert r.spec.stats_dtype == "input"
    assert r.evidence["stats_dtype"].confidence is Confidence.DECISIVE


def test_frozen_batchnorm_is_recognised_from_its_buffers():
    m = zoo.FrozenBatchNorm2d()
    r = infer(m, shape=IMAGE)
    ev = r.evidence["stats_dtype"]
    assert r.spec.stats_dtype == "input" or ev.confidence is Confidence.AMBIGUOUS
    assert_contract(r, NormSpec.preset("torch_batchnorm_eval", stats_dtype=r.spec.stats_dtype,
                                       batch_stats="frozen"), 4)
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(getattr(r.params, name), getattr(m, name).double().numpy(), rtol=1e-12)
    np.testing.assert_allclose(r.params.gamma, m.weight.double().numpy(), rtol=1e-6)
    np.testing.assert_allclose(r.params.beta, m.bias.double().numpy(), atol=1e-9)
    assert r.spec.eps == pytest.approx(1e-5, rel=1e-3)
    assert r.evidence["axes"].measured["buffers"] == ["running_mean", "running_var"]
    assert r.validation["max_relative_error"] < 1e-9


def test_each_mode_reports_its_own_eps():
    """A BatchNorm whose evaluation path uses another ε than training (an export-time fold changed it): the
    contract of each mode carries that mode's ε, and the other mode's is in the evidence."""
    import torch.nn.functional as F

    class TwoEps(torch.nn.BatchNorm2d):
        def forward(self, x):
            if self.training:
                return super().forward(x)
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, 1e-3)

    torch.manual_seed(0)
    m = TwoEps(4)
    with torch.no_grad():
        m.running_mean.copy_(torch.randn(4))
        m.running_var.copy_(torch.rand(4) + 0.5)
    zoo.randomize(m)
    r = infer(m.eval(), shape=IMAGE)
    assert r.spec.batch_stats == "running" and r.spec.eps == pytest.approx(1e-3, rel=1e-3)
    assert r.evidence["eps_evaluation"].measured["training_eps"] == pytest.approx(1e-5, rel=1e-3)
    r = infer(m.train(), shape=IMAGE)
    assert r.spec.batch_stats == "batch" and r.spec.eps == pytest.approx(1e-5, rel=1e-3)
    assert "eps_evaluation" in r.evidence
    assert "eps_evaluation" not in infer(torch.nn.BatchNorm2d(4).eval(), shape=IMAGE).evidence


def test_per_channel_affine_without_buffers_is_refused_with_what_decided():
    class Renamed(zoo.FrozenBatchNorm2d):
        def forward(self, x):
            return x * self.weight.reshape(1, -1, 1, 1) + self.bias.reshape(1, -1, 1, 1)

    m = Renamed()
    del m.running_mean, m.running_var
    with pytest.raises(NotANormalization, match="fixed affine map y = A·x \\+ B.*axis 1") as exc:
        infer(m, shape=IMAGE)
    assert "softmax" not in str(exc.value)


def test_input_modified_in_place_is_inferred_and_reported():
    _, r = inferred("modifies-input")  # its contract is torch_layernorm's (the registry case)
    ev = r.evidence["modifies_input"]
    assert ev.measured["calls_that_modified_input"] == r.calls
    assert "modifies_input" not in inferred("torch-layernorm-default-init")[1].evidence


def test_caller_array_is_never_shared_with_the_target():
    def zeroing(x):
        y = torch.nn.functional.layer_norm(x, (64,))
        x.zero_()
        return y

    t = normscope.targets.torch(zeroing)
    x = np.arange(2 * 8 * 64, dtype=np.float64).reshape(SHAPE)
    y = t(x)
    assert x[0, 0, 5] == 5.0  # the caller's array is untouched
    assert np.allclose(y, torch.nn.functional.layer_norm(torch.from_numpy(x), (64,)).numpy())


def test_nondeterministic_target_is_probed_for_determinism_first():
    _, r = inferred("non-deterministic")  # torch_layernorm (the registry case), not "BatchNorm … running statistics"
    det = r.evidence["determinism"]
    spread = det.measured["max_relative_difference"]
    assert 0 < spread < 1e-5
    assert det.measured["noise_floor"] >= 16 * spread  # every experiment treats the spread as noise
    assert inferred("torch-layernorm-default-init")[1].evidence["determinism"].measured[
        "max_relative_difference"] == 0


def test_user_hooks_never_fire_on_private_copies():
    from torch.nn.modules.module import register_module_forward_hook

    m = zoo.randomize(torch.nn.LayerNorm(64))
    fired = {"forward": 0, "pre": 0, "global": 0}
    m.register_forward_hook(lambda *a: fired.__setitem__("forward", fired["forward"] + 1))
    m.register_forward_pre_hook(lambda *a: fired.__setitem__("pre", fired["pre"] + 1))
    handle = register_module_forward_hook(lambda *a: fired.__setitem__("global", fired["global"] + 1))
    try:
        r = infer(m, shape=SHAPE)
        assert_contract(r, NormSpec.preset("torch_layernorm"), 3)
        assert fired == {"forward": 0, "pre": 0, "global": 0}
        m(torch.zeros(1, 64))  # the user's own calls still fire every hook
        assert fired == {"forward": 1, "pre": 1, "global": 1}
    finally:
        handle.remove()
    assert len(m._forward_hooks) == 1 and len(m._forward_pre_hooks) == 1


def test_per_head_layernorm_is_a_layernorm():
    r = infer(zoo.PerHeadLayerNorm(), shape=(2, 3, 4, 16))
    assert r.spec.resolve_axes(4) == (3,) and r.spec.resolve_param_axes(4) == (2, 3)
    assert r.spec.kind == "layernorm" and "InstanceNorm" not in r.spec.summary()


# --------------------------------------------------------------------------------------------- precision experiment
def test_precision_experiment_finds_the_emulated_candidate_and_formula():
    from normscope import reference
    from normscope.groups import Groups
    from normscope.precision import Precision
    from normscope.probe import precision_experiment as pe
    from normscope.results.params import NormParams

    rng = np.random.default_rng(3)
    spec = NormSpec.preset("torch_layernorm")
    g = Groups.of(spec, SHAPE)
    x = Precision("bfloat16").round((rng.normal(size=SHAPE) + pe.offset_groups(g)) * 3).astype(np.float64)
    params = NormParams(gamma=rng.uniform(0.5, 1.5, 64), beta=rng.uniform(-1, 1, 64))
    for stats, order in pe.CANDIDATES:
        y = reference.forward(x, spec.replace(stats_dtype=stats, affine_order=order), dtype="bfloat16",
                              **params.kwargs())
        scores = pe.score(y, x, "bfloat16", spec, params)
        assert scores[(stats, order)].mean == 0.0
        other = min(s.mean for c, s in scores.items() if c[0] != stats)
        assert other > 0.05, scores  # the other statistics dtype is visibly further
        sep = pe.separation(scores, repeat=0.0)
        assert sep["winner"] == stats and sep["reproduces"] and sep["beyond_noise"], sep
    # a folded affine is one of scale-then-cast's faithful formulas: found only when formulas are searched
    folded = spec.replace(affine_order="scale_then_cast")
    y = reference.forward(x, folded, dtype="bfloat16", formula="folded", **params.kwargs())
    assert pe.distance(y, x, "bfloat16", folded, params).mean > 0
    nearest = pe.score(y, x, "bfloat16", spec, params, [("float32", "scale_then_cast")], formulas=None)
    assert nearest[("float32", "scale_then_cast")].mean == 0.0
    assert nearest[("float32", "scale_then_cast")].formula == "folded"
    assert "folded" not in pe.faithful_formulas(spec.replace(affine_order="cast_then_scale"))


class _ShiftThenScale(torch.nn.Module):
    """(x̂ + b)·w: its applied shift is b·w, not its ``bias`` parameter."""

    def __init__(self, d=64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.rand(d, generator=g) + 0.5)
        self.bias = torch.nn.Parameter(torch.randn(d, generator=g) * 0.3)

    def forward(self, x):
        return (torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5) + self.bias) * self.weight


def test_parameters_that_do_not_explain_the_output_are_not_trusted():
    """The names would say γ = weight and no β; under random parameters the output is shifted by b·w, which no
    parameter equals, so γ and β come from behaviour (as for the same code written as a function)."""
    m = _ShiftThenScale()
    r = infer(m, shape=(2, 8, 64))
    assert r.spec.gamma and r.spec.beta and r.spec.eps == pytest.approx(1e-5, rel=0.01)
    assert "do not explain the output" in r.evidence["gamma"].note and "'weight'" in r.evidence["gamma"].note
    with torch.no_grad():
        expected_beta = (m.bias * m.weight).double().numpy()
    assert np.allclose(r.params.beta, expected_beta, rtol=1e-4, atol=1e-6)
    assert r.evidence["gamma"].confidence != "from parameters"


def _fp32_parameters_layernorm():
    """A mixed-precision LayerNorm: a bf16/fp16 input, γ/β kept in fp32 (× γ rounds once), cast back."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.rand(64, generator=g) * 1.7 + 0.3, torch.randn(64, generator=g) * 0.5

    def norm(x):
        return (torch.nn.functional.layer_norm(x.float(), (64,), eps=1e-5) * w + b).to(x.dtype)

    return norm


def test_where_gamma_is_stored_is_part_of_the_contract():
    """γ kept in fp32 while the input is bf16 rounds once; a module cast whole rounds γ to bf16 first."""
    r = infer(_fp32_parameters_layernorm(), framework="torch", shape=(2, 8, 64))
    assert r.spec.param_dtype == "float32" and r.evidence["param_dtype"].confidence == "decisive", \
        r.evidence["param_dtype"]
    assert "fp32 γ/β" in r.spec.summary()
    m = zoo.randomize(torch.nn.LayerNorm(64))
    r = infer(m, shape=(2, 8, 64))
    assert r.spec.param_dtype == "input" and r.evidence["param_dtype"].confidence == "decisive"
    spec = NormSpec.preset("torch_layernorm", param_dtype="float32")
    assert NormSpec.from_json(spec.to_json()) == spec
    assert differences(NormSpec.preset("torch_layernorm"), spec, 3) == [
        "expected γ/β kept in fp32; found γ/β stored at the input's dtype"]


def test_a_fixed_low_precision_target_is_refused_with_the_reason_not_called_no_normalization():
    """A LayerNorm that computes in float16 whatever it is given (flax's dtype=jnp.float16) would make every
    experiment read rounding as structure ("not a normalization"): infer says what it is and what to do."""

    def half_layernorm(x):
        h = torch.as_tensor(x).half()
        return torch.nn.functional.layer_norm(h.float(), h.shape[-1:]).half()

    with pytest.raises(TargetError, match="returns float16 for a float64 input: it computes at a fixed float16"):
        infer(half_layernorm, framework="torch", shape=(2, 8, 64))
