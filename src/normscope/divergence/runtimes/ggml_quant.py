"""A quantized GGUF in ``diff``: the twin llama.cpp's computation is held to.

A quantized GGUF's matrix products are not the dequantized weight's: ggml's CPU backend rounds the *activations*
too, to the weight type's ``vec_dot_type``, before an integer dot product per block (:data:`VEC_DOT`):

- ``q8_0`` (the weights ``Q4_0``, ``Q5_0``, ``Q8_0``): blocks of 32, ``d = amax/127`` stored as float16, each value
  ``round(x · 127/amax)``;
- ``q8_1`` (``Q4_1``, ``Q5_1``): the same values, with the block's sum ``s = d · Σq`` stored as float16, which the
  weight's per-block minimum multiplies;
- ``q8_K`` (the K-quants ``Q2_K`` … ``Q6_K``): blocks of 256 scaled by the value of largest magnitude,
  ``round(x · −127/max)``, capped at 127, ``d = 1/scale`` in float32;
- a float16 (bfloat16) matrix's activations are rounded to float16 (bfloat16).

The twin (:func:`twin`) is the reference with the file's own weights, dequantized by ggml's own row dequantizers
(the ``gguf`` package's where the library lacks one: :func:`dequantized`) and laid out as Hugging Face's (the
converter's permutations undone), whose linear modules round their input as ggml does
(:class:`Rounding`, a forward pre-hook; for ``q8_1`` a forward hook adds what the float16 block sum changes).
llama.cpp then computes the twin's products up to float32 summation order.

Ties: a value whose scaled form lies within :data:`TIE` of a rounding midpoint can round either way on another
CPU path (ggml's SIMD kernels compute ``127/amax`` or ``1/d``, round to even or away, and its repacked ``Q4_0``
kernels take other roads); both are faithful. Where a linear module's input and output are both tensors of
llama.cpp's graph, :meth:`Rounding.resolve` takes the candidate's rounding at those ties (the flips that best explain
its output, and only those); the twin then uses that rounding for any row within :data:`NEAR` of the candidate's
own input. No other element is ever taken from the candidate.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ...errors import InputError
from ...extras import require

#: weight type → the type ggml rounds the activations to before the product
VEC_DOT = {"Q4_0": "q8_0", "Q5_0": "q8_0", "Q8_0": "q8_0", "Q4_1": "q8_1", "Q5_1": "q8_1", "Q2_K": "q8_K",
           "Q3_K": "q8_K", "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K", "F16": "f16", "BF16": "bf16"}
#: the weight types this twin models; others (IQ*, TQ*, MXFP4…) are refused by name
QUANTIZED = tuple(t for t in VEC_DOT if t not in ("F16", "BF16"))
#: bits per weight value and the block (sub-block for the K-quants) one scale covers, for the weight check
BITS = {"Q4_0": (4, 32), "Q5_0": (5, 32), "Q8_0": (8, 32), "Q4_1": (4, 32), "Q5_1": (5, 32), "Q2_K": (2, 16),
        "Q3_K": (3, 16), "Q4_K": (4, 32), "Q5_K": (5, 32), "Q6_K": (6, 16)}
TIE = 2.0 ** -14  # a scaled activation this close to a rounding midpoint may round either way on another CPU path
NEAR = 2.0 ** -12  # a row within this (relative to its largest value) of the candidate's own input is that input


def round_activations(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``x`` (…, n) as ggml's ``kind`` holds it, dequantized (float32); with, for the 8-bit kinds, what each element
    would change by rounded the other way, and whether it lies at a tie (its scaled value within :data:`TIE` of a
    midpoint, where another CPU path may round it that other way)."""
    x = x.float()
    if kind == "f16":
        return x.half().float(), None, None
    if kind == "bf16":
        return x.bfloat16().float(), None, None
    size = 256 if kind == "q8_K" else 32
    n = x.shape[-1]
    if n % size:
        raise InputError(f"an activation of {n} values cannot be rounded to {kind} blocks of {size}")
    b = x.reshape(*x.shape[:-1], n // size, size)
    one = torch.ones((), dtype=b.dtype)
    if kind == "q8_K":
        at = b.abs().argmax(-1, keepdim=True)  # the first of largest magnitude, as ggml's strict comparison
        top = torch.gather(b, -1, at)
        scale = torch.where(top != 0, -127.0 / torch.where(top != 0, top, one), 0.0)
        t = b * scale
        q = torch.round(t).clamp(max=127)
        d = torch.where(top != 0, 1.0 / torch.where(scale != 0, scale, one), 0.0)
    else:
        amax = b.abs().amax(-1, keepdim=True)
        t = b * torch.where(amax != 0, 127.0 / torch.where(amax != 0, amax, one), 0.0)
        q = torch.round(t)
        d = (amax / 127.0).half().float()
    tie = ((t.abs() - t.abs().floor()) - 0.5).abs() <= TIE
    other = torch.sign(t - q) * d  # the other neighbour's value less this one's
    return (q * d).reshape(x.shape), other.reshape(x.shape), tie.reshape(x.shape)


def block_sum_error(x_deq: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``q8_1``: per block of 32, ggml's float16 sum ``fp16(d · Σq)`` (``d = amax/127`` in float32) less the sum the
    dequantized values make (``fp16(d) · Σq``): what a weight's per-block minimum multiplies beyond the twin's."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    d32 = b.abs().amax(-1) / 127.0
    d16 = d32.half().float()
    q_sum = torch.where(d16 != 0, x_deq.reshape(b.shape).sum(-1) / torch.where(d16 != 0, d16, torch.ones_like(d16)),
                        torch.zeros_like(d16)).round()
    return (d32 * q_sum).half().float() - d16 * q_sum


class Rounding:
    """The activation rounding of one quantized linear module of the twin (a forward pre-hook), with the
    candidate's rounding at ties where it was resolved (:meth:`resolve`)."""

    def __init__(self, kind: str, mins: torch.Tensor | None = None):
        self.kind, self.mins = kind, mins  # mins: q8_1 weights' per-block minimum (out × blocks)
        self.near: torch.Tensor | None = None  # the candidate's own input rows (rows × n)
        self.resolved: torch.Tensor | None = None  # their rounding, ties resolved (rows × n)
        self.flips = 0
        self._sum_error: torch.Tensor | None = None

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``'s rows as ggml rounds them, and the rows that rounding is of: a row near the candidate's own input
        (within :data:`NEAR`) is that input, with the candidate's rounding at its ties."""
        flat = x.reshape(-1, x.shape[-1]).float()
        y, _, _ = round_activations(flat, self.kind)
        if self.resolved is not None and self.near is not None and self.near.shape == flat.shape:
            scale = self.near.abs().amax(-1, keepdim=True).clamp(min=1e-30)
            near = ((flat - self.near).abs() <= NEAR * scale).all(-1, keepdim=True)
            y = torch.where(near, self.resolved, y)
            flat = torch.where(near, self.near, flat)
        return y, flat

    def pre(self, module, args):
        if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
            return None
        x = args[0]
        y, of = self.rows(x)
        if self.kind == "q8_1" and self.mins is not None:
            self._sum_error = block_sum_error(y, of)
        return (y.reshape(x.shape).to(x.dtype), *args[1:])

    def post(self, module, args, out):
        if self._sum_error is None or not isinstance(out, torch.Tensor):
            return None
        extra = (self._sum_error.double() @ self.mins.double().T).to(out.dtype)
        self._sum_error = None
        return out + extra.reshape(out.shape)

    def resolve(self, module: torch.nn.Module, x_cand: torch.Tensor, y_cand: torch.Tensor) -> None:
        """At each tie of the candidate's own input ``x_cand``, the rounding that explains its output ``y_cand``
        (the module's output there): the flips whose columns, by least squares, reduce the residual, kept only
        where they do. Kept as this module's rounding of any row near ``x_cand``."""
        if self.kind not in ("q8_0", "q8_1", "q8_K"):
            return
        flat = x_cand.reshape(-1, x_cand.shape[-1]).float()
        x_deq, other, tie = round_activations(flat, self.kind)
        w = module.weight.detach().float()
        if tuple(w.shape) != (y_cand.shape[-1], flat.shape[-1]):
            return
        with torch.no_grad():
            y_twin = module(x_cand.to(w.dtype))
        residual = y_cand.reshape(-1, w.shape[0]).double() - y_twin.reshape(-1, w.shape[0]).double()
        resolved = x_deq.clone()
        for row in torch.nonzero(tie.any(-1)).flatten().tolist():
            cols = torch.nonzero(tie[row]).flatten()
            basis = w[:, cols].double() * other[row, cols].double()  # out × ties: what each flip adds to the output
            coef = torch.linalg.lstsq(basis, residual[row].unsqueeze(-1)).solution.flatten()
            take = coef > 0.5
            if not bool(take.any()):
                continue
            if float((residual[row] - basis[:, take].sum(-1)).norm()) < float(residual[row].norm()):
                resolved[row, cols[take]] += other[row, cols[take]]
                self.flips += int(take.sum())
        self.near, self.resolved = flat, resolved


# ------------------------------------------------------------------------------------------------- the weights


def _undo_layout(value: np.ndarray, key: str, arch: str, heads: int | None, kv_heads: int | None) -> np.ndarray:
    """The converter's row permutation undone (rows: the output axis) by the inverses :mod:`.llamacpp` applies to a
    graph tensor's last axis: Llama's interleaved rotary pairs back to rotate-half, GPT-NeoX's all-queries-keys-values
    back to per head."""
    from .llamacpp import PERMUTED, regroup_qkv, unpermute

    if arch in PERMUTED and key.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")) and heads:
        h = int(heads if "q_proj" in key else kv_heads)
        return unpermute(value.swapaxes(0, -1), h).swapaxes(0, -1)
    if arch == "gptneox" and key.endswith("attention.query_key_value.weight") and heads:
        return regroup_qkv(value.swapaxes(0, -1), int(heads)).swapaxes(0, -1)
    return value


_DEQUANTIZE: dict[str, object] = {}


def _ggml_row_dequantizer(kind: str):
    """ggml's own ``dequantize_row_<type>`` (``(const void * blocks, float * out, int64_t n)``) from the library
    llama-cpp-python ships, or None where it is not there."""
    if kind not in _DEQUANTIZE:
        import ctypes
        from pathlib import Path

        fn = None
        try:
            lib_dir = Path(require("llama_cpp", "llamacpp").__file__).parent / "lib"
            found = sorted(lib_dir.glob("libggml-base.*")) or sorted(lib_dir.glob("libggml.*"))
            if found:
                fn = getattr(ctypes.CDLL(str(found[0])), f"dequantize_row_{kind[0].lower()}{kind[1:]}", None)
                if fn is not None:
                    fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        except (OSError, InputError):
            fn = None
        _DEQUANTIZE[kind] = fn
    return _DEQUANTIZE[kind]


def dequantized(t, gguf) -> np.ndarray:
    """A GGUF tensor's values as float32 (rows × columns): by ggml's own row dequantizer, rows split across threads
    (a foreign call releases the GIL), else by the ``gguf`` package's NumPy one."""
    kind = t.tensor_type.name
    raw = np.ascontiguousarray(t.data)
    if kind in ("F16", "BF16", "F32"):
        return gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32, copy=False)
    fn = _ggml_row_dequantizer(kind)
    if fn is None:
        return gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32)
    import concurrent.futures

    rows, cols = raw.shape[0], int(t.shape[0])
    out = np.empty((rows, cols), np.float32)
    step = max(1, -(-rows // (4 * max(1, torch.get_num_threads()))))

    def run(start: int) -> None:
        stop = min(rows, start + step)
        fn(raw[start:stop].ctypes.data, out[start:stop].ctypes.data, (stop - start) * cols)

    with concurrent.futures.ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        list(pool.map(run, range(0, rows, step)))
    return out


def _mins(t, gguf) -> np.ndarray | None:
    """A ``Q4_1``/``Q5_1`` tensor's per-block minimum (rows × blocks): the second float16 of each block."""
    if t.tensor_type.name not in ("Q4_1", "Q5_1"):
        return None
    _, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    raw = np.ascontiguousarray(t.data).reshape(int(t.shape[1]) if len(t.shape) > 1 else 1, -1, size)
    return raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)


def quantized_weights(info, reference: torch.nn.Module) -> dict[str, dict]:
    """Module path → {"weight": the dequantized weight in Hugging Face's layout, "type": its GGUF type, "mins":
    ``Q4_1``/``Q5_1`` block minima} for every quantized (or 16-bit float) matrix of the file; a tied output
    layer reads the embedding's tensor. Raises InputError for a type the twin does not model."""
    gguf = require("gguf", "gguf")
    tensors = {t.name: t for t in info.reader.tensors}
    unknown = sorted({t.tensor_type.name for t in tensors.values() if len(t.shape) >= 2
                      and t.tensor_type.name not in (*VEC_DOT, "F32")})
    if unknown:
        raise InputError(f"weights stored as {', '.join(unknown)}: diff models ggml's products for "
                         f"{', '.join(QUANTIZED)} (and F16/BF16/F32), not these; quantize the model to one of them "
                         "to compare it")
    arch_enum = getattr(gguf.MODEL_ARCH, info.arch.upper(), None)
    layers = 1 + max((int(n.split(".")[1]) for n in tensors if n.startswith("blk.")), default=-1)
    names = gguf.get_tensor_name_map(arch_enum, layers) if arch_enum is not None else None
    out: dict[str, dict] = {}
    # by module, not by state_dict: a tied output layer (Gemma's) is no key of its own there, nor a name of the
    # architecture's tensor map; it reads the tensor of the module whose weight it shares
    layers_with: dict[int, str] = {}
    found = []
    for path, module in reference.named_modules():
        p = getattr(module, "weight", None)
        if (isinstance(module, torch.nn.Linear | torch.nn.Embedding) and isinstance(p, torch.Tensor)
                and p.dim() == 2 and names is not None):
            name = names.get_name(f"{path}.weight", try_suffixes=(".weight", ".bias"))
            found.append((path, p, name))
            if name in tensors:
                layers_with.setdefault(id(p), name)
    for path, p, name in found:
        key = f"{path}.weight"
        if name is None or name not in tensors:
            name = layers_with.get(id(p), name)
        if name is None:
            continue
        t = tensors.get(name)  # the name with its suffix (``blk.0.attn_q.weight``)
        if t is None and name == "output.weight":  # no output tensor: llama.cpp reads the embedding
            t = tensors.get("token_embd.weight")
        if t is None or t.tensor_type.name not in VEC_DOT:
            continue
        mins = _mins(t, gguf)
        if mins is not None:
            mins = _undo_layout(mins, key, info.arch, info.heads, info.kv_heads)
        out[path] = {"load": functools.partial(_weight, t, key, tuple(p.shape), info, gguf), "type": t.tensor_type.name,
                     "mins": None if mins is None else torch.from_numpy(np.ascontiguousarray(mins)),
                     "tensor": t.name}
    return out


def _weight(t, key: str, shape: tuple, info, gguf) -> torch.Tensor:
    """A tensor of the file dequantized, in Hugging Face's layout (read when the twin takes it, one at a time)."""
    value = dequantized(t, gguf)
    value = value.reshape(shape) if value.size == math.prod(shape) else value
    return torch.from_numpy(np.ascontiguousarray(_undo_layout(value, key, info.arch, info.heads, info.kv_heads)))


#: a dequantized weight may lie this many steps from the reference's (the K-quants' scale search clips outliers)
STEPS = 4.0


def step_of(w: torch.Tensor, kind: str) -> torch.Tensor:
    """One quantization step per element of a dequantized weight (float32): its block's (sub-block's) range over
    the type's levels; a 16-bit float's: 2⁻¹⁰ of the value."""
    if kind not in BITS:
        return w.abs() * 2.0 ** -10
    bits, size = BITS[kind]
    rows, n = w.shape
    b = w.reshape(rows, n // size, size) if n % size == 0 else w.reshape(rows, 1, n)
    spread = (b.amax(-1, keepdim=True) - b.amin(-1, keepdim=True)) / (2 ** bits - 1)
    return spread.expand_as(b).reshape(w.shape)


def weight_fault(w: torch.Tensor, reference: torch.Tensor, kind: str) -> str | None:
    """None when every element of the dequantized weight ``w`` lies within :data:`STEPS` of its block's steps
    (:func:`step_of`; the K-quants choose each block's scale and minimum by a search that may clip its outliers) of
    the reference's, else where and by how much not (:func:`..quantized.step_fault`). In float32, one pass
    over the weight; the double-precision account only when it fails."""
    from ..quantized import step_fault

    ref = reference.detach().float().reshape(w.shape)
    step = step_of(w, kind)
    allowed = STEPS * step + 2.0 ** -10 * ref.abs() + 1e-30
    if bool(((w - ref).abs() <= allowed).all()):
        return None
    return step_fault(w, ref.double(), allowed.double(), step.double())


def kind_of(entry: dict) -> str:
    return f"{entry['type']} ({entry['tensor']}; activations rounded to {VEC_DOT[entry['type']]})"


def twin(reference: torch.nn.Module, weights: dict[str, dict], stack) -> tuple[torch.nn.Module, dict[str, str],
                                                                            dict[str, Rounding]]:
    """The reference with the file's dequantized weights, its linear modules rounding their inputs as ggml does;
    the modules whose weights are not the reference's, quantized (why); each linear module's :class:`Rounding`."""
    from ..quantized import dequantized_twin

    def fault(path, w, ref_w):
        return weight_fault(w, ref_w, weights[path]["type"])

    each = ((path, (e["load"](), kind_of(e))) for path, e in weights.items())  # dequantized as the twin takes it
    model, faults = dequantized_twin(reference, torch.float32, each, fault)
    modules = dict(model.named_modules())
    rounding: dict[str, Rounding] = {}
    for path, e in weights.items():
        m = modules.get(path)
        if not isinstance(m, torch.nn.Linear):
            continue  # an embedding's rows are dequantized as they are read: nothing rounds its input
        r = Rounding(VEC_DOT[e["type"]], e["mins"])
        rounding[path] = r
        h1 = m.register_forward_pre_hook(r.pre)
        h2 = m.register_forward_hook(r.post)
        stack.callback(h1.remove)
        stack.callback(h2.remove)
    return model, faults, rounding
