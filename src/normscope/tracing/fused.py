"""One-read statistics for the tracer on the CPU (numba): Σx² and max |x| of a float32 tensor in one pass, and a
parameter update's difference with its sums of squares in one pass over the two copies.

torch needs two reductions for the first (a dot and a min/max) and four passes for the second (the difference,
its sum of squares, its min/max, the parameter's sum of squares); at a recorded step these passes are most of the
tracer's cost. max |x| is taken on the bit patterns (sign cleared), an integer maximum that vectorises and that a
NaN or an infinity also reaches (their exponent bits are all ones): a result at or above ``INF_BITS`` means the
tensor holds a non-finite value, and the caller takes its exact path. Sums accumulate in float64.

Used for contiguous CPU float32 tensors when numba is installed (the ``kernels`` extra); anything else, or a
machine where numba cannot compile, gets torch's reductions (:func:`available` says which).
"""

from __future__ import annotations

import math

import numpy as np
import torch

INF_BITS = 0x7F800000
_KERNELS: list = []


def _compile():
    import numba

    fast = {"reassoc", "contract", "nsz"}  # reassociation lets the sums vectorise; NaN and inf still propagate

    @numba.njit(cache=True, nogil=True, fastmath=fast, boundscheck=False)
    def sumsq_maxbits(x, bits):  # pragma: no cover - compiled
        s = 0.0
        m = np.int32(0)
        for i in range(x.size):
            v = np.float64(x[i])
            s += v * v
            m = max(m, bits[i] & np.int32(0x7FFFFFFF))
        return s, m

    @numba.njit(cache=True, nogil=True, fastmath=fast, boundscheck=False)
    def subtract_sumsq(old, new):  # pragma: no cover - compiled
        """old -= new in place; returns (Σ(old - new)², Σnew²)."""
        su = 0.0
        sp = 0.0
        for i in range(old.size):
            d = old[i] - new[i]
            old[i] = d
            w = np.float64(new[i])
            su += np.float64(d) * np.float64(d)
            sp += w * w
        return su, sp

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def maxbits(bits):  # pragma: no cover - compiled
        m = np.int32(0)
        for i in range(bits.size):
            m = max(m, bits[i] & np.int32(0x7FFFFFFF))
        return m

    x = np.ones(4, np.float32)  # compile (or load from the cache) now, not inside a probe's first call
    sumsq_maxbits(x, x.view(np.int32))
    subtract_sumsq(x.copy(), x)
    maxbits(x.view(np.int32))
    return sumsq_maxbits, subtract_sumsq, maxbits


def _kernels():
    if not _KERNELS:
        try:
            _KERNELS.append(_compile())
        except Exception:  # numba missing or unable to compile here: torch's reductions
            _KERNELS.append(None)
    return _KERNELS[0]


def available() -> bool:
    return _kernels() is not None


def eligible(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and x.numel() > 0


def _max_abs(bits: int) -> float:
    return math.inf if bits >= INF_BITS else float(np.int32(bits).view(np.float32))


def sumsq_max(x: torch.Tensor) -> tuple[float, float] | None:
    """(Σx², max |x|) of a contiguous CPU float32 tensor in one read, max |x| = inf when the tensor holds a NaN or
    an infinity; None where this path does not apply (the caller uses torch)."""
    k = _kernels()
    if k is None or not eligible(x):
        return None
    a = x.detach().reshape(-1).numpy()
    s, m = k[0](a, a.view(np.int32))
    return s, _max_abs(int(m))


def update_sums(old: torch.Tensor, new: torch.Tensor) -> tuple[float, float, float] | None:
    """Turn ``old`` into ``old - new`` in place and return (Σ(old - new)², max |old - new|, Σnew²); max is inf
    when a difference is not finite. None where this path does not apply (``old`` is then unchanged)."""
    k = _kernels()
    if k is None or not (eligible(old) and eligible(new)) or old.shape != new.shape:
        return None
    o, n = old.reshape(-1).numpy(), new.detach().reshape(-1).numpy()
    su, sp = k[1](o, n)
    return su, _max_abs(int(k[2](o.view(np.int32)))), sp
