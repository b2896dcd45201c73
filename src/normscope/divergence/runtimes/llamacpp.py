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

import contextlib
import ctypes
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import InputError, TargetError
from ...extras import require
from ..candidate import Alignment, Candidate, NotMeasured, kept_bytes
from ..execution import Memo, Record, input_at, model_dtype, primary, stateless

#: llama.cpp's tensor (name pattern, which of the tensors so named, its rank) → the Hugging Face module whose output
#: it is, the tensor that holds that module's input (None: not in the graph) and, at a norm, the GGUF tensor of its
#: γ. ``{i}``: the layer; ``{p}``: the layer before (the embedding for layer 0); ``{last}``: the last layer. Which
#: tensor: ``first``; ``proj`` — a projection with its bias, the last matrix product or addition so named before its
#: reshape into heads; ``heads`` — that reshape.
SITES = (
    ("embd", "first", 2, "model.embed_tokens", "ids", None),
    ("attn_norm-{i}", "first", 2, "model.layers.{i}.input_layernorm", "{p}", "blk.{i}.attn_norm"),
    ("Qcur-{i}", "proj", 2, "model.layers.{i}.self_attn.q_proj", ("attn_norm-{i}", "first"), None),
    ("Kcur-{i}", "proj", 2, "model.layers.{i}.self_attn.k_proj", ("attn_norm-{i}", "first"), None),
    ("Vcur-{i}", "proj", 2, "model.layers.{i}.self_attn.v_proj", ("attn_norm-{i}", "first"), None),
    ("Qcur_normed-{i}", "first", 3, "model.layers.{i}.self_attn.q_norm", ("Qcur-{i}", "heads"),
     "blk.{i}.attn_q_norm"),
    ("Kcur_normed-{i}", "first", 3, "model.layers.{i}.self_attn.k_norm", ("Kcur-{i}", "heads"),
     "blk.{i}.attn_k_norm"),
    ("attn_out-{i}", "first", 2, "model.layers.{i}.self_attn.o_proj", ("kqv_out-{i}", "first"), None),
    ("attn_out-{i}", "first", 2, "model.layers.{i}.self_attn", ("attn_norm-{i}", "first"), None),
    ("ffn_norm-{i}", "first", 2, "model.layers.{i}.post_attention_layernorm", ("ffn_inp-{i}", "first"),
     "blk.{i}.ffn_norm"),
    ("ffn_gate-{i}", "first", 2, "model.layers.{i}.mlp.gate_proj", ("ffn_norm-{i}", "first"), None),
    ("ffn_up-{i}", "first", 2, "model.layers.{i}.mlp.up_proj", ("ffn_norm-{i}", "first"), None),
    ("ffn_out-{i}", "first", 2, "model.layers.{i}.mlp.down_proj", ("ffn_swiglu-{i}", "first"), None),
    ("ffn_out-{i}", "first", 2, "model.layers.{i}.mlp", ("ffn_norm-{i}", "first"), None),
    ("l_out-{i}", "first", 2, "model.layers.{i}", "{p}", None),
    ("result_norm", "first", 2, "model.norm", ("l_out-{last}", "first"), "output_norm"),
    ("result_output", "first", 2, "lm_head", ("result_norm", "first"), None),
    ("result_output", "first", 2, "", None, None),
)
#: the tensor names (without their layer) the callback reads; everything else (attention scores, views, the
#: cache) is left in llama.cpp
WANTED = {"embd", "attn_norm", "Qcur", "Kcur", "Vcur", "Qcur_normed", "Kcur_normed", "kqv_out", "attn_out",
          "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out", "l_out", "result_norm",
          "result_output"}
#: weight types with a bound here: a 16-bit float's rounding (quantized blocks have none in the error model)
FLOAT_TYPES = ("F32", "F16", "BF16")
PERMUTED = ("llama",)  # architectures whose converter permutes Q/K to interleaved rotary pairs
_GGML_F32, _GGML_F16 = 0, 1


def is_gguf(obj) -> bool:
    return isinstance(obj, str | Path) and (str(obj) == "llama.cpp" or str(obj).lower().endswith(".gguf"))


def _layer_names(layers: int) -> list[tuple]:
    """Every (tensor, selector) the mapping reads, with its rank, site path, input tensor and γ tensor."""
    out = []
    for pattern, selector, rank, path, source, gamma in SITES:
        for i in range(layers) if "{i}" in pattern else [None]:
            name = pattern.format(i=i, last=layers - 1)
            inp = None
            if source == "ids":
                inp = "ids"  # the token ids: the reference's own input
            elif source == "{p}":
                inp = ("embd", "first") if i == 0 else (f"l_out-{i - 1}", "first")
            elif source is not None:
                inp = (source[0].format(i=i, last=layers - 1), source[1])
            out.append(((name, selector), rank, path.format(i=i) if i is not None else path, inp,
                        gamma.format(i=i) if gamma and i is not None else gamma))
    return out


def select(values: dict, name: str, selector: str):
    """The tensor ``selector`` names among those called ``name`` (``values``: (name, occurrence) → (array, op)), or
    None."""
    found = []
    while (name, len(found)) in values:
        found.append(values[(name, len(found))])
    if not found:
        return None
    if selector == "first":
        return found[0]
    cut = next((k for k, (_, op) in enumerate(found) if op == "RESHAPE"), len(found))
    if selector == "heads":
        return found[cut] if cut < len(found) else None
    proj = [v for v in found[:cut] if v[1] in ("MUL_MAT", "ADD")]  # "proj": its bias added where there is one
    return proj[-1] if proj else None


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


_LOG_SINK = None


def _quiet(lc) -> None:
    """llama.cpp's log lines off (they go to stderr otherwise); the callback object is kept alive here."""
    global _LOG_SINK
    if _LOG_SINK is None:
        _LOG_SINK = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(_LOG_SINK, ctypes.c_void_p())
        lc.llama_backend_init()


class FileInfo:
    """What the GGUF says of itself: its architecture, head counts, each tensor's storage type and how many of each."""

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


def run_candidate(path: Path, ids: torch.Tensor) -> tuple[dict, FileInfo, str]:
    """Each sample of ``ids`` (batch × tokens) decoded by llama.cpp; every (tensor name, occurrence) the mapping
    reads → (the per-sample arrays stacked on a batch axis, its op); what the file says of itself; a description."""
    lc = require("llama_cpp.llama_cpp", "llamacpp")
    info = FileInfo(path)
    other = sorted(t for t in info.counts if t not in FLOAT_TYPES)
    if other:
        raise InputError(f"{path}: weights stored as {', '.join(other)}: a quantized GGUF's rounding has no bound "
                         "in normscope's error model, so no site could be judged against one; diff a float "
                         "GGUF (F32, F16, BF16) of the same model, or compare this one's logits yourself")
    _quiet(lc)
    ggml = _Ggml()
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
        renamed: dict[str, str] = {}  # an unnamed output the mapping needs → the name it stands for
        pending: list[str] = []  # a kqv_out seen, its output projection not yet

        def wanted(name: str, op: str) -> bool:
            if " (" in name:
                return False  # views
            if name.startswith("node_"):
                if pending and op == "MUL_MAT":  # Qwen 3 leaves its output projection unnamed
                    renamed[name] = "attn_out-" + pending.pop()
                    return True
                return False
            base = name.rsplit("-", 1)[0] if re.search(r"-\d+$", name) else name
            if base == "kqv_out":
                pending[:] = [name.rsplit("-", 1)[1]]
            elif op == "MUL_MAT":
                pending.clear()
            return base in WANTED

        @lc.ggml_backend_sched_eval_callback
        def callback(t, ask, user_data):
            name = ggml.name(t).decode(errors="replace")
            if ask:
                return wanted(name, ggml.op_of(t).decode())
            name = renamed.get(name, name) if name.startswith("node_") else name
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
            for store in (seen, ops, renamed, pending):
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
    return stacked, info, desc


def unpermute(value: np.ndarray, heads: int) -> np.ndarray:
    """Interleaved rotary pairs (llama.cpp's Llama layout) → Hugging Face's rotate-half rows, on the last axis."""
    n = value.shape[-1]
    v = value.reshape(*value.shape[:-1], heads, n // heads // 2, 2)
    return np.swapaxes(v, -1, -2).reshape(value.shape)


def _shaped(value: np.ndarray, rank: int) -> np.ndarray:
    """(batch, ne3, ne2, ne1, ne0) → (batch, tokens, features) for a rank-2 tensor, (batch, tokens, heads, head
    size) for rank 3: the token axis kept even for a single token."""
    b, ne3, ne2, ne1, ne0 = value.shape
    return value.reshape(b, ne2 * ne3, ne1, ne0) if rank == 3 else value.reshape(b, ne1 * ne2 * ne3, ne0)


def records(values: dict, info: FileInfo, ref_paths: list[str], record_type, stated) -> list:
    """The sites the graph's tensors give, as records aligned to the reference's module paths (its ``model.``
    prefix found, or not), each with the candidate's input where the graph names it, the dtype it is judged at and,
    at a norm, the contract the file states there (``stated(γ tensor name)``)."""
    layers = 1 + max((int(m.group(1)) for k in values for m in [re.fullmatch(r"l_out-(\d+)", k[0])] if m),
                     default=-1)
    prefix = "" if any(p.startswith("model.") for p in ref_paths) else "model."
    paths = set(ref_paths)
    out = []
    for (name, selector), rank, path, inp, gamma in _layer_names(layers):
        got = select(values, name, selector)
        if got is None:
            continue
        path = path.removeprefix(prefix) if path else path
        if path and path not in paths:
            continue
        value = _shaped(got[0], rank)
        if info.arch in PERMUTED and info.heads and path.endswith(("q_proj", "k_proj")):
            value = unpermute(value, int(info.heads if path.endswith("q_proj") else info.kv_heads))
        x = None
        if inp not in (None, "ids"):
            src = select(values, *inp)
            rank_in = 3 if inp[1] == "heads" else 2
            x = None if src is None else torch.from_numpy(np.ascontiguousarray(_shaped(src[0], rank_in)))
        y = torch.from_numpy(np.ascontiguousarray(value))
        dtype = info.norm_dtype(gamma) if gamma else info.matrix_dtype
        site = Site(y, "ids" if inp == "ids" else x, stated(gamma) if gamma else None, dtype)
        out.append(record_type(path, 0, site, y))
    return out


class Stated:
    """The contract a GGUF states at one norm, in the shape of an inference (``spec``, ``params``, ``evidence``):
    RMSNorm over the last axis, the file's ε inside the square root, its γ tensor multiplied as stored (llama.cpp
    computes the norm in float32). The fields that only matter at 16-bit inputs (statistics, cast order, output
    and parameter dtypes) are not stated: they are taken as the reference's."""

    note = "the candidate's contract as its file states it (not probed: llama.cpp runs the whole graph)"

    def __init__(self, eps: float, gamma: np.ndarray):
        self.eps, self.gamma = eps, gamma

    def as_inference(self, reference_spec):
        from ...results.inference import Confidence, Evidence
        from ...results.params import NormParams

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


def stated_contracts(path: Path, info: FileInfo):
    """γ tensor name → :class:`Stated` for the norms of a GGUF (its ε as :func:`~normscope.artifacts.contract`
    reads it)."""
    from ...artifacts.ggufread import read_gguf, tensor_values

    gguf = require("gguf", "gguf")
    eps = read_gguf(path).eps
    tensors = {t.name.removesuffix(".weight"): t for t in info.reader.tensors if t.name.endswith(".weight")}

    def stated(name: str):
        t = tensors.get(name)
        values = tensor_values(t, gguf) if t is not None and eps is not None else None
        return None if values is None else Stated(float(eps), values)

    return stated


class LlamaCppCandidate(Candidate):
    """A GGUF as llama.cpp runs it on the CPU (this module): ``"llama.cpp"`` (the reference written as a
    GGUF here) or a ``.gguf`` path. Its named graph tensors are the sites; where a site's input is named too (a
    norm reads the residual stream), its own error is the candidate's output against the reference's module on the
    candidate's own input; elsewhere the site is judged on its propagated error."""

    graph = True
    torch_modules = False
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
        if isinstance(source, str) and source == "llama.cpp":
            import tempfile

            from ...artifacts.gguf_write import write_gguf

            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="normscope-gguf-"))
            self.path = write_gguf(reference, Path(folder) / "reference.gguf")
            self.written_here = True
        else:
            self.path = Path(source)
            if not self.path.is_file():
                raise InputError(f"{source}: no such GGUF file")
            self.written_here = False
        self.values: dict = {}
        self.info = None

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
        self.values, self.info, self.desc = run_candidate(self.path,
                                                                         ids.reshape(-1, ids.shape[-1]).cpu())
        self.dtype = self.info.matrix_dtype
        if self.written_here:
            self.desc += "; the GGUF written here from the reference (normscope.artifacts.write_gguf)"

    def align(self, ref_paths: list[str]) -> Alignment:
        stated = stated_contracts(self.path, self.info)
        self.records = records(self.values, self.info, ref_paths, Record, stated)
        self.cache_bytes = kept_bytes(self.records)
        self.values = {}
        return Alignment(self.records, self.scopes_label, graph=True)

    def own(self, r: Record, args, kw, memo: Memo, kids=(), state=None) -> tuple[torch.Tensor, str, Any]:
        site = r.module
        module = self.modules.get(r.path)
        if site.input is None or module is None:
            raise NotMeasured(None, missing="llama.cpp: this site's input is not a named tensor of its graph")
        if isinstance(site.input, str):  # the token ids: the reference's own input, so its own output is the site's
            return site.output, site.dtype, site.stated
        if not (stateless(args) and stateless(kw)):  # running the module again would write to its cache
            raise NotMeasured(None, missing="llama.cpp: the reference's call takes a stateful argument (a cache "
                                            "object), so its module is not run again on the candidate's input")
        at = input_at(args, kw, None)
        if at is None:
            raise NotMeasured(None, missing="llama.cpp: the reference's call has no tensor input")
        x_ref = (args if at[0] == "arg" else kw)[at[1]]
        if tuple(site.input.shape) != tuple(x_ref.shape):
            raise NotMeasured(None, missing=f"llama.cpp: its input {list(site.input.shape)} is not the reference's "
                                            f"{list(x_ref.shape)}")
        x_cand = site.input.to(x_ref.device, x_ref.dtype)
        swapped = list(args), dict(kw)
        swapped[0 if at[0] == "arg" else 1][at[1]] = x_cand
        with torch.no_grad():
            y_ref = primary(module(*args, **kw))
            y_on_cand = primary(module(*swapped[0], **swapped[1]))
        # the candidate's own error at this site, carried onto the reference's output to be judged like any other
        yc = y_ref.double() + (site.output.to(y_ref.device).double() - y_on_cand.double())
        return yc.to(y_ref.dtype), site.dtype, site.stated


def is_candidate(obj) -> bool:
    return is_gguf(obj)


def candidate(obj, reference, ref_dtype: str, stack) -> LlamaCppCandidate:
    return LlamaCppCandidate(obj, reference, stack)
