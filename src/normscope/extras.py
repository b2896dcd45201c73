"""Optional dependencies: one way to import a package that comes with an extra of normscope."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from .errors import MissingExtraError

__all__ = ["require"]


def require(package: str, extra: str) -> ModuleType:
    """``import package``, or :class:`MissingExtraError` naming the package and ``pip install 'normscope[extra]'``.

    ``package`` may be dotted (``"jax.numpy"``); the error names the top-level package that is missing.
    Only a missing package becomes that error: a package that is installed but fails on import raises as it is.
    """
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        missing = exc.name if isinstance(exc, ModuleNotFoundError) and exc.name else None
        if missing is None and not _absent(package):
            raise
        raise MissingExtraError((missing or package).split(".")[0], extra) from exc


def _absent(package: str) -> bool:
    """True when ``package`` cannot be imported at all (a ``None`` entry in sys.modules, or not installed)."""
    import sys

    top = package.split(".")[0]
    if sys.modules.get(top, 0) is None or sys.modules.get(package, 0) is None:
        return True
    return importlib.util.find_spec(top) is None
