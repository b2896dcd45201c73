"""The forward's activation statistics, taken in one batch.

Each probe of the forward (a block's input, a norm's input and output, a residual add's branch and sum) only keeps
a reference to its tensor (and its version) while the forward runs; the statistics of all of them are taken together
when the forward ends (one fused call on the CPU, one host transfer per device otherwise), before a call that writes
in place (so a later in-place change is not seen), and when the held tensors pass ``PENDING_BYTES``. A tensor seen
twice (a block's input is the previous block's sum and its first norm's input) is read once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .statistics import StepEntries, act_stats, batch_stats, merge

PENDING_BYTES = 256 << 20  # activations a forward may hold for its batched statistics before they are taken


def deferrable(x: torch.Tensor) -> bool:
    """A dense tensor with a version counter: its statistics can wait for the forward's batch."""
    if x.layout != torch.strided or x.is_meta or not x.is_floating_point():
        return False
    try:
        return x._version >= 0
    except Exception:  # inference tensors have no version counter
        return False


class ActivationBatch:
    """Deferred statistics of the forward's activations, merged into ``entries`` when taken.

    ``guard(probe, fn, *args)`` runs the batch under the tracer's guard (probe ``"statistics"``); ``disabled`` is the
    tracer's set of disabled probes; ``left_out(n, why)`` is told of entries left out of the record.
    """

    def __init__(self, entries: StepEntries, guard: Callable, disabled: set[str],
                 left_out: Callable[[int, str], None]):
        self.entries, self.guard, self.disabled, self.left_out = entries, guard, disabled, left_out
        self.reset()

    def reset(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.slots: dict[int, int] = {}  # id(tensor) -> index, while that tensor is pending
        self.items: list[tuple[tuple, int, str]] = []  # (entry key, tensor index, kind)
        self.bytes = 0

    def defer(self, stage: str, layer: int | None, site: str, x: torch.Tensor, kind: str = "") -> None:
        """Take the statistics of ``x`` for an entry with the rest of the forward's, in one batch; the entry keeps
        its place in chain order now. ``kind``: ``"rows"`` adds the smallest row RMS (a norm's input); ``"scale"``:
        ``x`` is a norm's scale γ, whose RMS (``max_scale_rms``) is all the entry takes from it."""
        key = (stage, layer, site)
        self.entries.slot(key)
        if "statistics" in self.disabled:
            return
        if not deferrable(x):  # now, on torch's path
            self._apply([(key, 0, kind)], [x], [act_stats(x)])
            return
        i = self.slots.get(id(x))
        if i is None or self.tensors[i] is not x or self.versions[i] != x._version:
            i = len(self.tensors)
            self.tensors.append(x)
            self.versions.append(x._version)
            self.slots[id(x)] = i
            self.bytes += x.numel() * x.element_size()
        self.items.append((key, i, kind))
        if self.bytes > PENDING_BYTES:
            self.flush()

    def drop(self, keys) -> None:
        """Forget the entries of ``keys``: statistics already taken, pending ones (their tensors no longer held unless
        another entry reads them), and their places in chain order."""
        keys = set(keys)
        for key in keys:
            self.entries.acc.pop(key, None)
        if not any(it[0] in keys for it in self.items):
            return
        items = [it for it in self.items if it[0] not in keys]
        used = sorted({i for _, i, _ in items})
        index = {old: new for new, old in enumerate(used)}
        self.tensors = [self.tensors[i] for i in used]
        self.versions = [self.versions[i] for i in used]
        self.items = [(key, index[i], kind) for key, i, kind in items]
        self.slots = {id(t): i for i, t in enumerate(self.tensors)}
        self.bytes = sum(t.numel() * t.element_size() for t in self.tensors)

    def flush(self) -> None:
        """Take the pending statistics in one batch. The pending tensors are released first, so a failure (logged,
        the probe disabled) cannot keep them alive."""
        tensors, versions, items = self.tensors, self.versions, self.items
        self.reset()
        if items:
            self.guard("statistics", self._batch, items, tensors, versions)

    def _batch(self, items, tensors: list[torch.Tensor], versions: list[int]) -> None:
        fresh = [t._version == v for t, v in zip(tensors, versions, strict=True)]
        if not all(fresh):  # written in place by something the function mode does not see
            self.left_out(sum(not f for f in fresh), "were changed in place, by an operation the tracer does not "
                          "see, before their statistics were taken")
            items = [it for it in items if fresh[it[1]]]
            tensors = [t if f else t.new_empty(0) for t, f in zip(tensors, fresh, strict=True)]
        try:
            stats = batch_stats(tensors, rows=True)
        except Exception:  # one odd tensor (a subclass, freed storage): each alone, the failing ones left out
            stats = []
            for t in tensors:
                try:
                    stats.append(batch_stats([t], rows=True)[0])
                except Exception:
                    stats.append(None)
            self.left_out(sum(s is None for s in stats), "had statistics that could not be taken")
            items = [it for it in items if stats[it[1]] is not None]
        self._apply(items, tensors, stats)

    def _apply(self, items, tensors: list[torch.Tensor], stats: list[dict[str, Any]]) -> None:
        acc = self.entries.acc
        for key, i, kind in items:
            st = dict(stats[i])
            low = st.pop("min_row_sumsq", None)
            x = tensors[i]
            if kind == "scale":  # a norm's γ: its RMS, not an activation's entry (NaN when not finite)
                rms = math.sqrt(st["sumsq"] / st["n"]) if st["n"] and not st["nonfinite"] else math.nan
                merge(acc[key], {"max_scale_rms": rms})
                continue
            if kind == "rows" and x.dim() >= 1 and x.numel():
                if low is not None:
                    st["min_row_rms"] = math.sqrt(low / x.shape[-1])
                else:  # torch's path, finite rows only
                    rows = torch.linalg.vector_norm(x.detach(), 2, dim=-1, dtype=torch.float32) / math.sqrt(
                        x.shape[-1])
                    rows = rows[torch.isfinite(rows)]
                    if rows.numel():
                        st["min_row_rms"] = float(rows.min())
            if acc[key]:
                merge(acc[key], st)
            else:  # the entry's first statistics (a forward's, as a rule): the dict as it is
                acc[key] = st


_IN_PLACE = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
             "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__"}


def writes_in_place(name: str, args, kwargs) -> bool:
    """Whether a call may write into a tensor it is given (``add_``, ``x += y``, ``x[i] = v``, ``out=``,
    ``inplace=True``): the pending statistics are taken before it runs. A positional ``True`` counts too (the
    ``inplace`` flag of ``F.relu(x, True)``); a false alarm only takes them early."""
    return ((name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE
            or kwargs.get("out") is not None or kwargs.get("inplace") is True
            or any(a is True for a in args[1:]))
