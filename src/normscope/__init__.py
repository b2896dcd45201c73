"""normscope: make normalization layers trustworthy.

State the contract of a normalization as data (:class:`NormSpec`), compute it with a float64 reference
(:mod:`normscope.reference`), and build modules from it (:mod:`normscope.nn`).
"""

from __future__ import annotations

from . import reference
from .errors import (
    InputError,
    MissingExtraError,
    NormscopeError,
    NotANormalization,
    SpecError,
    TargetError,
)
from .presets import presets
from .spec import NormSpec

__version__ = "0.1.0"

__all__ = [
    "InputError",
    "MissingExtraError",
    "NormSpec",
    "NormscopeError",
    "NotANormalization",
    "SpecError",
    "TargetError",
    "presets",
    "reference",
    "__version__",
]

from . import targets  # noqa: E402
from .probe.checks import Finding, Report, check  # noqa: E402
from .probe.infer import Inference, infer  # noqa: E402

__all__ += ["Finding", "Inference", "Report", "check", "infer", "targets"]


def __getattr__(name: str):
    # scan needs torch, which `import normscope` does not load: imported on first use. The package
    # normscope.scan is callable, so normscope.scan(model, inputs) is the function.
    if name in ("scan", "ModelScan", "Site"):
        import importlib

        _scan = importlib.import_module(".scan", __name__)
        return _scan if name == "scan" else getattr(_scan, name)
    raise AttributeError(f"module 'normscope' has no attribute {name!r}")
