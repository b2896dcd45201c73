"""``diff`` against a GGUF as llama.cpp runs it (the ``llamacpp`` extra: llama-cpp-python, which builds llama.cpp
from source, so it is not part of ``dev``; these tests skip without it — ``pip install 'normscope[llamacpp]'``).

Tiny random-weight Hugging Face models (Llama, Qwen 2, Qwen 3, Gemma, Gemma 2, Gemma 3, Phi-3, GPT-NeoX: hidden 64,
two layers, a vocabulary of 128, the norms' γ perturbed so a fault in them shows) written as GGUF files by
:func:`normscope.artifacts.write_gguf` as llama.cpp's converter writes them (Llama's Q/K permuted to the interleaved
rotary layout, Gemma's γ stored as 1 + w, GPT-NeoX's fused QKV rows regrouped) and decoded by llama.cpp on the CPU,
its graph tensors read through the evaluation callback and mapped to the modules through the transformation each
went through (Gemma's embedding scaled by √d in the graph, GELU read from ggml's float16 table). A clean file
passes with every norm site judged on its own error; an ε changed in the file's metadata, one norm's γ channel ×1.5
or Gemma's γ offset applied twice is the first divergence, at its norm, with the difference named.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from runtime_models import SIZE, built, effective_gamma_times, quantized_by_the_gguf_package, tiny_causal_lm, token_ids

from normscope import diff
from normscope.errors import InputError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the gguf package is not installed: pip install 'normscope[llamacpp]'")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it builds llama.cpp from source, "
                                        "minutes): pip install 'normscope[llamacpp]'")
transformers.logging.set_verbosity_error()

from normscope.artifacts.gguf_write import write_gguf  # noqa: E402


def _model(family: str):
    return tiny_causal_lm(family)


#: the families beyond tiny_causal_lm's, each as its own config (ids 0–2 are the file's control pieces)
_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _tiny(family: str):
    """A tiny random-weight model of ``family`` (``gpt_neox_sequential``: GPT-NeoX without its parallel residual),
    its norms' γ (and every bias) perturbed. Gemma 2/3 attend through a sliding window of 8 of the 12 tokens, on one
    layer of two; the query scale is 1/√head_dim, the one llama.cpp derives (query_pre_attn_scalar = head_dim)."""
    if family in ("llama", "qwen3"):
        return tiny_causal_lm(family)
    t = transformers
    gemma = dict(SIZE, head_dim=16, query_pre_attn_scalar=16, **_SPECIAL)
    configs = {
        "qwen2": lambda: t.Qwen2Config(**SIZE),
        "gemma": lambda: t.GemmaConfig(**SIZE, head_dim=16, **_SPECIAL),
        "gemma2": lambda: t.Gemma2Config(**gemma, sliding_window=8),
        "gemma3": lambda: t.Gemma3TextConfig(**gemma, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention"]),
        "phi3": lambda: t.Phi3Config(**SIZE, **_SPECIAL),
        "gpt_neox": lambda: t.GPTNeoXConfig(**{k: v for k, v in SIZE.items() if k != "num_key_value_heads"},
                                            hidden_act="gelu_pytorch_tanh", **_SPECIAL),
        "gpt_neox_sequential": lambda: t.GPTNeoXConfig(
            **{k: v for k, v in SIZE.items() if k != "num_key_value_heads"}, hidden_act="gelu_pytorch_tanh",
            use_parallel_residual=False, **_SPECIAL),
        "gpt_neox_erf": lambda: t.GPTNeoXConfig(**{k: v for k, v in SIZE.items() if k != "num_key_value_heads"},
                                                hidden_act="gelu", **_SPECIAL),
    }
    return built(configs[family](), biases=True)


def _norms(model) -> list[str]:
    return [n for n, m in model.named_modules() if "RMSNorm" in type(m).__name__ or isinstance(m, torch.nn.LayerNorm)]


def _ids():
    return token_ids()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_clean_gguf_passes_with_every_norm_site_judged_on_its_own_error(family, tmp_path):
    model = _model(family)
    path = write_gguf(model, tmp_path / f"{family}.gguf")
    d = diff(model, str(path), _ids(), progress=False)
    assert d.verdict == "pass", (d.summary(), d.inconclusive)
    assert d.candidate.startswith("llama.cpp") and "f32 K/V cache" in d.candidate
    norms = [s for s in d.sites if s.kind == "norm"]
    n_norms = sum(1 for m in model.modules() if "RMSNorm" in type(m).__name__)
    assert len(norms) == n_norms and all(s.status == "within" and s.elementwise for s in norms), \
        [(s.name, s.status, s.note) for s in norms]
    # projections too: their inputs (the norm outputs, kqv_out, the SwiGLU product) are named in the graph
    assert d.site("model.layers.1.self_attn.o_proj").status == "within"
    assert d.site("model.layers.1.mlp.down_proj").status == "within"
    assert d.site("(model)").propagated["normalized"] < 1e-5


def test_the_reference_written_here_is_the_candidate_llama_cpp():
    d = diff(_model("llama"), "llama.cpp", _ids(), progress=False)
    assert d.verdict == "pass", d.summary()
    assert "written here" in d.candidate


def test_eps_changed_in_the_gguf_metadata_is_the_first_divergence_with_both_eps(tmp_path):
    model = _model("llama")
    path = write_gguf(model, tmp_path / "eps.gguf", eps=1e-2)
    d = diff(model, str(path), _ids(), progress=False)
    assert d.first_divergence == "model.layers.0.input_layernorm", d.summary()
    assert d.divergence["differences"] == ["expected ε=1e-05; found ε=0.01"]
    assert "as its file states it" in d.divergence["stated_note"]


def test_one_norm_weight_edited_in_the_gguf_is_found_at_that_norm(tmp_path):
    model = _model("qwen3")
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited.model.layers[1].self_attn.k_norm.weight[3] *= 1.5
    path = write_gguf(edited, tmp_path / "gamma.gguf")
    d = diff(model, str(path), _ids(), progress=False)
    assert d.first_divergence == "model.layers.1.self_attn.k_norm", d.summary()
    (gamma,) = d.divergence["parameter_differences"]
    assert "effective γ differs at 1 of 16 channels" in gamma and "channel 3" in gamma and "×1.5" in gamma


def test_a_q8_0_gguf_written_by_the_gguf_package_is_judged_against_its_dequantized_twin_and_passes(tmp_path):
    """Quantized by the ``gguf`` package rather than llama.cpp (each 2-D tensor whose rows hold whole blocks), on a
    64-wide model: judged against the reference with the file's dequantized weights (its quantized cases:
    tests/test_diff_llamacpp_quantized.py)."""
    model = _model("llama")
    path = write_gguf(model, tmp_path / "f32.gguf")
    quantized_by_the_gguf_package(path, tmp_path / "q8.gguf", {}, "Q8_0")
    d = diff(model, str(tmp_path / "q8.gguf"), _ids(), progress=False)
    assert d.verdict == "pass", (d.summary(), d.inconclusive)
    judged = [s for s in d.sites if s.beyond_twin is not None]
    assert len(judged) >= 20 and max(s.beyond_twin for s in judged) < 2e-6
    assert max(s.twin for s in judged) > 1e-3  # what the quantization explains, far beyond float rounding


def test_bad_llama_cpp_candidates_are_input_errors(tmp_path):
    model = _model("llama")
    with pytest.raises(InputError, match="no such GGUF"):
        diff(model, str(tmp_path / "missing.gguf"), _ids(), progress=False)
    with pytest.raises(InputError, match="token ids"):
        diff(model, "llama.cpp", torch.randn(2, 12, 64), progress=False)
    with pytest.raises(InputError, match="no backward"):
        diff(model, "llama.cpp", _ids(), grad=True, progress=False)
    with pytest.raises(InputError, match="GGUF is written here for"):
        diff(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)),
             "llama.cpp", {"input_ids": torch.randint(0, 64, (1, 8))}, progress=False)


def test_cli_diff_against_a_gguf(tmp_path, capsys):
    from normscope.cli import main

    model = _model("llama")
    model.save_pretrained(tmp_path / "llama")
    write_gguf(model, tmp_path / "llama-eps.gguf", eps=1e-6)
    code = main(["diff", str(tmp_path / "llama"), str(tmp_path / "llama-eps.gguf")])
    out = capsys.readouterr().out
    assert code == 5, out
    assert "first divergence" in out and "ε=1e-06" in out


def test_projections_with_a_bias_are_read_after_their_bias_qwen2(tmp_path):
    """Qwen 2's q/k/v projections have a bias: llama.cpp names the sum, not the product, as the projection."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZE)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # a bias the comparison cannot miss
    d = diff(model, str(write_gguf(model, tmp_path / "qwen2.gguf")), _ids(), progress=False)
    assert d.verdict == "pass", d.summary()
    assert d.site("model.layers.0.self_attn.q_proj").status == "within"


def test_an_f16_gguf_is_judged_at_float16_and_passes(tmp_path):
    model = _model("llama")
    d = diff(model, str(write_gguf(model, tmp_path / "f16.gguf", dtype="float16")), _ids(), progress=False)
    assert d.verdict == "pass", d.summary()
    assert d.candidate_dtype == "float16"
    q = d.site("model.layers.0.self_attn.q_proj")
    assert q.dtype == "float16" and q.status == "within"
    assert d.site("model.layers.0.input_layernorm").dtype == "float32"  # its γ is stored at float32


def test_inputs_are_read_by_name_and_a_single_token_keeps_its_axis(tmp_path):
    model = _model("llama")
    path = str(write_gguf(model, tmp_path / "m.gguf"))
    ids = _ids()["input_ids"]
    d = diff(model, path, {"attention_mask": torch.ones_like(ids), "input_ids": ids}, progress=False)
    assert d.verdict == "pass", d.summary()
    d = diff(model, path, {"input_ids": ids[:, :1]}, progress=False)
    assert d.verdict == "pass", d.summary()


def test_what_cannot_be_compared_is_refused_with_the_reason(tmp_path):
    model = _model("llama")
    with pytest.raises(InputError, match="less precise reference"):
        diff(copy.deepcopy(model).to(torch.bfloat16), "llama.cpp", _ids(), progress=False)
    with pytest.raises(InputError, match="vocabulary of 128"):
        diff(model, "llama.cpp", {"input_ids": torch.full((1, 4), 500)}, progress=False)
    scaled = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SIZE, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}))
    with pytest.raises(InputError, match="rotary embedding is scaled"):
        write_gguf(scaled, tmp_path / "scaled.gguf")


#: Gemma (√d embedding scale in the graph, γ stored as 1 + w), Gemma 2 (post norms, soft-capping, a sliding layer),
#: Gemma 3 (per-head q/k norms after the transpose to heads), Phi-3 (fused QKV and gate-up, an unnamed residual sum),
#: GPT-NeoX (LayerNorm with β, fused QKV regrouped, parallel and sequential residual), and Qwen 2's biases
CLEAN = ["gemma", "gemma2", "gemma3", "phi3", "gpt_neox", "gpt_neox_sequential", "qwen2", "qwen3"]
#: modules whose output no tensor of the graph holds (Gemma 3 calls its rotary embedding twice: ``rotary_emb#1``)
NOT_COMPARED = ("rotary_emb", "act_fn", "activation_fn")


@pytest.mark.parametrize("family", CLEAN)
def test_a_clean_gguf_of_each_mapped_architecture_passes_every_site_judged(family, tmp_path):
    model = _tiny(family)
    d = diff(model, str(write_gguf(model, tmp_path / f"{family}.gguf")), _ids(), progress=False)
    assert d.verdict == "pass", (d.summary(), d.inconclusive, d.divergence)
    norms = [s for s in d.sites if s.kind == "norm"]
    assert len(norms) == len(_norms(model))
    assert all(s.status == "within" and s.elementwise for s in norms), [(s.name, s.status, s.note) for s in norms]
    # the embedding is compared exactly: Gemma's graph scales it by √d (inp_scaled), as its embedding module does
    embedding = next(s for s in d.sites if s.name.endswith(("embed_tokens", "embed_in")))
    assert embedding.status == "within" and embedding.own["normalized"] == 0.0
    # every module is compared, but those whose output no tensor of the graph holds, each with the reason
    unmatched = [s for s in d.sites if s.status == "unmatched"]
    assert all(s.name.split("#")[0].endswith(NOT_COMPARED) and s.note.startswith("not compared: ")
               for s in unmatched), \
        [(s.name, s.note) for s in unmatched]
    own = [s for s in d.sites if s.own is not None]
    assert len(own) >= len(norms) + 4 and all(s.status == "within" for s in own)
    assert d.site("(model)").propagated["normalized"] < 2e-6
    if family.startswith(("gemma", "gpt_neox")):
        assert any("float16 table" in n and "moves the model's output" in n for n in d.notes), d.notes


@pytest.mark.parametrize("family, first", [("gemma2", "model.layers.0.input_layernorm"),
                                           ("phi3", "model.layers.0.input_layernorm"),
                                           ("gpt_neox", "gpt_neox.layers.0.input_layernorm")])
def test_eps_changed_in_the_metadata_is_found_at_the_first_norm(family, first, tmp_path):
    model = _tiny(family)
    d = diff(model, str(write_gguf(model, tmp_path / "eps.gguf", eps=1e-2)), _ids(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == first, d.summary()
    eps = getattr(model.config, "rms_norm_eps", None) or model.config.layer_norm_eps
    assert d.divergence["differences"] == [f"expected ε={eps:g}; found ε=0.01"]


@pytest.mark.parametrize("family, norm", [("gemma3", "model.layers.1.self_attn.k_norm"),
                                          ("gemma2", "model.layers.0.post_feedforward_layernorm"),
                                          ("phi3", "model.layers.1.post_attention_layernorm"),
                                          ("gpt_neox", "gpt_neox.layers.1.post_attention_layernorm")])
def test_one_gamma_channel_times_one_and_a_half_in_the_file_is_found_at_that_norm(family, norm, tmp_path):
    model = _tiny(family)
    path = write_gguf(effective_gamma_times(model, norm, 3, 1.5), tmp_path / "gamma.gguf")
    d = diff(model, str(path), _ids(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == norm, d.summary()
    (gamma,) = d.divergence["parameter_differences"]
    size = dict(model.named_modules())[norm].weight.numel()
    assert f"effective γ differs at 1 of {size} channels" in gamma and "channel 3" in gamma and "×1.5" in gamma


@pytest.mark.parametrize("family", ["gemma", "gemma3"])
def test_gemma_gamma_offset_applied_twice_is_found_at_the_first_norm(family, tmp_path):
    """A converter that adds Gemma's 1 to a γ that already holds it (stored 2 + w): every norm is off by one."""
    model = _tiny(family)
    twice = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in twice.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(1.0)
    d = diff(model, str(write_gguf(twice, tmp_path / "twice.gguf")), _ids(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == "model.layers.0.input_layernorm", d.summary()
    (gamma,) = d.divergence["parameter_differences"]
    assert "effective γ differs at 64 of 64 channels" in gamma
    assert "(1+w)" in d.divergence["offset_note"]


def test_an_exact_gelu_is_another_function_than_llama_cpps_and_is_found_at_the_activation(tmp_path):
    """llama.cpp's GELU is the tanh approximation (from a float16 table): a model whose GELU is exact (erf), as
    Pythia's, differs there, and diff says so rather than calling the file clean."""
    model = _tiny("gpt_neox_erf")
    d = diff(model, str(write_gguf(model, tmp_path / "erf.gguf")), _ids(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == "gpt_neox.layers.0.mlp.act", d.summary()
    assert any("tanh approximation" in n and "GELUActivation (erf)" in n for n in d.notes), d.notes


def test_write_gguf_refuses_a_gemma_query_scale_llama_cpp_would_not_apply(tmp_path):
    config = transformers.Gemma2Config(**SIZE, head_dim=16, query_pre_attn_scalar=256, **_SPECIAL)
    with pytest.raises(InputError, match="query_pre_attn_scalar"):
        write_gguf(transformers.Gemma2ForCausalLM(config), tmp_path / "scale.gguf")


def test_an_architecture_the_map_does_not_know_has_only_its_output_compared():
    """Its tensors are not mapped to modules (a Llama-named tensor of another graph need not be the module's
    output): none of its sites is judged, so the verdict cannot be a pass."""
    from types import SimpleNamespace

    from normscope.divergence.runtimes.llamacpp import site_map

    embedding, entries, not_compared = site_map(SimpleNamespace(arch="falcon", parallel=True))
    assert [e.path for e in entries] == [""] and not not_compared
