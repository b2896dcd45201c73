"""Watch a training run along the residual chain (see docs/trace.md).

``normscope.trace(model, run_dir, every=1)`` records, per recorded step, the statistics of each link of the chain
(data → layer input → norm input/output → attention logits → sublayer output → residual sum → loss, then
gradients and updates) into ``run_dir/trace.jsonl``; ``normscope.diagnose(run_dir)`` finds the first link that
broke. The names are imported on first use, so the command line can register ``diagnose`` without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

_LAZY = {
    "trace": ".recorder",
    "Tracer": ".recorder",
    "diagnose": ".diagnosis",
    "Diagnosis": ".diagnosis",
    "Anomaly": ".diagnosis",
    "STAGES": ".diagnosis",
    "SCHEMA": ".store",
    "read_run": ".store",
    "TensorBoardSink": ".sinks",
    "TraceCallback": ".callback",
}

__all__ = ["SCHEMA", "STAGES", "Anomaly", "Diagnosis", "TensorBoardSink", "TraceCallback", "Tracer", "diagnose",
           "read_run", "trace"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

if TYPE_CHECKING:
    from .callback import TraceCallback
    from .diagnosis import STAGES, Anomaly, Diagnosis, diagnose
    from .recorder import Tracer, trace
    from .sinks import TensorBoardSink
    from .store import SCHEMA, read_run
