"""A model larger than memory, run from its files: :func:`streamed` builds a Hugging Face checkpoint's architecture
with its parameters on the meta device, and each module's weights are read from the safetensors files when it is
called, then let go when other weights need the room.

The unit read at a call is the module's subtree down to, not into, the elements of a ``ModuleList`` or
``Sequential`` (a model's blocks, a mixture's experts): entering the model reads its embeddings, final norm and head;
entering a block reads that block; a block's children are then resident already. What a running call read is
pinned until the call returns (a parent's code may use a child's weight directly); the rest is kept
least-recently-used within a budget of bytes, so a module called again soon after (a site run again on the
reference's inputs) is not read twice. Peak memory: what the running calls pinned plus the budget.

A copy of a streamed model (``copy.deepcopy``, :func:`normscope.model.private_copy`) is streamed too, from the same
files; a copy at another dtype reads its weights cast to that dtype. The hooks that load weights are process-wide
forward hooks that act only on streamed modules, registered once when the first streamed model is built.
"""

from __future__ import annotations

import collections
import contextlib
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError, TargetError

TAG = "_normscope_stream"
GIB = 1 << 30
MIN_BUDGET = 1 * GIB


class WeightFiles:
    """The tensors of a safetensors checkpoint (one file or the shards an index names): where each is, its dtype and
    shape, and a reader. Shared by every copy of a streamed model (a deep copy is the same object)."""

    def __init__(self, folder: Path):
        from ..extras import require

        safetensors = require("safetensors", "hf")
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            from ..loading import read_json_file

            weight_map = read_json_file(index, "a safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise InputError(f"{index} has no weight_map: it is not a safetensors index; write it again with "
                                 "save_pretrained")
            files = sorted({folder / str(f) for f in weight_map.values()})
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise InputError(f"{folder} holds no .safetensors files: streaming reads weights from safetensors; save "
                             "the model with save_pretrained(..., safe_serialization=True)")
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for f in files:
            if not f.is_file():
                raise InputError(f"{f} is named by {index.name} but is not there; copy the checkpoint again")
            try:
                with safetensors.safe_open(str(f), framework="pt") as h:
                    for key in h.keys():
                        s = h.get_slice(key)
                        self.where[key] = f
                        self.shapes[key] = (_dtype(s.get_dtype()), tuple(s.get_shape()))
            except Exception as exc:
                raise InputError(f"could not read the weights in {f}: {exc} — the safetensors file is truncated or "
                                 "not one; copy or download it again") from None
        self.nbytes = sum(math.prod(shape) * dt.itemsize for dt, shape in self.shapes.values())
        self.bytes_read = 0
        self.reads = 0

    def __deepcopy__(self, memo) -> WeightFiles:
        return self

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The tensors under ``keys``, each file opened once and closed after (its pages are not kept mapped)."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.where[k], []).append(k)
        out = {}
        for f, ks in by_file.items():
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in ks:
                        out[k] = h.get_tensor(k)
            except Exception as exc:
                raise TargetError(f"reading {', '.join(ks[:2])} from {f} failed: {type(exc).__name__}: {exc} — the "
                                  "checkpoint changed or was removed while it was streamed") from None
        self.bytes_read += sum(t.numel() * t.element_size() for t in out.values())
        self.reads += 1
        return out


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _dtype(name: str) -> torch.dtype:
    try:
        return _SAFETENSORS_DTYPES[name]
    except KeyError:
        raise InputError(f"a tensor stored as {name}: streaming reads floating and integer tensors only") from None


@dataclass
class Tag:
    """What a streamed module knows: its files and, for each of its own parameters, the key it is stored under."""

    files: WeightFiles
    keys: dict[str, str]
    listed: bool = False  # an element of a ModuleList/Sequential: its own unit, read when it is entered
    path: str = ""  # its module path in the streamed model (for progress)
    unit: tuple | None = field(default=None, repr=False, compare=False)  # (a weakref to its module, its unit)

    def __deepcopy__(self, memo) -> Tag:
        return Tag(self.files, dict(self.keys), self.listed, self.path)


def tag_of(module: torch.nn.Module) -> Tag | None:
    return module.__dict__.get(TAG)


def is_streamed(module: torch.nn.Module) -> bool:
    """Whether ``module`` (or a module inside it) reads its weights from its files when called."""
    return any(tag_of(m) is not None for m in module.modules())


@dataclass
class _Slot:
    module: Any  # a weakref to the module
    name: str
    meta: torch.nn.Parameter
    nbytes: int
    source: tuple[int, str]  # (id of its WeightFiles, its checkpoint key)
    pins: int = 0


class Residency:
    """The weights of every streamed module that are in memory now, least recently used first, with what the
    running calls pinned and the most ever held (``peak``); the bytes read are counted by each :class:`WeightFiles`."""

    def __init__(self):
        self.slots: collections.OrderedDict[tuple[int, str], _Slot] = collections.OrderedDict()
        self.by_source: dict[tuple[int, str], set[tuple[int, str]]] = {}  # the slots holding each stored tensor
        self.budget = MIN_BUDGET
        self.resident = 0
        self.pinned = 0  # the bytes of the slots a running call holds
        self.peak = 0
        self.stack: list[tuple[torch.nn.Module, list[tuple[int, str]]]] = []
        self.handles = None
        self.say = None  # a progress callback told of each unit read (set by Accounting)
        self.weightless: dict[int, int] = {}  # modules whose calls now need no weights (their forward replaced)

    def enter(self, module: torch.nn.Module, force: bool = False) -> None:
        if not force and self.weightless.get(id(module)):
            self.stack.append((module, []))
            return
        unit = _unit(module)
        missing: dict[int, list[tuple[torch.nn.Module, str, str]]] = {}
        for sub, name in unit:
            key = (id(sub), name)
            slot = self.slots.get(key)
            if not sub._parameters[name].is_meta:  # read already (or a copy made while it was)
                if slot is not None and slot.module() is sub:
                    self.slots.move_to_end(key)
                continue
            if slot is not None:  # its module is gone, or something put the meta parameter back (untouched())
                self._drop(key)
            tag = tag_of(sub)
            missing.setdefault(id(tag.files), []).append((sub, name, tag.keys[name]))
        for files_id, entries in missing.items():
            files = tag_of(entries[0][0]).files
            # a tensor another streamed module holds now (the reference's, for its copy at another dtype, run on the
            # same inputs right after it) is taken from memory, not read again
            held = {k: self._held((files_id, k), files.shapes[k][0]) for _, _, k in entries}
            unread = sorted({k for k, t in held.items() if t is None})
            if unread and self.say is not None:
                from ..inputs import human_bytes

                size = sum(math.prod(files.shapes[k][1]) * files.shapes[k][0].itemsize for k in unread)
                self.say(f"reading {tag_of(module).path or type(module).__name__} ({human_bytes(size)}) from "
                         f"{files.folder.name}")
            tensors = files.read(unread) if unread else {}
            for sub, name, k in entries:
                meta = sub._parameters[name]
                # a copy reads its own dtype; a tensor taken from another module is its own copy
                value = tensors[k].to(meta.dtype) if held[k] is None else held[k].to(meta.dtype, copy=True)
                sub._parameters[name] = torch.nn.Parameter(value, requires_grad=meta.requires_grad)
                nbytes = value.numel() * value.element_size()
                self.slots[(id(sub), name)] = _Slot(weakref.ref(sub), name, meta, nbytes, (files_id, k))
                self.by_source.setdefault((files_id, k), set()).add((id(sub), name))
                self.resident += nbytes
        keys = [(id(sub), name) for sub, name in unit if (id(sub), name) in self.slots]
        for key in keys:
            slot = self.slots[key]
            slot.pins += 1
            if slot.pins == 1:
                self.pinned += slot.nbytes
        self.stack.append((module, keys))
        self.peak = max(self.peak, self.resident)
        self.trim()

    def leave(self, module: torch.nn.Module) -> None:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] is module:
                _, keys = self.stack.pop(i)
                for key in keys:
                    slot = self.slots.get(key)
                    if slot is not None and slot.pins > 0:
                        slot.pins -= 1
                        if slot.pins == 0:
                            self.pinned -= slot.nbytes
                break
        self.trim()

    def _held(self, source: tuple[int, str], stored: torch.dtype) -> torch.Tensor | None:
        """The stored tensor ``source`` as a module holds it now at the dtype it is stored at (a copy cast to
        another dtype holds less than the file: never a source), or None."""
        for key in self.by_source.get(source, ()):
            slot = self.slots[key]
            sub = slot.module()
            p = sub._parameters.get(slot.name) if sub is not None else None
            if p is not None and not p.is_meta and p.dtype == stored:
                return p.detach()
        return None

    def trim(self) -> None:
        """Let go of the least recently used unpinned weights until what they take fits the budget."""
        for key in list(self.slots):
            if self.resident - self.pinned <= self.budget:
                break
            if self.slots[key].pins == 0:
                self._drop(key)

    def _drop(self, key) -> None:
        slot = self.slots.pop(key)
        self.resident -= slot.nbytes
        if slot.pins:
            self.pinned -= slot.nbytes
        holders = self.by_source.get(slot.source)
        if holders is not None:
            holders.discard(key)
            if not holders:
                del self.by_source[slot.source]
        sub = slot.module()
        if sub is not None and sub._parameters.get(slot.name) is not slot.meta:
            sub._parameters[slot.name] = slot.meta

    def release(self) -> None:
        """Let go of every weight read so far (a run is over); the pins of calls still running are kept."""
        for key in [k for k, s in self.slots.items() if s.pins == 0]:
            self._drop(key)


RESIDENCY = Residency()


@contextlib.contextmanager
def weightless(modules) -> Iterator[None]:
    """While the block runs, calls of ``modules`` read no weights (their forward is replaced: a replayed output)."""
    ids = [id(m) for m in modules]
    for i in ids:
        RESIDENCY.weightless[i] = RESIDENCY.weightless.get(i, 0) + 1
    try:
        yield
    finally:
        for i in ids:
            RESIDENCY.weightless[i] -= 1
            if not RESIDENCY.weightless[i]:
                del RESIDENCY.weightless[i]


@contextlib.contextmanager
def weights_of(module: torch.nn.Module) -> Iterator[None]:
    """``module``'s weights in memory while the block runs (a replaced forward that runs the module's own after
    all), whatever :func:`weightless` says; nothing for a module that is not streamed."""
    if TAG not in module.__dict__:
        yield
        return
    RESIDENCY.enter(module, force=True)
    try:
        yield
    finally:
        RESIDENCY.leave(module)


def _unit(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """The parameters a call of ``module`` reads: its subtree's, down to (not into) the listed elements below it."""
    tag = tag_of(module)
    if tag.unit is not None and tag.unit[0]() is module:
        return tag.unit[1]
    unit, todo = [], [module]
    while todo:
        m = todo.pop()
        t = tag_of(m)
        if t is not None:
            unit.extend((m, n) for n in t.keys if m._parameters.get(n) is not None)
        for child in m.children():
            ct = tag_of(child)
            if ct is not None and ct.listed:
                continue
            todo.append(child)
    tag.unit = (weakref.ref(module), unit)
    return unit


def _pre(module, args):
    if TAG in module.__dict__:
        RESIDENCY.enter(module)


def _post(module, args, output=None):
    if TAG in module.__dict__:
        RESIDENCY.leave(module)


def _install() -> None:
    if RESIDENCY.handles is None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        RESIDENCY.handles = (register_module_forward_pre_hook(_pre),
                             register_module_forward_hook(_post, always_call=True))


def _listed(model: torch.nn.Module) -> set[int]:
    out = set()
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList | torch.nn.Sequential):
            out.update(id(c) for n, c in m.named_children() if n.isdigit())
    return out


def checkpoint_bytes(folder: str | Path) -> int | None:
    """The bytes of a model directory's safetensors files (None: there are none)."""
    files = list(Path(folder).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def memory_available() -> int | None:
    """The memory this machine can still give (``MemAvailable``), or None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def streamed(folder: str | Path, budget: int | None = None) -> torch.nn.Module:
    """The model a Hugging Face directory (``config.json`` and safetensors weights) holds, with every parameter on
    the meta device and read from the files at its module's call (see the module docstring). ``budget``: the bytes
    of weights kept beyond what running calls pin (default: twice the largest unit, at least 1 GiB)."""
    from ..extras import require
    from ..sources import load_error, model_class, quiet_libraries

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise InputError(f"{folder} has no config.json: streaming builds the architecture from it; pass the model's "
                         "directory")
    files = WeightFiles(folder)
    transformers = require("transformers", "hf")
    accelerate = require("accelerate", "hf")
    with quiet_libraries():
        try:
            config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
            cls = model_class(transformers, config)
            # parameters on the meta device; buffers computed as the model computes them (rotary frequencies)
            with accelerate.init_empty_weights(include_buffers=False):
                model = cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
            # a head tied to the embeddings is stored once (tied outside init_empty_weights, which would make the
            # tied parameter a new one)
            if callable(getattr(model, "tie_weights", None)):
                model.tie_weights()
        except Exception as exc:
            raise load_error(exc, str(folder)) from None
    model.eval()
    _attach(model, files)
    _install()
    units = [sum(sub._parameters[n].numel() * sub._parameters[n].element_size() for sub, n in _unit(m))
             for m in model.modules() if m is model or tag_of(m).listed]
    RESIDENCY.budget = budget if budget is not None else max(RESIDENCY.budget, MIN_BUDGET, 2 * max(units))
    return model


def _attach(model: torch.nn.Module, files: WeightFiles) -> None:
    """Tag every module with the keys of its own parameters (checked against the files: present, same shape), turn
    each meta parameter to the dtype it is stored at, and load the persistent buffers the files hold."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    listed = _listed(model)
    missing, wrong = [], []
    converted: dict[int, torch.nn.Parameter] = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        keys = {}
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            full = f"{prefix}.{name}" if prefix else name
            key = full if full in files.shapes else next((a for a in aliases[id(p)] if a in files.shapes), None)
            if key is None:
                missing.append(full)
                continue
            dtype, shape = files.shapes[key]
            if shape != tuple(p.shape):
                wrong.append(f"{full} {list(p.shape)} (stored {list(shape)})")
                continue
            keys[name] = key
            if p.is_meta and dtype != p.dtype and dtype.is_floating_point:
                if id(p) not in converted:
                    converted[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"),
                                                          requires_grad=p.requires_grad)
                m._parameters[name] = converted[id(p)]
        for name, b in list(m._buffers.items()):
            full = f"{prefix}.{name}" if prefix else name
            if b is not None and full in files.shapes and name not in m._non_persistent_buffers_set:
                m._buffers[name] = files.read([full])[full].to(b.dtype if b.is_floating_point() else
                                                               files.shapes[full][0])
        m.__dict__[TAG] = Tag(files, keys, listed=id(m) in listed, path=prefix)
    if missing or wrong:
        what = (f"{len(missing)} parameters the files do not hold (first: {', '.join(missing[:3])})" if missing else
                f"{len(wrong)} parameters of another shape ({'; '.join(wrong[:2])})")
        raise InputError(f"{files.folder}: the architecture config.json describes has {what}; streaming reads each "
                         "parameter under its module path, as save_pretrained writes it: check that the config is "
                         "the weights' own, or load the model whole (without --stream) and let transformers rename "
                         "the keys")


SMALL_COPY_BYTES = 256 << 20  # a copy this small (a norm handed to infer) is read whole when it is made


def settle_copy(m: torch.nn.Module, dtype: torch.dtype | None) -> bool:
    """``m``, a deep copy of (part of) a streamed model, at ``dtype``: read whole now when it is small, so every tool
    sees plain tensors; else left streamed, its weights read at ``dtype``. Whether it is still streamed."""
    if not is_streamed(m):
        return False
    every = [(sub, n) for sub in m.modules() if tag_of(sub) is not None for n in tag_of(sub).keys
             if sub._parameters.get(n) is not None]
    converted: dict[int, torch.nn.Parameter] = {}
    small = sum(sub._parameters[n].numel() * (dtype or sub._parameters[n].dtype).itemsize
                for sub, n in every) <= SMALL_COPY_BYTES
    if small:  # what was resident when it was copied is kept (already at dtype); the rest is read now
        slots = [(sub, n) for sub, n in every if sub._parameters[n].is_meta]
        by_files: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for sub, n in slots:
            by_files.setdefault(id(tag_of(sub).files), []).append((sub, n))
        for entries in by_files.values():
            tensors = tag_of(entries[0][0]).files.read(sorted({tag_of(sub).keys[n] for sub, n in entries}))
            for sub, n in entries:
                p = sub._parameters[n]
                if id(p) not in converted:
                    value = tensors[tag_of(sub).keys[n]].to(dtype if dtype is not None and p.is_floating_point()
                                                            else p.dtype)
                    converted[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
                sub._parameters[n] = converted[id(p)]
        for sub in m.modules():
            sub.__dict__.pop(TAG, None)
        return False
    for sub, n in every:  # every weight read from the files when its call needs it, at dtype
        p = sub._parameters[n]
        if id(p) not in converted:
            to = dtype if dtype is not None and p.is_floating_point() else p.dtype
            converted[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=to, device="meta"),
                                                  requires_grad=p.requires_grad)
        sub._parameters[n] = converted[id(p)]
    return True


class Accounting:
    """What streaming read and held while a command ran on ``models`` (those streamed among them); on exit every
    weight read is let go. ``note()``: the account in words; ``stats``: the numbers."""

    def __init__(self, *models, say=None):
        self.files = {id(f): f for f in (files_of(m) for m in models if m is not None) if f is not None}
        self.stats: dict[str, Any] = {}
        self.say = say

    def __enter__(self) -> Accounting:
        self.before = {k: (f.bytes_read, f.reads) for k, f in self.files.items()}
        RESIDENCY.peak = RESIDENCY.resident
        RESIDENCY.say = self.say
        return self

    def __exit__(self, *exc) -> None:
        self.stats = {"checkpoint_bytes": sum(f.nbytes for f in self.files.values()),
                      "bytes_read": sum(f.bytes_read - self.before[k][0] for k, f in self.files.items()),
                      "reads": sum(f.reads - self.before[k][1] for k, f in self.files.items()),
                      "peak_resident_bytes": RESIDENCY.peak, "budget_bytes": RESIDENCY.budget}
        RESIDENCY.say = None
        RESIDENCY.release()

    def note(self) -> str:
        s = self.stats
        folders = ", ".join(str(f.folder) for f in self.files.values())
        from ..inputs import human_bytes

        if not s["reads"]:
            return (f"streamed from {folders}: nothing read during the run (its weights were read before it and "
                    f"still held); at most {human_bytes(s['peak_resident_bytes'])} of weights in memory at once")
        return (f"streamed from {folders}: {human_bytes(s['bytes_read'])} read in {s['reads']:,} reads (the files "
                f"hold {human_bytes(s['checkpoint_bytes'])}); at most {human_bytes(s['peak_resident_bytes'])} of "
                f"weights in memory at once (budget {human_bytes(s['budget_bytes'])} beyond the running calls)")


def files_of(module: torch.nn.Module) -> WeightFiles | None:
    """The files a streamed model reads (None: it is not streamed)."""
    tag = tag_of(module)
    return tag.files if tag is not None else None
