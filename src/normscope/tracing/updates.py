"""The optimizer's update of a recorded step, per layer and parameter group: RMS(Δparameter) / RMS(parameter),
with the learning rate each group was stepped with.

Around ``optimizer.step()`` (torch's global step hooks): before it, a batched copy of the parameters into buffers
kept while steps in a row are recorded; after it, one read of both copies for the change's Σx², max and the
parameter's Σx². An optimizer subclass whose ``step()`` calls ``super().step()`` runs the global hooks once per
level: only the outermost call measures, so the subclass's own writes around ``super().step()`` are part of the
update. Under FSDP2 each rank measures its shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from . import fused
from .buffers import Buffers
from .discovery import Layout
from .gradients import local
from .statistics import batch_stats, merge


class UpdateCollector:
    def __init__(self, layout: Layout, guard: Callable, recording: Callable[[], bool], buffers: Buffers):
        self.layout, self.guard, self.recording, self.buffers = layout, guard, recording, buffers
        self.reset()

    def reset(self) -> None:
        self.stats: dict[tuple, dict[str, float]] = {}  # (layer, group) -> the update's statistics
        self.old: dict[int, torch.Tensor] = {}  # id(parameter) -> its value before the step
        self.lrs: dict[int, float] = {}  # id(parameter) -> the learning rate of its optimizer group at this step
        self.depth: dict[int, int] = {}  # id(optimizer) -> nesting of its step() calls in flight

    def _own(self, optimizer) -> list[torch.Tensor]:
        ids = self.layout.param_group
        return [p for g in optimizer.param_groups for p in g["params"] if id(p) in ids]

    def pre(self, optimizer, args, kwargs) -> None:
        depth = self.depth.get(id(optimizer), 0)
        self.depth[id(optimizer)] = depth + 1
        if self.recording() and depth == 0:
            self.guard("update", self._keep, optimizer)

    def post(self, optimizer, args, kwargs) -> None:
        depth = self.depth.get(id(optimizer), 1) - 1
        if depth > 0:
            self.depth[id(optimizer)] = depth
            return
        self.depth.pop(id(optimizer), None)
        if self.old:
            try:
                self.guard("update", self._measure, optimizer)
            finally:
                self.old.clear()

    def _keep(self, optimizer) -> None:
        """Before the step: the learning rates, and the parameters' values in one batched copy."""
        with torch.no_grad():
            own = self._own(optimizer)
            for g in optimizer.param_groups:  # the learning rate each parameter is stepped with
                lr = g.get("lr")
                if isinstance(lr, torch.Tensor):
                    lr = float(lr)
                if isinstance(lr, int | float) and not isinstance(lr, bool):
                    for p in g["params"]:
                        self.lrs[id(p)] = float(lr)
            if own:
                values = [local(p.detach()) for p in own]
                bufs = [self.buffers(id(p), v.shape, v.dtype, v.device) for p, v in zip(own, values, strict=True)]
                torch._foreach_copy_(bufs, values)
                self.old.update(zip(map(id, own), bufs, strict=True))

    def _measure(self, optimizer) -> None:
        """After the step: the change of each parameter against its kept value, summed per parameter group."""
        with torch.no_grad():
            own = [p for p in self._own(optimizer) if id(p) in self.old]
            if not own:
                return
            stats: list[tuple[torch.Tensor, dict[str, Any]]] = []
            rest: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
            olds, news = [self.old[id(p)] for p in own], [local(p.detach()) for p in own]
            # the change and its sums in one read of both copies, one call for all parameters
            for p, d, w, one in zip(own, olds, news, fused.update_sums(olds, news), strict=True):
                if one is not None and all(map(math.isfinite, one)):
                    stats.append((p, {"sumsq": one[0], "n": d.numel(), "max": one[1], "nonfinite": 0,
                                      "param_sumsq": one[2]}))
                else:
                    # old - new, in place in the copy: the update, negated; an element that is not finite before or
                    # after the step makes its change not finite, so the change's count is the group's (adding the
                    # parameter's count too counted such an element twice: a NaN group read "nonfinite 2")
                    d.sub_(w)
                    rest.append((p, d, w))
            if rest:  # torch's reductions, batched; the exact path where a number is not finite
                moves = batch_stats([d for _, d, _ in rest])
                sizes = batch_stats([w for _, _, w in rest], max_abs=False)
                for (p, _, _), us, ps in zip(rest, moves, sizes, strict=True):
                    stats.append((p, {"sumsq": us["sumsq"], "n": us["n"], "max": us["max"],
                                      "nonfinite": us["nonfinite"], "param_sumsq": ps["sumsq"]}))
            for p, st in stats:
                if id(p) in self.lrs:
                    st["max_lr"] = self.lrs[id(p)]
                g = self.layout.param_group[id(p)]
                acc = self.stats.setdefault(g, {"sumsq": 0.0, "n": 0, "max": 0.0, "nonfinite": 0, "param_sumsq": 0.0})
                merge(acc, st)

    def entries(self) -> list[dict[str, Any]]:
        return [{"stage": "update", "layer": g[0], "site": g[1], **self.stats[g]} for g in self.layout.param_order
                if g in self.stats]
