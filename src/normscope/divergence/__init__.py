"""``normscope.diff``: two executions of one model compared layer by layer, to the first site that is itself
wrong (see docs/diff.md).

``diff`` is :func:`normscope.divergence.core.diff`, a pipeline: ``candidate`` (one strategy per kind of
candidate, and the alignment), ``walk`` (the reference's forward, site by site), ``judge`` (a site's status and
bound), ``verdict`` (inconclusive reasons, the first divergence explained); ``execution`` is how a model is run
and its calls seen. ``metrics`` holds the per-site error numbers and the bound,
``result`` the ``Diff``/``SiteDiff`` data (JSON ``normscope.diff/1``), ``render`` the table and the plot,
``contracts`` the norm sites' error model, ``gradients`` the ``grad=True`` pass, ``runtimes`` one module per
runtime a candidate runs on (ONNX Runtime, OpenVINO, MLX, llama.cpp: the candidate, its run and its site map),
``command`` the CLI glue.
The names below are imported on first use, so the command line can register ``diff`` without loading torch or
rich.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

_LAZY = {
    "diff": ".core",
    "Diff": ".result",
    "SiteDiff": ".result",
    "SCHEMA": ".result",
    "render_diff": ".render",
    "plot_diff": ".render",
}

__all__ = ["SCHEMA", "Diff", "SiteDiff", "diff", "plot_diff", "render_diff"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

if TYPE_CHECKING:
    from .core import diff
    from .render import plot_diff, render_diff
    from .result import SCHEMA, Diff, SiteDiff
