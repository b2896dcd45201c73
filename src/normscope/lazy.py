"""Packages whose public names are imported on first use.

``import normscope`` and the command line's parser must not load torch, NumPy or rich; each package lists its
public names and the module that defines each, and this builds the module-level ``__getattr__``/``__dir__``
(PEP 562) that imports a name when it is first asked for and keeps it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping


def lazy_exports(package: str, names: Mapping[str, str], submodules: Iterable[str] = ()
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps a public name to the relative module that
    defines it; ``submodules`` are submodules exposed as attributes."""
    subs = frozenset(submodules)

    def __getattr__(name: str) -> object:
        if name in names:
            value = getattr(importlib.import_module(names[name], package), name)
        elif name in subs:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        """The public API only: the package's ``__all__`` and the lazy names (not its imports or helpers)."""
        return sorted(set(getattr(sys.modules[package], "__all__", ())) | set(names) | subs)

    return __getattr__, __dir__
