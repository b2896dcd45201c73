"""Random weights for a model built only to be read: fills done when read, large ones shared windows of a block.

A model that ``contract`` builds with values (its forward reads them) spends most of its build drawing random
numbers (every ``nn.Linear`` draws its weight in its constructor, and a Hugging Face model draws it again in
``post_init``) and most of its memory holding them: a wide model read at reduced depth is still gigabytes of
weights. Inside :func:`shared_draws`:

- a fill of a large CPU float tensor as a whole (``normal_``, ``uniform_``, ``torch.nn.init.trunc_normal_``,
  ``zero_``/``fill_``, the factories ``randn``, ``rand``, ``zeros``, ``ones``, ``full``) is recorded, not done,
  and so are the in-place elementwise scalings after it (``mul_``, ``add_``, ``clamp_``, ``erfinv_``…); a copy of
  a tensor whose fill is pending is a pending draw of its own;
- the first other operation that reads or writes such a tensor does its fill first, so everything the build
  computes from it is computed from values; a random fill is done as windows at random offsets of one block of
  independent draws (of the same distribution: scaled and shifted as asked), 2¹⁸ elements at a time, the offsets
  from torch's generator, so a seeded build is reproducible;
- :meth:`SharedDraws.share` then gives the model's parameters and buffers whose fill is still pending their values
  as views of one block per distinct fill (2²⁴ elements), at random offsets, instead of memory of their own: a
  tensor larger than the block overlaps itself row by row (row ``i`` starts ``i·step`` elements in), which an
  operator copies while it runs, except a matrix multiplication or a convolution under
  :func:`multiplied_in_pieces`, which copies a piece of rows (of output channels) at a time. A fill whose tensors
  together fit in one block is done as before.

Each window's or row's elements are independent draws of the distribution the model asked for; two tensors may
share values. A norm's contract does not depend on the weights before it: what the read needs of them is values
of the usual scale, no two rows alike, and the memory of a few blocks rather than of the model. Small tensors,
other devices and dtypes, and fills given a generator are done as usual, at once.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: elements per window (1 MiB of float32: a window is copied, scaled and shifted while it is in cache)
WINDOW = 1 << 18
#: tensors smaller than this are filled as usual, at once
LEAST = 1 << 16
#: elements of a shared block (64 MiB of float32)
BLOCK = 1 << 24
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

aten = torch.ops.aten
_DRAWS = {aten.normal_.default: "normal", aten.uniform_.default: "uniform"}
_FACTORIES = {aten.randn.default: ("normal", 0.0, 1.0), aten.rand.default: ("uniform", 0.0, 1.0),
              aten.zeros.default: ("fill", 0.0), aten.ones.default: ("fill", 1.0), aten.full.default: None}
#: fills with one value: ``zero_`` and ``fill_``
_CONSTANT_FILLS = {aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor}
#: in-place elementwise operations whose other arguments are scalars: recorded after a pending fill
_SCALINGS = {"mul_", "div_", "add_", "sub_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_", "neg_", "abs_"}
#: operations that read a tensor's shape, not its values
_SHAPE_ONLY = {getattr(aten, n).default for n in ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
                                                    "randn_like", "new_empty", "new_zeros", "new_ones", "new_full")}


@dataclass
class _Fill:
    """A fill recorded, not done: ``how`` is ``("normal", mean, std)``, ``("uniform", low, high)``,
    ``("trunc_normal", mean, std, low, high)`` or ``("fill", value)``; ``then`` the scalings recorded after it."""

    tensor: torch.Tensor  # holds the storage, so its address is not reused while the fill is pending
    how: tuple
    then: list = field(default_factory=list)
    patches: list = field(default_factory=list)  # constants written to part of it: (offset, shape, stride, value)

    def key(self) -> tuple:
        return (self.tensor.dtype, self.how, tuple((op, tuple(_plain(a) for a in args)) for op, args in self.then))


def _plain(value):
    return value.item() if isinstance(value, torch.Tensor) else value


def _constant(func, args) -> float:
    """The value a call of one of :data:`_CONSTANT_FILLS` writes."""
    return 0.0 if func is aten.zero_.default else _plain(args[1])


def _address(t: torch.Tensor) -> int | None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" or t.is_sparse:
        return None
    return t.untyped_storage().data_ptr() or None


def _whole(t: torch.Tensor) -> bool:
    """A large CPU float tensor that is all of its storage: the kind whose fill is recorded."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype in _FLOATS
            and t.numel() >= LEAST and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


class _Blocks:
    """One block of independent standard draws per distribution, 2·WINDOW elements, drawn on first use."""

    def __init__(self) -> None:
        self._blocks: dict[str, torch.Tensor] = {}

    def window_fill(self, t: torch.Tensor, kind: str, scale: float, shift: float) -> None:
        if kind not in self._blocks:
            self._blocks[kind] = torch.rand(2 * WINDOW) if kind == "uniform" else torch.randn(2 * WINDOW)
        block, flat = self._blocks[kind], t.view(-1)
        offsets = torch.randint(WINDOW, (-(-flat.numel() // WINDOW),)).tolist()
        with torch.no_grad():
            for i, off in enumerate(offsets):
                piece = flat[i * WINDOW:(i + 1) * WINDOW]
                piece.copy_(block[off:off + piece.numel()]).mul_(scale).add_(shift)


class SharedDraws(TorchDispatchMode):
    """The dispatch mode :func:`shared_draws` enters (see the module); :meth:`share` after the build."""

    def __init__(self, trunc_normal) -> None:
        super().__init__()
        self.pending: dict[int, _Fill] = {}
        self.blocks = _Blocks()
        self.shared_bytes = 0  # what the views given by share() would have held
        self._trunc_normal = trunc_normal  # torch's own, for a fill that is done
        self._off = False

    # -- recording ---------------------------------------------------------------------------------------------------
    def record(self, t: torch.Tensor, how: tuple) -> bool:
        """Record ``how`` as the pending fill of ``t`` (True), or leave it to be done at once (False)."""
        if self._off or not _whole(t):
            return False
        self.pending[_address(t)] = _Fill(t.detach(), how)  # an alias: whoever else holds the memory is counted
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._off:
            return func(*args, **kwargs)
        if (func in _FACTORIES and kwargs.get("layout") in (None, torch.strided)
                and (func is not aten.full.default or kwargs.get("dtype") is not None or isinstance(args[1], float))):
            how = _FACTORIES[func] or ("fill", _plain(args[1]))
            made = aten.empty.memory_format(args[0], **kwargs)
            if self.record(made, how):
                return made
            return func(*args, **kwargs)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        address = _address(first) if first is not None else None
        pending = self.pending.get(address) if address is not None else None
        if first is not None and _whole(first):
            if func in _DRAWS and kwargs.get("generator") is None:
                names = ("mean", "std") if func is aten.normal_.default else ("from", "to")
                given = [kwargs.get(n, d) for n, d in zip(names, (0.0, 1.0), strict=True)]
                low, high = (list(args[1:]) + given[len(args) - 1:])[:2]
                self.record(first, (_DRAWS[func], float(low), float(high)))
                return first
            if func in _CONSTANT_FILLS:
                self.record(first, ("fill", _constant(func, args)))
                return first
            if pending is not None:
                rest = list(args[1:]) + list(kwargs.values())
                if (func.overloadpacket.__name__ in _SCALINGS
                        and all(not isinstance(a, torch.Tensor) or a.dim() == 0 for a in rest)):
                    pending.then.append((func, tuple(a.clone() if isinstance(a, torch.Tensor) else a
                                                     for a in args[1:])))
                    return first
                if func is aten.clone.default:  # a copy of a pending draw: a draw of its own
                    made = aten.empty.memory_format(first.shape, dtype=first.dtype, device=first.device)
                    self.pending[_address(made)] = _Fill(made.detach(), pending.how, list(pending.then),
                                                         list(pending.patches))
                    return made
                if func is aten.copy_.default and _address(args[1]) != address:
                    del self.pending[address]  # overwritten as a whole
        if (pending is not None and func in _CONSTANT_FILLS
                and first.dtype == pending.tensor.dtype):  # a constant written to part of it (a padding row)
            pending.patches.append((first.storage_offset(), tuple(first.shape), first.stride(),
                                    _constant(func, args)))
            return first
        if self.pending and not func.is_view and func not in _SHAPE_ONLY:
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and (a := _address(t)) in self.pending:
                    self._do(self.pending.pop(a))
        return func(*args, **kwargs)

    # -- doing -------------------------------------------------------------------------------------------------------
    def _draw(self, t: torch.Tensor, fill: _Fill, shared: bool = False) -> None:
        """Do ``fill`` on ``t``; ``shared``: ``t`` is a shared block, drawn element by element (its windows would
        repeat the window block's values across rows), without the parts written to one tensor."""
        kind, *values = fill.how
        with torch.no_grad():
            if kind == "fill":
                t.fill_(values[0])
            elif kind == "trunc_normal":
                self._trunc_normal(t, *values)
            elif shared:
                getattr(t, f"{kind}_")(*values)
            elif kind == "uniform":
                self.blocks.window_fill(t, kind, values[1] - values[0], values[0])
            else:
                self.blocks.window_fill(t, kind, values[1], values[0])
            for op, args in fill.then:
                op(t, *args)
            for offset, shape, stride, value in () if shared else fill.patches:
                t.as_strided(shape, stride, t.storage_offset() + offset).fill_(value)

    @contextlib.contextmanager
    def _passing(self) -> Iterator[None]:
        """Within: operations pass through as they are (the mode's own fills and views)."""
        off, self._off = self._off, True
        try:
            yield
        finally:
            self._off = off

    def _do(self, fill: _Fill) -> None:
        with self._passing():
            self._draw(fill.tensor, fill)

    def share(self, model: torch.nn.Module) -> None:
        """Give the parameters and buffers of ``model`` whose fill is pending their values: views of one block per
        distinct fill where those of a fill do not fit in one block together, else a fill of their own. A block
        holds the largest of its tensors that an operator would copy whole if its rows overlapped (a tensor of two
        dimensions outside a ``linear``): an embedding's table, a ``linear``'s matrix and a convolution's kernel
        (read under :func:`multiplied_in_pieces`) and other stacks of three or more dimensions (experts' weights)
        overlap themselves, each row (an output channel's kernel, an expert's matrix) whole."""
        with self._passing():
            overlapping = _overlapping(model)
            groups: dict[tuple, dict[int, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
            for t in list(model.parameters()) + list(model.buffers()):
                fill = self.pending.get(_address(t)) if t.device.type == "cpu" else None
                if fill is not None and t.shape == fill.tensor.shape and t.dtype == fill.tensor.dtype:
                    groups[fill.key()][_address(t)].append(t)
            for by_address in groups.values():
                fills = [self.pending[a] for a in by_address]
                size = max(BLOCK, *(_least_block(f.tensor, any(id(t) in overlapping for t in by_address[a]))
                                    for a, f in zip(by_address, fills, strict=True)))
                if sum(f.tensor.numel() for f in fills) <= size:
                    continue
                block = torch.empty(size, dtype=fills[0].tensor.dtype)
                self._draw(block, fills[0], shared=True)
                for address, tensors in by_address.items():
                    view = _view(block, tensors[0].shape)
                    if view is None:
                        continue
                    for t in tensors:
                        t.data = view
                        t._normscope_shared_draws = True
                    self.shared_bytes += view.numel() * view.element_size()
                    del self.pending[address]
        self.finish()

    def finish(self) -> None:
        """Do every fill still pending of a tensor something besides this mode holds."""
        with self._passing():
            for fill in self.pending.values():
                if _held_elsewhere(fill.tensor):
                    self._draw(fill.tensor, fill)
            self.pending.clear()


def in_shared_block(t: torch.Tensor) -> bool:
    """Whether ``t`` was given a view of a block by :meth:`SharedDraws.share`: draws, not values anyone gave."""
    return bool(getattr(t, "_normscope_shared_draws", False))


def _least_block(t: torch.Tensor, overlapping: bool) -> int:
    """The size of block ``t`` needs: itself, or where its rows may overlap, a quarter more than one row (a row
    of a stack of experts is one expert's matrix: whole, and apart from the next)."""
    if not overlapping or t.dim() < 2:
        return t.numel()
    return t[0].numel() * 5 // 4 + 1


def _overlapping(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters whose rows may overlap in a shared block (see :meth:`SharedDraws.share`)."""
    out = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, torch.nn.Embedding | torch.nn.Linear) or p.dim() >= 3:
                out.add(id(p))
    return out


def _held_elsewhere(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    try:
        return torch._C._storage_Use_Count(storage._cdata) > 2  # the pending alias and the storage object just made
    except AttributeError:  # a torch without the count: do them all
        return True


def _view(block: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """A view of ``block`` shaped ``shape`` at a random offset: a window where it fits, else rows that overlap."""
    n = math.prod(shape)
    if n <= block.numel():
        offset = int(torch.randint(block.numel() - n + 1, ()))
        return block[offset:offset + n].view(shape)
    rows, width = shape[0], n // shape[0]
    step = (block.numel() - width) // (rows - 1) if rows > 1 and width <= block.numel() else 0
    if step < 1:
        return None
    inner = tuple(math.prod(shape[i + 1:]) for i in range(1, len(shape)))  # the rows' own strides: contiguous
    offset = int(torch.randint(block.numel() - (width + step * (rows - 1)) + 1, ()))
    return block.as_strided(shape, (step, *inner), offset)


def _rows_overlap(t: torch.Tensor) -> bool:
    """Whether a matrix (or a kernel, by its output channels) reads some elements twice: a view of a shared block
    whose rows (or a matrix's columns) overlap."""
    if t.dim() < 2 or t.numel() < LEAST or min(t.shape) < 2:
        return False
    if t.dim() > 2:
        return t.stride(0) < t[0].numel()
    (inner, inner_stride), (outer, outer_stride) = sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1])
    return inner_stride * inner > outer_stride


#: elements of one piece of a matrix copied whole (16 MiB of float32)
PIECE = 1 << 22


def _in_pieces(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with the matrix whose rows overlap copied a piece of rows at a time into one buffer (its rows are
    ``b``'s columns when it is on the right: a ``linear``'s ``x @ W.T``)."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.promote_types(a.dtype, b.dtype))
    right = _rows_overlap(b)
    rows = b.t() if right else a
    step = max(1, PIECE // rows.shape[1])
    buffer = torch.empty(min(step, rows.shape[0]), rows.shape[1], dtype=rows.dtype)
    for i in range(0, rows.shape[0], step):
        piece = buffer[:min(step, rows.shape[0] - i)]
        piece.copy_(rows[i:i + step])
        if right:
            out[:, i:i + step] = a @ piece.t()
        else:
            out[i:i + step] = piece @ b
    return out


class _MultipliedInPieces(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default and not kwargs and any(_rows_overlap(m) for m in args[:2]):
            return _in_pieces(*args)
        if (func is aten.convolution.default and _rows_overlap(args[1]) and not args[6] and args[8] == 1
                and not kwargs):  # by output channels: not transposed, not grouped
            x, weight, bias = args[:3]
            step = max(1, PIECE // weight[0].numel())
            return torch.cat([func(x, weight[j:j + step].contiguous(), None if bias is None else bias[j:j + step],
                                   *args[3:]) for j in range(0, weight.shape[0], step)], dim=1)
        if func is aten.addmm.default and any(_rows_overlap(m) for m in args[1:3]):
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            out = _in_pieces(args[1], args[2])
            if alpha != 1:
                out.mul_(alpha)
            return out.add_(args[0] if beta == 1 else args[0] * beta)
        return func(*args, **kwargs)


@contextlib.contextmanager
def multiplied_in_pieces(model: torch.nn.Module) -> Iterator[None]:
    """Within: a matrix multiplication or a convolution by one of ``model``'s shared matrices or kernels whose rows
    overlap (see the module) copies a piece of it at a time, not the whole; without one, nothing is
    intercepted."""
    layers = (m for m in model.modules() if isinstance(m, torch.nn.Linear | torch.nn.modules.conv._ConvNd))
    if not any(in_shared_block(m.weight) and _rows_overlap(m.weight) for m in layers):
        yield
        return
    with _MultipliedInPieces():
        yield


@contextlib.contextmanager
def shared_draws() -> Iterator[SharedDraws]:
    """Within: fills of large CPU float tensors recorded and done when read; ``share(model)`` after the build gives
    the pending ones views of shared blocks (see the module). On leaving, every fill still pending of a tensor in
    use is done."""
    import torch.nn.init as init

    trunc_normal = init.trunc_normal_
    mode = SharedDraws(trunc_normal)

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        if generator is None and mode.record(tensor, ("trunc_normal", float(mean), float(std), float(a), float(b))):
            return tensor
        return trunc_normal(tensor, mean, std, a, b, generator=generator)

    hf = _hf_init_functions()
    init.trunc_normal_ = trunc_normal_
    if hf is not None:
        hf["trunc_normal_"] = trunc_normal_
    try:
        with mode:
            yield mode
    finally:
        init.trunc_normal_ = trunc_normal
        if hf is not None:
            hf["trunc_normal_"] = trunc_normal
        mode.finish()


def _hf_init_functions() -> dict | None:
    """transformers' table of torch's init functions, which its guarded versions call (None without it)."""
    import sys

    module = sys.modules.get("transformers.initialization")
    table = getattr(module, "TORCH_INIT_FUNCTIONS", None)
    return table if isinstance(table, dict) and "trunc_normal_" in table else None
