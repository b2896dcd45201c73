"""A Hugging Face decoder written as a GGUF file llama.cpp runs: every tensor under llama.cpp's names, the
hyperparameters under its keys, and a placeholder vocabulary (``diff`` feeds token ids, never text).

What llama.cpp's own converter does for these architectures (Llama, Qwen 2, Qwen 3), and so this writer: Llama's
query and key projections are permuted from Hugging Face's rotate-half layout to the interleaved pairs llama.cpp's
rotary embedding reads; Qwen (rotate-half in both) is written as it is, Qwen 3 with its per-head query and key norms.
Weights are stored as float32 (``dtype="float16"``: the matrices at float16, norms and embeddings' γ at float32, as the
converter's ``--outtype f16`` does). ``eps=`` overrides the file's RMSNorm ε (the historical converter bug, for
tests and demonstrations).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import InputError
from ..extras import require

#: model_type → (llama.cpp architecture, whether Q/K are permuted to interleaved rotary pairs)
ARCHITECTURES = {"llama": ("llama", True), "qwen3": ("qwen3", False), "qwen2": ("qwen2", False)}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rotate-half rows (first half, second half of each head) → interleaved pairs, as llama.cpp's converter."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: str | Path, *, dtype: str = "float32", eps: float | None = None) -> Path:
    """``model`` (a Hugging Face causal LM: Llama, Qwen 2, Qwen 3) as a GGUF at ``path``. A model whose rotary
    embedding is scaled (Llama 3's ``rope_type="llama3"``, YaRN…) or whose attention uses a sliding window is
    refused: the keys and tensors that state those are not written here."""
    gguf = require("gguf", "gguf")
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        raise InputError(f"a GGUF is written here for {', '.join(sorted(ARCHITECTURES))} models; got "
                         f"{kind or type(model).__name__}: convert it with llama.cpp's convert_hf_to_gguf.py")
    if dtype not in ("float32", "float16"):
        raise InputError(f"dtype must be float32 or float16; got {dtype!r}")
    arch, permute = ARCHITECTURES[kind]
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise InputError(f"the model's rotary embedding is scaled (rope_type={rope.get('rope_type', rope.get('type'))!r})"
                         ": write_gguf states plain RoPE only; convert it with llama.cpp's convert_hf_to_gguf.py")
    if getattr(cfg, "use_sliding_window", False) or (getattr(cfg, "sliding_window", None) and kind == "llama"):
        raise InputError("the model's attention uses a sliding window, which write_gguf does not state; convert it "
                         "with llama.cpp's convert_hf_to_gguf.py")
    layers = cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), layers)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(type(model).__name__)
    w.add_block_count(layers)
    w.add_context_length(getattr(cfg, "max_position_embeddings", 2048))
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps if eps is None else eps))
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "float32" else gguf.LlamaFileType.MOSTLY_F16)
    _vocabulary(w, gguf, cfg.vocab_size)
    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # llama.cpp reads the embedding when there is no output tensor
    for key, value in state.items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            if key.endswith("rotary_emb.inv_freq"):
                continue
            raise InputError(f"{key}: no llama.cpp tensor name for it in architecture {arch}")
        if permute and key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            value = _permute(value, heads)
        elif permute and key.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            value = _permute(value, kv_heads)
        value = np.ascontiguousarray(value)
        if dtype == "float16" and value.ndim == 2 and "token_embd" not in name:
            value = value.astype(np.float16)
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _vocabulary(w, gguf, size: int) -> None:
    """A SentencePiece-style vocabulary of ``size`` placeholder pieces: unknown, begin, end, then normal pieces."""
    w.add_tokenizer_model("llama")
    w.add_token_list([b"<unk>", b"<s>", b"</s>"] + [f"<t{i}>".encode() for i in range(3, size)])
    w.add_token_scores([0.0] * size)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    w.add_token_types([int(t) for t in types] + [int(gguf.TokenType.NORMAL)] * (size - 3))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
