"""A llama.cpp candidate in ``diff``: a GGUF file as llama.cpp runs it, its named intermediate tensors mapped to the
torch sites.

The candidate is a ``.gguf`` path, or ``"llama.cpp"``: the reference written as a GGUF here
(:func:`normscope.artifacts.gguf_write.write_gguf`) and run by llama.cpp. The file is loaded through
llama-cpp-python's low-level API on the CPU, with a context whose K/V cache is float32 and flash attention off
(llama.cpp's defaults, an f16 cache, would put a 16-bit rounding into every attention site of an fp32
reference). Each sample of the batch is decoded alone (a fresh sequence), with logits for every token. The
graph-evaluation callback (the mechanism of llama.cpp's eval-callback example) reads every tensor the
mapping names once it is computed (``attn_norm-0``, ``ffn_out-0``, ``l_out-0``, ``result_norm``…; a name
given to several tensors of a layer keeps each, in order).

Sites: llama.cpp's graph names a tensor per role, not per module; :data:`SITES` says which Hugging Face module's
output each one is, and which tensor holds that module's input (a norm's input is the residual stream, also
named). Own errors: where a site's input is recorded too, the reference's module is run on the *candidate's*
input, and the candidate's output differs from that by the site's own error (``cand − ref(x_cand)``, added to
the reference's output to be judged like any other). Elsewhere the site is judged on its propagated error.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError, TargetError
from ..extras import require

#: llama.cpp's tensor (name pattern, which of the tensors so named, its op) → the Hugging Face module whose output it
#: is, the tensor that holds that module's input (None: not in the graph) and, at a norm, the GGUF tensor of its γ.
#: ``{i}``: the layer; ``{p}``: the layer before (the embedding for layer 0); ``{last}``: the last layer.
SITES = (
    ("embd", 0, "GET_ROWS", "model.embed_tokens", "ids", None),
    ("attn_norm-{i}", 0, None, "model.layers.{i}.input_layernorm", "{p}", "blk.{i}.attn_norm"),
    ("Qcur-{i}", 0, "MUL_MAT", "model.layers.{i}.self_attn.q_proj", ("attn_norm-{i}", 0), None),
    ("Kcur-{i}", 0, "MUL_MAT", "model.layers.{i}.self_attn.k_proj", ("attn_norm-{i}", 0), None),
    ("Vcur-{i}", 0, "MUL_MAT", "model.layers.{i}.self_attn.v_proj", ("attn_norm-{i}", 0), None),
    ("Qcur_normed-{i}", 0, None, "model.layers.{i}.self_attn.q_norm", ("Qcur-{i}", 1), "blk.{i}.attn_q_norm"),
    ("Kcur_normed-{i}", 0, None, "model.layers.{i}.self_attn.k_norm", ("Kcur-{i}", 1), "blk.{i}.attn_k_norm"),
    ("attn_out-{i}", 0, None, "model.layers.{i}.self_attn.o_proj", ("kqv_out-{i}", 0), None),
    ("attn_out-{i}", 0, None, "model.layers.{i}.self_attn", ("attn_norm-{i}", 0), None),
    ("ffn_norm-{i}", 0, None, "model.layers.{i}.post_attention_layernorm", ("ffn_inp-{i}", 0), "blk.{i}.ffn_norm"),
    ("ffn_gate-{i}", 0, None, "model.layers.{i}.mlp.gate_proj", ("ffn_norm-{i}", 0), None),
    ("ffn_up-{i}", 0, None, "model.layers.{i}.mlp.up_proj", ("ffn_norm-{i}", 0), None),
    ("ffn_out-{i}", 0, None, "model.layers.{i}.mlp.down_proj", ("ffn_swiglu-{i}", 0), None),
    ("ffn_out-{i}", 0, None, "model.layers.{i}.mlp", ("ffn_norm-{i}", 0), None),
    ("l_out-{i}", 0, None, "model.layers.{i}", "{p}", None),
    ("result_norm", 0, None, "model.norm", ("l_out-{last}", 0), "output_norm"),
    ("result_output", 0, None, "lm_head", ("result_norm", 0), None),
    ("result_output", 0, None, "", None, None),
)
#: weight types with a bound here: a 16-bit float's rounding (quantized blocks have none in the error model)
FLOAT_TYPES = ("F32", "F16", "BF16")
PERMUTED = ("llama",)  # architectures whose converter permutes Q/K to interleaved rotary pairs
_GGML_F32, _GGML_F16 = 0, 1


def is_gguf(obj) -> bool:
    return isinstance(obj, str | Path) and (str(obj) == "llama.cpp" or str(obj).lower().endswith(".gguf"))


def _layer_names(layers: int) -> list[tuple]:
    """Every (tensor, occurrence) the mapping reads, with its op filter, site path, input tensor and γ tensor."""
    out = []
    for pattern, occurrence, op, path, source, gamma in SITES:
        for i in range(layers) if "{i}" in pattern else [None]:
            fill = {"i": i, "last": layers - 1}
            name = pattern.format(**fill) if i is not None else pattern.format(last=layers - 1)
            inp = None
            if source == "ids":
                inp = "ids"  # the token ids: the reference's own input
            elif source == "{p}":
                inp = ("embd", 0) if i == 0 else (f"l_out-{i - 1}", 0)
            elif source is not None:
                inp = (source[0].format(i=i, last=layers - 1), source[1])
            out.append(((name, occurrence), op, path.format(i=i) if i is not None else path, inp,
                        gamma.format(i=i) if gamma and i is not None else gamma))
    return out


class _Ggml:
    """The few ggml functions the evaluation callback needs, from the libraries llama-cpp-python ships."""

    def __init__(self):
        lib_dir = Path(require("llama_cpp", "llamacpp").__file__).parent / "lib"
        candidates = sorted(lib_dir.glob("libggml-base.*")) or sorted(lib_dir.glob("libggml.*"))
        if not candidates:
            raise TargetError(f"llama-cpp-python's ggml library is not in {lib_dir}")
        base = ctypes.CDLL(str(candidates[0]))
        self.name = base.ggml_get_name
        self.name.restype, self.name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        self.op = base.ggml_op_name
        self.op.restype, self.op.argtypes = ctypes.c_char_p, [ctypes.c_int]
        self.op_of = base.ggml_op_desc
        self.op_of.restype, self.op_of.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        self.contiguous = base.ggml_is_contiguous
        self.contiguous.restype, self.contiguous.argtypes = ctypes.c_bool, [ctypes.c_void_p]
        self.nbytes = base.ggml_nbytes
        self.nbytes.restype, self.nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
        self.get = base.ggml_backend_tensor_get
        self.get.restype = None
        self.get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]

    def read(self, t: int) -> np.ndarray | None:
        """A computed tensor's values as float32, shaped (ne3, ne2, ne1, ne0) without its unit dims; None when it
        is not a contiguous f32/f16 tensor. ``type`` and ``ne`` are read at their fixed offsets of ggml_tensor
        (an enum, then the buffer pointer, then ne[4])."""
        kind = ctypes.c_int32.from_address(t).value
        if kind not in (_GGML_F32, _GGML_F16) or not self.contiguous(t):
            return None
        ne = list((ctypes.c_int64 * 4).from_address(t + 16))
        out = np.empty(int(np.prod(ne)), np.float32 if kind == _GGML_F32 else np.float16)
        if out.nbytes != self.nbytes(t):
            return None
        self.get(t, out.ctypes.data, 0, out.nbytes)
        shape = [d for d in reversed(ne)]
        while len(shape) > 1 and shape[0] == 1:
            shape.pop(0)
        return out.reshape(shape).astype(np.float32)


_LOG_SINK = None


def _quiet(lc) -> None:
    """llama.cpp's log lines off (they go to stderr otherwise); the callback object is kept alive here."""
    global _LOG_SINK
    if _LOG_SINK is None:
        _LOG_SINK = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(_LOG_SINK, ctypes.c_void_p())
        lc.llama_backend_init()


def weight_types(path: Path) -> tuple[str, dict[str, int]]:
    """(architecture, weight type → how many tensors) of a GGUF, read with the ``gguf`` package."""
    gguf = require("gguf", "gguf")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:
        raise InputError(f"{path}: not a readable GGUF ({type(exc).__name__}: {exc})") from None
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return arch or "?", types


class Site:
    """A llama.cpp site: the candidate's output there and, when the graph names it, its input (``"ids"``: the token
    ids, the reference's own input)."""

    __slots__ = ("output", "input", "stated")

    def __init__(self, output: torch.Tensor, inp: torch.Tensor | None, stated=None):
        self.output, self.input, self.stated = output, inp, stated


def run_candidate(path: Path, ids: torch.Tensor) -> tuple[dict, str, str]:
    """Each sample of ``ids`` (batch × tokens) decoded by llama.cpp; every (tensor name, occurrence) → the
    per-sample arrays stacked on a batch axis; the architecture; and a description."""
    lc = require("llama_cpp.llama_cpp", "llamacpp")
    arch, types = weight_types(path)
    other = sorted(t for t in types if t not in FLOAT_TYPES)
    if other:
        raise InputError(f"{path}: weights stored as {', '.join(other)}: a quantized GGUF's rounding has no bound "
                         "in normscope's error model, so no site could be judged against one; diff a float "
                         "GGUF (F32, F16, BF16) of the same model, or compare this one's logits yourself")
    _quiet(lc)
    ggml = _Ggml()
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    if not model:
        raise TargetError(f"llama.cpp could not load {path} (architecture {arch!r}; its log is silenced: run "
                          "llama.cpp on it to see why)")
    n_tok = int(ids.shape[-1])
    seen: dict[str, list[np.ndarray]] = {}
    ops: dict[str, list[str]] = {}
    order: list[tuple[str, int]] = []  # (name, occurrence) in the order computed

    @lc.ggml_backend_sched_eval_callback
    def callback(t, ask, user_data):
        if ask:
            return True  # every tensor: the names are only known once computed
        name = ggml.name(t).decode(errors="replace")
        if " (" in name or name.startswith("cache_"):
            return True  # views and the K/V cache
        value = ggml.read(t)
        if value is not None:
            order.append((name, len(seen.get(name, ()))))
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
        lc.llama_model_free(model)
        raise TargetError(f"llama.cpp could not create a context for {path}")
    per_sample: list[dict[tuple[str, int], np.ndarray]] = []
    batch = lc.llama_batch_init(n_tok, 0, 1)
    try:
        for row in ids.reshape(-1, n_tok).tolist():
            seen.clear()
            ops.clear()
            order.clear()
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            for j, tok in enumerate(row):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = int(tok), j, 1
                batch.seq_id[j][0], batch.logits[j] = 0, 1
            batch.n_tokens = n_tok
            code = lc.llama_decode(ctx, batch)
            if code != 0:
                raise TargetError(f"llama.cpp's decode returned {code} on {path}")
            sample = {}
            for name, values in seen.items():
                for k, v in enumerate(values):
                    sample[(name, k)] = (v, ops[name][k])
            _unnamed_outputs(sample, order)
            per_sample.append(sample)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    keys = set.intersection(*(set(s) for s in per_sample)) if per_sample else set()
    stacked = {k: (np.stack([s[k][0] for s in per_sample]), per_sample[0][k][1]) for k in keys}
    weights = ", ".join(f"{n} {t}" for t, n in sorted(types.items()))
    desc = (f"llama.cpp (llama-cpp-python {require('llama_cpp', 'llamacpp').__version__}) CPU, {path.name} "
            f"({arch}; tensors: {weights}), f32 K/V cache, flash attention off")
    return stacked, arch, desc


def _unnamed_outputs(sample: dict, order: list[tuple[str, int]]) -> None:
    """Outputs some architectures leave unnamed (Qwen 3's output projection is ``node_32``): the first matrix
    product computed after ``kqv_out-{i}`` is that layer's ``attn_out-{i}``."""
    for at, key in enumerate(order):
        m = re.fullmatch(r"kqv_out-(\d+)", key[0])
        if m is None or (f"attn_out-{m.group(1)}", 0) in sample:
            continue
        nxt = next((k for k in order[at + 1:] if sample[k][1] == "MUL_MAT"), None)
        if nxt is not None and nxt[0].startswith("node_"):
            sample[(f"attn_out-{m.group(1)}", 0)] = sample[nxt]


def unpermute(value: np.ndarray, heads: int) -> np.ndarray:
    """Interleaved rotary pairs (llama.cpp's Llama layout) → Hugging Face's rotate-half rows, on the last axis."""
    n = value.shape[-1]
    v = value.reshape(*value.shape[:-1], heads, n // heads // 2, 2)
    return np.swapaxes(v, -1, -2).reshape(value.shape)


def records(values: dict, arch: str, ref_paths: list[str], heads: tuple[int, int] | None, record_type,
            stated) -> list:
    """The sites the graph's tensors give, as records aligned to the reference's module paths (its ``model.``
    prefix found, or not), each with the candidate's input where the graph names it and, at a norm, the contract
    the file states there (``stated(γ tensor name)``)."""
    layers = 1 + max((int(m.group(1)) for k in values for m in [re.fullmatch(r"l_out-(\d+)", k[0])] if m),
                     default=-1)
    prefix = "" if any(p.startswith("model.") for p in ref_paths) else "model."
    paths = set(ref_paths)
    out = []
    for key, op, path, inp, gamma in _layer_names(layers):
        if key not in values:
            continue
        value, got_op = values[key]
        if op is not None and got_op != op:
            continue
        path = path.removeprefix(prefix) if path else path
        if path and path not in paths:
            continue
        if heads is not None and arch in PERMUTED and path.endswith(("q_proj", "k_proj")):
            value = unpermute(value, heads[0] if path.endswith("q_proj") else heads[1])
        x = values.get(inp, (None,))[0] if inp not in (None, "ids") else None
        y = torch.from_numpy(np.ascontiguousarray(value))
        site = Site(y, "ids" if inp == "ids" else None if x is None else torch.from_numpy(np.ascontiguousarray(x)),
                    stated(gamma) if gamma else None)
        out.append(record_type(path, 0, site, y))
    return out


class Stated:
    """The contract a GGUF states at one norm, in the shape of an inference (``spec``, ``params``, ``evidence``):
    RMSNorm over the last axis, the file's ε inside the square root, its γ tensor multiplied as stored (llama.cpp
    computes the norm in float32). The fields that only matter at 16-bit inputs (statistics, cast order, output
    and parameter dtypes) are not stated: they are taken as the reference's."""

    def __init__(self, eps: float, gamma: np.ndarray):
        self.eps, self.gamma = eps, gamma

    def as_inference(self, reference_spec):
        from ..results.inference import Confidence, Evidence
        from ..results.params import NormParams

        spec = reference_spec.replace(center=False, axes=(-1,), groups=None, group_axis=None, eps=self.eps,
                                      eps_placement="inside_sqrt", gamma=True, beta=False, param_axes=(-1,),
                                      gamma_offset=0.0, batch_stats=None)
        evidence = {"eps": Evidence("stated by the GGUF's metadata", {"eps": self.eps}),
                    "gamma_offset": Evidence("llama.cpp multiplies by the stored γ", {"effective_gamma": True},
                                             Confidence.FROM_PARAMETERS)}
        return _Inference(spec, NormParams(gamma=self.gamma), evidence)


class _Inference:
    __slots__ = ("spec", "params", "evidence")

    def __init__(self, spec, params, evidence):
        self.spec, self.params, self.evidence = spec, params, evidence


def stated_contracts(path: Path):
    """γ tensor name → :class:`Stated` for the norms of a GGUF (its ε from the metadata)."""
    from ..artifacts.ggufread import read_gguf

    gguf = require("gguf", "gguf")
    contract = read_gguf(path)
    reader = gguf.GGUFReader(str(path), "r")
    tensors = {t.name.removesuffix(".weight"): t for t in reader.tensors if t.name.endswith(".weight")}

    def stated(name: str):
        t = tensors.get(name)
        if t is None or contract.eps is None or t.tensor_type.name not in FLOAT_TYPES:
            return None
        values = np.asarray(t.data, dtype=np.float64).ravel() if t.tensor_type.name != "BF16" else (
            (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64).ravel())
        return Stated(float(contract.eps), values)

    return stated
