"""``diff`` against a quantized GGUF as llama.cpp runs it: is it broken, or only quantized? (The ``llamacpp``
extra; these tests skip without it — ``pip install 'normscope[llamacpp]'``.)

Tiny random-weight models (256 wide, so the K-quants' blocks of 256 apply; two layers; their norms' γ perturbed)
written as GGUF files (:func:`normscope.artifacts.write_gguf`) and quantized by llama.cpp's own quantizer
(:func:`normscope.artifacts.gguf_write.quantize_gguf`) to ``Q8_0``, ``Q4_0``, ``Q4_K_M`` (``Q4_K`` with some
tensors in ``Q6_K``) and others. The property over generated cases (Llama and Qwen 3 × type × fault): a clean file
passes with every module judged against the reference run with the file's dequantized weights, rounding its
products' inputs as ggml does; a fault in the file — ε changed in its metadata, one norm's γ channel ×1.5, the
rotary base changed, two quantized tensors swapped — is a FAIL at its module, found among quantization noise
hundreds of times larger. Every other architecture llama.cpp's map knows passes clean; Gemma 3's γ offset applied
twice fails at its first norm.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from runtime_models import QuantizedCase, built, effective_gamma_times, quantized_by_the_gguf_package, token_ids

from normscope import diff
from normscope.errors import InputError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: pip install 'normscope[llamacpp]'")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it builds llama.cpp from source, "
                                        "minutes): pip install 'normscope[llamacpp]'")
transformers.logging.set_verbosity_error()

from normscope.artifacts.gguf_write import quantize_gguf, write_gguf  # noqa: E402
from normscope.divergence.runtimes.llamacpp import run_candidate, select  # noqa: E402

#: 256 wide: every matrix's rows hold whole K-quant blocks (llama.cpp falls back to other types otherwise)
WIDE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def _model(family: str):
    t = transformers
    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    configs = {
        "qwen2": lambda: t.Qwen2Config(**WIDE),
        "gemma": lambda: t.GemmaConfig(**WIDE, head_dim=64, **special),
        "gemma2": lambda: t.Gemma2Config(**WIDE, head_dim=64, query_pre_attn_scalar=64, sliding_window=8, **special),
        "phi3": lambda: t.Phi3Config(**WIDE, **special),
        "gpt_neox": lambda: t.GPTNeoXConfig(**{k: v for k, v in WIDE.items() if k != "num_key_value_heads"},
                                            hidden_act="gelu_pytorch_tanh", **special),
        "llama": lambda: t.LlamaConfig(**WIDE, rms_norm_eps=1e-5),
        "qwen3": lambda: t.Qwen3Config(**WIDE, head_dim=64),
        "gemma3": lambda: t.Gemma3TextConfig(**WIDE, head_dim=64, query_pre_attn_scalar=64, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention"],
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2),
    }
    return built(configs[family](), biases=family in ("qwen2", "gpt_neox"))


_MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str):
    if family not in _MODELS:
        _MODELS[family] = _model(family)
    return _MODELS[family]


def _quantized(model, folder, kind: str, name: str = "m", **write) -> str:
    f32 = write_gguf(model, folder / f"{name}-f32.gguf", **write)
    return str(quantize_gguf(f32, folder / f"{name}-{kind}.gguf", kind))


def _swap(path: str, a: str, b: str) -> None:
    """Two tensors of one type and shape swapped in the file, in place (a conversion that mixed them up)."""
    reader = gguf.GGUFReader(path, "r+")
    tensors = {t.name: t for t in reader.tensors}
    x, y = tensors[a].data, tensors[b].data
    held = np.array(x, copy=True)
    x[...] = y
    y[...] = held
    reader.data.flush()


def _rope_base(model, base: float):
    """A copy of ``model`` whose configuration states another rotary base (its weights the same)."""
    edited = copy.deepcopy(model)
    rope = dict(getattr(edited.config, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):  # split per layer type (Gemma 3)
        rope = {k: ({**v, "rope_theta": base} if isinstance(v, dict) else v) for k, v in rope.items()}
    else:
        rope["rope_theta"] = base
    edited.config.rope_parameters = rope
    edited.config.rope_theta = base
    return edited


def logits(path: str, ids) -> np.ndarray:
    values, _, _, _ = run_candidate(Path(path), ids["input_ids"])
    return select(values, "result_output", "first")[0].astype(np.float64)


FAMILIES = ("llama", "qwen3")
KINDS = ("Q8_0", "Q4_K_M")
FAULTS = ("clean", "eps", "gamma", "rope", "swapped")
NORM = {"llama": "model.layers.1.post_attention_layernorm", "qwen3": "model.layers.1.self_attn.k_norm",
        "gemma3": "model.layers.1.pre_feedforward_layernorm"}


@dataclasses.dataclass(frozen=True)
class Case(QuantizedCase):
    folder: object = None

    def build(self):
        model = model_of(self.family)
        folder = self.folder
        clean = _quantized(model, folder, self.scheme, "clean")
        if self.fault == "clean":
            return model, clean, clean, None
        if self.fault == "eps":
            return model, _quantized(model, folder, self.scheme, "eps", eps=1e-2), clean, \
                "model.layers.0.input_layernorm"
        if self.fault == "gamma":
            norm = NORM[self.family]
            return model, _quantized(effective_gamma_times(model, norm, 3, 1.5), folder, self.scheme, "gamma"), clean, norm
        if self.fault == "rope":
            return model, _quantized(_rope_base(model, 500.0), folder, self.scheme, "rope"), clean, \
                "model.layers.0.self_attn"
        path = _quantized(model, folder, self.scheme, "swapped")
        _swap(path, "blk.1.attn_q.weight", "blk.1.attn_output.weight")
        return model, path, clean, "model.layers.1.self_attn.q_proj"


CASES = [(f, k, x) for f in FAMILIES for k in KINDS for x in FAULTS]


@pytest.mark.parametrize("family, kind, fault", CASES, ids=["-".join(c) for c in CASES])
def test_diff_judges_a_quantized_gguf_by_what_its_quantization_explains(family, kind, fault, tmp_path):
    case = Case(family, kind, fault, tmp_path)
    d = case.check(logits)
    judged = [s for s in d.sites if s.beyond_twin is not None]
    if fault == "clean":
        # every product and block against the dequantized twin, within float rounding, while the quantization
        # alone moves them by far more
        assert len(judged) >= 20, [(s.name, s.status, s.note) for s in d.sites]
        assert max(s.beyond_twin for s in judged) < 2e-6
        assert min(s.twin for s in judged if s.kind == "leaf") > 1e-3
        assert all(s.status == "within" for s in d.sites if s.kind == "norm")
        assert d.site("(model)").status == "within"
        assert not d.inconclusive
    elif fault == "swapped":
        assert "not the reference's, quantized" in d.site("model.layers.1.self_attn.q_proj").note
        assert d.site("model.layers.1.self_attn.o_proj").status == "diverged"
    elif fault == "eps":
        assert d.divergence["differences"] == ["expected ε=1e-05; found ε=0.01"] if family == "llama" else True


@pytest.mark.parametrize("family", ["qwen2", "gemma", "gemma2", "phi3", "gpt_neox"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M"])
def test_every_mapped_architecture_quantized_passes_clean(family, kind, tmp_path):
    """The other architectures llama.cpp's map knows: biases (Qwen 2, GPT-NeoX), fused QKV and gate-up (Phi-3,
    GPT-NeoX), Gemma's output layer tied to its embedding (its products' inputs rounded as the embedding's type
    says), soft-capping (Gemma 2), the GELU table (Gemma, GPT-NeoX)."""
    model = model_of(family)
    d = diff(model, _quantized(model, tmp_path, kind), token_ids(), progress=False)
    assert d.verdict == "pass", (d.summary(), d.inconclusive)
    judged = [s for s in d.sites if s.beyond_twin is not None]
    assert len(judged) >= 16 and max(s.beyond_twin / s.bound for s in judged) < 0.1
    assert d.site("lm_head").status == "within"


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_K_M", "Q6_K", "Q4_1"])
def test_other_quantization_types_pass_clean(kind, tmp_path):
    """Q4_0 (its repacked CPU kernels round ties their own way: resolved from the candidate's output), the K-quants
    at 5 and 6 bits, and Q4_1 (activations as q8_1, whose float16 block sum the weight's minimum multiplies)."""
    model = model_of("llama")
    d = diff(model, _quantized(model, tmp_path, kind), token_ids(), progress=False)
    assert d.verdict == "pass", (d.summary(), d.inconclusive)
    judged = [s for s in d.sites if s.beyond_twin is not None]
    assert len(judged) >= 20 and max(s.beyond_twin for s in judged) < 2e-6


def test_gemma3_quantized_passes_and_its_gamma_offset_applied_twice_is_found(tmp_path):
    model = model_of("gemma3")
    d = diff(model, _quantized(model, tmp_path, "Q8_0"), token_ids(), progress=False)
    assert d.verdict == "pass", (d.summary(), d.inconclusive)
    twice = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in twice.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(1.0)
    d = diff(model, _quantized(twice, tmp_path, "Q8_0", "twice"), token_ids(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == "model.layers.0.input_layernorm", d.summary()
    assert "(1+w)" in d.divergence["offset_note"]


def test_the_reference_quantized_here_is_the_candidate_llama_cpp_colon_type():
    d = diff(model_of("qwen3"), "llama.cpp:Q4_K_M", token_ids(), progress=False)
    assert d.verdict == "pass", d.summary()
    assert "quantized by llama.cpp" in d.candidate and "Q4_K" in d.candidate
    assert any("Q6_K where the" in n for n in d.notes), d.notes  # the recipe's mixed types, named


def test_quantize_gguf_refuses_an_unknown_type_and_an_existing_path(tmp_path):
    f32 = write_gguf(model_of("llama"), tmp_path / "f32.gguf")
    with pytest.raises(InputError, match="not a llama.cpp file type"):
        quantize_gguf(f32, tmp_path / "q.gguf", "Q9_9")
    with pytest.raises(InputError, match="exists"):
        quantize_gguf(f32, f32, "Q8_0")


def test_a_type_the_twin_does_not_model_is_refused_by_name(tmp_path):
    model = model_of("llama")
    path = _quantized(model, tmp_path, "IQ4_NL") if hasattr(__import__("llama_cpp.llama_cpp").llama_cpp,
                                                            "LLAMA_FTYPE_MOSTLY_IQ4_NL") else None
    if path is None:
        pytest.skip("this llama.cpp build names no IQ4_NL file type")
    with pytest.raises(InputError, match="IQ4_NL"):
        diff(model, path, token_ids(), progress=False)


def test_gradients_of_a_quantized_gguf_are_refused(tmp_path):
    model = model_of("llama")
    with pytest.raises(InputError):
        diff(model, _quantized(model, tmp_path, "Q8_0"), token_ids(), progress=False, grad=True)


def test_a_file_llama_cpp_cannot_quantize_is_an_input_error_with_its_reason(tmp_path):
    """A GGUF that states contracts only (no context length): llama.cpp's own reason is in the message."""
    w = gguf.GGUFWriter(str(tmp_path / "partial.gguf"), arch="llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match="could not quantize.*context_length"):
        quantize_gguf(tmp_path / "partial.gguf", tmp_path / "q.gguf", "Q8_0")


def test_one_tensor_at_another_type_than_its_peers_is_named_at_its_module(tmp_path):
    """A file whose recipe put one layer's query projection at Q4_0 among Q8_0 tensors: faithful to the weights it
    holds (a pass), and the module quantized otherwise than its peers is named; a recipe may mean it."""
    model = model_of("llama")
    f32 = write_gguf(model, tmp_path / "f32.gguf")
    path = quantized_by_the_gguf_package(f32, tmp_path / "mixed.gguf", {"blk.1.attn_q.weight": "Q4_0"}, "Q8_0")
    d = diff(model, path, token_ids(), progress=False)
    assert d.verdict == "pass", (d.summary(), d.inconclusive)
    assert any(n.startswith("model.layers.1.self_attn.q_proj quantized at Q4_0 where the") for n in d.notes), d.notes
    q1, q0 = d.site("model.layers.1.self_attn.q_proj"), d.site("model.layers.0.self_attn.q_proj")
    assert q1.twin > 3 * q0.twin  # what its quantization explains there, beside its Q8_0 peer's
