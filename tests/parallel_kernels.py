"""A numba kernel's ``prange`` really runs in parallel: numba runs one it cannot transform as a plain loop, on one
thread, and says so only with a warning at compile time (a conditional in a ``prange`` bound once did this to the
16-bit norm forward). Used by the kernel and tracer tests."""

from __future__ import annotations

import warnings


def assert_transformed(kernel, **options) -> None:
    """``kernel`` (a parallel numba dispatcher that has been called), compiled afresh without its cache, with
    ``options`` (its own ``njit`` options but ``cache``) for its first signature, compiles without numba's warning
    that no transformation for parallel execution was possible."""
    from numba import njit
    from numba.core.errors import NumbaPerformanceWarning

    assert kernel.signatures, f"{kernel.py_func.__name__} was not called"
    fresh = njit(parallel=True, **{k: v for k, v in options.items() if k != "cache"})(kernel.py_func)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumbaPerformanceWarning)
        fresh.compile(kernel.signatures[0])
