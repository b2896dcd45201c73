"""The optimizer's update of a recorded step, per layer and parameter group: RMS(Δparameter) / RMS(parameter),
with the learning rate each group was stepped with.

Around ``optimizer.step()`` (torch's global step hooks): before it, a batched copy of the parameters into buffers
kept while steps in a row are recorded; after it, one read of both copies for the change's Σx², max and the
parameter's Σx². An optimizer subclass whose ``step()`` calls ``super().step()`` runs the global hooks once per
level: only the outermost call measures, so the subclass's own writes around ``super().step()`` are part of the
update. Under FSDP2 each rank measures its shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import fused
from .buffers import Buffers
from .discovery import Layout
from .gradients import local
from .params import Columns, ParamTable
from .statistics import _most, batch_stats, merge


class _Plan:
    """One optimizer's parameters as the table sees them: built at its first recorded step and kept while its
    parameter groups hold the same parameters."""

    def __init__(self, table: ParamTable, optimizer):
        self.ids = _ids(optimizer)
        self.own: list[torch.Tensor] = []  # the parameters it steps that the table holds, in its order
        self.covers: list[list[int]] = []  # per optimizer group, the table's groups it steps
        for g in optimizer.param_groups:
            own = [p for p in g["params"] if id(p) in table.index]
            self.own.extend(own)
            self.covers.append(sorted({int(table.group[table.index[id(p)]]) for p in own}))
        rows = np.array([table.index[id(p)] for p in self.own], np.int64)
        self.order = np.argsort(rows, kind="stable")  # the table's (model) order, in which groups are summed
        self.rows = rows[self.order]
        self.sizes = np.array([p.numel() for p in self.own], np.int64)
        self.sharded = any(callable(getattr(p, "to_local", None)) for p in self.own)

    def values(self) -> list[torch.Tensor]:
        """The parameters' values now (each rank's shard of a sharded one)."""
        return [local(p.detach()) for p in self.own] if self.sharded else self.own


def _ids(optimizer) -> list[int]:
    return [id(p) for g in optimizer.param_groups for p in g["params"]]


class UpdateCollector:
    def __init__(self, layout: Layout, guard: Callable, recording: Callable[[], bool], buffers: Buffers):
        self.layout, self.guard, self.recording, self.buffers = layout, guard, recording, buffers
        self.table = ParamTable(layout)
        self.plans: dict[int, _Plan] = {}  # id(optimizer) -> its plan
        self.reset()

    def reset(self) -> None:
        self.stats: dict[tuple, dict[str, float]] = {}  # (layer, group) -> the update's statistics
        self.old: dict[int, list[torch.Tensor]] = {}  # id(optimizer) -> its parameters' values before the step
        self.lrs: dict[int, dict[int, float]] = {}  # id(optimizer) -> table group -> the largest learning rate
        self.depth: dict[int, int] = {}  # id(optimizer) -> nesting of its step() calls in flight

    def _plan(self, optimizer) -> _Plan:
        plan = self.plans.get(id(optimizer))
        if plan is None or plan.ids != _ids(optimizer):
            plan = self.plans[id(optimizer)] = _Plan(self.table, optimizer)
        return plan

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
        if id(optimizer) in self.old:
            try:
                self.guard("update", self._measure, optimizer)
            finally:
                self.old.pop(id(optimizer), None)

    def _keep(self, optimizer) -> None:
        """Before the step: the learning rates, and the parameters' values in one batched copy."""
        with torch.no_grad():
            plan = self._plan(optimizer)
            lrs: dict[int, float] = {}
            for g, covers in zip(optimizer.param_groups, plan.covers, strict=True):
                lr = g.get("lr")  # the learning rate this group's parameters are stepped with
                if isinstance(lr, torch.Tensor):
                    lr = float(lr)
                if isinstance(lr, int | float) and not isinstance(lr, bool):
                    for j in covers:
                        lrs[j] = float(lr) if j not in lrs else _most(max, lrs[j], float(lr))
            self.lrs[id(optimizer)] = lrs
            if plan.own:
                values = plan.values()
                bufs = [self.buffers(id(p), v.shape, v.dtype, v.device) for p, v in zip(plan.own, values, strict=True)]
                torch._foreach_copy_(bufs, values)
                self.old[id(optimizer)] = bufs

    def _measure(self, optimizer) -> None:
        """After the step: the change of each parameter against its kept value, summed per parameter group."""
        with torch.no_grad():
            plan = self._plan(optimizer)
            olds, news = self.old[id(optimizer)], plan.values()
            if len(olds) != len(news):  # the optimizer's parameters changed within its step
                return
            m = len(news)
            change, size = Columns(m), np.zeros(m)
            # the change and its sums in one read of both copies, one call for all parameters
            take, sumsq, bits, sizes = fused.update_columns(olds, news)
            fine = np.zeros(m, bool)
            if take:
                idx = np.array(take, np.int64)
                ok = (bits < fused.INF_BITS) & np.isfinite(sumsq) & np.isfinite(sizes)
                idx = idx[ok]
                fine[idx] = True
                change.sumsq[idx], change.max[idx], size[idx] = sumsq[ok], fused.max_abs_values(bits[ok]), sizes[ok]
            change.n[:] = plan.sizes if not plan.sharded else [v.numel() for v in news]
            rest = np.flatnonzero(~fine).tolist()
            if rest:  # torch's reductions, batched; the exact path where a number is not finite
                # old - new, in place in the copy: the update, negated; an element that is not finite before or after
                # the step makes its change not finite, so the change's count is the group's (adding the parameter's
                # count too counted such an element twice: a NaN group read "nonfinite 2")
                for i in rest:
                    olds[i].sub_(news[i])
                moves = batch_stats([olds[i] for i in rest])
                params = batch_stats([news[i] for i in rest], max_abs=False)
                for i, us, ps in zip(rest, moves, params, strict=True):
                    change.sumsq[i], change.n[i], change.max[i] = us["sumsq"], us["n"], us["max"]
                    change.nonfinite[i], size[i] = us["nonfinite"], ps["sumsq"]
            for name in Columns.__slots__:  # in the table's order, as it sums
                setattr(change, name, getattr(change, name)[plan.order])
            sums = self.table.by_group(plan.rows, change, start_max=0.0)
            param_sumsq = np.bincount(self.table.group[plan.rows], weights=size[plan.order],
                                      minlength=len(self.table.groups)).tolist()
            lrs = self.lrs.get(id(optimizer), {})
            for j, st in sums.items():
                st["param_sumsq"] = param_sumsq[j]
                if j in lrs:
                    st["max_lr"] = lrs[j]
                g = self.table.groups[j]
                if g in self.stats:  # a second optimizer stepping the same group
                    merge(self.stats[g], st)
                else:
                    self.stats[g] = st

    def entries(self) -> list[dict[str, Any]]:
        return [{"stage": "update", "layer": g[0], "site": g[1], **self.stats[g]} for g in self.layout.param_order
                if g in self.stats]
