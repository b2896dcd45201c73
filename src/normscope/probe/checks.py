"""Compatibility module: the acceptance battery now lives in :mod:`normscope.battery`, its results in
:mod:`normscope.results.check` and its error model in :mod:`normscope.numerics`. These names stay importable."""

from __future__ import annotations

from ..battery.check import check, resolve_expected
from ..battery.context import Progress
from ..battery.forward import HIDDEN_SIZES
from ..numerics.constants import ATOL_UNITS
from ..results.check import SCHEMA, Finding, Report, Status

__all__ = ["ATOL_UNITS", "HIDDEN_SIZES", "SCHEMA", "Finding", "Progress", "Report", "Status", "check",
           "resolve_expected"]
