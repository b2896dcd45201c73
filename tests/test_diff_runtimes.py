"""``diff`` against a model as a deployment runtime runs it: OpenVINO (the ``openvino`` extra).

Tiny random-weight Hugging Face models; the candidate is the model converted by ``openvino.convert_model`` and
run by OpenVINO on the CPU, either converted by ``diff`` itself (own errors by each site's module converted
alone) or converted elsewhere (an ``openvino.Model`` or an IR ``.xml``: propagated errors only).
"""

from __future__ import annotations

import os

import pytest
import torch

from normscope import diff

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
ov = pytest.importorskip("openvino", reason="the openvino extra is not installed: pip install 'normscope[openvino]'")
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


def test_a_model_converted_elsewhere_with_a_lost_eps_is_found_at_its_norm():
    model = _llama()
    norm = model.layers[1].input_layernorm
    norm.variance_epsilon = 0.1  # what the converter saw
    bad = _converted(model)
    norm.variance_epsilon = 1e-6
    d = diff(_Ids(model), bad, _inputs(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == "m.layers.1.input_layernorm", d.summary()


def test_a_clean_model_converted_elsewhere_is_inconclusive_never_a_pass(tmp_path):
    model = _llama()
    ov.save_model(_converted(model), str(tmp_path / "llama.xml"), compress_to_fp16=False)
    d = diff(_Ids(model), str(tmp_path / "llama.xml"), _inputs(), progress=False)
    assert d.verdict == "inconclusive" and d.first_divergence is None, d.summary()
    assert all(s.status != "diverged" for s in d.sites)
    assert any("no site runs alone" in (s.own_missing or "") for s in d.sites)


def test_weights_an_ir_stores_in_16_bits_are_found_at_the_first_site(tmp_path, monkeypatch):
    # openvino.save_model compresses the weights to float16 unless told otherwise
    _at_precision(monkeypatch, "f32")
    model = _llama()
    ov.save_model(_converted(model), str(tmp_path / "llama.xml"))
    d = diff(_Ids(model), str(tmp_path / "llama.xml"), _inputs(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == "m.embed_tokens", d.summary()
    assert "weight constants stored in 16 bits" in d.candidate and "inference precision float32" in d.candidate


def test_16_bit_weights_under_bfloat16_inference_are_never_a_pass(tmp_path, monkeypatch):
    """Computing in bfloat16 (OpenVINO's CPU default where the CPU has bfloat16 instructions) rounds more than the
    float16 weights do: their error is inside the candidate's own bound, and no site runs alone in an IR converted
    elsewhere — not decided, and the header names the precision (a CPU without bfloat16 computes in float32: a
    fail)."""
    _at_precision(monkeypatch, "bf16")
    model = _llama()
    ov.save_model(_converted(model), str(tmp_path / "llama.xml"))
    d = diff(_Ids(model), str(tmp_path / "llama.xml"), _inputs(), progress=False)
    assert d.verdict in ("inconclusive", "fail"), d.summary()
    if "inference precision bfloat16" in d.candidate:
        assert d.verdict == "inconclusive" and "sites with an error of their own were compared" in d.summary()


def test_bad_openvino_candidates_are_input_errors(tmp_path):
    from normscope.errors import InputError

    with pytest.raises(InputError, match="no such OpenVINO IR"):
        diff(_llama(), str(tmp_path / "absent.xml"), _inputs(), progress=False)
    (tmp_path / "junk.xml").write_text("<not-a-model/>")
    with pytest.raises(InputError, match="not an OpenVINO IR"):
        diff(_llama(), str(tmp_path / "junk.xml"), _inputs(), progress=False)
    with pytest.raises(InputError, match="OpenVINO candidate runs as exported"):
        diff(_llama(), "openvino", _inputs(), candidate_dtype="bfloat16", progress=False)


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


def test_a_module_is_converted_at_the_shapes_it_runs_with():
    """Every dimension of a converted module is fixed to its input's: with dynamic shapes the CPU plugin's fused
    LLM MLP (AMX CPUs) refused to compile Llama's MLP ("Check 'feature.is_static()' failed")."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from normscope.divergence.runtimes.openvino import convert, prepare

    mlp = LlamaMLP(transformers.LlamaConfig(**CONFIG)).eval()
    model = convert(*prepare(mlp, (torch.randn(2, 8, 32),), {}))
    assert [list(i.get_partial_shape().to_shape()) for i in model.inputs] == [[2, 8, 32]]
    assert all(i.get_partial_shape().is_static for i in model.inputs)
