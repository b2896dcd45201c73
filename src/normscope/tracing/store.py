"""The run store: ``RUN_DIR/trace.jsonl``, one JSON object per line, append-only (schema ``normscope.trace/1``).

Lines: a ``header`` (schema, model, blocks, norms, ``every``, world size) each time a tracer opens the run, one
``step`` record per recorded step (its ``entries``: stage, layer, site and sufficient statistics; its per-sample
``samples``; ``sample_ids``), and an ``end`` line when the tracer closes (with the probes that were disabled and
why). Each line is written whole and flushed, so a killed process loses at most the step in flight and a reader
sees only whole lines: :func:`read_run` skips a last line that is still being written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..errors import InputError

SCHEMA = "normscope.trace/1"
TRACE_FILE = "trace.jsonl"


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


def read_run(run_dir: str | os.PathLike) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(headers, step records, end lines) of a run; a step recorded twice (a resumed run) keeps its last record."""
    path = trace_path(run_dir)
    headers, ends = [], []
    steps: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.endswith("\n"):
                break  # the line in flight
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{i + 1} is not JSON ({exc}); the trace file is damaged") from None
            kind = rec.get("kind")
            if kind == "header":
                if rec.get("schema") != SCHEMA:
                    raise InputError(f"{path}:{i + 1}: schema {rec.get('schema')!r}, expected {SCHEMA!r}")
                headers.append(rec)
            elif kind == "step":
                steps[int(rec["step"])] = _num(rec)
            elif kind == "end":
                ends.append(rec)
    if not headers:
        raise InputError(f"{path} has no normscope.trace header line; it was not written by normscope.trace")
    return headers, [steps[k] for k in sorted(steps)], ends


def finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)
