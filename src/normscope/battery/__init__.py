"""The acceptance battery: prove that an implementation honours an expected contract.

:func:`check` (``battery/check.py``) builds a :class:`~normscope.battery.context.Context` and walks the
sections of :data:`~normscope.battery.registry.SECTIONS`, one module each (parameters, determinism/dtypes,
hand case, invariances, extremes, dependency, affine, forward, rounding order, backward, modes). The
tolerances come from :mod:`normscope.numerics`; results are :mod:`normscope.results.check` types.
"""

from .check import check, resolve_expected
from .context import Context
from .registry import SECTIONS, Section

__all__ = ["Context", "SECTIONS", "Section", "check", "resolve_expected"]
