"""Parsing of command-line values: ``--args``/``--kwargs`` JSON (never evaluated), JSON files and ``--shape``.

What a TARGET names, and loading it, is :mod:`normscope.sources` (``load_target`` is still importable here).
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import InputError, TargetError
from .inputs import shorten


def _loads(text: str, what: str, example: str):
    """JSON from text, one clear TargetError otherwise (deep nesting included)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TargetError(f"{what} is not valid JSON ({exc.msg}, at character {exc.pos}); e.g. {example}") from None
    except RecursionError:
        raise TargetError(f"{what} is nested too deeply to parse; e.g. {example}") from None


def parse_json(text: str | None, kind: type, flag: str):
    if text is None:
        return kind()
    example = f"{flag} '[64]'" if kind is list else f"{flag} '{{\"eps\": 1e-6}}'"
    value = _loads(text, flag, example)
    if not isinstance(value, kind):
        raise TargetError(f"{flag} must be a JSON {'list' if kind is list else 'object'}; got {shorten(text)}")
    return value


def read_json_file(path: str | Path, what: str = "--expect"):
    """The JSON value in a file, or one clear InputError (not UTF-8, not JSON, nested too deeply)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        hint = (" (it looks like UTF-16, as some shells write with >; save it as UTF-8)"
                if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "")
        raise InputError(f"{what} {path} is not a UTF-8 text file{hint}; give a preset name or a spec JSON file") \
            from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} {path} is not JSON: {exc}") from None
    except RecursionError:
        raise InputError(f"{what} {path} is nested too deeply to be a spec JSON file") from None


def parse_shape(text: str) -> tuple[int, ...]:
    """``--shape 2,8,64`` as a tuple; every part must be a size ≥ 1 (no empty parts, no signs)."""
    from .inputs import probe_shape

    parts = [s.strip() for s in text.split(",")]
    bad = [p for p in parts if not (p.isascii() and p.isdigit())]
    if bad:
        what = "an empty size" if "" in bad else f"{shorten(bad[0], 30)}, not a size ≥ 1"
        raise InputError(f"--shape must be comma-separated sizes like 2,8,64; {shorten(text, 40)} has {what}")
    return probe_shape(tuple(int(p) for p in parts), "--shape")


def __getattr__(name: str):
    if name in ("load_target", "is_onnx_path"):  # their home is normscope.sources
        from . import sources

        return getattr(sources, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
