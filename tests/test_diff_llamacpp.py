"""``diff`` against a GGUF as llama.cpp runs it (the ``llamacpp`` extra: llama-cpp-python, which builds llama.cpp
from source, so it is not part of ``dev``; these tests skip without it — ``pip install 'normscope[llamacpp]'``).

Tiny random-weight Hugging Face Llama and Qwen 3 written as GGUF files by :func:`normscope.artifacts.write_gguf`
(Llama's Q/K permuted to llama.cpp's interleaved rotary layout, as its converter does) and decoded by llama.cpp on
the CPU, its graph tensors read through the evaluation callback. A clean file passes with every norm site judged on
its own error; an ε changed in the file's metadata or one norm's γ edited in it is the first divergence, at its
site, with the difference named.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from runtime_models import SIZE, tiny_causal_lm, token_ids

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


def test_a_quantized_gguf_is_refused_with_the_reason(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    model = _model("llama")
    path = write_gguf(model, tmp_path / "f32.gguf")
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "q8.gguf"), arch="llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = np.asarray(t.data).reshape(tuple(reversed([int(x) for x in t.shape])))
        if data.ndim == 2 and data.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match="Q8_0.*no bound"):
        diff(model, str(tmp_path / "q8.gguf"), _ids(), progress=False)


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
