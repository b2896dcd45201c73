"""A candidate run sharded over the ranks of a ``torch.distributed`` process group — tensor and sequence parallelism
with DTensor (``parallelize_module``), FSDP2 (``fully_shard``) — against the single-process reference every rank holds.

Every rank calls ``diff(reference, candidate)`` with the same reference (checked: a checksum of its parameters is
compared across ranks) and the same inputs (rank 0's are broadcast). The candidate's forward runs sharded; at each
module call its output is mapped back to the full tensor: a DTensor by ``full_tensor()``, a plain tensor (a
parallel style's local output) by gathering every rank's piece and placing the pieces where the reference's output
says they belong — the same values on every rank (replicated), or split along the one dimension whose sizes add up
to the reference's. Teacher forcing gives each candidate module the reference's input laid out as its own was (a
DTensor with the same placements, or this rank's piece), and a parent's replayed children return the reference's
output laid out as theirs was. Every rank takes the same decisions from the same gathered numbers, so the
collectives stay in step. A norm whose statistics cover one shard, a γ sharded where it must be replicated, a
reduction left partial: each is a module whose own output, mapped back, is not the reference's — named at its site.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import InputError
from ..model import private_copy, untouched
from .candidate import NotMeasured, TorchCandidate
from .execution import Record, Replay, input_of, primary, restored, site_name


def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters (tensor parallelism or FSDP2) in an initialized process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    dtensor = _dtensor()
    return any(isinstance(p, dtensor) for p in module.parameters())


def _fsdp_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        return None
    return FSDPModule


def kinds(module: torch.nn.Module) -> list[str]:
    """How ``module`` is sharded, in words: FSDP2, tensor parallel (DTensor parameters outside FSDP's units)."""
    fsdp = _fsdp_class()
    dtensor = _dtensor()
    units = [m for m in module.modules() if fsdp is not None and isinstance(m, fsdp)]
    managed = {id(p) for u in units for p in u.parameters()}
    out = ["FSDP2"] if units else []
    if any(isinstance(p, dtensor) and id(p) not in managed for p in module.parameters()) or any(
            _tensor_parallel_in(u) for u in units):
        out.append("tensor parallel")
    return out


def _tensor_parallel_in(unit) -> bool:
    """Whether an FSDP unit shards parameters that were DTensors already (tensor parallel inside FSDP2)."""
    try:
        group = unit._get_fsdp_state()._fsdp_param_group
        return group is not None and any(getattr(p, "is_dtensor", False) for p in group.fsdp_params)
    except AttributeError:  # another torch's private layout: FSDP2 alone is said
        return False


def model_name(module: torch.nn.Module) -> str:
    """The class a model was built as (FSDP2 renames it ``FSDP<class>``)."""
    fsdp = _fsdp_class()
    if fsdp is not None and isinstance(module, fsdp):
        return next(c for c in type(module).__mro__ if not issubclass(c, fsdp)).__name__
    return type(module).__name__


def _gather_pieces(t: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    world = dist.get_world_size()
    # clone(): a collective's result may still be in flight (an AsyncCollectiveTensor waits on an op, not a view)
    mine = t.detach().clone().contiguous()
    shapes: list[Any] = [None] * world
    dist.all_gather_object(shapes, (tuple(mine.shape), str(mine.dtype)))
    if all(s == shapes[0] for s in shapes):  # the usual case: the pieces travel as tensors, on their device
        pieces = [torch.empty_like(mine) for _ in range(world)]
        try:
            dist.all_gather(pieces, mine)
            return [p.to("cpu") for p in pieces]
        except (RuntimeError, TypeError, ValueError):  # a dtype the backend does not carry: every rank alike
            pass
    objects: list[Any] = [None] * world  # uneven pieces: pickled
    dist.all_gather_object(objects, mine.to("cpu"))
    return objects


def full_of(t) -> torch.Tensor:
    """A DTensor's full value, leaving it as it was: a pending sum is reduced as a plain sum of this rank's value
    (a row-wise embedding's partial holds a mask — the rows of ids outside this rank's shard — that its own
    reduction consumes, and the module's output hook reduces it after this: the mask is applied here to a copy)."""
    placements = list(t.placements)
    if any(p.is_partial() for p in placements):
        from torch.distributed.tensor import DTensor, Partial

        local = t.to_local()
        for i, p in enumerate(placements):
            if p.is_partial():
                mask = getattr(getattr(p, "mask_buffer", None), "data", None)
                if mask is not None:
                    local = local.clone()
                    local[mask] = 0.0
                placements[i] = Partial(p.reduce_op)
        t = DTensor.from_local(local, t.device_mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
    return t.full_tensor().detach()


def distinct(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The ranks' pieces without repeats, in rank order: the ranks of other groups of a mesh of several dimensions
    (data-parallel replicas of a tensor-parallel group) hold the same pieces again."""
    out: list[torch.Tensor] = []
    for p in pieces:
        if not any(q.shape == p.shape and torch.equal(q, p) for q in out):
            out.append(p)
    return out


def _layout_of(t, pieces: list[torch.Tensor] | None = None) -> tuple:
    """How a tensor sits on this rank: ("dtensor", mesh, placements), or ("local", its shape, the index of its piece
    among the ranks' distinct pieces, their number) — ``pieces``: every rank's, when gathered."""
    if isinstance(t, _dtensor()):
        return ("dtensor", t.device_mesh, tuple(t.placements))
    if pieces is None:
        return ("local", tuple(t.shape), 0, 1)
    import torch.distributed as dist

    unique = distinct(pieces)
    mine = pieces[dist.get_rank()]
    index = next(i for i, q in enumerate(unique) if q.shape == mine.shape and torch.equal(q, mine))
    return ("local", tuple(t.shape), index, len(unique))


def assemble(pieces: list[torch.Tensor], shape) -> tuple[torch.Tensor, str]:
    """The full tensor every rank's piece belongs to, given the reference's ``shape``, and how it was laid out:
    the same everywhere (replicated), split along one dimension, or full-shaped pieces that differ (rank 0's is
    taken, so every rank decides alike: a partial sum left unreduced, ranks that drifted apart)."""
    shape = tuple(shape)
    pieces = distinct(pieces) if len(pieces) > 1 else pieces
    first = pieces[0]
    if all(p.shape == first.shape for p in pieces) and all(torch.equal(p, first) for p in pieces[1:]):
        if tuple(first.shape) == shape:
            return first, "replicated"
    for d in range(len(shape)):
        if all(p.dim() == len(shape) for p in pieces) and sum(p.shape[d] for p in pieces) == shape[d] and all(
                p.shape[:d] == shape[:d] and p.shape[d + 1:] == shape[d + 1:] for p in pieces):
            return torch.cat(pieces, d), f"sharded on dim {d}"
    if tuple(first.shape) == shape:
        return first, "different on each rank (rank 0's compared)"
    return first, f"pieces of shape {list(first.shape)} that make no {list(shape)}"


def _local(x: torch.Tensor, layout: tuple) -> torch.Tensor:
    """The reference's full ``x`` laid out as a candidate tensor was (``layout``)."""
    if layout[0] == "dtensor":
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

        mesh, placements = layout[1], list(layout[2])
        if mesh.ndim != 1:
            return distribute_tensor(x.detach(), mesh, placements)
        (p,) = placements
        local = mesh.get_local_rank()
        if isinstance(p, Shard):
            piece = torch.chunk(x.detach(), mesh.size(), p.dim)[local].contiguous()
        elif isinstance(p, Replicate):
            piece = x.detach()
        elif isinstance(p, Partial):  # a pending sum: the value on one rank, zeros on the others
            piece = x.detach() if local == 0 else torch.zeros_like(x)
            placements = [Partial(p.reduce_op)]  # not a masked embedding's partial: its mask was its own call's
        else:
            return distribute_tensor(x.detach(), mesh, placements)
        return DTensor.from_local(piece, mesh, placements, run_check=False, shape=x.shape, stride=x.stride())
    _, shape, index, count = layout
    if tuple(x.shape) == tuple(shape) or x.dim() != len(shape) or count < 2:
        return x
    for d in range(x.dim()):
        if x.shape[d] != shape[d]:
            pieces = torch.chunk(x, count, d)
            if len(pieces) == count and tuple(pieces[index].shape) == tuple(shape):
                return pieces[index].contiguous()
    return x


def _floating(args, kw) -> list[tuple[str, Any]]:
    out = [("arg", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return out + [("kw", k) for k, v in kw.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]


class ShardedCandidate(TorchCandidate):
    """A torch module whose parameters are DTensors, run by every rank of the process group (see the module
    docstring)."""

    def __init__(self, candidate: torch.nn.Module, reference: torch.nn.Module, ref_dtype: str, stack):
        import torch.distributed as dist

        from .execution import model_dtype

        stack.enter_context(untouched(candidate))
        dtype = model_dtype(candidate)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        how = " and ".join(kinds(candidate)) or "DTensor parameters"
        super().__init__(candidate.eval(), f"{model_name(candidate)} sharded over {self.world} ranks ({how})",
                         dtype, ref_dtype)
        self.inputs_in: dict[tuple[str, int], list[tuple]] = {}  # a call's floating arguments, as laid out
        self.outputs_out: dict[str, tuple] = {}  # a site's primary output as its forward returned it
        self.pending: dict[tuple[str, int], list[torch.Tensor]] = {}  # plain outputs: every rank's piece
        self.modules = dict(candidate.named_modules())
        fsdp = _fsdp_class()
        self.fsdp = {p for p, m in self.modules.items() if fsdp is not None and isinstance(m, fsdp)}
        if dtype != ref_dtype:
            self.twin = private_copy(reference, dtype=getattr(torch, dtype))
        self.notes.append(f"sharded candidate: every module's output mapped back to the full tensor from the "
                          f"{self.world} ranks' pieces (rank {self.rank} of {self.world} reports)")

    # ------------------------------------------------------------------ its own forward
    def run(self, args, kwargs) -> None:
        def pre(module, path, number, a, kw):
            # a plain input's piece index among the ranks' (a teacher-forced run hands this rank that piece)
            tensors = [(a if w == "arg" else kw)[k] for w, k in _floating(a, kw)]
            self.inputs_in[(path, number)] = [_layout_of(t, None if isinstance(t, _dtensor()) else _gather_pieces(t))
                                              for t in tensors]

        def post(module, path, number, a, kw, output):
            t = primary(output)
            kept = None
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                if isinstance(t, _dtensor()):
                    self.outputs_out[site_name(path, number)] = _layout_of(t)
                    kept = full_of(t)
                else:
                    pieces = _gather_pieces(t)
                    self.outputs_out[site_name(path, number)] = _layout_of(t, pieces)
                    self.pending[(path, number)] = pieces
                    kept = pieces[0]
            x = input_of(a, kw, t if isinstance(t, torch.Tensor) else None)
            self.records.append(Record(path, number, module, kept, x.dtype if x is not None else None))

        hooks = self.forward(args, kwargs, pre, post)
        # an output that could not be mapped back is a site without a counterpart: say why
        self.notes.extend(f"not mapped back to the full tensor at {e}" for e in hooks.errors[:5])

    def matched(self, r: Record, y: torch.Tensor, path: str) -> str | None:
        pieces = self.pending.pop((r.path, r.number), None)
        if pieces is None:
            return None
        r.output, how = assemble(pieces, y.shape)
        r.version, r.shape = r.output._version, list(r.output.shape)
        if how.startswith("pieces of shape"):  # not a layout this knows how to undo: not compared, never a pass
            return (f"not compared: the ranks' {how} (the reference's output); a layout of pieces this diff cannot "
                    "map back to the full tensor")
        return None

    # ------------------------------------------------------------------ one site on the reference's inputs
    def _full(self, t, shape) -> torch.Tensor:
        if isinstance(t, _dtensor()):
            return full_of(t)
        return assemble(_gather_pieces(t), shape)[0]

    def _kid_view(self, kid, out):
        layout = self.outputs_out.get(kid.name)
        y = primary(out)
        if layout is None or not isinstance(y, torch.Tensor):
            return out
        local = _local(y, layout)
        if isinstance(out, torch.Tensor):
            return local
        if isinstance(out, tuple | list):
            items = [local if o is y else o for o in out]
            return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
        if isinstance(out, Mapping):  # a Hugging Face ModelOutput
            items = {k: (local if v is y else v) for k, v in out.items()}
            return type(out)(**items) if type(out) is not dict else items
        return out

    @contextlib.contextmanager
    def _unsharded(self, path: str):
        """The FSDP unit that holds ``path``'s parameters gathered while it runs alone (its own unit's hooks do
        that when it is one)."""
        owner = next((p for p in sorted(self.fsdp, key=len, reverse=True)
                      if p != path and (p == "" or path.startswith(p + "."))), None)
        if path in self.fsdp or owner is None:
            yield
            return
        unit = self.modules[owner]
        unit.unshard()
        try:
            yield
        finally:
            unit.reshard()

    def own(self, r: Record, args, kw, memo, kids=(), state=None) -> tuple[torch.Tensor, str, Any]:
        self.replay, self.own_output = None, None
        ready = restored(args, kw, state)
        if isinstance(ready, str):
            raise NotMeasured(f"own error not measured: {ready}")
        args, kw = list(memo.cast(ready[0], self.torch_dtype)), dict(memo.cast(ready[1], self.torch_dtype, True))
        layouts = self.inputs_in.get((r.path, r.number), [])
        for (where, k), layout in zip(_floating(args, kw), layouts, strict=False):
            box = args if where == "arg" else kw
            box[k] = _local(box[k], layout)
        replay = Replay(list(kids), view=self._kid_view, gathered=lambda kid, xc: self._full(xc, kid.x.shape))
        yc, _ = self.teacher_forced(r, args, kw, replay, self._unsharded(r.path), ", laid out as its own was")
        yc = self._full(yc, r.shape) if r.shape is not None else yc
        self.own_output = yc
        return yc, self.dtype, r.module


def agreed_inputs(args, kwargs) -> tuple[tuple, dict]:
    """Rank 0's inputs on every rank (a sharded candidate's ranks must run the same batch)."""
    import torch.distributed as dist

    box = [(args, kwargs)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_same_reference(reference: torch.nn.Module) -> None:
    """Every rank's reference holds the same parameters (a checksum compared), or an InputError."""
    import torch.distributed as dist

    total = 0.0
    for p in reference.parameters():
        if not p.is_meta:
            total += float(p.detach().double().abs().sum()) + float(p.detach().double().sum())
    sums: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sums, total)
    if any(not math.isclose(s, sums[0], rel_tol=0, abs_tol=0) for s in sums):
        raise InputError(f"the reference differs across the {len(sums)} ranks (parameter checksums "
                         f"{', '.join(f'{s:.6g}' for s in sums)}): each rank must hold the same single-process "
                         "reference; seed its construction or load it from the same files on every rank")
