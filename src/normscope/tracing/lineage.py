"""What a scope of the residual stream computes from its input, while it has had no residual add of that input.

A block whose shortcut is a projection (ResNet's ``conv(x) + shortcut_conv(x)`` when a stage changes width or
stride; Hiera's ``proj(norm(x)) + attn(norm(x))``) never adds its own input: its residual add is an add of two
tensors that both derive from the input along separate paths, the branch's long and the shortcut's short.
:class:`Lineage` follows the tensors computed in a scope from its input for the tracer to find such an add: each
one's distance from the input (operations on the way), the tensors it was computed from, and whether it derives
from a pending projection add's sum. It holds weak references only, so it keeps no activation alive, and stops
following past :data:`LIMIT` tensors.
"""

from __future__ import annotations

import weakref

import torch

LIMIT = 4096  # tensors a scope follows from its input


class Lineage:
    def __init__(self, x: torch.Tensor):
        # id(tensor) -> (weak reference, depth, marked, serial); an id is reused once its tensor dies, so the graph of
        # what was computed from what is kept by serial number: serial -> the serials of its sources
        self.entries: dict[int, tuple] = {}
        self.sources: list[tuple[int, ...]] = []
        self.full = False
        self.put(x, 0, False, ())

    def put(self, t: torch.Tensor, depth: int, marked: bool, sources: tuple[int, ...]) -> None:
        if len(self.sources) >= LIMIT:
            self.full = True
            return
        self.entries[id(t)] = (weakref.ref(t), depth, marked, len(self.sources))
        self.sources.append(sources)

    def get(self, t) -> tuple | None:
        """``t``'s entry (depth, marked, serial after the reference), or None when ``t`` is not followed (an id of a
        tensor that died and was reused is not ``t``)."""
        e = self.entries.get(id(t))
        return e if e is not None and e[0]() is t else None

    def derive(self, args, out) -> None:
        """``out`` (a tensor, or a tuple of them) computed from the first two positional ``args``: one operation
        further from the input than the furthest followed source."""
        depth, marked, sources = -1, False, ()
        first, second = args[0] if args else None, args[1] if len(args) > 1 else None
        for a in (first, second):
            e = self.entries.get(id(a))
            if e is not None and e[0]() is a:
                depth, marked, sources = max(depth, e[1]), marked or e[2], (*sources, e[3])
        if depth < 0:
            return
        for o in out if isinstance(out, (tuple, list)) else (out,):  # noqa: UP038 (the tuple form is faster)
            # (one already followed keeps its entry: a marked sum, the tensor an in-place op returns)
            if isinstance(o, torch.Tensor) and o is not first and o is not second and self.get(o) is None:
                self.put(o, depth + 1, marked, sources)

    def inherit(self, x: torch.Tensor, out: torch.Tensor, inner: int) -> None:
        """``out`` of a nested scope called on ``x``, ``inner`` operations inside it."""
        e = self.get(x)
        if e is not None and isinstance(out, torch.Tensor):
            self.put(out, e[1] + inner, e[2], (e[3],))

    def depth(self, t) -> int | None:
        e = self.get(t)
        return None if e is None else e[1]

    def derives(self, t, ancestor) -> bool:
        """Whether ``t`` was computed from ``ancestor`` (through followed tensors)."""
        e, a = self.get(t), self.get(ancestor)
        if e is None or a is None:
            return False
        target = a[3]
        todo, seen = [e[3]], set()
        while todo:
            i = todo.pop()
            if i == target:
                return True
            if i not in seen:
                seen.add(i)
                todo.extend(self.sources[i])
        return False

    def mark(self, t: torch.Tensor) -> None:
        """``t`` is a pending projection add's sum: it and what derives from it from now on are marked."""
        e = self.get(t)
        if e is None:
            self.put(t, 0, True, ())
        else:
            self.entries[id(t)] = (e[0], e[1], True, e[3])

    def marked(self, t) -> bool:
        e = self.get(t)
        return e is not None and e[2]

    def unmark(self) -> None:
        """The pending add was not the scope's residual add: nothing derives from a pending sum any more."""
        self.entries = {k: e for k, e in self.entries.items() if not e[2]}
