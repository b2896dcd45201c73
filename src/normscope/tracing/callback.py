"""``TraceCallback``: trace a Hugging Face ``Trainer`` run with one line.

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TraceCallback("runs/exp1")])

The callback opens a :func:`normscope.trace` on the model when training begins, records the loss of every
micro-batch the model returns (``outputs.loss``, through a forward hook on the model), closes each optimizer step
with ``tr.step(global_step, loss=...)`` and closes the tracer when training ends. The tracer's probes never raise
into the Trainer; neither does the callback.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import TrainerCallback

from .recorder import Tracer

log = logging.getLogger("normscope.trace")


class TraceCallback(TrainerCallback):
    """Record a ``Trainer`` run into ``run_dir`` (see :func:`normscope.trace` for ``every`` and the other options)."""

    def __init__(self, run_dir: str | os.PathLike, every: int = 1, **trace_kw: Any):
        self.run_dir, self.every, self.trace_kw = run_dir, every, trace_kw
        self.tracer: Tracer | None = None
        self._losses: list[float] = []
        self._hook = None

    def on_train_begin(self, args, state, control, model=None, **kw):
        if model is None or self.tracer is not None:
            return
        self.tracer = Tracer(model, self.run_dir, every=self.every, **self.trace_kw)
        self.tracer.open()
        self._hook = model.register_forward_hook(self._keep_loss)

    def _keep_loss(self, module, args, output) -> None:
        try:
            loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, dict):
                loss = output.get("loss")
            if loss is not None and module.training:
                self._losses.append(float(loss.detach().float().mean()))
        except Exception as exc:  # never break training
            log.warning("normscope.trace: the Trainer callback could not read the loss (%s)", exc)

    def on_step_end(self, args, state, control, **kw):
        if self.tracer is None:
            return
        losses, self._losses = self._losses, []
        loss = sum(losses) / len(losses) if losses else None
        self.tracer.step(state.global_step - 1, loss=loss)

    def on_train_end(self, args, state, control, **kw):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.tracer is not None:
            self.tracer.close()
            self.tracer = None
