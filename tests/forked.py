"""Run a function in a forked child and read back what it returns (bytes), with a time limit."""

from __future__ import annotations

import gc
import os
import select
import signal
from collections.abc import Callable

import pytest


def in_forked_child(fn: Callable[[], bytes], timeout: float = 120.0) -> bytes:
    """``fn()`` in a child made by ``os.fork()``; its bytes, or a test failure when it fails, dies or hangs.

    The garbage earlier tests left is collected before the fork and the child collects none: collected in the
    child, an object whose destructor waits on its own threads (an ONNX Runtime session's pool) waits forever,
    those threads not being forked."""
    read, write = os.pipe()
    gc.collect()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            gc.disable()
            os.write(write, fn())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child gave nothing in {timeout:.0f} s (killed)")
        got = os.read(read, 1 << 16)
    finally:
        os.close(read)
    _, status = os.waitpid(pid, 0)
    assert status == 0, f"the forked child exited with status {status}"
    return got
