"""Watch a training run along the residual chain (see docs/trace.md).

``normscope.trace(model, run_dir, every=1)`` records, per recorded step, the statistics of each link of the chain
(data → layer input → norm input/output → attention logits → sublayer output → residual sum → loss, then
gradients and updates) into ``run_dir/trace.jsonl``; ``normscope.diagnose(run_dir)`` finds the first link that
broke. The names are imported on first use, so the command line can register ``diagnose`` without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_LAZY = {
    "trace": ".recorder",
    "Tracer": ".recorder",
    "diagnose": ".detect",
    "Diagnosis": ".detect",
    "Anomaly": ".detect",
    "STAGES": ".detect",
    "SCHEMA": ".store",
    "read_run": ".store",
}

__all__ = ["SCHEMA", "STAGES", "Anomaly", "Diagnosis", "Tracer", "diagnose", "read_run", "trace"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'normscope.tracing' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .detect import STAGES, Anomaly, Diagnosis, diagnose
    from .recorder import Tracer, trace
    from .store import SCHEMA, read_run
