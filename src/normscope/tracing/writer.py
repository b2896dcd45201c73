"""The writer of a run: ``RUN_DIR/trace.jsonl`` (each line written whole and flushed, so a killed process loses at
most the step in flight) and the sinks that receive every record on rank 0 (a sink that raises is disabled; the
store goes on)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..jsonable import jsonable
from .store import TRACE_FILE


class RecordWriter:
    """Writes records to ``run_dir/trace.jsonl`` and hands them to ``sinks``; ``fail(probe, exc)`` is told of a
    sink that raised (and that sink is skipped from then on)."""

    def __init__(self, run_dir: Path, sinks: list, fail: Callable[[str, BaseException], None], disabled: set[str]):
        self.run_dir, self.sinks, self.fail, self.disabled = run_dir, sinks, fail, disabled
        self.file = None

    def open(self) -> None:
        self.file = open(self.run_dir / TRACE_FILE, "a", encoding="utf-8")

    @property
    def is_open(self) -> bool:
        return self.file is not None

    def write(self, rec: dict[str, Any]) -> None:
        if self.file is None:
            return
        self.file.write(dumps(rec) + "\n")
        self.file.flush()  # a killed process loses at most the step in flight
        for i, sink in enumerate(self.sinks):
            probe = f"sink {i}"
            if probe in self.disabled:
                continue
            try:
                sink.write(rec)
            except Exception as exc:  # a failing sink is disabled; the JSONL store goes on
                self.fail(probe, exc)

    def close(self, end: dict[str, Any]) -> None:
        if self.file is None:
            return
        self.write(end)
        self.file.close()
        self.file = None
        for i, sink in enumerate(self.sinks):
            close = getattr(sink, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:
                    self.fail(f"sink {i}", exc)


_SEVEN = "{:.7g}".format
_STRING = json.encoder.encode_basestring_ascii  # as json.dumps writes a string
_KEYS: dict = {}  # a record's keys, each encoded once (they repeat in every record)


def _number(v: float) -> str:
    """A float to 7 significant digits (float32 statistics carry no more: a third of the line length), still a
    float when read back (``3.0``, not ``3``); a non-finite one as a string (``"nan"``, ``"inf"``)."""
    s = _SEVEN(v)
    if "." in s or "e" in s:
        return s
    if s in ("nan", "inf", "-inf"):
        return f'"{s}"'
    return s + ".0"


def _encode(v, key: str = "") -> str:
    """A record as JSON text in one walk, numbers formatted as :func:`_number` says (the ``time`` fields, seconds
    since the epoch, in full); NumPy values and other numbers through :func:`..jsonable.jsonable`. Written by hand
    because the walk that rounds every float before ``json.dumps`` cost more than the rest of a small model's
    recorded step."""
    t = type(v)
    if t is float:
        return repr(v) if key == "time" and v - v == 0.0 else _number(v)
    if t is dict:
        parts = []
        for k, x in v.items():  # the common leaves inline: a record holds thousands of them
            name = _KEYS.get(k)
            if name is None:
                name = _KEYS[k] = _STRING(str(k)) + ":"
            tx = type(x)
            if tx is float and k != "time":
                parts.append(name + _number(x))
            elif tx is int:
                parts.append(name + str(x))
            elif tx is str:
                parts.append(name + _STRING(x))
            else:
                parts.append(name + _encode(x, k))
        return "{" + ",".join(parts) + "}"
    if t is list or t is tuple:
        return "[" + ",".join([_number(x) if type(x) is float else str(x) if type(x) is int else _encode(x)
                               for x in v]) + "]"
    if t is str:
        return _STRING(v)
    if t is int:
        return str(v)
    if v is None:
        return "null"
    if t is bool:
        return "true" if v else "false"
    plain = jsonable(v)
    if type(plain) is t:  # not a number jsonable knows: json.dumps says what it is (a TypeError)
        return json.dumps(plain, separators=(",", ":"))
    return _encode(plain, key)


def dumps(rec) -> str:
    return _encode(rec)
