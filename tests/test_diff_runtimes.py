"""``diff`` against a model as a deployment runtime runs it: OpenVINO (the ``openvino`` extra) and ONNX Runtime.

Tiny random-weight Hugging Face models; the candidate is the model converted by ``openvino.convert_model`` and
run by OpenVINO on the CPU, either converted by ``diff`` itself (own errors by each site's module converted
alone) or converted elsewhere (an ``openvino.Model`` or an IR ``.xml``: own errors by each site's nodes cut out of
its graph), or exported to ONNX (scopes matched to module paths by structure where the exporter skips a level).
How a runtime graph's final output is judged (explained by its sites, or a divergence of the model's own code).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from normscope import diff

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
try:
    import openvino as ov
except ImportError:
    ov = None
openvino_only = pytest.mark.skipif(ov is None, reason="the openvino extra is not installed: pip install "
                                                      "'normscope[openvino]'")
transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning",
                                        "ignore::torch.jit.TracerWarning")

CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama(layers: int = 2):
    torch.manual_seed(0)
    return transformers.LlamaModel(transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": layers})).eval()


def _inputs():
    ids = torch.randint(4, 120, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class _Ids(torch.nn.Module):
    """The model as one would export it: token ids in, the last hidden state out."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, input_ids, attention_mask):
        return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def _at_precision(monkeypatch, hint: str) -> None:
    """OpenVINO compiles at ``hint`` ("f32", "bf16") here. Its CPU plugin computes in bfloat16 by default on CPUs
    with bfloat16 instructions (AMX, AVX512-BF16) and in float32 elsewhere, and a test of what a 16-bit weight does
    must not depend on which CPU runs it."""
    compile_model = ov.Core.compile_model

    def pinned(self, model, device=None, config=None, **kw):
        return compile_model(self, model, device, {"INFERENCE_PRECISION_HINT": hint, **(config or {})}, **kw)

    monkeypatch.setattr(ov.Core, "compile_model", pinned)


def _converted(model):
    inputs = _inputs()
    return ov.convert_model(_Ids(model), example_input=(inputs["input_ids"], inputs["attention_mask"]))


@openvino_only
def test_the_reference_as_openvino_runs_it_passes_with_own_errors():
    # Llama's own pieces (each own error converts one module, ~0.8 s: a whole model is for bench/, not CI)
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.norm, self.mlp = torch.nn.Linear(32, 32), LlamaRMSNorm(32, eps=1e-6), LlamaMLP(cfg)
            self.final_norm = LlamaRMSNorm(32, eps=1e-5)

        def forward(self, x):
            h = self.proj(x)
            return self.final_norm(h + self.mlp(self.norm(h)))

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG)
    model = Block().eval()
    with torch.no_grad():
        for norm in (model.norm, model.final_norm):
            norm.weight.uniform_(0.5, 1.5)
    d = diff(model, "openvino", torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)), progress=False)
    assert d.verdict == "pass", d.summary()
    assert "OpenVINO" in d.candidate and "inference precision" in d.candidate
    norms = [s for s in d.sites if s.kind == "norm"]
    assert len(norms) == 2 and all(s.status == "within" and s.own is not None for s in norms), \
        [(s.name, s.status, s.note) for s in norms]
    assert sum(s.own is not None for s in d.sites) >= 6


@openvino_only
def test_a_model_converted_elsewhere_with_a_lost_eps_is_found_at_its_norm():
    model = _llama()
    norm = model.layers[1].input_layernorm
    norm.variance_epsilon = 0.1  # what the converter saw
    bad = _converted(model)
    norm.variance_epsilon = 1e-6
    d = diff(_Ids(model), bad, _inputs(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == "m.layers.1.input_layernorm", d.summary()


def _norm_weights(model):
    """Norm weights other than ones: the converter drops a multiplication by ones, and γ would have no node."""
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    return model


@openvino_only
def test_a_clean_model_converted_elsewhere_is_judged_site_by_site_never_a_fail(tmp_path, monkeypatch):
    """Each site's own output is its nodes in the IR, cut out and run by OpenVINO on the reference's input: a clean
    IR passes (it was inconclusive, every site judged on its propagated error only)."""
    _at_precision(monkeypatch, "f32")
    model = _norm_weights(_llama())
    ov.save_model(_converted(model), str(tmp_path / "llama.xml"), compress_to_fp16=False)
    d = diff(_Ids(model), str(tmp_path / "llama.xml"), _inputs(), progress=False)
    assert d.verdict == "pass" and d.first_divergence is None, (d.summary(), d.inconclusive)
    assert all(s.status != "diverged" for s in d.sites)
    norms = [s for s in d.sites if s.kind == "norm"]
    assert len(norms) == 5 and all(s.own is not None and s.elementwise["ok"] for s in norms), \
        [(s.name, s.status, s.own_missing) for s in norms]
    assert d.stats["own_measured"] >= 20
    assert "the site's nodes in the candidate's graph" in d.site("m.layers.0.self_attn.q_proj").bound_rule
    root = d.sites[-1]
    assert root.depth == 0 and root.status == "within" and root.bound is not None


def _edited(model, site: str, edit) -> object:
    """``model`` converted by openvino.convert_model, with one constant read by a node of ``site`` replaced by
    ``edit(node, values)`` (None: not that one), as one would edit a converted model or its IR."""
    ovm = _converted(model)
    scope = "__module.m." + site + "/"
    for op in ovm.get_ordered_ops():
        if not op.get_friendly_name().startswith(scope):
            continue
        for port in op.inputs():
            source = port.get_source_output().get_node()
            if source.get_type_name() != "Constant":
                continue
            values = edit(op, source.get_data().copy())
            if values is not None:
                port.replace_source_output(ov.opset13.constant(values).output(0))
                return ovm
    raise AssertionError(f"no constant to edit in {site}")


@openvino_only
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_one_gamma_channel_edited_in_an_ir_converted_elsewhere_fails_at_its_norm(tmp_path, monkeypatch, precision):
    """One γ channel ×1.5 in one RMSNorm of the converted model, saved as an IR: a fail at that norm, by its own
    error (its nodes on the reference's input, element by element), with the channel named. Where OpenVINO computes
    in bfloat16 (AMX, AVX512-BF16 CPUs), the propagated error it makes (‖Δ‖/‖r‖ 0.05) is inside the site's bound:
    the verdict was inconclusive with no site; the element-wise contract sees it at any precision."""
    _at_precision(monkeypatch, precision)
    model = _norm_weights(_llama())
    site = "layers.1.post_attention_layernorm"

    def gamma(op, values):
        if op.get_type_name() != "Multiply" or values.size != CONFIG["hidden_size"]:
            return None
        values.reshape(-1)[5] *= 1.5
        return values

    ov.save_model(_edited(model, site, gamma), str(tmp_path / "llama.xml"), compress_to_fp16=False)
    d = diff(_Ids(model), str(tmp_path / "llama.xml"), _inputs(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == "m." + site, d.summary()
    s = d.site("m." + site)
    assert s.own is not None and not s.elementwise["ok"] and s.elementwise["outside"] == 2 * 8, s.elementwise
    assert any("γ differs at 1 of 32 channels (largest at channel 5" in t and "×1.5" in t
               for t in d.divergence["differences"]), d.divergence


@openvino_only
def test_an_eps_edited_in_an_ir_converted_elsewhere_is_named_at_its_norm(tmp_path, monkeypatch):
    _at_precision(monkeypatch, "f32")
    model = _norm_weights(_llama())
    site = "layers.0.input_layernorm"

    def eps(op, values):
        return np.full_like(values, 0.1) if op.get_type_name() == "Add" and values.size == 1 else None

    ov.save_model(_edited(model, site, eps), str(tmp_path / "llama.xml"), compress_to_fp16=False)
    d = diff(_Ids(model), str(tmp_path / "llama.xml"), _inputs(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == "m." + site, d.summary()
    assert d.site("m." + site).own is not None
    assert "expected ε=1e-06; found ε=0.1" in d.divergence["differences"], d.divergence


@openvino_only
def test_weights_an_ir_stores_in_16_bits_are_found_at_the_first_site(tmp_path, monkeypatch):
    # openvino.save_model compresses the weights to float16 unless told otherwise
    _at_precision(monkeypatch, "f32")
    model = _llama()
    ov.save_model(_converted(model), str(tmp_path / "llama.xml"))
    d = diff(_Ids(model), str(tmp_path / "llama.xml"), _inputs(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == "m.embed_tokens", d.summary()
    assert "weight constants stored in 16 bits" in d.candidate and "inference precision float32" in d.candidate


@openvino_only
def test_16_bit_weights_under_bfloat16_inference_are_never_a_pass(tmp_path, monkeypatch):
    """Computing in bfloat16 (OpenVINO's CPU default where the CPU has bfloat16 instructions) rounds more than the
    float16 weights do: their error is inside every site's bound at bfloat16, so the model's output is held
    undecided, naming the weights — not decided, and the header names the precision (a CPU without bfloat16
    computes in float32: a fail)."""
    from normscope.divergence.runtimes import openvino as ov_runtime

    _at_precision(monkeypatch, "bf16")
    model = _llama()
    ov.save_model(_converted(model), str(tmp_path / "llama.xml"))
    d = diff(_Ids(model), str(tmp_path / "llama.xml"), _inputs(), progress=False)
    assert d.verdict in ("inconclusive", "fail"), d.summary()
    if "inference precision bfloat16" not in d.candidate:
        # a CPU that computes in float32: its sites judged as if at bfloat16 hold the same verdict
        monkeypatch.setitem(ov_runtime._DTYPES, "float32", "bfloat16")
        d = diff(_Ids(model), str(tmp_path / "llama.xml"), _inputs(), progress=False)
    assert d.verdict == "inconclusive", d.summary()
    assert any("weight constants in 16 bits" in why for why in d.inconclusive), d.inconclusive


@openvino_only
def test_bad_openvino_candidates_are_input_errors(tmp_path):
    from normscope.errors import InputError

    with pytest.raises(InputError, match="no such OpenVINO IR"):
        diff(_llama(), str(tmp_path / "absent.xml"), _inputs(), progress=False)
    (tmp_path / "junk.xml").write_text("<not-a-model/>")
    with pytest.raises(InputError, match="not an OpenVINO IR"):
        diff(_llama(), str(tmp_path / "junk.xml"), _inputs(), progress=False)
    with pytest.raises(InputError, match="OpenVINO candidate runs as exported"):
        diff(_llama(), "openvino", _inputs(), candidate_dtype="bfloat16", progress=False)


@openvino_only
def test_cli_diff_against_an_openvino_ir(tmp_path, capsys, monkeypatch):
    from normscope.cli import main

    _at_precision(monkeypatch, "f32")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    model.save_pretrained(tmp_path / "llama")
    ids = torch.randint(4, 120, (2, 8), generator=torch.Generator().manual_seed(0))

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits

    ov.save_model(ov.convert_model(Logits(model), example_input=(ids,)), str(tmp_path / "llama.xml"))
    code = main(["diff", str(tmp_path / "llama"), str(tmp_path / "llama.xml"), "--inputs", "ids:2,8"])
    out = capsys.readouterr().out
    assert code == 5 and "FAIL" in out and "weight constants stored in 16 bits" in " ".join(out.split()), out


@openvino_only
def test_a_module_is_converted_at_the_shapes_it_runs_with():
    """Every dimension of a converted module is fixed to its input's: with dynamic shapes the CPU plugin's fused
    LLM MLP (AMX CPUs) refused to compile Llama's MLP ("Check 'feature.is_static()' failed")."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from normscope.divergence.runtimes.openvino import convert, prepare

    mlp = LlamaMLP(transformers.LlamaConfig(**CONFIG)).eval()
    model = convert(*prepare(mlp, (torch.randn(2, 8, 32),), {}))
    assert [list(i.get_partial_shape().to_shape()) for i in model.inputs] == [[2, 8, 32]]
    assert all(i.get_partial_shape().is_static for i in model.inputs)


# ---------------------------------------------------------------------------------------------- ONNX scopes
OPT = dict(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, use_cache=False)


class _Logits(torch.nn.Module):
    """A causal LM as one would export it: token ids in, the logits out."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, input_ids):
        return self.m(input_ids=input_ids, use_cache=False).logits


def test_an_onnx_export_that_skips_a_module_level_is_matched_by_structure(tmp_path):
    """OPT's causal LM calls ``self.model.decoder`` without calling ``self.model``, so its export's scopes read
    ``/m/decoder/layers.1/...`` (under the exporting wrapper ``m``) for ``model.decoder.layers.1``: 26 of 28 sites
    went unmatched and an ε edited into one LayerNormalization was seen only in the output. Matched by structure,
    every site is compared and the ε is found at its norm."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**OPT)).eval()
    ids = _inputs()["input_ids"]
    path = tmp_path / "opt.onnx"
    torch.onnx.export(_Logits(model), (ids,), str(path), input_names=["input_ids"], dynamo=False, opset_version=17)
    d = diff(model, str(path), {"input_ids": ids}, progress=False)
    assert d.verdict == "pass", (d.summary(), d.inconclusive)
    assert not d.unmatched_reference and len(d.sites) == 28, d.unmatched_reference
    assert d.site("model.decoder.layers.1.fc1").counterpart == "model.decoder.layers.1.fc1"
    norms = [s for s in d.sites if s.kind == "norm"]
    assert len(norms) == 5 and all(s.own is not None and s.elementwise["ok"] for s in norms)
    proto = onnx.load(str(path))
    node = next(n for n in proto.graph.node if n.op_type == "LayerNormalization"
                and "/decoder/layers.1/self_attn_layer_norm/" in n.name)
    next(a for a in node.attribute if a.name == "epsilon").f = 1e-2
    d = diff(model, proto, {"input_ids": ids}, progress=False)
    assert d.verdict == "fail" and d.first_divergence == "model.decoder.layers.1.self_attn_layer_norm", d.summary()
    assert "expected ε=1e-05; found ε=0.01" in d.divergence["differences"], d.divergence


def test_scopes_are_matched_by_structure_never_by_a_guess():
    from normscope.divergence.runtimes.onnx import structural

    paths = ["", "model", "model.decoder", "model.decoder.layers", "model.decoder.layers.0",
             "model.decoder.layers.0.fc1", "model.decoder.layers.0.attn", "model.decoder.layers.0.attn.q",
             "model.decoder.embed", "model.encoder", "model.encoder.norm", "model.decoder.norm", "head"]
    # a level skipped (model), a wrapper's level (m), a renamed one (dec for decoder), one level skipped twice
    got = structural(["m", "m.dec", "m.dec.layers", "m.dec.layers.0", "m.dec.layers.0.fc1", "m.dec.layers.0.q",
                      "m.dec.embed", "m.dec.norm", "m.head", "m.norm", "m.encoder"], paths)
    assert got["model.decoder.layers.0"] == "m.dec.layers.0" and got["model.decoder.layers.0.fc1"] == \
        "m.dec.layers.0.fc1"
    assert got["model.decoder.layers.0.attn.q"] == "m.dec.layers.0.q"  # attn skipped
    assert got["model.decoder"] == "m.dec"  # renamed: the module common to the two it holds
    assert got["head"] == "m.head" and got["model.encoder"] == "m.encoder"
    assert got["model.decoder.norm"] == "m.dec.norm"  # looked for under the renamed level's module
    assert "model.encoder.norm" not in got and "m.norm" not in got.values()  # two norms: never a guess


# ---------------------------------------------------------------------------------------------- the final output
class _Scaled(torch.nn.Module):
    """A model whose own code, outside every module, scales its output."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(32), torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(self.norm(x)) * 2.0


def test_a_runtime_graph_s_final_output_is_judged(tmp_path):
    """The output of a runtime's graph was compared, not judged: a constant of the model's own code edited in the
    ONNX file (×2 → ×2.2, outside every module) passed with every site within. It is a fail at the model now,
    whose own code (outside the sites) holds it; the clean export still passes."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import numpy_helper

    torch.manual_seed(0)
    model = _Scaled().eval()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "scaled.onnx"
    torch.onnx.export(model, (x,), str(path), input_names=["x"], dynamo=False, opset_version=17)
    d = diff(model, str(path), x, progress=False)
    assert d.verdict == "pass", (d.summary(), d.inconclusive)
    assert d.sites[-1].depth == 0 and d.sites[-1].status == "within"
    proto = onnx.load(str(path))
    mul = next(n for n in proto.graph.node if n.op_type == "Mul" and "/fc/" not in n.name)
    const = next(n for n in proto.graph.node if mul.input[1] in n.output)
    value = numpy_helper.to_array(const.attribute[0].t)
    const.attribute[0].t.CopyFrom(numpy_helper.from_array((value * 1.1).astype(value.dtype)))
    d = diff(model, proto, x, progress=False)
    assert d.verdict == "fail" and d.first_divergence == "(model)", d.summary()
    assert all(s.status == "within" for s in d.sites[:-1])
    assert "born in the model's own code outside the compared sites" in d.divergence["reason"], d.divergence


def _output_site(err: float) -> object:
    from normscope.divergence.result import SiteDiff

    return SiteDiff(name="(model)", cls="M", kind="module", order=9, depth=0, shape=[2, 8, 32], status="propagated",
                    propagated={"normalized": err})


def test_the_final_output_s_error_is_explained_by_its_sites_or_not():
    from normscope.divergence import judge

    # within its own bound (16·u·√n at float32, n = 32: 5.4e-6)
    s = _output_site(1e-6)
    judge.graph_output(s, n=32, cand_dtype="float32", ref_dtype="float32", child_error=1e-7, not_compared=[])
    assert s.status == "within"
    # beyond it, carried from sites that erred almost as much: explained
    s = _output_site(2e-5)
    judge.graph_output(s, n=32, cand_dtype="float32", ref_dtype="float32", child_error=1e-5, not_compared=[])
    assert s.status == "within" and "carried from them" in s.bound_rule
    # the same where sites were not compared: not explained, undecided with them named
    s = _output_site(2e-5)
    judge.graph_output(s, n=32, cand_dtype="float32", ref_dtype="float32", child_error=1e-5,
                       not_compared=["a.b", "a.c"])
    assert s.status == "propagated" and "2 site(s) inside it not compared (a.b, a.c)" in s.note
    # far beyond every site's error: born outside them, a divergence at the model
    s = _output_site(1e-2)
    judge.graph_output(s, n=32, cand_dtype="float32", ref_dtype="float32", child_error=1e-6, not_compared=["a.b"])
    assert s.status == "diverged" and "or in one of the 1 site(s) inside it not compared (a.b)" in s.note
    # held by the candidate: never a pass
    s = _output_site(1e-6)
    judge.graph_output(s, n=32, cand_dtype="float32", ref_dtype="float32", child_error=0.0, not_compared=[],
                       hold="the weights cannot be told apart")
    assert s.status == "propagated" and s.note == "the weights cannot be told apart"


@openvino_only
def test_openvino_candidates_send_no_usage_telemetry(tmp_path):
    """OpenVINO's converter reported usage (processes posting to an analytics service, a client id written under
    the user's home) on every `diff MODEL openvino`: normscope imports OpenVINO with that package blocked. Run in a
    fresh process, with HOME pointing at an empty folder."""
    import subprocess
    import sys

    script = ("import torch\nfrom torch import nn\nfrom normscope.divergence import diff\n"
              "m = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).eval()\n"
              "print(diff(m, 'openvino', torch.randn(2, 3, 8), progress=False).verdict)\n"
              "import sys\nprint(sys.modules.get('openvino_telemetry', 'absent'))\n")
    env = {**__import__("os").environ, "HOME": str(tmp_path)}
    env.pop("CI", None)  # the converter skips its report under CI=true: the user's case is without it
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["pass", "None"], out.stdout
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


def test_openvino_conversion_of_a_hugging_face_model_leaves_stderr_quiet():
    """The converter's trace reads every attribute of the model, and a Hugging Face model's loss property logs
    "`loss_type=None` was set in the config but it is unrecognized" on the way: normscope silences what it triggers
    (and gives the user's logging settings back)."""
    import subprocess
    import sys

    pytest.importorskip("openvino")
    script = ("import torch, transformers\nfrom normscope.divergence import diff\n"
              "cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, "
              "num_attention_heads=4, num_key_value_heads=2, vocab_size=64)\n"
              "torch.manual_seed(0)\nm = transformers.LlamaForCausalLM(cfg).eval()\n"
              "v = transformers.logging.get_verbosity()\n"
              "print(diff(m, 'openvino', {'input_ids': torch.randint(0, 64, (2, 8))}, progress=False).verdict)\n"
              "assert transformers.logging.get_verbosity() == v\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["pass"], out.stdout
    assert "[transformers]" not in out.stderr and "loss_type" not in out.stderr, out.stderr
