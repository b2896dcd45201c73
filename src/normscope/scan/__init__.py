"""Scan a live model: every norm site with its contract, role and placement (see docs/scan.md).

``normscope.scan(model, inputs)`` calls :func:`normscope.scan.core.scan`: this package is itself callable, so
the name works both as the function and as the package holding ``ModelScan``, ``Site`` and the CLI glue.
"""

from __future__ import annotations

import sys
import types

from .core import DEFAULT_DTYPES, scan
from .dataflow import PLACEMENTS, ROLES
from .result import SCHEMA, ModelScan, Site

__all__ = ["DEFAULT_DTYPES", "PLACEMENTS", "ROLES", "SCHEMA", "ModelScan", "Site", "scan"]


class _CallablePackage(types.ModuleType):
    def __call__(self, model, inputs=None, *, dtypes=None, progress=True) -> ModelScan:
        return scan(model, inputs, dtypes=dtypes, progress=progress)


sys.modules[__name__].__class__ = _CallablePackage
