"""Scan a live model: every norm site with its contract, role and placement (see docs/scan.md).

``normscope.scan(model, inputs)`` is :func:`normscope.sites.core.scan`; this package holds the recording of one
forward (``trace``), the dataflow roles (``dataflow``), the results (``ModelScan``, ``Site``) and the CLI glue
(``command``). The names below are imported on first use, so the command line can register ``scan`` without
loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

_LAZY = {
    "DEFAULT_DTYPES": ".core",
    "scan": ".core",
    "PLACEMENTS": ".dataflow",
    "ROLES": ".dataflow",
    "SCHEMA": ".result",
    "ModelScan": ".result",
    "Site": ".result",
}

__all__ = ["DEFAULT_DTYPES", "PLACEMENTS", "ROLES", "SCHEMA", "ModelScan", "Site", "scan"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

if TYPE_CHECKING:
    from .core import DEFAULT_DTYPES, scan
    from .dataflow import PLACEMENTS, ROLES
    from .result import SCHEMA, ModelScan, Site
