"""The error model: how far an implementation of a contract may be from the exact result, and why.

:mod:`normscope.numerics.tolerance` derives per-element bounds (forward and backward) and compares outputs
against them; :mod:`normscope.numerics.constants` is the one table of the factors those bounds use. Both are
pure: a layer-by-layer diff, a kernel test or a training tracer calls them without building a battery.
"""

from .tolerance import (
    Comparison,
    Conditioning,
    accumulation_bound,
    atol,
    backward_bound,
    backward_rounding,
    compare,
    conditioning,
    faithful_gradients,
    forward_bound,
    noise_floor,
    recovery_tolerance,
    summation_factor,
)

__all__ = [
    "Comparison", "Conditioning", "accumulation_bound", "atol", "backward_bound", "backward_rounding", "compare",
    "conditioning", "faithful_gradients", "forward_bound", "noise_floor", "recovery_tolerance", "summation_factor",
]
