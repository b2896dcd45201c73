"""Sinks for ``normscope.trace(model, run_dir, sinks=[...])``: other places the trace's records also go.

A sink is any object with ``write(record)`` (and optionally ``close()``); on rank 0 the tracer hands it every
record it writes to ``run_dir/trace.jsonl`` (``header``, ``step``, ``end``), in order, on the tracer's writer thread
(not the training thread), and a sink that raises is disabled while the JSONL store goes on. The JSONL stays the
source of truth (``normscope.diagnose`` reads only it).

:class:`TensorBoardSink` writes each step record's series as TensorBoard scalars, with the values that
``normscope.diagnose`` judges (derived from the entries by :mod:`normscope.tracing.diagnosis`), under tags grouped by
metric so that each TensorBoard section is one kind of number:

==============================================  ===============================================================
tag                                             value
==============================================  ===============================================================
``loss``                                        the step's loss
``rms/<stage>/layer<i>/<site>``                 RMS of an activation (``layer_input`` … ``residual_sum``)
``max/<stage>/layer<i>/<site>``                 max |x| of an activation
``scale_rms/norm_output/layer<i>/<site>``       RMS of the norm's scale γ
``min_row_rms/norm_input/layer<i>/<site>``      the smallest per-row RMS of a norm's input
``max_logit/layer<i>/head<h>``                  max |logit| of an attention head over unmasked entries
``entropy/layer<i>/head<h>``                    mean softmax entropy of a head (sampled query rows)
``focus/layer<i>/head<h>``                      how far that is below uniform attention's entropy (nats)
``masked_rows/layer<i>/head<h>``                fully masked query rows of a head
``masked_samples/layer<i>/head<h>``             samples whose every query row is fully masked, per head
``nonfinite/attention_logits/layer<i>/head<h>`` non-finite logits of a head
``grad_rms/layer<i>/<group>``, ``grad_max/…``   gradient RMS and max |g| per parameter group
``update_ratio/layer<i>/<group>``               RMS(Δparameter) / RMS(parameter) per parameter group
``update_lr/layer<i>/<group>``                  the learning rate the group was stepped with
``nonfinite/<stage>/layer<i>/<site>``           non-finite fraction (activations, gradients, updates) or 0/1
                                                (loss)
``samples/<name>/rms``, ``samples/<name>/max``  histograms over the samples of the step (``data``: the model's
                                                input or its embedding), finite values only
``samples/loss``                                histogram of the per-sample losses (where ``losses=`` is given)
``samples/<name>/nonfinite_samples``            how many samples carry a non-finite value
``trace/header``, ``trace/end`` (text)          the run's model, blocks, norms; the probes disabled and why
==============================================  ===============================================================

Outside the blocks the ``layer<i>`` part is left out (``rms/norm_output/ln_f``, ``grad_rms/wte``); an empty site
(``layer_input``, SDPA attention) is left out too. The global step is the trace's step and the wall time the
record's own. A step's values go out as one event through ``torch.utils.tensorboard.FileWriter``: the
``SummaryWriter.add_scalar`` way, one event per value, waits on the writer thread's queue each time (~0.33 ms a
value, ~75 ms for the 222 series of the 3-layer test decoder), while one event per step costs that decoder's
traced step (~24 ms on one CPU thread) 0.6-3 ms in all.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any

from ..errors import InputError, MissingExtraError
from ..extras import require
from .diagnosis import entry_metrics, rms

__all__ = ["TensorBoardSink", "record_samples", "record_scalars", "tag"]

HIST_BINS = 30  # a fixed bin count: numpy's "auto" bins cost ~1.4 ms a histogram (quantiles), this ~0.1 ms

# the TensorBoard section of a (stage, metric); the default is "<metric>/<stage>", and "nonfinite/<stage>" for every
# stage: one section per kind of number
_SECTION = {"grad": "grad_{metric}", "update": "update_{metric}", "attention_logits": "{metric}", "loss": "{metric}"}


@functools.lru_cache(maxsize=8192)  # the same few hundred tags every step
def tag(stage: str, metric: str, layer: int | None = None, site: str = "", head: int | None = None) -> str:
    """The TensorBoard tag of one series (the key :func:`normscope.tracing.diagnosis.diagnose` judges it under)."""
    section = f"nonfinite/{stage}" if metric == "nonfinite" else \
        _SECTION.get(stage, "{metric}/{stage}").format(metric=metric, stage=stage)
    parts = [section, "" if layer is None else f"layer{layer}", site or "", "" if head is None else f"head{head}"]
    return "/".join(p for p in parts if p)


def record_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one ``step`` record by tag: the values ``diagnose`` judges, one per series (``{}`` for other
    records). A value that cannot be formed (no elements, no entropy rows) is left out; non-finite values stay."""
    out: dict[str, float] = {}
    if record.get("kind") != "step":
        return out
    for e in record.get("entries", ()):
        stage, layer, site = e["stage"], e.get("layer"), e.get("site") or ""
        for metric, v in entry_metrics(e).items():
            if isinstance(v, list):
                for h, vh in enumerate(v):
                    if vh is not None:
                        out[tag(stage, metric, layer, site, h)] = float(vh)
            elif v is not None:
                out[tag(stage, metric, layer, site)] = float(v)
    if isinstance(record.get("tracer_ms"), int | float):
        out["trace/tracer_ms"] = float(record["tracer_ms"])  # what recording this step cost the training thread
    return out


def record_samples(record: dict[str, Any]) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Per-sample values of one ``step`` record: (finite values by histogram tag, non-finite samples by tag).

    ``data`` samples (sufficient statistics per sample) give their RMS and max |x|, ``loss`` its per-sample losses;
    the token id range (``tokens``) is not a series ``diagnose`` judges and is left out.
    """
    hists: dict[str, list[float]] = {}
    bad: dict[str, int] = {}
    if record.get("kind") != "step":
        return hists, bad
    for name, d in (record.get("samples") or {}).items():
        if name == "loss":
            series = {"samples/loss": d.get("loss") or []}
            flags = [not _finite(v) for v in series["samples/loss"]]
            base = "samples/loss"
        elif "sumsq" in d:
            series = {f"samples/{name}/rms": [rms(s, n) for s, n in zip(d["sumsq"], d["n"], strict=False)],
                      f"samples/{name}/max": list(d.get("max") or [])}
            flags = [c > 0 for c in d.get("nonfinite") or []]
            base = f"samples/{name}"
        else:
            continue
        for t, vs in series.items():
            fin = [float(v) for v in vs if _finite(v)]
            if fin:
                hists[t] = fin
        bad[f"{base}/nonfinite_samples"] = sum(flags)
    return hists, bad


def _finite(v) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)


class TensorBoardSink:
    """Write the trace's series as TensorBoard scalars (see the module's table of tags) into ``log_dir``.

    ``flush_secs``: how often the event file is flushed to disk (TensorBoard's writer flushes also every
    ``max_queue`` steps). Needs the ``tensorboard`` package (``pip install tensorboard``); without it the
    constructor raises :class:`~normscope.errors.InputError` before the run starts. The event file is created at the
    first record, so a sink built on every rank of a distributed run writes only on rank 0 (the only rank the
    tracer hands records to). Use with ``normscope.trace(model, run_dir, sinks=[TensorBoardSink(log_dir)])``.
    """

    def __init__(self, log_dir: str | os.PathLike, *, flush_secs: float = 30, max_queue: int = 10):
        if not isinstance(log_dir, str | os.PathLike):
            raise InputError(f"log_dir must be a folder path (str or os.PathLike), got {type(log_dir).__name__}")
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, int | float) or not flush_secs > 0:
            raise InputError(f"flush_secs must be a positive number of seconds, got {flush_secs!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise InputError(f"max_queue must be a positive integer (events held before a flush), got {max_queue!r}")
        try:
            require("tensorboard", "dev")
        except MissingExtraError as exc:
            raise InputError("TensorBoardSink needs the tensorboard package, which is not installed: "
                             "pip install tensorboard (or leave the sink out: the trace's JSONL store does not "
                             "need it)") from exc
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import FileWriter
        from torch.utils.tensorboard import summary as tb_summary

        self.log_dir = os.fspath(log_dir)
        self.flush_secs = flush_secs
        self.max_queue = max_queue
        self._Summary, self._FileWriter, self._tb = Summary, FileWriter, tb_summary
        self._writer = None
        self._next_step = 0  # the global step of a header/end text: after the last step written

    def _file(self):
        if self._writer is None:
            self._writer = self._FileWriter(self.log_dir, max_queue=self.max_queue, flush_secs=self.flush_secs)
        return self._writer

    def write(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        wall = record.get("time")
        if kind == "step":
            step = int(record["step"])
            values = [self._Summary.Value(tag=t, simple_value=v) for t, v in record_scalars(record).items()]
            hists, bad = record_samples(record)
            values += [self._Summary.Value(tag=t, simple_value=float(n)) for t, n in bad.items()]
            for t, vs in hists.items():
                values.extend(self._histogram(t, vs).value)
            if values:
                self._file().add_summary(self._Summary(value=values), step, wall)
            self._next_step = max(self._next_step, step + 1)
        elif kind == "header":
            meta = {k: v for k, v in record.items() if k not in ("kind", "time", "schema")}
            text = f"{record.get('schema', '')}\n\n```\n{json.dumps(meta, indent=1, default=str)}\n```"
            self._file().add_summary(self._tb.text("trace/header", text), self._next_step, wall)
        elif kind == "end":
            lines = [f"last step {record.get('last_step')}; disabled probes: "
                     f"{', '.join(record.get('disabled') or []) or 'none'}"]
            lines += [f"- {e.get('probe')} (step {e.get('step')}): {e.get('error', e)}"
                      for e in record.get("errors") or []]
            self._file().add_summary(self._tb.text("trace/end", "\n".join(lines)), self._next_step, wall)
            self._writer.flush()

    def _histogram(self, t: str, values: list[float]):
        import numpy as np

        return self._tb.histogram(t, np.asarray(values, dtype=np.float64), bins=HIST_BINS)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; a later record opens a new one in the same folder."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()
