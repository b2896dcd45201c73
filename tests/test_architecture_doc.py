"""docs/architecture.md names only what exists: every file path and every dotted name it cites."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import normscope

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "src" / "normscope"
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[\w/]+\.(py|md)$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def cited() -> tuple[list[str], list[str]]:
    text = DOC.read_text()
    spans = CODE.findall(text)
    paths = [s for s in spans if PATH.match(s)] + re.findall(r"\b(?:docs|tests)/\w+\.(?:md|py)\b", text)
    return paths, [s for s in spans if DOTTED.match(s) and not PATH.match(s)]


def _modules() -> list[object]:
    mods = [normscope]
    for info in pkgutil.walk_packages(normscope.__path__, "normscope."):
        if info.name.endswith("__main__"):  # running it is the command line
            continue
        try:
            mods.append(importlib.import_module(info.name))
        except ImportError:  # an optional extra (numba, triton, …) that is not installed here
            pass
    return mods


def _steps(obj: object, part: str) -> list[object]:
    """What ``obj.part`` may mean: the attribute, the submodule (a package may export a function of the same name,
    as normscope.battery does with check), a dataclass field without a default."""
    found = []
    if hasattr(obj, part):
        found.append(getattr(obj, part))
    if hasattr(obj, "__path__"):
        try:
            found.append(importlib.import_module(f"{obj.__name__}.{part}"))
        except ImportError:
            pass
    if part in getattr(obj, "__dataclass_fields__", {}):
        found.append(None)
    return found


def resolves(name: str, modules: list[object]) -> bool:
    """``name`` is ``normscope.<name>`` or an attribute chain starting at some normscope module (``Layout.of``
    is found in normscope.layout)."""
    parts = name.split(".")
    if parts[0] == "normscope":
        parts = parts[1:]
    frontier = [normscope, *modules]
    for part in parts:
        frontier = [nxt for obj in frontier if obj is not None for nxt in _steps(obj, part)]
    return bool(frontier)


def test_every_cited_path_exists():
    paths, _ = cited()
    assert len(paths) > 50
    missing = [p for p in paths if not ((PACKAGE / p).exists() or (ROOT / p).exists())]
    assert not missing, missing


def test_every_cited_dotted_name_exists():
    pytest.importorskip("torch")
    _, names = cited()
    assert len(names) > 50
    modules = _modules()
    missing = sorted({n for n in names if not resolves(n, modules)})
    assert not missing, missing
