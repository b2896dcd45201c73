"""A llama.cpp candidate in ``diff``: a GGUF file as llama.cpp runs it, its named intermediate tensors mapped to the
torch sites.

The candidate is a ``.gguf`` path, or ``"llama.cpp"``: the reference written as a GGUF here
(:func:`normscope.artifacts.gguf_write.write_gguf`) and run by llama.cpp. The file is loaded through
llama-cpp-python's low-level API on the CPU, with a context whose K/V cache is float32 and flash attention off
(llama.cpp's defaults, an f16 cache, would put a 16-bit rounding into every attention site of an fp32
reference). Each sample of the batch is decoded alone (a fresh sequence), with logits for every token. The
graph-evaluation callback (the mechanism of llama.cpp's eval-callback example) reads every tensor the
mapping names once it is computed (``attn_norm-0``, ``ffn_out-0``, ``l_out-0``, ``result_norm``…; a name
given to several tensors of a layer keeps each, in order). A tensor the graph leaves unnamed is found by what it
reads (:data:`UNNAMED`): the output projection is the product that reads ``kqv_out-{i}``, its bias the sum of that
product and a weight.

Sites: llama.cpp's graph names a tensor per role, not per module, and each architecture's graph differs; the map
of the file's architecture (:func:`site_map`) says which Hugging Face module's output each tensor is, through what
transformation (Llama's Q/K rows in interleaved rotary pairs, GPT-NeoX's fused QKV rows regrouped, Gemma's
embedding scaled by √d in the graph, Gemma's γ stored as 1 + w, a GELU read from a float16 table), and which tensor
holds that module's input. A module whose output no tensor holds (the rotary embedding; an activation fused with
its product) is listed as not compared, with the reason; the modules of an architecture the map does not know are
not compared at all (only the model's output is), never judged against a tensor that may not be theirs.

Own errors: where a site's input is recorded too, the reference's module is run on the *candidate's* input (with
the transformation the graph applies inside it, where there is one), and the candidate's output differs from that
by the site's own error (``cand − ref(x_cand)``, added to the reference's output to be judged like any other).
Elsewhere the site is judged on its propagated error.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...artifacts.gguf_write import quiet_llama_cpp
from ...errors import InputError, TargetError
from ...extras import require
from ...report.numbers import sig
from ..candidate import Alignment, Candidate, NotMeasured, kept_bytes
from ..execution import Memo, Record, input_at, model_dtype, primary, restored, stateless

#: weight types with a bound here: a 16-bit float's rounding (quantized blocks have none in the error model)
FLOAT_TYPES = ("F32", "F16", "BF16")
PERMUTED = ("llama",)  # architectures whose converter permutes Q/K to interleaved rotary pairs
GEMMA = ("gemma", "gemma2", "gemma3")
GELU_TABLE = (*GEMMA, "gptneox")  # architectures whose graph computes a GELU (ggml's CPU backend: from its table)
#: the tensor that holds the GELU's input in each of those graphs (per layer)
GELU_INPUT = {**{a: ("ffn_gate-{i}",) for a in GEMMA}, "gptneox": ("ffn_up_b-{i}", "ffn_up-{i}")}
TIE = 1 / 64  # inputs this close (in float16 steps) are one input to a float16 table lookup (:func:`llama_gelu`)
_GGML_F32, _GGML_F16 = 0, 1

# ---------------------------------------------------------------------------------------------------- the maps


@dataclasses.dataclass(frozen=True)
class Entry:
    """One site of an architecture's map: the graph tensor that holds a Hugging Face module's output.

    ``tensor``: (name pattern, which of the tensors so named) alternatives, the first found taken; ``source``: the
    tensor that holds the module's input, alike (``"ids"``: the token ids, the reference's own input; ``"{p}"``:
    the layer's input stream; None: not in the graph, the site is judged on its propagated error); ``gamma``: at a
    norm, the GGUF tensor of its γ (its β: the same name's ``.bias``); ``layout``: how the tensor's last axis is
    laid out where it is not Hugging Face's (``"interleaved"``: Llama's rotary pairs; ``"qkv"``: GPT-NeoX's fused
    rows, all queries, all keys, all values; ``"heads_first"``: a per-head tensor Hugging Face holds as (batch,
    heads, tokens, head size), Gemma 3's query and key norms, where llama.cpp's is token-major, its input too).

    Patterns: ``{i}`` the layer, ``{last}`` the last layer. Which tensor: ``first``; ``layer`` — the i-th of the
    tensors so named (a name the graph gives without its layer); ``proj`` — a projection with its bias, the last
    matrix product or addition so named before its reshape into heads; ``heads`` — that reshape."""

    tensor: tuple
    path: str
    source: Any = None
    rank: int = 2
    gamma: str | None = None
    layout: str | None = None


def _t(*names) -> tuple:
    """Tensor alternatives: a name (its ``first``) or a (name, selector) pair each."""
    return tuple(n if isinstance(n, tuple) else (n, "first") for n in names)


def _e(tensor, path, source=None, **kw) -> Entry:
    """An entry; ``tensor`` and ``source``: a name, a (name, selector) pair or a list of alternatives."""
    tensor = _t(*tensor) if isinstance(tensor, list) else _t(tensor)
    if source is not None and source not in ("ids", "{p}"):
        source = _t(*source) if isinstance(source, list) else _t(source)
    return Entry(tensor, path, source, **kw)


def _attention(m: str, qkv: str, q_norm: bool, heads_first: bool = False) -> list[Entry]:
    """The attention sites of a decoder layer: projections (``qkv``: separate, or ``fused`` as Phi-3's), the per-head
    query/key norms (``heads_first``: applied after the transpose to heads, as Gemma 3's), the output projection
    (with its bias) and the attention module."""
    a = f"{m}.layers.{{i}}.self_attn"
    out = []
    if qkv == "separate":
        for x, proj in (("Q", "q_proj"), ("K", "k_proj"), ("V", "v_proj")):
            out.append(_e((f"{x}cur-{{i}}", "proj"), f"{a}.{proj}", "attn_norm-{i}",
                          layout="interleaved" if x in "QK" else None))
    elif qkv == "fused":
        out.append(_e(("wqkv-{i}", "proj"), f"{a}.qkv_proj", "attn_norm-{i}"))
    layout = "heads_first" if heads_first else None
    if q_norm:
        out.append(_e("Qcur_normed-{i}", f"{a}.q_norm", ("Qcur-{i}", "heads"), rank=3, gamma="blk.{i}.attn_q_norm",
                      layout=layout))
        out.append(_e("Kcur_normed-{i}", f"{a}.k_norm", ("Kcur-{i}", "heads"), rank=3, gamma="blk.{i}.attn_k_norm",
                      layout=layout))
    out.append(_e(("attn_out-{i}", "proj"), f"{a}.o_proj", "kqv_out-{i}"))
    out.append(_e(("attn_out-{i}", "proj"), a, "attn_norm-{i}"))
    return out


def _head(m: str, lm: tuple = ("result_output",)) -> list[Entry]:
    """The final norm, the inner model's output (its last hidden state, normed), the logits and the model's output."""
    return [_e("result_norm", f"{m}.norm", "l_out-{last}", gamma="output_norm"),
            _e("result_norm", m),
            _e(list(lm), "lm_head", "result_norm"),
            _e("result_output", "")]


ROTARY = ("llama.cpp applies the rotary embedding inside its ROPE operation, on the positions; no tensor of the "
          "graph holds the (cos, sin) this module returns")
#: the tensors a graph leaves unnamed, found by what they read (see :func:`_unnamed`)
UNNAMED = ("attn_out-{i}: the product that reads kqv_out-{i}, and its sum with a weight (the bias)",
           "ffn_inp-{i}: the sum that reads the output projection (Phi-3 names none)",
           "lm_out: the product that reads result_norm, where the logits are soft-capped after it")


def site_map(info) -> tuple[str, list[Entry], dict[str, str]]:
    """The map of the file's architecture: the tensor that holds the embedding's output (the first layer's input),
    its entries, and the modules that are not compared (path pattern → why). ``info``: :class:`FileInfo`. An
    architecture not mapped here has only its output compared."""
    arch, m = info.arch, "model"
    rotary = {f"{m}.rotary_emb": ROTARY}
    fused = ("llama.cpp fuses the activation with the gate product ({}); no tensor of the graph holds the "
             "activation alone")
    if arch in ("llama", "qwen2", "qwen3"):
        entries = [_e("embd", f"{m}.embed_tokens", "ids"),
                   _e("attn_norm-{i}", f"{m}.layers.{{i}}.input_layernorm", "{p}", gamma="blk.{i}.attn_norm"),
                   *_attention(m, "separate", arch == "qwen3"),
                   _e("ffn_norm-{i}", f"{m}.layers.{{i}}.post_attention_layernorm", "ffn_inp-{i}",
                      gamma="blk.{i}.ffn_norm"),
                   _e("ffn_gate-{i}", f"{m}.layers.{{i}}.mlp.gate_proj", "ffn_norm-{i}"),
                   _e("ffn_up-{i}", f"{m}.layers.{{i}}.mlp.up_proj", "ffn_norm-{i}"),
                   _e("ffn_out-{i}", f"{m}.layers.{{i}}.mlp.down_proj", "ffn_swiglu-{i}"),
                   _e("ffn_out-{i}", f"{m}.layers.{{i}}.mlp", "ffn_norm-{i}"),
                   _e("l_out-{i}", f"{m}.layers.{{i}}", "{p}"),
                   *_head(m)]
        return "embd", entries, {**rotary, f"{m}.layers.{{i}}.mlp.act_fn": fused.format("ffn_swiglu")}
    if arch in GEMMA:
        # the graph scales the embedding by √d (inp_scaled), as Hugging Face's Gemma embedding module does
        post = arch != "gemma"  # Gemma 2/3: a norm after the attention and after the MLP
        entries = [_e("inp_scaled", f"{m}.embed_tokens", "ids"),
                   _e("attn_norm-{i}", f"{m}.layers.{{i}}.input_layernorm", "{p}", gamma="blk.{i}.attn_norm"),
                   *_attention(m, "separate", arch == "gemma3", heads_first=True)]
        if post:
            entries += [
                _e("attn_post_norm-{i}", f"{m}.layers.{{i}}.post_attention_layernorm", ("attn_out-{i}", "proj"),
                   gamma="blk.{i}.post_attention_norm"),
                _e("ffn_norm-{i}", f"{m}.layers.{{i}}.pre_feedforward_layernorm", "sa_out-{i}",
                   gamma="blk.{i}.ffn_norm"),
                # Gemma 2's graph names it without its layer
                _e([("ffn_post_norm-{i}", "first"), ("ffn_post_norm", "layer")],
                   f"{m}.layers.{{i}}.post_feedforward_layernorm", "ffn_out-{i}", gamma="blk.{i}.post_ffw_norm")]
        else:
            entries.append(_e("ffn_norm-{i}", f"{m}.layers.{{i}}.post_attention_layernorm", "sa_out-{i}",
                              gamma="blk.{i}.ffn_norm"))
        entries += [_e("ffn_gate-{i}", f"{m}.layers.{{i}}.mlp.gate_proj", "ffn_norm-{i}"),
                    _e("ffn_up-{i}", f"{m}.layers.{{i}}.mlp.up_proj", "ffn_norm-{i}"),
                    _e("ffn_out-{i}", f"{m}.layers.{{i}}.mlp.down_proj", "ffn_geglu-{i}"),
                    _e("ffn_out-{i}", f"{m}.layers.{{i}}.mlp", "ffn_norm-{i}"),
                    _e("l_out-{i}", f"{m}.layers.{{i}}", "{p}"),
                    # with a final soft-capping the logits are the product before it (``lm_out``)
                    *_head(m, ("lm_out", "result_output"))]
        return "inp_scaled", entries, {**rotary, f"{m}.layers.{{i}}.mlp.act_fn": fused.format("ffn_geglu")}
    if arch == "phi3":
        entries = [_e("embd", f"{m}.embed_tokens", "ids"),
                   _e("attn_norm-{i}", f"{m}.layers.{{i}}.input_layernorm", "{p}", gamma="blk.{i}.attn_norm"),
                   *_attention(m, "fused", False),
                   _e(("attn_out-{i}", "proj"), f"{m}.layers.{{i}}.resid_attn_dropout"),
                   # the sum after the attention is unnamed in Phi-3's graph: found by what it reads (UNNAMED)
                   _e("ffn_norm-{i}", f"{m}.layers.{{i}}.post_attention_layernorm", "ffn_inp-{i}",
                      gamma="blk.{i}.ffn_norm"),
                   _e("ffn_up-{i}", f"{m}.layers.{{i}}.mlp.gate_up_proj", "ffn_norm-{i}"),
                   _e("ffn_out-{i}", f"{m}.layers.{{i}}.mlp.down_proj", "ffn_swiglu-{i}"),
                   _e("ffn_out-{i}", f"{m}.layers.{{i}}.mlp", "ffn_norm-{i}"),
                   _e("ffn_out-{i}", f"{m}.layers.{{i}}.resid_mlp_dropout"),
                   _e("l_out-{i}", f"{m}.layers.{{i}}", "{p}"),
                   *_head(m)]
        return "embd", entries, {**rotary, f"{m}.layers.{{i}}.mlp.activation_fn": fused.format("ffn_swiglu")}
    if arch == "gptneox":
        m = "gpt_neox"
        layer = f"{m}.layers.{{i}}"
        entries = [_e("embd", f"{m}.embed_in", "ids"),
                   _e("embd", f"{m}.emb_dropout"),
                   _e("attn_norm-{i}", f"{layer}.input_layernorm", "{p}", gamma="blk.{i}.attn_norm"),
                   _e(["wqkv_b-{i}", "wqkv-{i}"], f"{layer}.attention.query_key_value", "attn_norm-{i}", layout="qkv"),
                   _e(("attn_out-{i}", "proj"), f"{layer}.attention.dense", "kqv_out-{i}"),
                   _e(("attn_out-{i}", "proj"), f"{layer}.attention", "attn_norm-{i}"),
                   _e(("attn_out-{i}", "proj"), f"{layer}.post_attention_dropout"),
                   # parallel residual: both norms read the layer's input; else the sum after the attention
                   _e("ffn_norm-{i}", f"{layer}.post_attention_layernorm", "{p}" if info.parallel else "ffn_inp-{i}",
                      gamma="blk.{i}.ffn_norm"),
                   _e(["ffn_up_b-{i}", "ffn_up-{i}"], f"{layer}.mlp.dense_h_to_4h", "ffn_norm-{i}"),
                   _e("ffn_gelu-{i}", f"{layer}.mlp.act", ["ffn_up_b-{i}", "ffn_up-{i}"]),
                   _e("ffn_out-{i}", f"{layer}.mlp.dense_4h_to_h", "ffn_gelu-{i}"),
                   _e("ffn_out-{i}", f"{layer}.mlp", "ffn_norm-{i}"),
                   _e("ffn_out-{i}", f"{layer}.post_mlp_dropout"),
                   _e("l_out-{i}", layer, "{p}"),
                   _e("result_norm", f"{m}.final_layer_norm", "l_out-{last}", gamma="output_norm"),
                   _e("result_norm", m),
                   _e("result_output", "lm_head", "result_norm"),
                   _e("result_output", "")]
        return "embd", entries, {f"{m}.rotary_emb": ROTARY}
    return "embd", [_e("result_output", "")], {}


def _layer_names(entries: list[Entry], layers: int, embedding: str) -> list[tuple]:
    """Every entry resolved per layer: (tensor alternatives, rank, site path, input, γ tensor, layout)."""
    out = []

    def fmt(pattern: str, i):
        return pattern.format(i=i, last=layers - 1)

    for e in entries:
        per_layer = any("{i}" in n for n, _ in e.tensor) or "{i}" in e.path
        for i in range(layers) if per_layer else [None]:
            tensors = tuple((fmt(n, i), i if s == "layer" else s) for n, s in e.tensor)
            if e.source == "{p}":
                inp = ((embedding, "first"),) if i == 0 else ((f"l_out-{i - 1}", "first"),)
            elif isinstance(e.source, tuple):
                inp = tuple((fmt(n, i), s) for n, s in e.source)
            else:
                inp = e.source
            out.append((tensors, e.rank, e.path.format(i=i), inp, fmt(e.gamma, i) if e.gamma else None, e.layout))
    return out


def select(values: dict, name: str, selector):
    """The tensor ``selector`` names among those called ``name`` (``values``: (name, occurrence) → (array, op)), or
    None. An integer selector: that occurrence."""
    found = []
    while (name, len(found)) in values:
        found.append(values[(name, len(found))])
    if not found:
        return None
    if isinstance(selector, int):
        return found[selector] if selector < len(found) else None
    if selector == "first":
        return found[0]
    cut = next((k for k, (_, op) in enumerate(found) if op == "RESHAPE"), len(found))
    if selector == "heads":
        return found[cut] if cut < len(found) else None
    proj = [v for v in found[:cut] if v[1] in ("MUL_MAT", "ADD")]  # "proj": its bias added where there is one
    return proj[-1] if proj else None


def _first(values: dict, tensors: tuple):
    return next((got for name, sel in tensors if (got := select(values, name, sel)) is not None), None)


# ---------------------------------------------------------------------------------------------------- ggml


class _Ggml:
    """The few ggml functions the evaluation callback needs, from the libraries llama-cpp-python ships."""

    #: ggml_tensor: type (int32, padded), buffer, ne[4], nb[4], op, op_params[16], flags, then src[10]
    SRC_OFFSET, N_SRC, NAME_OFFSET = 152, 10, 256

    def __init__(self):
        self.lib_dir = Path(require("llama_cpp", "llamacpp").__file__).parent / "lib"
        candidates = sorted(self.lib_dir.glob("libggml-base.*")) or sorted(self.lib_dir.glob("libggml.*"))
        if not candidates:
            raise TargetError(f"llama-cpp-python's ggml library is not in {self.lib_dir}")
        base = ctypes.CDLL(str(candidates[0]))
        self.name = base.ggml_get_name
        self.name.restype, self.name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        # the same function, its result as an address (to check the struct's layout against)
        self.name_at = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
            ctypes.cast(base.ggml_get_name, ctypes.c_void_p).value)
        self.op_of = base.ggml_op_desc
        self.op_of.restype, self.op_of.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        self.contiguous = base.ggml_is_contiguous
        self.contiguous.restype, self.contiguous.argtypes = ctypes.c_bool, [ctypes.c_void_p]
        self.nbytes = base.ggml_nbytes
        self.nbytes.restype, self.nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
        self.get = base.ggml_backend_tensor_get
        self.get.restype = None
        self.get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.layout_ok: bool | None = None  # whether src[] is where SRC_OFFSET says (checked on the first tensor)

    def sources(self, t: int) -> list[int]:
        """The tensors ``t`` reads (their addresses), or [] when the struct's layout is not the one assumed here (the
        name's address is checked against it once)."""
        if self.layout_ok is None:
            self.layout_ok = self.name_at(t) == t + self.NAME_OFFSET
        if not self.layout_ok:
            return []
        return [p for p in (ctypes.c_void_p * self.N_SRC).from_address(t + self.SRC_OFFSET) if p]

    def read(self, t: int) -> np.ndarray | None:
        """A computed tensor's values as float32, shaped (ne3, ne2, ne1, ne0); None when it is not a contiguous
        f32/f16 tensor. ``type`` and ``ne`` are read at their fixed offsets of ggml_tensor
        (an enum, then the buffer pointer, then ne[4])."""
        kind = ctypes.c_int32.from_address(t).value
        if kind not in (_GGML_F32, _GGML_F16) or not self.contiguous(t):
            return None
        ne = list((ctypes.c_int64 * 4).from_address(t + 16))
        out = np.empty(int(np.prod(ne)), np.float32 if kind == _GGML_F32 else np.float16)
        if out.nbytes != self.nbytes(t):
            return None
        self.get(t, out.ctypes.data, 0, out.nbytes)
        return out.reshape(tuple(reversed(ne))).astype(np.float32)

    def gelu_table(self) -> np.ndarray | None:
        """The float16 GELU table ggml's CPU backend computes GELU from (``ggml_table_gelu_f16``, filled when the
        backend starts), as float16 values indexed by a float16's bits; None when it is not there or not filled."""
        files = sorted(self.lib_dir.glob("libggml-cpu.*"))
        try:  # the copy llama.cpp loaded (the wheel may hold the library under several names, each its own copy)
            with open("/proc/self/maps") as maps:
                loaded = {line.split()[-1] for line in maps if "libggml-cpu" in line}
            files = [f for f in files if str(f) in loaded] or files
        except OSError:
            pass
        one = int(np.array(1.0, np.float16).view(np.uint16))
        for f in files:
            try:
                lib = ctypes.CDLL(str(f))
                raw = np.ctypeslib.as_array((ctypes.c_uint16 * 65536).in_dll(lib, "ggml_table_gelu_f16")).copy()
            except (OSError, ValueError):
                continue
            table = raw.view(np.float16)
            if abs(float(table[one]) - 0.8412) < 1e-3:
                return table
        return None


def gelu_table_computed() -> np.ndarray:
    """ggml's GELU table computed here (its tanh approximation in float32 at every float16, rounded to float16): used
    only when the library's own table cannot be read."""
    x = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(all="ignore"):
        y = 0.5 * x * (1.0 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * x * (1.0 + np.float32(0.044715) * x * x)))
    return y.astype(np.float16)


def llama_gelu(x: torch.Tensor, table: np.ndarray, near: torch.Tensor | None = None) -> torch.Tensor:
    """GELU as ggml's CPU backend computes it: the input rounded to float16 looks its value up in the float16 table;
    at and beyond ±10, 0 or the input itself.

    ``near``: llama.cpp's own input to this GELU, where known (the same shape). The lookup is discontinuous: two
    inputs that agree to within a rounding can fall on either side of a float16 rounding boundary, and both lookups
    are then faithful. Where ``x`` and ``near`` agree to within 1/64 of a float16 step (:data:`TIE`) but round to
    neighbouring float16 values, llama.cpp's rounding is taken, so a difference of rounding upstream is not turned
    into a float16 step here; a larger difference keeps its own lookup."""
    xf = x.float()
    h = xf.half()
    if near is not None and tuple(near.shape) == tuple(xf.shape):
        c = near.to(xf.device, torch.float32)
        step = torch.ldexp(torch.ones_like(xf), (torch.frexp(xf.abs())[1] - 11).clamp(min=-24))
        h = torch.where((xf - c).abs() <= step * TIE, c.half(), h)
    bits = h.view(torch.int16).to(torch.int64) & 0xFFFF
    y = torch.from_numpy(table.astype(np.float32))[bits]
    y = torch.where(xf <= -10.0, torch.zeros_like(xf), torch.where(xf >= 10.0, xf, y))
    return y.to(x.dtype)


def gelu_kind(module: torch.nn.Module) -> str | None:
    """``"tanh"`` or ``"erf"``: which GELU a leaf activation module computes (probed), else None."""
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = module(x.float()).double()
    except Exception:
        return None
    for kind, ref in (("tanh", torch.nn.functional.gelu(x, approximate="tanh")), ("erf", torch.nn.functional.gelu(x))):
        if y.shape == ref.shape and float((y - ref).abs().max()) < 1e-5:
            return kind
    return None


class FileInfo:
    """What the GGUF says of itself: its architecture, head counts, the hyperparameters the map depends on, each
    tensor's storage type and how many of each."""

    def __init__(self, path: Path):
        gguf = require("gguf", "gguf")
        try:
            reader = gguf.GGUFReader(str(path), "r")
        except Exception as exc:
            raise InputError(f"{path}: not a readable GGUF ({type(exc).__name__}: {exc})") from None

        def field(key):
            f = reader.get_field(key)
            try:
                return f.contents() if f is not None else None
            except (ValueError, IndexError, UnicodeDecodeError):
                return None

        self.reader = reader
        self.arch = field("general.architecture") or "?"
        self.heads = field(f"{self.arch}.attention.head_count")
        self.kv_heads = field(f"{self.arch}.attention.head_count_kv") or self.heads
        self.sliding_window = field(f"{self.arch}.attention.sliding_window") or 0
        parallel = field(f"{self.arch}.use_parallel_residual")
        self.parallel = True if parallel is None else bool(parallel)  # llama.cpp's GPT-NeoX default
        self.tensor_types = {t.name: t.tensor_type.name for t in reader.tensors}
        self.counts: dict[str, int] = {}
        for kind in self.tensor_types.values():
            self.counts[kind] = self.counts.get(kind, 0) + 1
        matrices = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
        #: the dtype the file's matrix products round their weights to: the least precise float type of its matrices
        self.matrix_dtype = ("bfloat16" if "BF16" in matrices else "float16" if "F16" in matrices else "float32")

    def norm_dtype(self, gamma: str | None) -> str:
        """The dtype a norm's γ is stored at (llama.cpp computes the norm in float32 and multiplies by it)."""
        kind = self.tensor_types.get(f"{gamma}.weight") if gamma else None
        return {"F16": "float16", "BF16": "bfloat16"}.get(kind, "float32")


class Site:
    """A llama.cpp site: the candidate's output there and, when the graph names it, its input (``"ids"``: the token
    ids, the reference's own input)."""

    __slots__ = ("output", "input", "stated", "dtype")

    def __init__(self, output: torch.Tensor, inp, stated=None, dtype: str = "float32"):
        self.output, self.input, self.stated, self.dtype = output, inp, stated, dtype


class NotCompared:
    """A module the map knows has no tensor of its own in the graph; ``why`` says so."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


class _Alignment(Alignment):
    """By path and call number; a module the map does not compare is not compared at any of its calls (Gemma 3 calls
    its rotary embedding once per kind of layer)."""

    def counterpart(self, path: str, number: int, shape: list[int]) -> Record | None:
        r = super().counterpart(path, number, shape)
        first = self.by_key.get((path, 0)) if r is None and number else None
        return first if first is not None and isinstance(first.module, NotCompared) else r


def _wanted_names(entries: list[Entry]) -> set[str]:
    """The tensor names (without their layer) the callback reads; everything else (attention scores, views, the
    cache) is left in llama.cpp."""
    names = {"kqv_out", "result_norm"}
    for e in entries:
        for n, _ in e.tensor + (e.source if isinstance(e.source, tuple) else ()):
            names.add(re.sub(r"-\{(i|last)\}$", "", n))
    names.update(("embd", "inp_scaled", "l_out"))
    return names


def _unnamed(op: str, srcs: list[int], seen: dict[int, str], ggml: _Ggml) -> str | None:
    """The name an unnamed tensor stands for, by what it reads (:data:`UNNAMED`); ``seen``: address → name of the
    tensors so far."""
    names = [seen.get(s) for s in srcs[:2]]
    if op == "MUL_MAT" and len(names) == 2 and names[1]:
        if names[1].startswith("kqv_out-"):
            return "attn_out-" + names[1].rsplit("-", 1)[1]
        if names[1] == "result_norm":
            return "lm_out"
    if op == "ADD" and len(names) == 2 and names[0] and names[0].startswith("attn_out-"):
        if ggml.op_of(srcs[1]).decode() == "NONE":  # a weight: the projection's bias
            return names[0]
        return "ffn_inp-" + names[0].rsplit("-", 1)[1]  # the residual stream: the sum after the attention
    return None


def run_candidate(path: Path, ids: torch.Tensor) -> tuple[dict, FileInfo, str, np.ndarray | None]:
    """Each sample of ``ids`` (batch × tokens) decoded by llama.cpp; every (tensor name, occurrence) the mapping
    reads → (the per-sample arrays stacked on a batch axis, its op); what the file says of itself; a description;
    the GELU table llama.cpp computed with."""
    lc = require("llama_cpp.llama_cpp", "llamacpp")
    info = FileInfo(path)
    from .ggml_quant import QUANTIZED

    other = sorted(t for t in info.counts if t not in FLOAT_TYPES + QUANTIZED)
    if other:
        raise InputError(f"{path}: weights stored as {', '.join(other)}: diff models ggml's products for "
                         f"{', '.join(QUANTIZED)} and float weights (F32, F16, BF16), not these; quantize the model "
                         "to one of those types (or diff a float GGUF of it)")
    quiet_llama_cpp(lc)
    ggml = _Ggml()
    wanted_names = _wanted_names(site_map(info)[1])
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    if not model:
        raise TargetError(f"llama.cpp could not load {path} (architecture {info.arch!r}; its log is silenced: run "
                          "llama.cpp on it to see why)")
    ctx = batch = None
    try:
        vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise InputError(f"token ids from {int(ids.min())} to {int(ids.max())}: {path} has a vocabulary of "
                             f"{vocab}")
        n_tok = int(ids.shape[-1])
        seen: dict[str, list[np.ndarray]] = {}
        ops: dict[str, list[str]] = {}
        names: dict[int, str] = {}  # address → the name a tensor stands for (its own, or found by what it reads)

        def wanted(t: int, name: str, op: str) -> bool:
            if " (" in name:
                return False  # views
            if name.startswith("node_"):
                srcs = ggml.sources(t)
                if op == "GET_ROWS" and srcs and srcs[0] in names:  # the last layer's rows: the same tensor
                    names[t] = names[srcs[0]]
                    return False
                found = _unnamed(op, srcs, names, ggml)
                if found is None:
                    return False
                names[t] = found
                return True
            names[t] = name
            base = name.rsplit("-", 1)[0] if re.search(r"-\d+$", name) else name
            return base in wanted_names

        @lc.ggml_backend_sched_eval_callback
        def callback(t, ask, user_data):
            name = ggml.name(t).decode(errors="replace")
            if ask:
                return wanted(t, name, ggml.op_of(t).decode())
            name = names.get(t, name)
            value = ggml.read(t)
            if value is not None:
                seen.setdefault(name, []).append(value)
                ops.setdefault(name, []).append(ggml.op_of(t).decode())
            return True

        params = lc.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = max(n_tok, 8)
        params.n_threads = params.n_threads_batch = max(1, torch.get_num_threads())
        params.cb_eval = callback
        params.type_k = params.type_v = _GGML_F32  # an f16 cache would round every attention site of an fp32 model
        params.flash_attn_type = 0  # disabled
        ctx = lc.llama_init_from_model(model, params)
        if not ctx:
            raise TargetError(f"llama.cpp could not create a context for {path}")
        per_sample: list[dict] = []
        batch = lc.llama_batch_init(n_tok, 0, 1)
        for row in ids.reshape(-1, n_tok).tolist():
            for store in (seen, ops, names):
                store.clear()
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            for j, tok in enumerate(row):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = int(tok), j, 1
                batch.seq_id[j][0], batch.logits[j] = 0, 1
            batch.n_tokens = n_tok
            code = lc.llama_decode(ctx, batch)
            if code != 0:
                raise TargetError(f"llama.cpp's decode returned {code} on {path} ({n_tok} tokens)")
            per_sample.append({(name, k): (v, ops[name][k]) for name, values in seen.items()
                               for k, v in enumerate(values)})
        table = ggml.gelu_table()
    finally:
        if batch is not None:
            lc.llama_batch_free(batch)
        if ctx is not None:
            lc.llama_free(ctx)
        lc.llama_model_free(model)
    keys = set.intersection(*(set(s) for s in per_sample)) if per_sample else set()
    stacked = {k: (np.stack([s[k][0] for s in per_sample]), per_sample[0][k][1]) for k in keys}
    weights = ", ".join(f"{n} {t}" for t, n in sorted(info.counts.items()))
    desc = (f"llama.cpp (llama-cpp-python {require('llama_cpp', 'llamacpp').__version__}) CPU, {path.name} "
            f"({info.arch}; tensors: {weights}), f32 K/V cache, flash attention off")
    return stacked, info, desc, table


# ---------------------------------------------------------------------------------------------------- layouts


def unpermute(value: np.ndarray, heads: int) -> np.ndarray:
    """Interleaved rotary pairs (llama.cpp's Llama layout) → Hugging Face's rotate-half rows, on the last axis."""
    n = value.shape[-1]
    v = value.reshape(*value.shape[:-1], heads, n // heads // 2, 2)
    return np.swapaxes(v, -1, -2).reshape(value.shape)


def regroup_qkv(value: np.ndarray, heads: int) -> np.ndarray:
    """GPT-NeoX's fused QKV as llama.cpp holds it (all queries, all keys, all values) → Hugging Face's rows (per
    head: its query, key and value), on the last axis."""
    n = value.shape[-1]
    v = value.reshape(*value.shape[:-1], 3, heads, n // heads // 3)
    return np.swapaxes(v, -3, -2).reshape(value.shape)


def _shaped(value: np.ndarray, rank: int) -> np.ndarray:
    """(batch, ne3, ne2, ne1, ne0) → (batch, tokens, features) for a rank-2 tensor, (batch, tokens, heads, head
    size) for rank 3: the token axis kept even for a single token."""
    b, ne3, ne2, ne1, ne0 = value.shape
    return value.reshape(b, ne2 * ne3, ne1, ne0) if rank == 3 else value.reshape(b, ne1 * ne2 * ne3, ne0)


def records(values: dict, info: FileInfo, ref_paths: list[str], record_type, stated) -> list:
    """The sites the graph's tensors give, as records aligned to the reference's module paths (the map's prefix —
    ``model.``, ``gpt_neox.`` — found in them, or not), each with the candidate's input where the graph names it,
    the dtype it is judged at and, at a norm, the contract the file states there (``stated(γ tensor name)``); and
    a record saying why for each module the map knows the graph holds no tensor of."""
    layers = 1 + max((int(m.group(1)) for k in values for m in [re.fullmatch(r"l_out-(\d+)", k[0])] if m),
                     default=-1)
    embedding, entries, not_compared = site_map(info)
    prefixes = {p.split(".", 1)[0] + "." for e in entries if "." in (p := e.path)}
    strip = {p for p in prefixes if not any(r.startswith(p) for r in ref_paths)}
    paths = set(ref_paths)

    def aligned(path: str) -> str:
        """The path in the reference: without the map's prefix where the reference is the inner model itself (a
        ``LlamaModel``), whose output is then the inner model's (``result_norm``), not the logits."""
        if path + "." in strip:
            return ""
        return next((path.removeprefix(p) for p in strip if path.startswith(p)), path)

    out, taken = [], set()
    for tensors, rank, path, inp, gamma, layout in _layer_names(entries, layers, embedding):
        got = _first(values, tensors)
        path = aligned(path)
        if got is None or (path and path not in paths) or path in taken:
            continue
        taken.add(path)
        value = _shaped(got[0], rank)
        if layout == "interleaved" and info.arch in PERMUTED and info.heads:
            value = unpermute(value, int(info.heads if path.endswith("q_proj") else info.kv_heads))
        elif layout == "qkv" and info.heads:
            value = regroup_qkv(value, int(info.heads))
        x = None
        if inp not in (None, "ids"):
            src = _first(values, inp)
            x = None if src is None else _shaped(src[0], 3 if inp[0][1] == "heads" else 2)
            if x is not None and layout == "heads_first":
                x = np.swapaxes(x, 1, 2)
            x = None if x is None else torch.from_numpy(np.ascontiguousarray(x))
        if layout == "heads_first":
            value = np.swapaxes(value, 1, 2)
        y = torch.from_numpy(np.ascontiguousarray(value))
        dtype = info.norm_dtype(gamma) if gamma else info.matrix_dtype
        site = Site(y, "ids" if inp == "ids" else x, stated(gamma) if gamma else None, dtype)
        out.append(record_type(path, 0, site, y))
    for pattern, why in not_compared.items():
        for i in range(max(layers, 1)) if "{i}" in pattern else [None]:
            path = aligned(pattern.format(i=i))
            if path in paths and path not in taken:
                out.append(record_type(path, 0, NotCompared(why), None))
    return out


# ---------------------------------------------------------------------------------------------------- contracts


class Stated:
    """The contract a GGUF states at one norm, in the shape of an inference (``spec``, ``params``, ``evidence``):
    RMSNorm (or LayerNorm, with its β, for a LayerNorm architecture) over the last axis, the file's ε inside the
    square root, its γ tensor multiplied as stored (llama.cpp computes the norm in float32). The fields that only
    matter at 16-bit inputs (statistics, cast order, output and parameter dtypes) are not stated: they are taken
    as the reference's."""

    note = "the candidate's contract as its file states it (not probed: llama.cpp runs the whole graph)"

    def __init__(self, eps: float, gamma: np.ndarray, beta: np.ndarray | None = None, center: bool = False):
        self.eps, self.gamma, self.beta, self.center = eps, gamma, beta, center

    def as_inference(self, reference_spec):
        from ...results.inference import Confidence, Evidence
        from ...results.params import NormParams

        spec = reference_spec.replace(center=self.center, axes=(-1,), groups=None, group_axis=None, eps=self.eps,
                                      eps_placement="inside_sqrt", gamma=True, beta=self.beta is not None,
                                      param_axes=(-1,), gamma_offset=0.0, batch_stats=None)
        evidence = {"eps": Evidence("stated by the GGUF's metadata", {"eps": self.eps}),
                    "gamma_offset": Evidence("llama.cpp multiplies by the stored γ", {"effective_gamma": True},
                                             Confidence.FROM_PARAMETERS)}
        return _Inference(spec, NormParams(gamma=self.gamma, beta=self.beta), evidence)


class _Inference:
    __slots__ = ("spec", "params", "evidence")

    def __init__(self, spec, params, evidence):
        self.spec, self.params, self.evidence = spec, params, evidence


def stated_contracts(path: Path, info: FileInfo):
    """γ tensor name → :class:`Stated` for the norms of a GGUF (its ε as :func:`~normscope.artifacts.contract`
    reads it; LayerNorm with its β where the file's norms are LayerNorms)."""
    from ...artifacts.ggufread import read_gguf, tensor_values

    gguf = require("gguf", "gguf")
    contract = read_gguf(path, info.reader)
    eps = contract.eps
    layernorm = any(s.family == "layernorm" for s in contract.sites)
    tensors = {t.name: t for t in info.reader.tensors}

    def stated(name: str):
        t, b = tensors.get(f"{name}.weight"), tensors.get(f"{name}.bias")
        values = tensor_values(t, gguf) if t is not None and eps is not None else None
        beta = tensor_values(b, gguf) if b is not None else None
        return None if values is None else Stated(float(eps), values, beta, center=layernorm)

    return stated


# ---------------------------------------------------------------------------------------------------- candidate


class LlamaCppCandidate(Candidate):
    """A GGUF as llama.cpp runs it on the CPU (this module): ``"llama.cpp"`` (the reference written as a
    GGUF here) or a ``.gguf`` path. Its named graph tensors are the sites; where a site's input is named too (a
    norm reads the residual stream), its own error is the candidate's output against the reference's module on the
    candidate's own input; elsewhere the site is judged on its propagated error."""

    graph = True
    torch_modules = False
    rounding: dict = {}  # a quantized file's products: their activation rounding, by module path (.ggml_quant)
    runner = " on llama.cpp"
    scopes_label = "llama.cpp tensor names"
    bound_suffix = " (llama.cpp: its output against the reference's module on the candidate's own input)"

    def __init__(self, source, reference: torch.nn.Module, stack: contextlib.ExitStack):
        from ...extras import require

        require("llama_cpp", "llamacpp")
        ref_dtype = model_dtype(reference)
        if ref_dtype not in ("float32", "float64"):
            raise InputError(f"the reference is {ref_dtype}; llama.cpp computes in float32 (from the file's weights at "
                             "their own types), so a less precise reference would be the suspect, not the judge: "
                             "give a float32 reference (model.float())")
        super().__init__("", "float32")
        self.reference = reference
        self.modules = dict(reference.named_modules())
        if isinstance(source, str) and (source == "llama.cpp" or source.startswith("llama.cpp:")):
            import tempfile

            from ...artifacts.gguf_write import quantize_gguf, write_gguf

            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="normscope-gguf-"))
            self.path = write_gguf(reference, Path(folder) / "reference.gguf")
            if source != "llama.cpp":  # "llama.cpp:Q4_K_M": quantized by llama.cpp's own quantizer
                self.path = quantize_gguf(self.path, Path(folder) / "quantized.gguf", source.split(":", 1)[1])
            self.written_here = True
        else:
            self.path = Path(source)
            if not self.path.is_file():
                raise InputError(f"{source}: no such GGUF file")
            self.written_here = False
        self.values: dict = {}
        self.info = None
        self._last_twin: tuple | None = None  # (record, its twin output): see twin_output
        self.stack = stack

    def run(self, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            ids = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                        and not a.is_floating_point() and not a.is_complex()), None)
        if ids is None or ids.dim() not in (1, 2) or ids.is_floating_point():
            raise InputError("a llama.cpp candidate runs on token ids: give input_ids (batch × tokens) as the inputs")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and not bool((mask == 1).all()):
            self.notes.append("the attention mask has padding; llama.cpp decoded every token of each sample")
        self.values, self.info, self.desc, table = run_candidate(self.path, ids.reshape(-1, ids.shape[-1]).cpu())
        self.dtype = self.info.matrix_dtype
        if self.written_here:
            self.desc += ("; the GGUF written here from the reference (normscope.artifacts.write_gguf"
                          + (", quantized by llama.cpp)" if self.path.name == "quantized.gguf" else ")"))
        self._activations(table, args, kwargs)
        self._quantized()
        n_tok = int(ids.shape[-1])
        if self.info.arch == "phi3" and 0 < int(self.info.sliding_window) < n_tok:
            self.notes.append(f"the file states a sliding window of {self.info.sliding_window} tokens; llama.cpp runs "
                              f"Phi-3 without one, so on these {n_tok} tokens its attention differs from the model's")
        _, entries, _ = site_map(self.info)
        if len(entries) == 1:
            self.notes.append(f"llama.cpp's {self.info.arch!r} graph is not mapped to the model's modules here: only "
                              "the final output is compared (its sites are not judged)")

    def _activations(self, table, args, kwargs) -> None:
        """llama.cpp's GELU is its tanh approximation read from a float16 table (:func:`llama_gelu`): a transformation
        of the model's own tanh GELU that is llama.cpp's computation, not a divergence. For the whole comparison the
        reference's tanh GELU modules compute it so (restored after the diff), and a note says how far that alone
        moves the model's output; an exact (erf) GELU is another function, left as it is and named in a note."""
        if self.info.arch not in GELU_TABLE:
            return
        table = table if table is not None else gelu_table_computed()
        leaves = [m for m in {id(m): m for m in self.reference.modules()}.values()
                  if not any(True for _ in m.children()) and "gelu" in type(m).__name__.lower()]
        kinds = {id(m): gelu_kind(m) for m in leaves}
        other = sorted({f"{type(m).__name__} ({kinds[id(m)] or 'not a GELU probed here'})" for m in leaves
                        if kinds[id(m)] != "tanh"})
        if other:
            self.notes.append(f"llama.cpp computes GELU as its tanh approximation (from a float16 table); the model's "
                              f"activation {', '.join(other)} is another function, so the sites that hold it differ "
                              "by that approximation")
        tanh = [m for m in leaves if kinds[id(m)] == "tanh"]
        if not tanh:
            return
        layer_of: dict[int, set[int]] = {}
        for path, m in self.reference.named_modules(remove_duplicate=False):
            found = re.search(r"(?:^|\.)layers\.(\d+)\.", path)
            layer_of.setdefault(id(m), set()).add(int(found.group(1)) if found else -1)
        with torch.no_grad():
            before = primary(self.reference(*args, **kwargs))
        for m in tanh:
            layers = layer_of.get(id(m), set())
            near = None
            if len(layers) == 1 and min(layers) >= 0:  # llama.cpp's input to this GELU, for ties at the table's steps
                i = min(layers)
                got = _first(self.values, tuple((n.format(i=i), "first") for n in GELU_INPUT[self.info.arch]))
                near = None if got is None else torch.from_numpy(np.ascontiguousarray(_shaped(got[0], 2)))
            own = m.__dict__.get("forward")
            m.forward = functools.partial(_table_gelu, table=table, near=near)
            self.stack.callback(_restore_forward, m, own)
        with torch.no_grad():
            after = primary(self.reference(*args, **kwargs))
        moved = ""
        if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.shape == after.shape:
            d = float(torch.linalg.vector_norm((after - before).double()) / torch.linalg.vector_norm(before.double()))
            moved = f"; that alone moves the model's output by ‖Δ‖/‖r‖ = {sig(d)}"
        self.notes.append(f"llama.cpp computes GELU from a float16 table (its tanh approximation at the input rounded "
                          f"to float16, the value rounded to float16): the reference's {len(tanh)} tanh GELU "
                          f"module(s) compute it so throughout this comparison{moved}")

    def _quantized(self) -> None:
        """A quantized file's twin (:mod:`.ggml_quant`): the reference with the file's dequantized weights, rounding
        each product's input as ggml does; each site is then judged against it."""
        from .. import quantized
        from .ggml_quant import QUANTIZED, kind_of, quantized_weights, twin

        if not any(t in QUANTIZED for t in self.info.counts):
            return
        weights = quantized_weights(self.info, self.reference)
        self.twin, self.weight_faults, self.rounding = twin(self.reference, weights, self.stack)
        self._twin_modules = None
        self.quantized = {path: kind_of(e) for path, e in weights.items()}
        self.notes.extend(quantized.notes({p: e["type"] for p, e in weights.items()}))
        self.notes.append("llama.cpp rounds each matrix product's input to the weight type's activation type "
                          "(q8_0, q8_1, q8_K; float16 for an F16 matrix) before an integer dot product per block; the "
                          "reference run with the file's dequantized weights rounds them the same way")

    def _resolve_ties(self) -> None:
        """Each quantized product whose input and output are both graph tensors: the candidate's rounding at the
        ties of its input (:meth:`.ggml_quant.Rounding.resolve`)."""
        flips = 0
        for r in self.records:
            site = r.module
            if r.path in self.rounding and isinstance(site, Site) and isinstance(site.input, torch.Tensor):
                self.rounding[r.path].resolve(self.twin_modules[r.path], site.input, site.output)
                flips += self.rounding[r.path].flips
        if flips:
            self.notes.append(f"{flips} activation value(s) lay at a rounding tie of their block (within 2^-14 of a "
                              "midpoint) and were rounded the other way by llama.cpp; the twin takes llama.cpp's "
                              "rounding there")

    def align(self, ref_paths: list[str]) -> Alignment:
        stated = stated_contracts(self.path, self.info)
        self.records = records(self.values, self.info, ref_paths, Record, stated)
        if self.quantized:
            self._resolve_ties()
        self.cache_bytes = kept_bytes(self.records)
        self.values = {}
        return _Alignment(self.records, self.scopes_label, graph=True)

    def covered_by(self, name: str, names: list[str]) -> list[str]:
        """The sites that compute a module the graph holds no tensor of inside themselves, each judged on its own
        error against the reference's module there: every attention, for the rotary embedding (llama.cpp rotates
        inside the attention, on the positions); the MLP, for its activation (fused with the gate product)."""
        path = name.split("#")[0]  # a module called more than once: Gemma 3's rotary embedding, per layer kind
        r = next((r for r in self.records if r.path == path), None)
        if r is None or not isinstance(r.module, NotCompared):
            return []
        if path.endswith("rotary_emb"):
            return [n for n in names if n.split("#")[0].endswith((".self_attn", ".attention"))]
        parent = path.rsplit(".", 1)[0]
        return [parent] if parent.endswith(".mlp") and parent in names else []

    def twin_output(self, path: str, r: Record, args, kw, memo: Memo, kids=(), state=None):
        """The twin's module on the reference's inputs, run once per call: :meth:`own` measures against it and the
        walk then judges the same call with it."""
        if self._last_twin is not None and self._last_twin[0] is r:
            return self._last_twin[1]
        out = super().twin_output(path, r, args, kw, memo, kids, state)
        self._last_twin = (r, out)
        return out

    def matched(self, r: Record, y: torch.Tensor, path: str) -> str | None:
        if isinstance(r.module, NotCompared):
            return f"not compared: {r.module.why}"
        return None

    def own(self, r: Record, args, kw, memo: Memo, kids=(), state=None) -> tuple[torch.Tensor, str, Any]:
        site = r.module
        module = self.modules.get(r.path)
        if site.input is None or module is None:
            raise NotMeasured(None, missing="llama.cpp: this site's input is not a named tensor of its graph")
        if isinstance(site.input, str):  # the token ids: the reference's own input, so its own output is the site's
            return site.output, site.dtype, site.stated
        y_ref = None
        if self.quantized:  # against the twin: on the reference's input as the walk runs it, and on the candidate's
            module = self.twin_modules.get(r.path)
            y_ref, _ = self.twin_output(r.path, r, args, kw, memo, kids, state)
            if module is None or y_ref is None:
                raise NotMeasured(None, missing="llama.cpp: the dequantized twin could not run this module")
            ready = restored(args, kw, state)  # a fresh copy of the call's cache (the walk kept it)
            if isinstance(ready, str):
                raise NotMeasured(None, missing=f"llama.cpp: {ready}")
            call_args, call_kw = ready
        elif not (stateless(args) and stateless(kw)):  # running the module again would write to its cache
            raise NotMeasured(None, missing="llama.cpp: the reference's call takes a stateful argument (a cache "
                                            "object), so its module is not run again on the candidate's input")
        else:
            call_args, call_kw = args, kw
        at = input_at(args, kw, None)
        if at is None:
            raise NotMeasured(None, missing="llama.cpp: the reference's call has no tensor input")
        x_ref = (args if at[0] == "arg" else kw)[at[1]]
        if tuple(site.input.shape) != tuple(x_ref.shape):
            raise NotMeasured(None, missing=f"llama.cpp: its input {list(site.input.shape)} is not the reference's "
                                            f"{list(x_ref.shape)}")
        x_cand = site.input.to(x_ref.device, x_ref.dtype)
        swapped = list(call_args), dict(call_kw)
        swapped[0 if at[0] == "arg" else 1][at[1]] = x_cand
        with torch.no_grad():
            if y_ref is None:
                y_ref = primary(module(*args, **kw))
            y_on_cand = primary(module(*swapped[0], **swapped[1]))
        # the candidate's own error at this site, carried onto the reference's output to be judged like any other
        yc = y_ref.double() + (site.output.to(y_ref.device).double() - y_on_cand.double())
        return yc.to(y_ref.dtype), site.dtype, site.stated


def _table_gelu(x, *args, table, near, **kwargs):
    return llama_gelu(x, table, near)


def _restore_forward(module: torch.nn.Module, own) -> None:
    if own is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = own


def is_gguf(obj) -> bool:
    """A ``.gguf`` path, ``"llama.cpp"`` (the reference written as a GGUF) or ``"llama.cpp:Q4_K_M"`` (and then
    quantized by llama.cpp to that file type)."""
    return isinstance(obj, str | Path) and (str(obj) == "llama.cpp" or str(obj).startswith("llama.cpp:")
                                            or str(obj).lower().endswith(".gguf"))


def is_candidate(obj) -> bool:
    return is_gguf(obj)


def candidate(obj, reference, ref_dtype: str, stack) -> LlamaCppCandidate:
    return LlamaCppCandidate(obj, reference, stack)
