"""When and how numba's parallel kernels run: on as many threads as torch uses, leaving torch's thread count as it
was, and only where a parallel launch is safe.

numba's OpenMP threading layer can share torch's OpenMP runtime, where a parallel launch sets the runtime's
thread count (a user's ``torch.set_num_threads(1)`` became 2 after a launch on numba's default count); and numba
would otherwise use every core while torch was told to use fewer. GNU OpenMP terminates a forked child that
launches parallel work after its parent did, and numba's ``workqueue`` layer aborts the process when two threads
launch at once: there, each kernel's serial build runs instead.
"""

from __future__ import annotations

import contextlib
import os

import torch

_STATE = {"forked": False, "layer_ok": None}


def _forked() -> None:
    _STATE["forked"] = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def parallel_allowed() -> bool:
    """Whether numba's parallel kernels may be launched here: not in a forked child, and only under a threading
    layer that is safe for launches from several threads (OpenMP, TBB)."""
    if _STATE["forked"]:
        return False
    if _STATE["layer_ok"] is None:
        try:
            import numba

            numba.get_num_threads()  # starts numba's threading layer if it has not started
            _STATE["layer_ok"] = numba.config.NUMBA_NUM_THREADS > 1 and numba.threading_layer() in ("omp", "tbb")
        except Exception:  # no usable threading layer
            _STATE["layer_ok"] = False
    return bool(_STATE["layer_ok"])


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


def launch(parallel, serial, *args) -> None:
    """Run a numba kernel: its ``parallel`` build where :func:`parallel_allowed`, else its ``serial`` one, within
    :func:`matched`."""
    with matched():
        (parallel if parallel_allowed() else serial)(*args)
