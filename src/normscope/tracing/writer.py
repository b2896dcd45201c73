"""The writer of a run: ``RUN_DIR/trace.jsonl`` (each line written whole and flushed) and the sinks that receive
every record on rank 0 (a sink that raises is disabled; the store goes on).

Records are encoded and written on a thread of the writer's own, in the order they were handed over: the training
thread only queues a record (a few microseconds), and its text (a small model's recorded step spends about as long
encoding its record as in all of its probes) is written while the training loop goes on to its next step. The
tracer drains the writer (:meth:`RecordWriter.drain`) before each recorded forward, and at once after a record
whose next step is not recorded, so a killed process loses at most the step in flight, as with a synchronous
writer; closing drains, and so does the interpreter's exit for a writer left open. The queue is bounded
(``QUEUE_RECORDS``): a writer that falls behind slows training down rather than hold records without limit.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import queue
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..jsonable import jsonable
from .store import TRACE_FILE

QUEUE_RECORDS = 64  # records handed over and not yet written, at most
_STOP = object()


class RecordWriter:
    """Writes records to ``run_dir/trace.jsonl`` and hands them to ``sinks``, in order, on its own thread;
    ``fail(probe, exc, step)`` is told of a sink that raised at the record of ``step`` (and that sink is skipped
    from then on) and of a store that could not be written (probe ``"store"``: the records after it are
    dropped)."""

    def __init__(self, run_dir: Path, sinks: list, fail: Callable[..., None], disabled: set[str]):
        self.run_dir, self.sinks, self.fail, self.disabled = run_dir, sinks, fail, disabled
        self.file = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._at_exit = functools.partial(_drain_at_exit, weakref.ref(self))
        self._pid: int | None = None  # the process that opened it: a forked child inherits the exit handler only

    def open(self) -> None:
        self.file = open(self.run_dir / TRACE_FILE, "a", encoding="utf-8")
        self._pid = os.getpid()
        self._queue = queue.Queue(QUEUE_RECORDS)
        self._thread = threading.Thread(target=self._run, args=(self._queue,), name="normscope-trace-writer",
                                        daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    @property
    def is_open(self) -> bool:
        return self.file is not None

    def write(self, rec: dict[str, Any]) -> None:
        """Queue ``rec`` (the writer owns it from now on: the caller must not change it)."""
        if self.file is None:
            return
        if not self._thread.is_alive():  # never expected (the thread catches every failure): written here instead
            self._write_now(rec)
            return
        self._queue.put(rec)

    def drain(self) -> None:
        """Wait until every record queued so far is written and handed to the sinks."""
        if self._queue is not None and self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def _run(self, q: queue.Queue) -> None:
        while True:
            rec = q.get()
            try:
                if rec is _STOP:
                    return
                self._write_now(rec)
            finally:
                q.task_done()

    def _write_now(self, rec: dict[str, Any]) -> None:
        if "store" not in self.disabled:
            try:
                self.file.write(dumps(rec) + "\n")
                self.file.flush()  # each line whole on disk before the next: a reader never sees half a record
            except Exception as exc:  # a full disk or a bad value: the tracer says so; training goes on
                self.fail("store", exc, _step_of(rec))
        for i, sink in enumerate(self.sinks):
            probe = f"sink {i}"
            if probe in self.disabled:
                continue
            try:
                sink.write(rec)
            except Exception as exc:  # a failing sink is disabled; the JSONL store goes on
                self.fail(probe, exc, _step_of(rec))

    def close(self, end: Callable[[], dict[str, Any]]) -> None:
        """Drain, then write the record ``end()`` gives (built after the drain, so it sees every failure) and stop."""
        if self.file is None:
            return
        self.drain()
        self.write(end())
        self._queue.put(_STOP)
        self._thread.join()
        atexit.unregister(self._at_exit)
        self.file.close()
        self.file = None
        for i, sink in enumerate(self.sinks):
            close = getattr(sink, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:
                    self.fail(f"sink {i}", exc)


def _step_of(rec: dict[str, Any]) -> int:
    """The step a record's failure is told at: a step's own, the header's 0, the end's one past the last step."""
    if "step" in rec:
        return rec["step"]
    return rec["last_step"] + 1 if rec.get("kind") == "end" else 0


def _drain_at_exit(ref) -> None:
    writer = ref()
    if writer is not None and writer.file is not None and writer._pid == os.getpid():
        writer.drain()
        writer.file.flush()


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
