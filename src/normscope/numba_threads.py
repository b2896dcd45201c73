"""numba's parallel kernels run on as many threads as torch uses, and leave torch's thread count as it was.

numba's OpenMP threading layer can share torch's OpenMP runtime, where a parallel launch sets the runtime's
thread count (a user's ``torch.set_num_threads(1)`` became 2 after a launch on numba's default count); and numba
would otherwise use every core while torch was told to use fewer.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def matched():
    """Around a call of numba parallel kernels: numba's thread count set to torch's (within numba's pool), and
    torch's restored afterwards if the launch changed it."""
    import numba

    n = torch.get_num_threads()
    try:
        want = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
        if numba.get_num_threads() != want:
            numba.set_num_threads(want)
        yield
    finally:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
