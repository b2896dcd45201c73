"""A Hugging Face decoder written as a GGUF file llama.cpp runs: every tensor under llama.cpp's names, the
hyperparameters under its keys, and a placeholder vocabulary (``diff`` feeds token ids, never text).

What llama.cpp's own converter (``convert_hf_to_gguf.py``) does for these architectures, and so this writer:

- Llama: the query and key projections permuted from Hugging Face's rotate-half layout to the interleaved pairs
  llama.cpp's rotary embedding reads; Qwen 2, Qwen 3 (with its per-head query and key norms) and Phi-3 (its fused
  ``qkv_proj`` and ``gate_up_proj`` kept fused, ``rope.dimension_count`` from its partial rotary factor) are
  rotate-half in both and written as they are;
- Gemma, Gemma 2, Gemma 3: every norm's γ stored as ``1 + w`` (Hugging Face's Gemma norms compute x̂·(1 + w),
  llama.cpp multiplies by the stored γ); Gemma 2's attention and final logit soft-capping and sliding window,
  Gemma 3's sliding window and final soft-capping where it has one; the embedding's √d scale is not stored
  (llama.cpp's Gemma graphs apply it). Beyond the converter, which leaves llama.cpp to its defaults, the
  sliding layers are stated (``attention.sliding_window_pattern``, one flag per layer, from the model's layer
  types) with their rotary base (``rope.freq_base_swa``): llama.cpp reads both;
- GPT-NeoX: the fused ``query_key_value`` rows reordered from Hugging Face's per-head (q, k, v) interleave to
  all queries, all keys, all values, as llama.cpp's graph views them; LayerNorm ε, parallel residual flag, rotary
  dimension count.

Weights are stored as float32 (``dtype="float16"``: the matrices at float16, norms and embeddings at float32, as
the converter's ``--outtype f16`` does). ``eps=`` overrides the file's norm ε (the historical converter bug, for
tests and demonstrations).

What a file cannot state is refused, with the reason, rather than written to run differently: a scaled rotary
embedding, a sliding window on Llama or Qwen (not stated by their keys), a Gemma 2/3 query scale other than the one
llama.cpp derives from the head size (it reads no key for it), a Gemma 2 without soft-capping (its graph divides by
the caps), a Gemma whose output layer is not its embedding (its graphs use the embedding), a GPT-NeoX without its
attention biases.
"""

from __future__ import annotations

import collections
import ctypes
import math
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..extras import require
from ..report.numbers import sig

#: model_type → llama.cpp architecture
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2",
                 "gemma3_text": "gemma3", "phi3": "phi3", "gpt_neox": "gptneox"}
PERMUTED = ("llama",)  # the converter permutes Q/K to interleaved rotary pairs
GAMMA_PLUS_ONE = ("gemma", "gemma2", "gemma3")  # the converter stores 1 + w for every norm's γ
LAYERNORM = ("gptneox",)  # LayerNorm architectures: ε under layer_norm_epsilon, γ and β
#: Gemma 2/3: llama.cpp's default sliding-window layer period (overridden by the pattern key written here)
SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
#: Gemma 2/3: the layer count llama.cpp reads as its 27B model, whose query scale is 1/√(d/heads), not 1/√head_dim
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rotate-half rows (first half, second half of each head) → interleaved pairs, as llama.cpp's converter."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _split_heads_qkv(w: np.ndarray, heads: int) -> np.ndarray:
    """GPT-NeoX's fused rows, per head (q, k, v), → all queries, all keys, all values, as llama.cpp's converter."""
    return w.reshape(heads, 3, w.shape[0] // heads // 3, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)


def _rope(cfg, layer_type: str = "full_attention") -> dict:
    """The rotary parameters (transformers 5's ``rope_parameters``, per layer type where it is split; earlier
    versions' ``rope_scaling`` and ``rope_theta``)."""
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if isinstance(rope.get(layer_type), dict):
        rope = dict(rope[layer_type])
    rope.setdefault("rope_theta", getattr(cfg, "rope_theta", None) or getattr(cfg, "rotary_emb_base", None) or 10000.0)
    return rope


def _scaled(rope: dict) -> str | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    return None if kind in ("default", None) else str(kind)


def llama_query_scale(arch: str, cfg) -> float:
    """The query scale llama.cpp's Gemma 2/3 graphs apply: 1/√head_dim, or 1/√(d/heads) for the 27B layer count."""
    if cfg.num_hidden_layers == GEMMA_27B_LAYERS.get(arch):
        return 1.0 / math.sqrt(cfg.hidden_size / cfg.num_attention_heads)
    return 1.0 / math.sqrt(_head_dim(cfg))


def sliding_layers(arch: str, cfg) -> list[bool]:
    """Which layers attend through a sliding window: the model's layer types, else llama.cpp's default pattern
    for the architecture (a layer is sliding when i % period < period - 1)."""
    types = list(getattr(cfg, "layer_types", None) or [])
    if types:
        return [t == "sliding_attention" for t in types]
    period = SWA_PERIOD[arch]
    return [i % period < period - 1 for i in range(cfg.num_hidden_layers)]


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _refusals(arch: str, kind: str, cfg) -> str | None:
    """Why ``cfg`` cannot be written as a file llama.cpp runs like the model (None: it can)."""
    convert = "convert it with llama.cpp's convert_hf_to_gguf.py"
    types = ["full_attention"] + (["sliding_attention"] if arch == "gemma3" else [])
    for t in types:
        scaled = _scaled(_rope(cfg, t))
        if scaled:
            return (f"the model's rotary embedding is scaled (rope_type={scaled!r}): write_gguf states plain RoPE "
                    f"only; {convert}")
    if getattr(cfg, "use_sliding_window", False) or (getattr(cfg, "sliding_window", None) and kind == "llama"):
        return f"the model's attention uses a sliding window, which write_gguf does not state; {convert}"
    if arch in ("gemma2", "gemma3"):
        hf = (getattr(cfg, "query_pre_attn_scalar", None) or _head_dim(cfg)) ** -0.5
        ours = llama_query_scale(arch, cfg)
        if not math.isclose(hf, ours, rel_tol=1e-6):
            return (f"the model scales its queries by query_pre_attn_scalar^-½ = {sig(hf, 6)}; llama.cpp's {arch} graph "
                    f"derives {sig(ours, 6)} from the head size (no key states it), so the file would run another "
                    "attention")
        if arch == "gemma2" and not getattr(cfg, "sliding_window", None):
            return "a Gemma 2 without a sliding window: llama.cpp's gemma2 graph expects one"
        if arch == "gemma2" and not (getattr(cfg, "attn_logit_softcapping", None)
                                     and getattr(cfg, "final_logit_softcapping", None)):
            return ("a Gemma 2 without attention or final logit soft-capping: llama.cpp's gemma2 graph applies both, "
                    "dividing by the stated caps")
    if arch == "gptneox" and not getattr(cfg, "attention_bias", True):
        return "a GPT-NeoX without attention biases: llama.cpp's gptneox graph adds its fused QKV bias"
    return None


def write_gguf(model, path: str | Path, *, dtype: str = "float32", eps: float | None = None) -> Path:
    """``model`` (a Hugging Face causal LM: Llama, Qwen 2, Qwen 3, Gemma, Gemma 2, Gemma 3, Phi-3, GPT-NeoX) as a
    GGUF at ``path``. What the file cannot state is refused with the reason (see the module's notes)."""
    gguf = require("gguf", "gguf")
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        raise InputError(f"a GGUF is written here for {', '.join(sorted(ARCHITECTURES))} models; got "
                         f"{kind or type(model).__name__}: convert it with llama.cpp's convert_hf_to_gguf.py")
    if dtype not in ("float32", "float16"):
        raise InputError(f"dtype must be float32 or float16; got {dtype!r}")
    arch = ARCHITECTURES[kind]
    refused = _refusals(arch, kind, cfg)
    if refused:
        raise InputError(refused)
    layers = cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if arch == "gptneox":
        kv_heads = heads
    head_dim = _head_dim(cfg)
    rope = _rope(cfg)
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
    if arch not in ("phi3", "gptneox"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None)
                       or getattr(cfg, "rotary_pct", None))
    if arch == "gptneox":
        w.add_rope_dimension_count(int((partial or 1.0) * head_dim))
    elif arch == "phi3":
        w.add_rope_dimension_count(int((partial or 1.0) * cfg.hidden_size) // heads)
        orig = rope.get("original_max_position_embeddings", getattr(cfg, "original_max_position_embeddings", None))
        if orig:
            w.add_rope_scaling_orig_ctx_len(int(orig))
        # as the converter (0: none); llama.cpp runs Phi-3 without a sliding window either way (it warns), which
        # diff notes when its inputs are longer than the model's window
        w.add_sliding_window(int(getattr(cfg, "sliding_window", None) or 0))
    if arch in LAYERNORM:
        w.add_layer_norm_eps(float(cfg.layer_norm_eps if eps is None else eps))
        w.add_parallel_residual(bool(getattr(cfg, "use_parallel_residual", True)))
    else:
        w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps if eps is None else eps))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
        w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
        w.add_sliding_window(int(cfg.sliding_window))
    elif arch == "gemma3":
        if getattr(cfg, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
        if any(sliding_layers(arch, cfg)):
            w.add_sliding_window(int(cfg.sliding_window))
    if arch == "gemma2" or arch == "gemma3" and any(sliding_layers(arch, cfg)):
        # the converter leaves llama.cpp to its default pattern and local base; both are stated here, from the
        # model's own layer types and rotary parameters (llama.cpp reads the two keys)
        w.add_sliding_window_pattern([bool(x) for x in sliding_layers(arch, cfg)])
        w.add_rope_freq_base_swa(float(_rope(cfg, "sliding_attention")["rope_theta"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "float32" else gguf.LlamaFileType.MOSTLY_F16)
    # llama.cpp's Phi-3 vocabulary loader looks its end-of-text piece up by name
    _vocabulary(w, gguf, cfg.vocab_size, ("<|endoftext|>",) if arch == "phi3" else ())
    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    if arch in GAMMA_PLUS_ONE and "lm_head.weight" in state:
        embedding = next((v for k, v in state.items() if k.endswith("embed_tokens.weight")), None)
        if embedding is None or not np.array_equal(embedding, state["lm_head.weight"]):
            raise InputError("the model's lm_head is not its embedding; llama.cpp's Gemma graphs compute the logits "
                             "with the embedding matrix, so the file would run another output layer")
    if getattr(cfg, "tie_word_embeddings", False) or arch in GAMMA_PLUS_ONE:
        state.pop("lm_head.weight", None)  # llama.cpp reads the embedding when there is no output tensor
    for key, value in state.items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            if key.endswith(("rotary_emb.inv_freq", "embed_scale")) or ".masked_bias" in key:
                continue
            raise InputError(f"{key}: no llama.cpp tensor name for it in architecture {arch}")
        if arch in PERMUTED and key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            value = _permute(value, heads)
        elif arch in PERMUTED and key.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            value = _permute(value, kv_heads)
        elif arch == "gptneox" and key.endswith(("attention.query_key_value.weight",
                                                 "attention.query_key_value.bias")):
            value = _split_heads_qkv(value, heads)
        if arch in GAMMA_PLUS_ONE and key.endswith("norm.weight"):
            value = value + np.float32(1.0)  # Gemma's norms compute x̂·(1 + w); llama.cpp multiplies by γ as stored
        value = np.ascontiguousarray(value)
        if dtype == "float16" and value.ndim == 2 and "token_embd" not in name:
            value = value.astype(np.float16)
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _vocabulary(w, gguf, size: int, control: tuple[str, ...] = ()) -> None:
    """A SentencePiece-style vocabulary of ``size`` placeholder pieces: unknown, begin, end, normal pieces, and the
    ``control`` pieces an architecture's loader looks up by name last."""
    w.add_tokenizer_model("llama")
    normal = size - 3 - len(control)
    w.add_token_list([b"<unk>", b"<s>", b"</s>"] + [f"<t{i}>".encode() for i in range(3, 3 + normal)]
                     + [c.encode() for c in control])
    w.add_token_scores([0.0] * size)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    w.add_token_types([int(t) for t in types] + [int(gguf.TokenType.NORMAL)] * normal
                      + [int(gguf.TokenType.CONTROL)] * len(control))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


def quantize_gguf(source: str | Path, path: str | Path, kind: str = "Q8_0") -> Path:
    """The GGUF at ``source`` quantized by llama.cpp's own quantizer (through llama-cpp-python) to ``kind`` — a
    file type as llama.cpp's ``quantize`` tool names it: ``Q8_0``, ``Q4_0``, ``Q4_K_M``, ``Q5_K_M``, ``Q6_K`` … —
    written at ``path``. llama.cpp chooses each tensor's type as its recipe says (``Q4_K_M`` keeps some in
    ``Q6_K``; a tensor whose rows are not a multiple of the block falls back to another type)."""
    lc = require("llama_cpp.llama_cpp", "llamacpp")
    known = sorted(n.removeprefix("LLAMA_FTYPE_MOSTLY_") for n in dir(lc) if n.startswith("LLAMA_FTYPE_MOSTLY_"))
    code = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}", None)
    if code is None:
        raise InputError(f"{kind!r} is not a llama.cpp file type; known: {', '.join(known)}")
    source, path = Path(source), Path(path)
    if not source.is_file():
        raise InputError(f"{source}: no such GGUF file")
    if path.exists():
        raise InputError(f"{path} exists; give a new path (nothing is overwritten)")
    params = lc.llama_model_quantize_default_params()
    params.ftype = code
    quiet_llama_cpp(lc)
    LOG_TAIL.clear()
    if lc.llama_model_quantize(str(source).encode(), str(path).encode(), ctypes.byref(params)) != 0:
        why = next((line for line in reversed(LOG_TAIL) if "fail" in line or "error" in line), "")
        raise InputError(f"llama.cpp could not quantize {source} to {kind}" + (f" ({why})" if why else "")
                         + ": give a GGUF that llama.cpp loads (normscope.artifacts.write_gguf writes one from a "
                           "model; convert_hf_to_gguf.py is llama.cpp's own)")
    return path


_LOG_SINK = None
LOG_TAIL: collections.deque[str] = collections.deque(maxlen=32)  # llama.cpp's last log lines, for its errors


def quiet_llama_cpp(lc) -> None:
    """llama.cpp's log lines kept here (:data:`LOG_TAIL`) instead of going to stderr, its backend started; the
    callback object is kept alive here. ``lc``: ``llama_cpp.llama_cpp``."""
    global _LOG_SINK
    if _LOG_SINK is None:
        def keep(level, text, data):
            LOG_TAIL.append((text or b"").decode(errors="replace").strip())

        _LOG_SINK = lc.llama_log_callback(keep)
        lc.llama_log_set(_LOG_SINK, ctypes.c_void_p())
        lc.llama_backend_init()
