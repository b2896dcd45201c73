"""``normscope.gradflow``: gradient norms per block and per sublayer, as the residual stream carries them back
(see docs/placements.md). ``core`` measures (``gradflow``, ``GradFlow``, ``plot_flows``, ``blocks_of``), ``command``
is the CLI glue. The names are imported on first use, so the command line registers ``gradflow`` without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

_LAZY = {
    "gradflow": ".core",
    "GradFlow": ".core",
    "Snapshot": ".core",
    "SCHEMA": ".core",
    "COLUMNS": ".core",
    "plot_flows": ".core",
    "blocks_of": ".core",
}

__all__ = ["COLUMNS", "SCHEMA", "GradFlow", "Snapshot", "blocks_of", "gradflow", "plot_flows"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

if TYPE_CHECKING:
    from .core import COLUMNS, SCHEMA, GradFlow, Snapshot, blocks_of, gradflow, plot_flows
