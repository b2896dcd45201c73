"""normscope: make normalization layers trustworthy.

State the contract of a normalization as data (:class:`NormSpec`), compute it with a float64 reference
(:mod:`normscope.reference`), and build modules from it (:mod:`normscope.nn`).

The public names are imported on first use, so ``normscope --help`` and ``normscope explain`` do not load
the probes (and nothing loads torch unless a torch target is used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import (
    InputError,
    MissingExtraError,
    NormscopeError,
    NotANormalization,
    SpecError,
    TargetError,
    TargetTimeout,
)
from .lazy import lazy_exports
from .presets import presets  # the function; cheap (no NumPy), so imported eagerly
from .spec import NormSpec

__version__ = "0.1.0"

_LAZY = {
    "Finding": ".results.check",
    "Report": ".results.check",
    "check": ".battery.check",
    "Inference": ".probe.infer",
    "infer": ".probe.infer",
    "scan": ".sites",
    "ModelScan": ".sites",
    "Site": ".sites",
    "diff": ".divergence",
    "Diff": ".divergence",
    "load": ".documents",
    "trace": ".tracing",
    "diagnose": ".tracing",
    "Diagnosis": ".tracing",
    "Anomaly": ".tracing",
    "gradflow": ".gradient_flow",
    "GradFlow": ".gradient_flow",
    "Capabilities": ".targets",
    "Outputs": ".targets",
    "contract": ".artifacts",
    "ModelContract": ".artifacts",
    "ContractDiff": ".artifacts",
}
_SUBMODULES = ("kernels", "reference", "sources", "targets")

__all__ = [
    "InputError",
    "MissingExtraError",
    "NormSpec",
    "NormscopeError",
    "NotANormalization",
    "SpecError",
    "TargetError",
    "TargetTimeout",
    "presets",
    "reference",
    "__version__",
    "Finding",
    "Inference",
    "Report",
    "check",
    "infer",
    "targets",
    "scan",
    "ModelScan",
    "Site",
    "contract",
    "ModelContract",
    "ContractDiff",
    "diff",
    "Diff",
    "load",
    "trace",
    "diagnose",
    "Diagnosis",
    "Anomaly",
    "gradflow",
    "GradFlow",
    "Capabilities",
    "Outputs",
    "kernels",
    "sources",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, _SUBMODULES)


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from . import reference, targets
    from .artifacts import ContractDiff, ModelContract, contract
    from .battery.check import check
    from .divergence import Diff, diff
    from .documents import load
    from .gradient_flow import GradFlow, gradflow
    from .probe.infer import Inference, infer
    from .results.check import Finding, Report
    from .sites import ModelScan, Site, scan
    from .tracing import Anomaly, Diagnosis, diagnose, trace
