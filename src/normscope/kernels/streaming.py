"""Streaming (non-temporal) stores for the CPU row kernels: a row computed in a small scratch buffer is written
to its output without the output's cache lines being read first.

An ordinary store of a line that is not in cache reads the line before it writes it, so a kernel that reads x and
writes y moves three tensors' worth of bytes where an allocating copy (``x.clone()``, whose ``memcpy`` streams
large copies) moves two. Streaming stores take the third away; they also leave nothing of y in cache, so they pay
only when y is too large to stay there anyway (:data:`STREAM_MIN_BYTES`).

The store is LLVM's ``!nontemporal`` hint on 32-byte vector stores (``vmovntps`` on x86-64; where a target has
no such store, an ordinary one). Such a store needs an aligned address: :func:`stream_row` writes a row's
unaligned head and its tail with ordinary stores. Streaming stores are weakly ordered, so a kernel ends with
:func:`store_fence` before its output is read.
"""

from __future__ import annotations

import os

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

VECTOR_BYTES = 32


def _l3_bytes() -> int:
    try:
        return int(os.sysconf("SC_LEVEL3_CACHE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


#: Outputs at least this large are streamed: the last-level cache (32 MiB where it cannot be read), below which
#: the output may still be in cache for whatever reads it next.
STREAM_MIN_BYTES = _l3_bytes() or 32 << 20


@intrinsic
def _store32_nontemporal(typingctx, dst, src):
    """32 bytes from address ``src`` (any alignment) to address ``dst`` (32-byte aligned), a streaming store."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        d, s = args
        vec = ir.VectorType(ir.IntType(32), VECTOR_BYTES // 4)
        value = builder.load(builder.inttoptr(s, vec.as_pointer()), align=1)
        store = builder.store(value, builder.inttoptr(d, vec.as_pointer()), align=VECTOR_BYTES)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_fence(typingctx):
    """A sequentially consistent fence: the streaming stores before it are visible to every thread after it."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def stream_row(dst, src, n):
    """``dst[:n] = src[:n]`` for 1-D contiguous arrays of one dtype: streaming stores wherever ``dst`` is 32-byte
    aligned, ordinary ones for its head before that and its tail."""
    size = dst.itemsize
    address = dst.ctypes.data
    step = VECTOR_BYTES // size
    head = n
    if address % size == 0:
        head = min(n, (VECTOR_BYTES - address % VECTOR_BYTES) % VECTOR_BYTES // size)
    for j in range(head):
        dst[j] = src[j]
    body = head + (n - head) // step * step
    source = src.ctypes.data
    for j in range(head, body, step):
        _store32_nontemporal(address + size * j, source + size * j)
    for j in range(body, n):
        dst[j] = src[j]
