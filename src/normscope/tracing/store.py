"""The run store: ``RUN_DIR/trace.jsonl``, one JSON object per line, append-only (schema ``normscope.trace/1``).

Lines: a ``header`` (schema, model, blocks, norms, ``every``, world size) each time a tracer opens the run, one
``step`` record per recorded step (its ``entries``: stage, layer, site and sufficient statistics; its per-sample
``samples``; ``sample_ids``; the learning rate of each parameter group in its ``update`` entries), and an ``end``
line when the tracer closes (with the probes that were disabled and why). Each line is written whole and flushed,
so a killed process loses at most the step in flight and a reader sees only whole lines: :func:`read_run` skips a
last line that is still being written.

A damaged file (bytes that are not UTF-8, NUL blocks from a crash, a line cut by a kill and followed by a resumed
run's header, a record of the wrong shape) is read for what is readable: each damaged line is skipped and named
in :attr:`Run.damaged`, never raised.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from ..errors import InputError

SCHEMA = "normscope.trace/1"
TRACE_FILE = "trace.jsonl"
MAX_DAMAGED = 50  # damaged lines named one by one; past this, counted


def _num(v: Any) -> Any:
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    if isinstance(v, list):
        return [_num(x) for x in v]
    if isinstance(v, dict):
        return {k: _num(x) for k, x in v.items()}
    return v


def trace_path(run_dir: str | os.PathLike) -> Path:
    p = Path(run_dir)
    if p.is_file():
        return p
    f = p / TRACE_FILE
    if not f.is_file():
        what = "no such folder" if not p.exists() else f"no {TRACE_FILE} in it"
        raise InputError(f"{run_dir}: {what}; pass the run_dir given to normscope.trace(model, run_dir)")
    return f


@dataclasses.dataclass
class Run:
    """One training run of a trace file: its headers, its step records (ordered by step; a step recorded twice, as
    by a resumed run, keeps its last record), its end lines, and one line per damaged record that was skipped.

    A folder reused by a later run holds several (:attr:`runs`, one summary each, oldest first); the one read is
    :attr:`number` (1-based; the latest unless asked for another)."""
    path: Path
    headers: list[dict[str, Any]]
    records: list[dict[str, Any]]
    ends: list[dict[str, Any]]
    damaged: list[str]
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    number: int = 1

    def __iter__(self):  # ``headers, records, ends = read_run(...)``
        return iter((self.headers, self.records, self.ends))

    def __getitem__(self, i: int):
        return (self.headers, self.records, self.ends)[i]


_NUMBERS = ("sumsq", "n", "max", "nonfinite")
_REQUIRED = {"attention_logits": (("nonfinite",), ("max_logit", "masked_rows", "entropy_sum", "entropy_rows")),
             "loss": (("sum", "count", "nonfinite"), ()),
             "update": (("sumsq", "n", "param_sumsq", "nonfinite"), ())}


def is_number(v: Any) -> bool:
    """A JSON number of a record (a bool is not one)."""
    return isinstance(v, int | float) and not isinstance(v, bool)


def _entry_ok(e: Any) -> bool:
    """Whether an entry has its stage, layer, site and the numbers its stage's metrics are computed from."""
    if not (isinstance(e, dict) and isinstance(e.get("stage"), str) and isinstance(e.get("site"), str)
            and (e.get("layer") is None or isinstance(e.get("layer"), int))):
        return False
    numbers, lists = _REQUIRED.get(e["stage"], (_NUMBERS, ()))
    return (all(is_number(e.get(k)) for k in numbers)
            and all(isinstance(e.get(k), list) and all(is_number(x) for x in e[k]) for k in lists))


def _step_problem(rec: dict[str, Any]) -> tuple[str | None, str | None]:
    """(why the step record cannot be used, what was dropped from it); entries of the wrong shape are dropped
    from it in place."""
    step = rec.get("step")
    if not is_number(step) or not math.isfinite(step) or step != int(step):
        return f"its step is {step!r}, not an integer", None
    entries = rec.get("entries")
    if not isinstance(entries, list):
        return "it has no list of entries", None
    good = [e for e in entries if _entry_ok(e)]
    rec["entries"] = good
    if not isinstance(rec.get("samples"), dict):
        rec["samples"] = {}
    ids = rec.get("sample_ids")
    if ids is not None and not isinstance(ids, list):
        rec["sample_ids"] = None
    if len(good) < len(entries):
        return None, f"{len(entries) - len(good)} of its {len(entries)} entries have the wrong shape (kept the rest)"
    return None, None


def _objects(text: str) -> tuple[list[dict[str, Any]], bool]:
    """(the records of one line, whether the line was exactly one record). A line cut by a kill and continued by
    the next write (a resumed run's header appended to a half-written record) gives the whole records that begin
    after the cut."""
    try:
        obj = json.loads(text)
        return ([obj], True) if isinstance(obj, dict) else ([], False)
    except json.JSONDecodeError:
        pass
    dec = json.JSONDecoder()
    found, i = [], text.find("{", 1)
    while i > 0:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict) and "kind" in obj:
            found.append(obj)
            i = text.find("{", end)
        else:
            i = text.find("{", i + 1)
    return found, False


@dataclasses.dataclass
class _Segment:
    """What one opening of a tracer wrote: its header (None before the first readable one), steps and end lines."""
    header: dict[str, Any] | None
    line: int
    steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ends: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def _runs(segments: list[_Segment]) -> list[list[_Segment]]:
    """The segments grouped into training runs. A tracer opened again on the same folder resumes the run when its
    first recorded step comes after the run's first (training resumed from a checkpoint re-records from there);
    at or before it (training started again from the start), a new run begins. A segment without steps (a tracer
    opened and closed before recording) belongs to the run it was opened in."""
    runs: list[list[_Segment]] = []
    first: int | None = None  # the current run's first recorded step
    for seg in segments:
        start = min((int(r["step"]) for r in seg.steps), default=None)
        if not runs or (start is not None and first is not None and start <= first):
            runs.append([seg])
            first = start
        else:
            runs[-1].append(seg)
            first = start if first is None else first
    return runs


def read_run(run_dir: str | os.PathLike, run: int | None = None) -> Run:
    """Read a run's trace file, also while it is being written; damaged lines are skipped and named.

    ``run``: which training run of a folder that holds several (1 the oldest; -1 or None the latest)."""
    path = trace_path(run_dir)
    segments: list[_Segment] = [_Segment(None, 0)]
    damaged: list[str] = []
    n_damaged = 0

    def damage(lineno: int, why: str) -> None:
        nonlocal n_damaged
        n_damaged += 1
        if n_damaged <= MAX_DAMAGED:
            damaged.append(f"line {lineno}: {why}")

    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    lines = raw.split(b"\n")
    last = len(lines) - 1  # the text after the last newline: the line in flight (or nothing)
    for i, blob in enumerate(lines):
        if i == last:
            if blob.strip(b"\0 \r\t"):
                damage(i + 1, "incomplete (the line being written, or cut by a crash)")
            break
        if b"\0" in blob:  # a block the file system zero-filled after a crash
            blob = blob.replace(b"\0", b"")
            if blob.strip():
                damage(i + 1, "NUL bytes inside a record (a crash's zero-filled block); read what remains")
            else:
                damage(i + 1, "NUL bytes only (a crash's zero-filled block)")
                continue
        blob = blob.strip()
        if not blob:
            continue
        try:
            text = blob.decode("utf-8")
        except UnicodeDecodeError as exc:
            damage(i + 1, f"not UTF-8 text ({exc.reason} at byte {exc.start})")
            continue
        objs, whole = _objects(text)
        if not objs:
            damage(i + 1, "not a JSON record")
            continue
        if not whole:
            damage(i + 1, "a record cut by a crash; the whole record(s) after the cut were read")
        for rec in objs:
            kind = rec.get("kind")
            if kind == "header":
                if rec.get("schema") != SCHEMA:
                    raise InputError(f"{path}:{i + 1}: schema {rec.get('schema')!r}, expected {SCHEMA!r}; this file "
                                     "was not written by this version of normscope.trace")
                segments.append(_Segment(rec, i + 1))
            elif kind == "step":
                rec = _num(rec)
                fatal, dropped = _step_problem(rec)
                if fatal is not None:
                    damage(i + 1, f"a step record that cannot be used: {fatal}")
                    continue
                if dropped is not None:
                    damage(i + 1, f"step {int(rec['step'])}: {dropped}")
                segments[-1].steps.append(rec)
            elif kind == "end":
                segments[-1].ends.append(rec)
            else:
                damage(i + 1, f"a JSON object of unknown kind {kind!r}")
    if n_damaged > MAX_DAMAGED:
        damaged.append(f"… {n_damaged - MAX_DAMAGED} more damaged lines")
    if segments[0].steps or segments[0].ends:  # records before any readable header: the header was lost
        segments[0].header = {"schema": SCHEMA, "kind": "header", "model": None, "lost": True}
        damaged.append("no readable header line before the first records: the model's name and settings are unknown")
    segments = [s for s in segments if s.header is not None]
    if not segments:
        raise InputError(f"{path} has no normscope.trace header line and no readable step record; it was not "
                         "written by normscope.trace, or it is damaged beyond reading")
    runs = _runs(segments)
    number = len(runs) if run in (None, -1) else run
    if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= len(runs):
        raise InputError(f"run {run!r}: {path} holds {len(runs)} run{'s' * (len(runs) != 1)}; pick 1 to {len(runs)} "
                         "(or -1, the latest)")
    summaries = [_summary(k + 1, r) for k, r in enumerate(runs)]
    chosen = runs[number - 1]
    steps: dict[int, dict[str, Any]] = {}
    for seg in chosen:
        for rec in seg.steps:
            steps[int(rec["step"])] = rec
    return Run(path, [s.header for s in chosen], [steps[k] for k in sorted(steps)],
               [e for s in chosen for e in s.ends], damaged, summaries, number)


def _summary(number: int, run: list[_Segment]) -> dict[str, Any]:
    steps = sorted({int(r["step"]) for s in run for r in s.steps})
    return {"run": number, "line": run[0].line, "time": run[0].header.get("time"), "openings": len(run),
            "steps_recorded": len(steps), "first_step": steps[0] if steps else None,
            "last_step": steps[-1] if steps else None, "closed": sum(len(s.ends) for s in run) >= len(run)}


def finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)
