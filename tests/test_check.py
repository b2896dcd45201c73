"""The acceptance battery: real implementations pass their presets, every wrong one fails the right finding."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import registry
import torch
import zoo

import normscope
from normscope import NormSpec, check
from normscope.results.check import Report
from normscope.testing import assert_conforms

SHAPE = (2, 8, 64)
IMAGE = (2, 4, 5, 5)


def failed(report) -> set[str]:
    """The keys (stable id and parameters) of the failed findings."""
    return report.keys("fail")


TINY_1E_12 = "extreme.tiny_variance[variance=1e-12; dtype=float32]"


def assert_passes(report):
    assert report.ok, report.text()
    assert report.counts()["pass"] >= 15


# ---------------------------------------------------------------------------------------------- real ones
@pytest.mark.parametrize("make, preset, shape, overrides", [
    (lambda: torch.nn.LayerNorm(64), "torch_layernorm", SHAPE, {}),
    (lambda: zoo.randomize(torch.nn.LayerNorm(64)), "torch_layernorm", SHAPE, {}),
    (lambda: torch.nn.RMSNorm(64), "torch_rmsnorm", SHAPE, {}),
    (lambda: zoo.randomize(torch.nn.GroupNorm(2, 4)), "torch_groupnorm", IMAGE, {"groups": 2}),
    (lambda: torch.nn.LayerNorm(64, eps=1e-12), "bert_layernorm", SHAPE, {}),
], ids=["layernorm", "layernorm-random", "rmsnorm", "groupnorm", "bert"])
def test_real_implementations_pass_their_preset(make, preset, shape, overrides):
    assert_passes(check(make(), expect=NormSpec.preset(preset, **overrides), shape=shape))


@pytest.mark.parametrize("name", ["llama", "gemma", "t5"])
def test_hugging_face_norms_pass_their_presets(name):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    cls, preset = {"llama": (LlamaRMSNorm, "llama_rmsnorm"), "gemma": (GemmaRMSNorm, "gemma_rmsnorm"),
                   "t5": (T5LayerNorm, "t5_layernorm")}[name]
    assert_passes(check(zoo.randomize(cls(64, eps=1e-6)), expect=preset, shape=SHAPE))


def test_batchnorm_eval_passes_its_preset():
    bn = zoo.randomize(torch.nn.BatchNorm2d(4))
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    assert_passes(check(bn.eval(), expect="torch_batchnorm_eval", shape=IMAGE))


def test_batchnorm_train_and_eval_rules():
    bn = zoo.randomize(torch.nn.BatchNorm2d(4))
    r = check(bn, expect="torch_batchnorm", shape=IMAGE)
    assert_passes(r)
    (update,) = r.find("modes.running_update")
    assert update.status == "pass"
    assert update.measured["momentum_from_mean"] == pytest.approx(0.1)
    (evaluation,) = r.find("modes.evaluation_running_statistics")
    assert evaluation.status == "pass"


def test_batchnorm_with_biased_running_variance_fails_the_update_rule():
    class BiasedRunningBN(torch.nn.BatchNorm2d):
        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
                    self.running_mean.mul_(0.9).add_(0.1 * mean)
                    self.running_var.mul_(0.9).add_(0.1 * var)
                return torch.nn.functional.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
            return super().forward(x)

    r = check(BiasedRunningBN(4), expect="torch_batchnorm", shape=IMAGE,
              quick=True, explain_failures=False)
    assert "modes.running_update" in failed(r)


# ---------------------------------------------------------------------------------------------- wrong ones
def test_seed_std_plus_eps_fails_a_torch_layernorm_contract_with_explanation():
    r = check(zoo.seed_layer_norm, expect=NormSpec.preset("torch_layernorm", affine=False), shape=SHAPE,
              framework="numpy")
    assert not r.ok
    assert TINY_1E_12 in failed(r)
    assert "expected ε inside √ (sqrt(var+ε)); found ε outside √ (std+ε)" in r.differences


@pytest.mark.parametrize("target, framework, expect, finding, difference", [
    (zoo.sequence_axis_layernorm, "torch", NormSpec.preset("torch_layernorm", affine=False),
     "dependency.other_tokens[axis=1; dtype=float32]", "statistics reduce over [-2], expected [-1]"),
    (zoo.batch_axis_layernorm, "torch", NormSpec.preset("torch_layernorm", affine=False),
     "dependency.other_batch_items[axis=0; dtype=float32]", "statistics reduce over [0], expected [-1]"),
    (zoo.eps_outside_layernorm, "torch", NormSpec.preset("torch_layernorm", affine=False),
     TINY_1E_12, "found ε outside √"),
    (zoo.one_pass_layernorm, "torch", NormSpec.preset("torch_layernorm", affine=False),
     "extreme.offset[offset=10000; dtype=float32]", "one-pass"),
], ids=["sequence-axis", "batch-axis", "eps-outside", "one-pass"])
def test_wrong_functions_fail_the_right_finding(target, framework, expect, finding, difference):
    r = check(target, expect=expect, shape=SHAPE, framework=framework)
    assert finding in failed(r), r.text()
    assert any(difference in d for d in r.differences), r.differences


def test_unbiased_variance_fails():
    r = check(zoo.randomize(zoo.UnbiasedLayerNorm()), expect="torch_layernorm", shape=SHAPE)
    assert "hand.case[dtype=float32]" in failed(r)
    assert any("unbiased" in d for d in r.differences)


def test_gamma_along_sequence_fails_affine_broadcast():
    r = check(zoo.SequenceGammaLayerNorm(), expect="torch_layernorm", shape=SHAPE)
    assert "affine" in {f.section for f in r.failures}, r.text()
    assert any("γ/β indexed by" in d for d in r.differences)


def test_bf16_statistics_fail_under_llama_contract():
    r = check(zoo.randomize(zoo.InputDtypeStatsRMSNorm()), expect="llama_rmsnorm", shape=SHAPE)
    assert "reference.rounding[dtype=bfloat16]" in failed(r)
    assert "expected fp32 statistics; found statistics in the input dtype" in r.differences


def test_gemma_cast_order_under_llama_contract_fails():
    r = check(zoo.randomize(zoo.ScaleThenCastRMSNorm()), expect="llama_rmsnorm", shape=SHAPE)
    assert failed(r) == {"reference.rounding[dtype=bfloat16]", "reference.rounding[dtype=float16]"}, r.text()
    assert r.differences == ["expected cast then scale; found scale then cast"]


def test_rounding_rule_escalates_where_one_draw_does_not_separate():
    # BatchNorm3d at (4, 3, 2, 2, 2): 32 elements per channel; at float16 (seed 2) one draw puts the contract's
    # rounding (input-dtype batch statistics) and fp32 statistics about as far away, not beyond noise; more draws of
    # inputs decide it (the contract nearer, beyond noise), so the finding passes with the numbers of both steps
    r = check(torch.nn.BatchNorm3d(3), expect="torch_batchnorm", shape=(4, 3, 2, 2, 2), quick=True, seed=2,
              explain_failures=False)
    (f,) = r.find("reference.rounding", dtype="float16")
    assert f.status == "pass" and "escalated to 17 draws" in f.why and "rounds as its contract" in f.why, f
    assert r.ok and r.verdict == "pass"


def test_an_undecided_deciding_finding_is_inconclusive_never_a_pass(monkeypatch, tmp_path):
    """Without the escalation's extra draws the same finding stays undecided: inconclusive, not a pass — in the
    report, its JSON and JUnit, and the command line's exit code 6."""
    from normscope.battery import rounding
    from normscope.results.check import Report

    monkeypatch.setattr(rounding, "ESCALATION", 0)
    r = check(torch.nn.BatchNorm3d(3), expect="torch_batchnorm", shape=(4, 3, 2, 2, 2), quick=True, seed=2,
              explain_failures=False)
    (f,) = r.find("reference.rounding", dtype="float16")
    assert f.status == "inconclusive" and "what would decide it" in f.why, f
    assert r.verdict == "inconclusive" and not r.ok and not r.conclusive and not r.failures
    data = r.to_dict()
    assert data["verdict"] == "inconclusive" and not data["ok"]
    assert Report.from_dict(data).verdict == "inconclusive"
    r.to_junit(tmp_path / "j.xml")
    assert 'type="inconclusive"' in (tmp_path / "j.xml").read_text()
    from normscope.cli import main

    code = main(["check", "torch.nn:BatchNorm3d", "--args", "[3]", "--shape", "4,3,2,2,2", "--expect",
                 "torch_batchnorm", "--quick", "--seed", "2"])
    assert code == 6


def test_a_report_of_only_skips_tested_nothing_and_is_inconclusive(monkeypatch, tmp_path):
    """All skips (or no finding at all) is no comparison with the contract: inconclusive with the reason and what
    would decide it — in the report, its JSON, the text, JUnit and exit code 6 — never a pass."""
    import importlib

    from normscope.battery.registry import Section
    from normscope.cli import main
    from normscope.results.check import Finding, Report

    skip = Finding("modes", "modes", "skip", why="the target has no train/eval modes", id="modes.available")
    r = Report(target="t", expected=NormSpec.preset("torch_layernorm"), shape=(2, 16), dtypes=("float32",),
               findings=[skip, skip], params_source="", calls=0, seconds=0.0, quick=True)
    assert r.verdict == "inconclusive" and not r.ok and not r.failures
    assert r.undecided[0].startswith("nothing was tested: all 2 findings are skips") and "decides it" in r.undecided[0]
    data = r.to_dict()
    assert (data["verdict"], data["ok"], data["undecided"]) == ("inconclusive", False, r.undecided)
    assert Report.from_dict(data).verdict == "inconclusive"
    assert "INCONCLUSIVE: nothing was tested" in r.text()
    r.to_junit(tmp_path / "j.xml")
    suite = ET.parse(tmp_path / "j.xml").getroot()
    assert suite.get("failures") == "1" and 'name="nothing tested"' in (tmp_path / "j.xml").read_text()
    assert Report(**{**vars(r), "findings": []}).verdict == "inconclusive"
    assert Report(**{**vars(r), "findings": [skip, Finding("x", "hand", "pass", id="hand.case")]}).verdict == "pass"

    battery = importlib.import_module("normscope.battery.check")  # the module, not the function it exports
    monkeypatch.setattr(battery, "SECTIONS", [Section("modes", None, lambda ctx: iter([skip]), in_mode=False)])
    assert main(["check", "torch.nn:LayerNorm", "--args", "[16]", "--shape", "2,16", "--expect", "torch_layernorm",
                 "--quick"]) == 6


def test_rounding_rule_fails_where_the_contracts_separate():
    # a Gemma-style RMSNorm (γ applied in fp32, then one cast) under the Llama contract (cast, then γ) at fp16
    r = check(_gemma_order_norm(), expect="llama_rmsnorm", shape=(2, 8, 64), dtypes=("float32", "float16"), quick=True,
              explain_failures=False)
    (f,) = r.find("reference.rounding", dtype="float16")
    assert f.status == "fail" and "separated" in f.why, f


def _gemma_order_norm():
    class ScaleThenCast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(64) + 0.5)

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (h * self.weight.float()).to(x.dtype)
    return ScaleThenCast()


def test_wrong_eps_value_fails():
    r = check(torch.nn.LayerNorm(64, eps=1e-3), expect="torch_layernorm", shape=SHAPE)
    assert TINY_1E_12 in failed(r)
    assert "expected ε=1e-05; found ε=0.001" in r.differences


def test_eps_override_makes_it_pass():
    assert check(torch.nn.LayerNorm(64, eps=1e-3), expect="torch_layernorm", eps=1e-3, shape=SHAPE, quick=True).ok


# ---------------------------------------------------------------------------------------------- reporting
def test_report_json_and_junit(tmp_path):
    r = check(zoo.eps_outside_layernorm, expect=NormSpec.preset("torch_layernorm", affine=False), shape=SHAPE,
              framework="torch", quick=True)
    data = json.loads(r.to_json())
    assert data["schema"] == "normscope.check/1" and data["ok"] is False
    assert data["counts"]["fail"] == len(r.failures) > 0
    f0 = data["findings"][0]
    assert set(f0) == {"name", "section", "status", "measured", "expected", "tolerance", "why", "id", "params"}
    assert f0["id"] == "determinism.repeated_calls" and f0["params"] == {"dtype": "float32"}
    assert {f["id"] for f in data["findings"] if f["status"] == "fail"} >= {"extreme.tiny_variance"}
    back = Report.from_dict(data)  # the report loads back from its JSON, non-finite numbers included
    assert back.to_dict() == data and back.keys("fail") == failed(r)
    path = tmp_path / "out.xml"
    r.to_junit(path)
    suite = ET.parse(path).getroot()
    assert suite.tag == "testsuite" and int(suite.get("failures")) == len(r.failures)
    assert len(suite.findall("testcase")) == len(r.findings)


def test_expect_from_spec_file(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(NormSpec.preset("torch_rmsnorm").to_json())
    assert check(torch.nn.RMSNorm(64), expect=str(path), shape=SHAPE, quick=True).ok


def test_assert_conforms():
    assert assert_conforms(torch.nn.LayerNorm(64), "torch_layernorm", shape=SHAPE).ok
    with pytest.raises(AssertionError, match="FAIL"):
        assert_conforms(torch.nn.LayerNorm(64, eps=1e-3), "torch_layernorm", shape=SHAPE)


def test_pytest_fixture(assert_norm_conforms):
    assert_norm_conforms(torch.nn.RMSNorm(64), "torch_rmsnorm", shape=SHAPE)


MARKED = """
import pytest
import torch


@pytest.mark.normscope(expect="torch_layernorm", shape=(2, 8, 64))
def test_conforms():
    return torch.nn.LayerNorm(64)


@pytest.mark.normscope(expect="torch_layernorm", shape=(2, 8, 64))
def test_wrong_eps():
    return torch.nn.LayerNorm(64, eps=1e-3)
"""


def test_pytest_marker(pytester, request):
    # the inner run loads plugins as this one did: with the plugin off, the wrong-ε test passes and this fails
    pytester.makepyfile(MARKED)
    off = [] if request.config.pluginmanager.has_plugin("normscope") else ["-p", "no:normscope"]
    result = pytester.runpytest_inprocess(*off, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_wrong_eps*", "*extreme/tiny variance 1e-12*"])


def test_quick_is_smaller():
    full = check(torch.nn.LayerNorm(64), expect="torch_layernorm", shape=SHAPE)
    quick = check(torch.nn.LayerNorm(64), expect="torch_layernorm", shape=SHAPE, quick=True)
    assert quick.ok and full.ok and quick.calls < full.calls


def test_module_is_untouched_by_check():
    m = zoo.randomize(torch.nn.LayerNorm(64))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    check(m, expect="torch_layernorm", shape=SHAPE, quick=True)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert m.training


def test_hidden_size_grid_for_functions():
    r = check(lambda x: torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5), expect=NormSpec.preset(
        "torch_layernorm", affine=False), shape=SHAPE, framework="torch")
    shapes = {f.params["shape"] for f in r.find("reference.forward")}
    for h in (3, 123, 1000, 4097):
        assert any(s[-1] == h for s in shapes), shapes
    assert r.ok, r.text()
    assert np.isfinite([f.measured for f in r.findings if isinstance(f.measured, float)]).all()


def test_instancenorm_passes():
    assert_passes(check(torch.nn.InstanceNorm2d(4), expect="torch_instancenorm",
                        shape=IMAGE))


def _onnx_layernorm():
    pytest.importorskip("onnx")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import onnx_layernorm

    return onnx_layernorm.build()


def test_onnxruntime_layernorm_passes_with_its_rounding_order():
    # onnxruntime's CPU kernel multiplies by the scale in fp32 before the cast back
    assert_passes(check(_onnx_layernorm(), expect="onnxruntime_layernorm", shape=SHAPE))


def test_onnxruntime_deviates_from_the_onnx_function_body_only_in_rounding_order():
    r = check(_onnx_layernorm(), expect="onnx_layernorm", shape=SHAPE)
    assert failed(r) == {"reference.rounding[dtype=float16]", "reference.rounding[dtype=bfloat16]"}, r.text()
    assert r.differences == ["expected cast then scale; found scale then cast"]


def test_flax_layernorm_passes_its_one_pass_contract():
    jax = pytest.importorskip("jax")
    import flax.linen as fnn
    import jax.numpy as jnp

    m = fnn.LayerNorm()
    params = m.init(jax.random.PRNGKey(0), jnp.ones(SHAPE))
    params = jax.tree_util.tree_map(lambda a: a + jax.random.uniform(jax.random.PRNGKey(1), a.shape), params)
    assert_passes(check(lambda x: m.apply(params, x), expect="flax_layernorm", shape=SHAPE, framework="jax"))


def test_a_one_pass_input_dtype_norm_passes_its_own_contract():
    """jax.nn.standardize (E[x²] − E[x]², the statistics in the input dtype) against the contract inferred from it
    failed reference.rounding at float16 by 6170 ulps: at the rounding finding's 30σ group offset the contract's
    own emulation cancels to noise, and two faithful operation orders agree on nothing there. Such inputs are left
    out (as extreme.offset skips them); a wrong statistics dtype still fails."""
    jax = pytest.importorskip("jax")

    def standardize(x):
        return jax.nn.standardize(x, axis=-1, epsilon=1e-4)

    spec = NormSpec(center=True, eps=1e-4, variance_algorithm="one_pass", gamma=False, beta=False,
                    stats_dtype="input")
    r = check(standardize, expect=spec, shape=SHAPE, framework="jax", explain_failures=False)
    assert r.verdict == "pass", r.text()
    wrong = check(standardize, expect=spec.replace(stats_dtype="float32"), shape=SHAPE, framework="jax",
                  explain_failures=False)
    assert "reference.rounding[dtype=bfloat16]" in failed(wrong), wrong.text()


def test_a_sub_ulp_lean_is_not_a_statistics_dtype_under_input_dtype_statistics():
    """NumPy on bfloat16 arrays sums in bfloat16, each partial rounded: against its contract (statistics in the
    input dtype) it sits 0.50 ulps from the emulation and 0.44 from fp32 statistics, nearer the latter at 1653
    elements of 17408 (sign test z = 20). It failed, with no difference to name; the contract does not state how
    statistics accumulate, and a lean that small decides nothing: inconclusive, with what would decide it."""
    g = np.linspace(0.5, 1.5, 64).astype(np.float32)

    def rms(x):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * g

    spec = NormSpec.preset("llama_rmsnorm").replace(stats_dtype="input", output_dtype="float32",
                                                    param_dtype="float32", affine_order="scale_then_cast")
    r = check(rms, expect=spec, shape=SHAPE, framework="numpy", explain_failures=False)
    bad = {f.key: f.status for f in r.findings if f.status in ("fail", "inconclusive")}
    assert bad == {"reference.rounding[dtype=bfloat16]": "inconclusive"}, r.text()
    assert "leans towards statistics in fp32" in r.text()


@pytest.mark.parametrize("target, finding", [
    (zoo.DoubledWeightLayerNorm(), "affine.is_parameter[parameter=gamma]"),
    (zoo.HalfWithoutEpsLayerNorm(), "extreme.constant_vector[dtype=float16]"),
    (zoo.NoGradLayerNorm(), "reference.backward[dtype=float32]"),
    (zoo.ContiguousOnlyLayerNorm(), "reference.noncontiguous[dtype=float32]"),
], ids=["doubled-weight", "half-without-eps", "no-grad", "contiguous-only"])
def test_wrong_modules_fail_the_right_finding(target, finding):
    r = check(target, expect="torch_layernorm", shape=SHAPE, explain_failures=False)
    assert finding in failed(r), r.text()


def test_a_contract_with_learned_affine_fails_a_module_that_has_none():
    """A LayerNorm built without γ or β (torch's elementwise_affine=False or bias=False, OLMo's parameter-free
    LayerNorm) behaves like one with γ ≡ 1 and β ≡ 0, so every numeric finding passed against a contract with a
    learned γ/β: but a checkpoint's γ/β has nowhere to go in it. A γ held per group and repeated per channel moves
    with its parameters and still passes (the registry's per-group-affine case)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    del transformers
    for module, missing in ((torch.nn.LayerNorm(64, elementwise_affine=False), {"gamma", "beta"}),
                            (torch.nn.LayerNorm(64, bias=False), {"beta"}), (OlmoLayerNorm(64), {"gamma", "beta"})):
        r = check(module, expect="torch_layernorm", shape=SHAPE, explain_failures=False)
        assert failed(r) == {f"affine.is_parameter[parameter={f}]" for f in missing}, r.text()
        assert "has nowhere to go" in r.text() and "=False" in r.text()
        right = NormSpec.preset("torch_layernorm", **{f: False for f in missing})
        assert_passes(check(module, expect=right, shape=SHAPE))


def test_gammas_offset_is_undecided_on_a_target_without_parameters():
    """Gemma's γ acts as 1 + w for a stored w: a function that applies it holds no w, and its probed γ fits any
    offset — the finding is inconclusive, never a pass (it was not checked at all). The same code as a module
    holding w decides it."""
    w = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 0.3

    def gemma(x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * (1.0 + w.to(x.dtype).float())).to(x.dtype)  # w stored at the model's dtype, as Gemma's

    r = check(gemma, expect="gemma_rmsnorm", shape=SHAPE, framework="torch", explain_failures=False)
    undecided = [f.key for f in r.findings if f.status == "inconclusive"]
    assert r.verdict == "inconclusive" and undecided == ["affine.gamma_offset"], r.text()
    assert not failed(r) and "exposes no parameters" in r.text()

    class Gemma(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(w.clone())

        def forward(self, x):
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (y * (1.0 + self.weight.float())).to(x.dtype)

    assert_passes(check(Gemma(), expect="gemma_rmsnorm", shape=SHAPE))


def test_odd_hidden_size_passes():
    assert_passes(check(zoo.randomize(torch.nn.LayerNorm(7)), expect="torch_layernorm", shape=(2, 8, 7)))


def test_a_promoted_output_dtype_is_part_of_the_contract():
    """A wider output is not a pass by default (layers after it compute in another dtype than the checkpoint's):
    it fails against a contract at the input's dtype, passes against one that says fp32, and infer finds it."""
    class Promoting(torch.nn.LayerNorm):
        def forward(self, x):  # computes and returns float32 for half-precision inputs
            return torch.nn.functional.layer_norm(x.float(), self.normalized_shape, self.weight.float(),
                                                  self.bias.float(), self.eps)

    r = check(Promoting(64), expect="torch_layernorm", shape=SHAPE, explain_failures=False)
    (out,) = r.find("reference.output_dtype", dtype="bfloat16")
    assert out.status == "fail" and out.measured == "float32" and "output_dtype='float32'" in out.why
    promoted = NormSpec.preset("torch_layernorm").replace(output_dtype="float32")
    r = check(Promoting(64), expect=promoted, shape=SHAPE, quick=True, explain_failures=False)
    assert all(f.status == "pass" for f in r.find("reference.output_dtype")), r.text()
    assert "fp32 output" in promoted.summary()
    inferred = normscope.infer(Promoting(64), shape=SHAPE).spec
    assert inferred.output_dtype == "float32"
    assert normscope.infer(torch.nn.LayerNorm(64), shape=SHAPE).spec.output_dtype == "input"


def test_a_frozen_batchnorm_passes_its_own_frozen_contract():
    """A frozen BatchNorm (running statistics in train mode too, never updated) is stated by batch_stats="frozen"
    and passes against it; a BatchNorm that trains fails the same contract where it departs from it."""
    m = zoo.FrozenBatchNorm2d()
    frozen = NormSpec.preset("torch_batchnorm_eval", batch_stats="frozen", stats_dtype="input")
    assert "frozen running statistics" in frozen.summary()
    r = check(m, expect=frozen, shape=(2, 4, 5, 5), quick=True, explain_failures=False)
    assert r.ok, r.text()
    assert {f.id for f in r.findings if f.section == "modes"} == {
        "modes.frozen_training", "modes.frozen_evaluation", "modes.frozen_unchanged"}
    bn = torch.nn.BatchNorm2d(4).train()
    r = check(bn, expect=frozen.replace(stats_dtype="float32"), shape=(2, 4, 5, 5), quick=True,
              explain_failures=False)
    assert {"modes.frozen_training[dtype=float32]", "modes.frozen_unchanged"} <= failed(r), r.text()


def test_two_element_groups_pass_backward():
    # dx is exactly 0 for groups of two: every term cancels, and rounding of the terms is all that is left
    gn = torch.nn.GroupNorm(2, 4)
    assert_passes(check(gn, expect=NormSpec.preset("torch_groupnorm", groups=2, spatial_dims=0), shape=(8, 4)))


def test_large_hidden_size_with_values_whose_squares_overflow_float32():
    r = check(torch.nn.LayerNorm(1024), expect="torch_layernorm", shape=(2, 4, 1024), quick=True)
    assert r.ok, r.text()
    (big,) = r.find("extreme.large_values", scale=1e18)
    assert big.status == "skip"  # float32 statistics themselves overflow there: the contract says so


@pytest.mark.parametrize("fn", [lambda x: x * 0, lambda x: torch.zeros_like(x) + 0.5], ids=["zeros", "constant"])
def test_an_output_that_ignores_the_input_fails(fn):
    r = check(fn, expect="torch_layernorm", shape=SHAPE, framework="torch", explain_failures=False)
    assert "affine.follows_input[dtype=float32]" in failed(r)


def test_tuple_outputs_and_in_place_inputs_are_handled():
    def as_tuple(x):
        return torch.nn.functional.layer_norm(x, (64,)), None

    def in_place(x):
        return torch.nn.functional.layer_norm(x.mul_(1.0), (64,))

    for fn in (as_tuple, in_place):
        assert check(fn, expect=NormSpec.preset("torch_layernorm", affine=False), shape=SHAPE, framework="torch",
                     quick=True).ok


def test_single_element_groups_are_a_clear_error():
    from normscope import InputError

    with pytest.raises(InputError, match="one element"):
        check(torch.nn.LayerNorm(1), expect="torch_layernorm", shape=(2, 8, 1))


# ---------------------------------------------------------------------------------------------- the registry
@pytest.mark.parametrize("case", registry.CHECK_CASES, ids=lambda c: c.name)
def test_zoo_registry_verdicts(case):
    r = check(case.make(), expect=case.expect, shape=case.shape, quick=True, explain_failures=False, **case.kwargs)
    assert failed(r) == case.fails, r.text()
    assert case.skips <= r.keys("skip"), r.keys("skip")
    for f in r.findings:  # the table never contradicts itself: a pass's measured number is within its tolerance
        if isinstance(f.measured, float) and isinstance(f.tolerance, float) and f.status == "pass":
            assert f.measured <= f.tolerance, (f.key, f.measured, f.tolerance)
    assert list(r.dtypes) == case.tried  # the header lists every dtype tried; findings say which could not run


@pytest.mark.parametrize("seed", [0, 1, 7])  # seed 7 once failed: the old rule compared two noise-sized distances
def test_variance_algorithm_rule_separates_beyond_noise(seed):
    one_pass = NormSpec.preset("torch_layernorm", affine=False, variance_algorithm="one_pass", stats_dtype="input")
    kw = dict(shape=SHAPE, dtypes=("float32",), quick=True, seed=seed, explain_failures=False)
    r = check(zoo.one_pass_layernorm, expect=one_pass, framework="torch", **kw)
    (f,) = r.find("extreme.variance_algorithm", algorithm="one_pass")
    assert f.status == "pass" and f.measured < 0.01, f.why  # thousands of two-pass bounds away
    r = check(lambda x: torch.nn.functional.layer_norm(x, (64,)), expect=one_pass, framework="torch", **kw)
    assert "extreme.variance_algorithm[algorithm=one_pass; dtype=float32]" in failed(r)
    r = check(zoo.one_pass_layernorm, expect=one_pass.replace(variance_algorithm="two_pass"), framework="torch", **kw)
    assert "extreme.variance_algorithm[algorithm=two_pass; dtype=float32]" in failed(r)


def test_an_undecided_rounding_names_only_the_conditions_that_failed():
    """"ratio 1.2 < 1.5 or z = 5.74 < 4" read as if z had failed: only what failed is named."""
    from normscope.numerics import constants as C
    from normscope.probe.precision_experiment import not_separated_because

    sep = {"ratio": 1.2, "near": 1.0, "far": 1.5, "floor": 0.1, "sign_z": 5.74}
    assert not_separated_because(sep) == f"ratio 1.2 < {C.SEPARATION_RATIO:g}"
    sep = {"ratio": 3.0, "near": 1.0, "far": 4.0, "floor": 0.1, "sign_z": 2.0}
    assert not_separated_because(sep) == f"sign test z = 2 < {C.SEPARATION_Z:g}"
    sep = {"ratio": 1.1, "near": 1.0, "far": 1.05, "floor": 0.1, "sign_z": 1.0}
    assert not_separated_because(sep).count(" and ") == 2


def _sequential_layernorm(one_pass: bool = False):
    """A LayerNorm whose sums are plain loops (numpy's cumsum: each partial sum rounded in float32), as some
    frameworks' CPU reductions are: faithful, but ~40× numpy's pairwise error at a 4097-wide row."""

    def norm(x, eps=1e-5):
        x = np.asarray(x, np.float32)
        n = np.float32(x.shape[-1])
        mean = np.cumsum(x, -1, dtype=np.float32)[..., -1:] / n
        if one_pass:
            var = np.maximum(np.cumsum(x * x, -1, dtype=np.float32)[..., -1:] / n - mean * mean, 0)
        else:
            d = x - mean
            var = np.cumsum(d * d, -1, dtype=np.float32)[..., -1:] / n
        return ((x - mean) / np.sqrt(var + np.float32(eps))).astype(np.float32)

    return norm


def test_a_sequential_sum_is_faithful_and_the_bound_still_separates_the_algorithms():
    spec = NormSpec.preset("torch_layernorm", gamma=False, beta=False)
    report = check(_sequential_layernorm(), expect=spec, framework="numpy", shape=(2, 4, 4097), dtypes=("float32",))
    assert report.verdict == "pass", [(f.name, f.why) for f in report.findings if f.status == "fail"]
    report = check(_sequential_layernorm(one_pass=True), expect=spec, framework="numpy", shape=(2, 4, 4097),
                   dtypes=("float32",))
    assert "two-pass variance at offset" in {f.name for f in report.findings if f.status == "fail"}


def test_a_target_that_keeps_gamma_in_fp32_fails_a_contract_that_stores_it_at_the_input_dtype():
    import torch

    g = torch.Generator().manual_seed(0)
    w, b = torch.rand(64, generator=g) * 1.7 + 0.3, torch.randn(64, generator=g) * 0.5

    def norm(x):
        return (torch.nn.functional.layer_norm(x.float(), (64,), eps=1e-5) * w + b).to(x.dtype)

    report = check(norm, framework="torch", expect="torch_layernorm", shape=SHAPE)
    failed = {f.name: f for f in report.findings if f.status == "fail"}
    assert "rounding at bfloat16" in failed and "γ/β stored in fp32" in failed["rounding at bfloat16"].why
    assert check(norm, framework="torch", expect=NormSpec.preset("torch_layernorm", param_dtype="float32"),
                 shape=SHAPE).verdict == "pass"


def test_jax_half_precision_rms_rounds_its_reciprocal_root_once():
    """jnp.mean of a float16 input accumulates wider and rounds the mean to float16; lax.rsqrt rounds its result
    once: a faithful input-dtype-statistics RMSNorm, which check passes (x·(1/σ) with two roundings does not
    describe it)."""
    jax = pytest.importorskip("jax", reason="the jax extra installs jax")
    jnp = jax.numpy

    def rms(x, eps=1e-6):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)

    spec = NormSpec.preset("llama_rmsnorm", gamma=False, stats_dtype="input")
    report = check(rms, framework="jax", expect=spec, shape=SHAPE)
    assert report.verdict == "pass", [(f.name, f.why) for f in report.findings if f.status != "pass"]
