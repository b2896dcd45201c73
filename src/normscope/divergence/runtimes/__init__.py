"""The runtimes ``diff`` runs a candidate on, one module each behind one protocol.

Each module (:mod:`.onnx` — ONNX Runtime, :mod:`.openvino`, :mod:`.mlx`, :mod:`.llamacpp`) holds everything of
its runtime: how a candidate given in its form is recognised (``is_candidate``), how it is built (``candidate``:
a :class:`~normscope.divergence.candidate.Candidate`), run (``Candidate.run``), and how its tensors correspond to
the reference's module calls — the site map (``Candidate.align``: scopes, module names or graph tensor names,
with the transformation each tensor went through) and a site's own output on the reference's input
(``Candidate.own``), or the reason it has none (``NotMeasured``: the site is then judged on its propagated error,
never called a divergence for want of a correspondence).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any


@dataclasses.dataclass(frozen=True)
class Runtime:
    name: str  # as the verdict names it
    module: str  # the module of this package that holds it

    def _mod(self):
        return importlib.import_module(f"{__name__}.{self.module}")

    def is_candidate(self, obj) -> bool:
        return self._mod().is_candidate(obj)

    def candidate(self, obj, reference, ref_dtype: str, stack) -> Any:
        return self._mod().candidate(obj, reference, ref_dtype, stack)


#: in the order a candidate is recognised (an ONNX path before an OpenVINO IR, a GGUF last)
RUNTIMES = (Runtime("ONNX", "onnx"), Runtime("OpenVINO", "openvino"), Runtime("MLX", "mlx"),
            Runtime("llama.cpp", "llamacpp"))


def runtime_of(candidate) -> Runtime | None:
    """The runtime a candidate is given for (None: a torch module, or nothing)."""
    if candidate is None:
        return None
    return next((r for r in RUNTIMES if r.is_candidate(candidate)), None)
