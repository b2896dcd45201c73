"""Streaming (non-temporal) stores for the CPU row kernels, off unless ``NORMSCOPE_STREAMING_STORES=1``: a row
computed in a small scratch buffer is written to its output without the output's cache lines being read first.

An ordinary store of a line that is not in cache may read the line before it writes it, so a kernel that reads x
and writes y can move three tensors' worth of bytes where an allocating copy (``x.clone()``) moves two. Streaming
stores take the third away; they also leave nothing of y in cache, so they could pay only when y is too large to
stay there anyway (:data:`LAST_LEVEL_CACHE_BYTES`). Measured on an otherwise idle machine, the kernels ran 5–20 %
slower with them than with ordinary stores at float32 and bfloat16, forward and backward (docs/kernels.md), so
they are an opt-in for machines where a benchmark shows otherwise (``bench/kernel_bandwidth.py`` prints their gain).

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


#: The last-level cache (32 MiB where it cannot be read): an output smaller than this may still be in cache for
#: whatever reads it next, so it is never streamed.
LAST_LEVEL_CACHE_BYTES = _l3_bytes() or 32 << 20

#: Outputs at least this large are streamed: never, unless ``NORMSCOPE_STREAMING_STORES=1`` (then
#: :data:`LAST_LEVEL_CACHE_BYTES`). Read at each kernel call.
STREAM_MIN_BYTES = LAST_LEVEL_CACHE_BYTES if os.environ.get("NORMSCOPE_STREAMING_STORES") == "1" else 1 << 62


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
