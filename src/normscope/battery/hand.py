"""Section "hand case": every group holds [1, 2, 3, 1, 2, 3, …]; the stages are shown with the verdict."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .. import reference
from ..results.check import Finding
from .context import Context


def hand_case(ctx: Context) -> Iterator[Finding]:
    g, spec = ctx.groups, ctx.spec
    flat = g.labels.ravel()
    order = np.argsort(flat, kind="stable")
    rank = np.empty(flat.size, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=g.count))[:-1]])
    rank[order] = np.arange(flat.size) - starts[flat[order]]
    x = np.array([1.0, 2.0, 3.0])[rank % 3].reshape(ctx.shape)
    stats = reference.statistics(x, spec.replace(batch_stats=None) if spec.uses_running_statistics else spec,
                                 **ctx.params.running())
    first = g.labels == 0
    kind = "mean square" if not spec.center else "variance"
    stages = {"mean": float(stats.mean[first][0]), kind: float(stats.var[first][0]),
              "denominator": float(stats.denom[first][0]),
              "normalized": [float(v) for v in stats.xhat[first][:3]]}
    note = "" if g.size % 3 == 0 else f" (group size {g.size} is not a multiple of 3: stages differ from the text)"
    f = ctx.compare("hand.case", "hand case [1, 2, 3]", x, ctx.dtype, "every group holds [1, 2, 3, 1, 2, 3, …]" + note)
    f.expected = {"stages": stages}
    yield f
