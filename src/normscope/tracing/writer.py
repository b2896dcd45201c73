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


def _short(v, key: str = ""):
    """A record as JSON-ready values in one walk: floats to 7 significant digits (float32 statistics carry no more:
    a third of the line length), non-finite floats as strings, NumPy scalars as Python numbers. Times (the ``time``
    fields, seconds since the epoch) keep their full precision."""
    t = type(v)
    if t is float:
        if v - v != 0.0:  # inf or NaN
            return str(v)
        return v if key == "time" else float(f"{v:.7g}")
    if t is list or t is tuple:
        return [_short(x) for x in v]
    if t is dict:
        return {str(k): _short(x, k) for k, x in v.items()}
    if t is int or t is str or t is bool or v is None:
        return v
    return jsonable(v)  # NumPy values and other numbers: the general conversion


def dumps(rec) -> str:
    return json.dumps(_short(rec), separators=(",", ":"))
