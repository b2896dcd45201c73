"""The gradients of a recorded step, per layer and parameter group, as the backward finished them.

``register_post_accumulate_grad_hook`` marks each parameter whose gradient is final for this backward; a callback
the autograd engine runs when the backward ends summarises them all in one batch (before a clip or an optimizer
step can change them). The last backward of a step wins (gradient accumulation reads the accumulated gradients).
Under FSDP2 each rank summarises its shard of the reduce-scattered gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .discovery import Layout
from .params import Columns, ParamTable, columns


def local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's local shard (an FSDP2 ``DTensor`` parameter or gradient), else the tensor itself: each rank
    summarises its own shard, and the ranks' sums add up to the whole tensor's."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class GradientCollector:
    def __init__(self, layout: Layout, guard: Callable, recording: Callable[[], bool], disabled: set[str]):
        self.layout, self.guard, self.recording, self.disabled = layout, guard, recording, disabled
        self.table = ParamTable(layout)
        self.reset()

    def reset(self) -> None:
        m = len(self.table.params)
        self.stats = Columns(m)  # per parameter, its gradient's statistics (where ``seen``)
        self.seen = np.zeros(m, bool)
        self.batch: dict[int, torch.Tensor] = {}  # parameters whose gradient is final, not yet summarised
        self.order: dict[tuple, None] = {}  # parameter groups in the order the backward finished them
        self.queued = False

    def hook(self, p: torch.Tensor) -> None:
        """A parameter's gradient is final for this backward: summarise it when the backward ends."""
        if not self.recording() or "grad" in self.disabled or p.grad is None:
            return
        self.batch[id(p)] = p
        self.order.setdefault(self.layout.param_group[id(p)])
        if self.queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self.queued = True
        except Exception:  # not inside a backward the engine runs (or no such API): summarise now
            self.flush()

    def flush(self) -> None:
        self.queued = False
        batch, self.batch = self.batch, {}
        self.guard("grad", self._summarise, [p for p in batch.values() if p.grad is not None])

    def _summarise(self, params: list[torch.Tensor]) -> None:
        rows = np.array([self.table.index[id(p)] for p in params], np.int64)
        got = columns([local(p.grad) for p in params])
        for name in Columns.__slots__:  # the accumulated gradient: the last backward wins
            getattr(self.stats, name)[rows] = getattr(got, name)
        self.seen[rows] = True

    def entries(self) -> list[dict[str, Any]]:
        """One entry per parameter group, in backward order: as the backward finished each group's first gradient
        (a NaN born in layer 3's backward also poisons layers 0-2 and, within a layer, the parameters its backward
        reaches later); groups it did not report, last layer first."""
        if self.batch:  # a backward whose end-callback did not run
            self.flush()
        rows = np.flatnonzero(self.seen)
        cols = Columns(0)
        for name in Columns.__slots__:
            setattr(cols, name, getattr(self.stats, name)[rows])
        groups = self.table.groups
        sums = {groups[j]: st for j, st in self.table.by_group(rows, cols).items()}
        out = []
        for g in [*self.order, *reversed(self.layout.param_order)]:
            if g in sums:
                out.append({"stage": "grad", "layer": g[0], "site": g[1], **sums.pop(g)})
        return out
