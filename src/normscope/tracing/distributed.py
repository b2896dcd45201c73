"""Reduction of one step's record across the ranks of a ``torch.distributed`` run (rank 0 writes).

Each rank's entries are sufficient statistics, gathered to rank 0 and combined exactly: maxima take the max
(``max``, ``max_logit``, the norm scale), minima the min, sums of squares, element counts, non-finite counts,
fully masked rows and entropy sums add, so an RMS is the RMS over all ranks' elements. Per-sample values and
``sample_ids`` are concatenated in rank order. Gradients are recorded as each rank accumulated them (before
DDP's all-reduce), so their RMS is over the ranks' local gradients.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .statistics import merge


def merge_records(parts: list[tuple[list[dict[str, Any]], dict[str, dict[str, list]], list | None]]):
    """Combine the (entries, samples, sample_ids) of several ranks, rank 0 first."""
    entries: dict[tuple, dict[str, Any]] = {}
    samples: dict[str, dict[str, list]] = {}
    ids: list | None = []
    for ents, samp, sid in parts:
        for e in ents:
            key = (e["stage"], e["layer"], e["site"])
            stats = {k: v for k, v in e.items() if k not in ("stage", "layer", "site")}
            if key in entries:
                merge(entries[key], stats)
            else:
                entries[key] = {"stage": e["stage"], "layer": e["layer"], "site": e["site"], **stats}
        for name, d in samp.items():
            cur = samples.setdefault(name, {k: [] for k in d})
            for k, v in d.items():
                cur.setdefault(k, []).extend(v)
        if ids is not None:
            ids = ids + list(sid) if sid is not None else None
    return list(entries.values()), samples, ids


def reduce_record(entries, samples, sample_ids):
    if sample_ids is not None and hasattr(sample_ids, "tolist"):
        sample_ids = sample_ids.reshape(-1).tolist()
    mine = (entries, samples, None if sample_ids is None else list(sample_ids))
    rank = dist.get_rank()
    out = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, out, dst=0)
    if rank != 0:
        return entries, samples, sample_ids
    return merge_records(out)
