"""The static contract of a GGUF file (llama.cpp), read memory-mapped with the ``gguf`` package.

A GGUF file states ε (``{arch}.attention.layer_norm_rms_epsilon`` for RMSNorm architectures,
``{arch}.attention.layer_norm_epsilon`` for LayerNorm ones), the number of blocks and one γ (and β) tensor
per norm, named by role (``blk.3.attn_norm``, ``blk.3.post_attention_norm``, ``output_norm``). llama.cpp
computes every norm with ε inside the square root and multiplies by the stored γ as is — its Gemma
converter stores 1 + w — so a GGUF site's γ offset is 0.

Before ``gguf.GGUFReader`` sees the file, a bounded walk checks every count and length in the header
against the bytes that are actually there: a hostile header cannot make the reader loop or allocate
without bound.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..extras import require
from ..loading import unreadable
from .model import ContractSite, ModelContract, value_stats
from .names import canonicalize, module_path, site_order, split_block

RMS_KEY = "{arch}.attention.layer_norm_rms_epsilon"
LN_KEY = "{arch}.attention.layer_norm_epsilon"
FAMILY = {
    "llama": "rmsnorm", "mistral": "rmsnorm", "qwen2": "rmsnorm", "qwen3": "rmsnorm", "gemma": "rmsnorm",
    "gemma2": "rmsnorm", "gemma3": "rmsnorm", "olmo2": "rmsnorm", "phi3": "rmsnorm",
    "gpt2": "layernorm", "bert": "layernorm", "phi2": "layernorm", "command-r": "layernorm", "gptneox": "layernorm",
    "falcon": "layernorm",
}
#: architectures whose llama.cpp graph always runs attention and the MLP on the block's one input (parallel)
PARALLEL = {"falcon"}
MAX_DIMS = 4
MAX_NESTING = 4
# value type → size in bytes (strings and arrays are variable)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _gguf():
    return require("gguf", "gguf")


class _Walk:
    """A bounds-checked pass over a GGUF header: every length and count is checked before it is used."""

    def __init__(self, path: Path, buf, quant_sizes: dict[int, tuple[int, int]]):
        self.path, self.buf, self.size, self.quant = path, buf, len(buf), quant_sizes
        self.order = "<"
        self.offs = 0
        self.alignment = 32

    def fail(self, what: str):
        raise InputError(f"{self.path}: malformed GGUF: {what}")

    def take(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if self.offs + n > self.size:
            self.fail(f"{what} at byte {self.offs} runs past the end of the file ({self.size} bytes)")
        value = struct.unpack_from(self.order + fmt, self.buf, self.offs)
        self.offs += n
        return value[0] if len(value) == 1 else value

    def string(self, what: str) -> bytes:
        n = self.take("Q", f"length of {what}")
        if n > self.size - self.offs:
            self.fail(f"{what} claims {n} bytes but only {self.size - self.offs} remain")
        out = bytes(self.buf[self.offs:self.offs + n])
        self.offs += n
        return out

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALAR:
            n = _SCALAR[vtype]
            if self.offs + n > self.size:
                self.fail(f"{what} runs past the end of the file")
            start = self.offs
            self.offs += n
            return start
        if vtype == _STRING:
            self.string(what)
            return None
        if vtype == _ARRAY:
            if depth >= MAX_NESTING:
                self.fail(f"{what} nests arrays more than {MAX_NESTING} deep")
            etype = self.take("I", f"element type of {what}")
            count = self.take("Q", f"length of {what}")
            least = _SCALAR.get(etype, 8 if etype in (_STRING, _ARRAY) else None)
            if least is None:
                self.fail(f"{what} has unknown element type {etype}")
            if count * least > self.size - self.offs:
                self.fail(f"{what} claims {count} elements but only {self.size - self.offs} bytes remain")
            if etype in _SCALAR:
                self.offs += count * least
            else:
                for _ in range(count):
                    self.value(etype, what, depth + 1)
            return None
        self.fail(f"{what} has unknown value type {vtype}")

    def run(self) -> None:
        if self.size < 24:
            self.fail(f"{self.size} bytes is shorter than a GGUF header (24 bytes)")
        if bytes(self.buf[:4]) != b"GGUF":
            self.fail("it does not start with the GGUF magic bytes (is it a GGUF file?)")
        self.offs = 4
        version = self.take("I", "version")
        if version & 0xFFFF == 0:
            self.order = ">"
            self.offs = 4
            version = self.take("I", "version")
        if version not in (2, 3):
            self.fail(f"version {version} (normscope reads GGUF versions 2 and 3)")
        n_tensors = self.take("Q", "tensor count")
        n_kv = self.take("Q", "metadata count")
        if n_kv * 13 > self.size - self.offs:  # key length (8) + ≥1 byte key + type (4)
            self.fail(f"the header claims {n_kv} metadata entries, more than {self.size - self.offs} bytes can hold")
        for i in range(n_kv):
            key = self.string(f"metadata key #{i}")
            vtype = self.take("I", f"type of {key!r}")
            start = self.value(vtype, f"metadata {key.decode('utf-8', 'replace')!r}")
            if key == b"general.alignment" and vtype == 4 and start is not None:
                self.alignment = struct.unpack_from(self.order + "I", self.buf, start)[0]
                if self.alignment == 0 or self.alignment & (self.alignment - 1):
                    self.fail(f"general.alignment {self.alignment} is not a power of two")
        if n_tensors * 24 > self.size - self.offs:  # name length (8) + n_dims (4) + type (4) + offset (8)
            self.fail(f"the header claims {n_tensors} tensors, more than {self.size - self.offs} bytes can hold")
        infos = []
        for i in range(n_tensors):
            name = self.string(f"name of tensor #{i}")
            n_dims = self.take("I", f"dimension count of tensor {name!r}")
            if n_dims > MAX_DIMS:
                self.fail(f"tensor {name.decode('utf-8', 'replace')!r} claims {n_dims} dimensions (at most {MAX_DIMS})")
            dims = [self.take("Q", f"dimensions of tensor {name!r}") for _ in range(n_dims)]
            ttype = self.take("I", f"type of tensor {name!r}")
            offset = self.take("Q", f"data offset of tensor {name!r}")
            infos.append((name, dims, ttype, offset))
        data_start = -(-self.offs // self.alignment) * self.alignment
        room = self.size - data_start
        for name, dims, ttype, offset in infos:
            label = name.decode("utf-8", "replace")
            if ttype not in self.quant:
                self.fail(f"tensor {label!r} has unknown type {ttype}")
            block, type_size = self.quant[ttype]
            n = 1
            for d in dims:
                n *= d
            if n % block:
                self.fail(f"tensor {label!r} has {n} elements, not a multiple of its block size {block}")
            nbytes = n // block * type_size
            if offset > room or nbytes > room - offset:
                self.fail(f"tensor {label!r} claims {nbytes} bytes at offset {offset}, past the end of the file "
                          f"(truncated?)")


def read_gguf(path: str | Path, reader=None) -> ModelContract:
    """The contract of a GGUF file; tensors stay memory-mapped, only norm weights are read. ``reader``: the file's
    ``gguf.GGUFReader`` where the caller holds one already (parsing a large vocabulary takes seconds)."""
    gguf = _gguf()
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size == 0:
                raise InputError(f"{path}: empty file, not a GGUF model")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _Walk(path, buf, {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}).run()
    except OSError as exc:
        raise unreadable(path, exc) from None
    if reader is not None:
        return _contract(path, reader, gguf)
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as exc:
        raise InputError(f"{path}: malformed GGUF: {exc}") from None
    return _contract(path, reader, gguf)


def _field(reader, key: str):
    field = reader.get_field(key)
    if field is None:
        return None
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


def _contract(path: Path, reader, gguf) -> ModelContract:
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InputError(f"{path}: the GGUF has no general.architecture")
    rms, ln = _field(reader, RMS_KEY.format(arch=arch)), _field(reader, LN_KEY.format(arch=arch))
    expected = FAMILY.get(arch)
    if expected == "rmsnorm" and rms is None or expected == "layernorm" and ln is None:
        key = (RMS_KEY if expected == "rmsnorm" else LN_KEY).format(arch=arch)
        raise InputError(f"{path}: no {key}: llama.cpp reads the ε of {arch}'s norms from that key")
    notes = []
    if expected is not None:
        family, eps, key = expected, (rms if expected == "rmsnorm" else ln), None
        key = (RMS_KEY if expected == "rmsnorm" else LN_KEY).format(arch=arch)
    elif rms is not None and ln is None:
        family, eps, key = "rmsnorm", rms, RMS_KEY.format(arch=arch)
    elif ln is not None and rms is None:
        family, eps, key = "layernorm", ln, LN_KEY.format(arch=arch)
    elif rms is None and ln is None:
        raise InputError(f"{path}: no ε: neither {RMS_KEY.format(arch=arch)} nor {LN_KEY.format(arch=arch)} is set")
    else:
        family, eps, key = None, None, None
        notes.append(f"architecture {arch!r} states both an RMSNorm ε ({rms}) and a LayerNorm ε ({ln}); which "
                     "norm uses which is not known")
    if eps is not None and (not isinstance(eps, float | int) or not eps >= 0):
        raise InputError(f"{path}: {key} must be a number ≥ 0; got {eps!r}")
    n_layers = _field(reader, f"{arch}.block_count")

    tensors = {t.name: t for t in reader.tensors}
    paths = sorted({module_path(n) for n in tensors})
    names = canonicalize(paths)
    sites = []
    for p in paths:
        name, layer, role = names[p]
        last = split_block(p)[1].rsplit(".", 1)[-1]
        if role is None and "norm" not in last:
            continue
        weight, bias = tensors.get(p + ".weight"), tensors.get(p + ".bias")
        if weight is None:
            continue
        dims = [int(d) for d in weight.shape]
        site = ContractSite(
            name=name, source=p, layer=layer, role=role, family=family,
            eps=float(eps) if eps is not None else None, eps_placement="inside_sqrt" if family else None,
            axes=(-1,), size=dims[0] if dims else None, gamma=True, beta=bias is not None, gamma_offset=0.0,
            param_shape=tuple(reversed(dims)),
        )
        if bias is not None and (b := tensor_values(bias, gguf)) is not None:
            site.beta_stats = value_stats(b)
        values = tensor_values(weight, gguf)
        if values is None:
            site.notes.append(f"γ stored as {weight.tensor_type.name}: statistics not read")
        else:
            site.gamma_stats = value_stats(values)
        sites.append(site)
    sites.sort(key=lambda s: site_order(s.name))
    if not sites:
        notes.append("no norm tensors found")
    parallel = _field(reader, f"{arch}.use_parallel_residual")  # llama.cpp's GPT-NeoX reads this flag
    out = ModelContract(source=str(path), kind="gguf", sites=sites, architecture=arch,
                        eps=float(eps) if eps is not None else None, eps_key=key,
                        n_layers=int(n_layers) if isinstance(n_layers, int) else None, notes=notes, weights=True)
    if parallel is True and out.placement == "pre":  # two pre norms read the one stream: the file says so
        out.stated_placement = "parallel"
        out.notes.append(f"placement parallel: {arch}.use_parallel_residual is true")
    elif arch in PARALLEL and out.placement == "pre":  # Falcon-40B's two norms (attn_norm, attn_norm_2) on one input
        out.stated_placement = "parallel"
        out.notes.append(f"placement parallel: llama.cpp's {arch} runs attention and the MLP on the block's input")
    return out


def tensor_values(tensor, gguf) -> np.ndarray | None:
    """A norm tensor's values as float64 (a small copy), or None for quantized storage."""
    t = gguf.GGMLQuantizationType
    if tensor.tensor_type in (t.F32, t.F16, t.F64):
        return np.asarray(tensor.data, dtype=np.float64).ravel()
    if tensor.tensor_type == t.BF16:
        raw = np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).astype(np.float64).ravel()
    return None
