"""numba in one place: how its kernels are loaded (:func:`load`: compiled once per process, or None with the
reason kept, :func:`why_not`) and when and how its parallel kernels run: on as many threads as torch uses,
leaving torch's thread count as it was, and only where a parallel launch is safe. Every numba user of the
package (the fused norm kernels, the tracer's statistics, diff's error metrics) loads through :func:`load`;
an explicit request for a numba backend raises with that reason, the others fall back to torch.

numba's OpenMP threading layer can share torch's OpenMP runtime, where a parallel launch sets the runtime's
thread count (a user's ``torch.set_num_threads(1)`` became 2 after a launch on numba's default count); and numba
would otherwise use every core while torch was told to use fewer. GNU OpenMP terminates a forked child that
launches parallel work after its parent did, and numba's ``workqueue`` layer aborts the process when two threads
launch at once: there, each kernel's serial build runs instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch

_STATE = {"forked": False, "layer_ok": None}
_LOADED: dict[str, tuple[object | None, Exception | None]] = {}  # key → (the built kernels or None, why not)


def load(key: str, build: Callable[[], object], required: bool = False) -> object | None:
    """``build()`` once per process (importing and compiling numba code): its result, or None where numba is
    missing or cannot compile here (the reason kept for :func:`why_not`). ``required``: raise that reason
    instead (a numba backend the user asked for by name)."""
    if key not in _LOADED:
        try:
            _LOADED[key] = (build(), None)
        except Exception as exc:
            _LOADED[key] = (None, exc)
    value, exc = _LOADED[key]
    if exc is not None and required:
        raise exc
    return value


def why_not(key: str) -> str | None:
    """Why :func:`load` gave None for ``key`` (None: it loaded, or was never asked)."""
    exc = _LOADED.get(key, (None, None))[1]
    return None if exc is None else f"{type(exc).__name__}: {exc}"


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
    both restored afterwards (torch's if the launch changed it, numba's as the caller had it)."""
    import numba

    n = torch.get_num_threads()
    before = numba.get_num_threads()
    try:
        want = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
        if before != want:
            numba.set_num_threads(want)
        yield
    finally:
        if numba.get_num_threads() != before:
            numba.set_num_threads(before)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


#: Below this many elements a kernel runs on the calling thread: waking the pool costs more than the work (one row
#: of 4096 through a norm kernel: ~3 µs serial, ~7 µs parallel).
SERIAL_BELOW = 1 << 14


def launch(parallel, serial, *args, elements: int | None = None) -> None:
    """Run a numba kernel: its ``parallel`` build where :func:`parallel_allowed`, else its ``serial`` one, within
    :func:`matched`; its ``serial`` one on the calling thread, without touching the thread counts, for fewer than
    :data:`SERIAL_BELOW` ``elements`` (read at each call)."""
    if elements is not None and elements < SERIAL_BELOW:
        serial(*args)
        return
    if not parallel_allowed():
        serial(*args)
        return
    import numba

    n = torch.get_num_threads()
    if n <= 1:  # one thread either way: the serial build, with no thread count to set and restore
        serial(*args)
        return
    if numba.get_num_threads() == min(n, numba.config.NUMBA_NUM_THREADS):  # already matched: nothing to restore
        try:
            parallel(*args)
        finally:
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)
        return
    with matched():
        parallel(*args)
