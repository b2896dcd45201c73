"""Parsing of command-line values: ``--args``/``--kwargs`` JSON (never evaluated), JSON files and ``--shape``;
the guards every file reader shares (:func:`unreadable`, :func:`file_size`).

What a TARGET names, and loading it, is :mod:`normscope.sources` (``load_target`` is still importable here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import InputError, TargetError
from .inputs import human_bytes, shorten


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


def unreadable(path: str | Path, exc: OSError, what: str = "") -> InputError:
    """The one error for a file the operating system will not give us (missing, a folder, no permission)."""
    name = f"{what} {path}" if what else str(path)
    return InputError(f"{name}: cannot read it ({exc.strerror or exc}); check the path and its permissions")


def file_size(path: str | Path, limit: int, kind: str, fix: str, what: str = "") -> int:
    """The size of the file at ``path`` in bytes, or one InputError: it cannot be read, or it is over ``limit``.

    ``kind`` names what the file should be ("a config.json"), ``fix`` what to do about an oversize one; ``what``
    prefixes the path with the flag or role it came from ("--expect").
    """
    try:
        size = Path(path).stat().st_size
    except OSError as exc:
        raise unreadable(path, exc, what) from None
    if size > limit:
        name = f"{what} {path}" if what else str(path)
        raise InputError(f"{name} is {size:,} bytes ({human_bytes(size)}), over the {limit:,}-byte "
                         f"({human_bytes(limit)}) limit for {kind}; {fix}")
    return size


#: The most bytes :func:`read_json_file` reads unless told otherwise: far beyond any spec or result normscope writes.
MAX_JSON_BYTES = 256 * 2**20
_JSON_TYPES = {"dict": "object", "list": "list", "str": "string", "int": "number", "float": "number",
               "bool": "boolean", "NoneType": "null"}


def read_json_file(path: str | Path, expected: str, *, what: str = "", limit: int = MAX_JSON_BYTES,
                   need_object: bool = False) -> Any:
    """The JSON value in a file: the one reader of every JSON file normscope is given.

    Anything wrong is one InputError naming the file (prefixed by ``what``, the flag or role it came from), the
    problem (cannot be read, over ``limit`` bytes, not UTF-8, not JSON, nested too deeply, not an object when
    ``need_object``) and the fix, in which ``expected`` says what the file should be ("a spec JSON file").
    """
    path = Path(path)
    name = f"{what} {path}" if what else str(path)
    file_size(path, limit, expected, "is it the right file?", what)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise unreadable(path, exc, what) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        hint = (" (it looks like UTF-16, as some shells write with >; save it as UTF-8)"
                if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "")
        raise InputError(f"{name} is not a UTF-8 text file{hint}; give {expected}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{name} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); fix it "
                         f"there, or give {expected}") from None
    except RecursionError:
        raise InputError(f"{name} is JSON nested too deeply to parse; give {expected}") from None
    if need_object and not isinstance(data, dict):
        got = _JSON_TYPES.get(type(data).__name__, type(data).__name__)
        raise InputError(f"{name} must hold a JSON object; got a {got}; give {expected}")
    return data


def parse_shape(text: str, flag: str = "--shape") -> tuple[int, ...]:
    """``--shape 2,8,64`` as a tuple; every part must be a size ≥ 1 (no empty parts, no signs). ``flag``: the option
    as the user wrote it, for the messages (``--inputs ids:`` for token ids, whose example is ``2,8``)."""
    from .inputs import flag_example, probe_shape

    parts = [s.strip() for s in text.split(",")]
    bad = [p for p in parts if not (p.isascii() and p.isdigit())]
    if bad:
        what = "an empty size" if "" in bad else f"{shorten(bad[0], 30)}, not a size ≥ 1"
        raise InputError(f"{flag} must be comma-separated sizes, {flag_example(flag)}; {shorten(text, 40)} has {what}")
    return probe_shape(tuple(int(p) for p in parts), flag)

