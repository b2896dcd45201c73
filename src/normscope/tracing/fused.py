"""One-read statistics for the tracer on the CPU (numba): Σx², max |x| and the smallest row Σx² of float32
tensors in one pass each, and a parameter update's sums in one pass over its two copies; one call per batch of
tensors (all of a model's gradients, all of its parameters).

torch needs two or three reductions for the first (a dot, a min/max, a row norm) and four passes for the second
(the difference, its sum of squares, its min/max, the parameter's sum of squares), plus a Python dispatch per
tensor; at a recorded step these passes are most of the tracer's cost. max |x| is taken on the bit patterns (sign
cleared), an integer maximum that vectorises and that a NaN or an infinity also reaches (their exponent bits are
all ones): a result at or above ``INF_BITS`` means the tensor holds a non-finite value, and the caller takes its
exact path. Sums accumulate in float64.

Used for contiguous CPU float32 tensors when numba is installed (the ``kernels`` extra); anything else, or a
machine where numba cannot compile, gets torch's reductions (:func:`available` says which).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..numba_threads import launch, matched, parallel_allowed

INF_BITS = 0x7F800000
_KERNELS: list = []


class _Kernels:
    """The compiled kernels, each run through :func:`normscope.numba_threads.launch` (its parallel or serial build,
    on torch's thread count)."""

    def __init__(self):
        from . import fused_kernels

        self.k = fused_kernels
        with matched():
            fused_kernels.warm_up(parallel_allowed())

    def sums(self, *args) -> None:
        launch(self.k.sums_parallel, self.k.sums_serial, *args)

    def update_sums(self, *args) -> None:
        launch(self.k.update_sums_parallel, self.k.update_sums_serial, *args)

    def attention_summary(self, *args) -> None:
        launch(self.k.attention_summary_parallel, self.k.attention_summary_serial, *args)


def _kernels() -> _Kernels | None:
    if not _KERNELS:
        try:
            _KERNELS.append(_Kernels())
        except Exception:  # numba missing or unable to compile here: torch's reductions
            _KERNELS.append(None)
    return _KERNELS[0]


def available() -> bool:
    return _kernels() is not None


def eligible(x: torch.Tensor) -> bool:
    """A contiguous CPU float32 tensor whose storage holds all of it: the kernels read raw addresses, so a view of
    freed or shrunk storage (FSDP resizes a parameter's storage to 0 between uses) must never reach them."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and x.numel() > 0):
        return False
    try:
        storage = x.untyped_storage()
        return storage.data_ptr() != 0 and storage.nbytes() >= (x.storage_offset() + x.numel()) * 4
    except Exception:  # a tensor subclass without plain storage
        return False


def absmax(x: torch.Tensor, dim=None) -> torch.Tensor:
    """max |x| (over ``dim``, else all) in float32, NaN-propagating, as ``max(amax(x), -amin(x))``: torch's path.

    On the CPU ``amax``/``amin`` are vectorised reductions, while ``vector_norm(x, inf)`` and ``abs().max()`` run
    a slow generic kernel: about 45x slower on a (8, 128, 256) activation.
    """
    if dim is None:
        return torch.maximum(torch.amax(x), -torch.amin(x)).float()
    return torch.maximum(torch.amax(x, dim=dim), -torch.amin(x, dim=dim)).float()


def _max_abs(bits: int) -> float:
    return math.inf if bits >= INF_BITS else float(np.int32(bits).view(np.float32))


class Sums:
    """Σx², max |x| (inf when the tensor holds a NaN or an infinity) and the smallest Σx² over its rows (the
    last dimension)."""

    __slots__ = ("sumsq", "max", "min_row_sumsq")

    def __init__(self, sumsq: float, max_abs: float, min_row_sumsq: float):
        self.sumsq, self.max, self.min_row_sumsq = sumsq, max_abs, min_row_sumsq


def sums(xs: Sequence[torch.Tensor], rows: bool = False) -> list[Sums | None] | None:
    """:class:`Sums` of each tensor, in one read each and one call for all; None for a tensor this path does not
    take (the caller uses torch), None for the whole batch without numba. ``rows=False``: the whole tensor is one
    row (its smallest row Σx² is Σx²), which keeps the loop vectorised when the last dimension is short."""
    k = _kernels()
    if k is None:
        return None
    take = [i for i, x in enumerate(xs) if eligible(x)]
    out: list[Sums | None] = [None] * len(xs)
    if not take:
        return out
    keep = [xs[i].detach() for i in take]  # alive (and their addresses valid) until the call returns
    addresses = np.fromiter((x.data_ptr() for x in keep), np.int64, len(keep))
    sizes = np.fromiter((x.numel() for x in keep), np.int64, len(keep))
    row_sizes = np.fromiter((x.shape[-1] if rows and x.dim() else x.numel() for x in keep), np.int64, len(keep))
    ss, mb, low = np.empty(len(keep)), np.empty(len(keep), np.int32), np.empty(len(keep))
    k.sums(addresses, sizes, row_sizes, ss, mb, low)
    for j, i in enumerate(take):
        out[i] = Sums(float(ss[j]), _max_abs(int(mb[j])), float(low[j]))
    return out


def update_sums(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]) -> list[tuple[float, float, float] | None]:
    """Per pair: (Σ(old - new)², max |old - new|, Σnew²) in one read of both (neither is written); max is inf when
    a difference is not finite. None for a pair this path does not take (and for all without numba)."""
    out: list[tuple[float, float, float] | None] = [None] * len(olds)
    k = _kernels()
    if k is None:
        return out
    take = [i for i, (o, n) in enumerate(zip(olds, news, strict=True))
            if eligible(o) and eligible(n) and o.shape == n.shape]
    if not take:
        return out
    keep_o = [olds[i].detach() for i in take]
    keep_n = [news[i].detach() for i in take]
    a = np.fromiter((x.data_ptr() for x in keep_o), np.int64, len(take))
    b = np.fromiter((x.data_ptr() for x in keep_n), np.int64, len(take))
    sizes = np.fromiter((x.numel() for x in keep_n), np.int64, len(take))
    su, mb, sp = np.empty(len(take)), np.empty(len(take), np.int32), np.empty(len(take))
    k.update_sums(a, b, sizes, su, mb, sp)
    for j, i in enumerate(take):
        out[i] = (float(su[j]), _max_abs(int(mb[j])), float(sp[j]))
    return out


def mask_array(masked: torch.Tensor, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A boolean mask that broadcasts to (N, H, Tq, Tk) logits, as :func:`attention_summary` reads it: a contiguous
    uint8 array (a dimension of 1 shared) and, per row, one past its last unmasked key and whether no key before
    that is masked. None where this path does not apply."""
    if _kernels() is None or masked.device.type != "cpu" or len(shape) != 4 or masked.dim() > 4:
        return None
    m = masked.detach().to(torch.bool)
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.shape[3] != shape[3] or any(d not in (1, s) for d, s in zip(m.shape, shape, strict=True)):
        m = m.expand(shape)  # a key dimension of 1: full size
    keys = torch.arange(1, m.shape[3] + 1, device=m.device)
    extent = torch.where(m, 0, keys).amax(-1)
    prefix = (~m).sum(-1) == extent
    # uint8, not bool: the kernel's loop vectorises
    return m.contiguous().view(torch.uint8).numpy(), extent.numpy(), prefix.view(torch.uint8).numpy()


def readable_rows(x: torch.Tensor) -> bool:
    """A CPU float32 tensor whose last dimension is contiguous, whose strides are not negative and whose storage
    holds every element: the kernels may read its rows by address."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and x.numel() > 0 and x.dim() >= 1
            and x.stride(-1) == 1 and min(x.stride()) >= 0):
        return False
    try:
        storage = x.untyped_storage()
        last = x.storage_offset() + sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True))
        return storage.data_ptr() != 0 and storage.nbytes() >= (last + 1) * 4
    except Exception:  # a tensor subclass without plain storage
        return False


_NO_BIAS = np.zeros((1, 1, 1, 1), np.float32)


def attention_summary(q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None,
                      mask: tuple[np.ndarray, np.ndarray, np.ndarray], stride: int) -> dict[str, list] | None:
    """Per head of the attention logits ``scale · q kᵀ + bias`` ((N, H, Tq, d) queries, (N, H / g, Tk, d) keys,
    CPU float32, read in place when :func:`readable_rows`), computed and read in one pass without the (Tq, Tk)
    matrix: max |logit| over the unmasked entries, fully masked query rows, and the softmax entropy summed over
    every ``stride``-th query row with an unmasked key (float64 sums of float32 terms) and their number; ``mask``
    from :func:`mask_array`, ``bias`` None or contiguous float32 (N or 1, H or 1, Tq or 1, Tk). None where this
    path does not apply or a logit is not finite (the caller's exact path)."""
    kern = _kernels()
    if (kern is None or q.dim() != 4 or k.dim() != 4 or not readable_rows(q) or not readable_rows(k)
            or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0] or k.shape[1] == 0
            or q.shape[1] % k.shape[1]):
        return None
    if bias is None:
        b = _NO_BIAS
    else:
        if (not eligible(bias) or bias.dim() != 4 or bias.shape[3] != k.shape[2] or bias.shape[3] == 1
                or any(d not in (1, s) for d, s in zip(bias.shape[:3], q.shape[:3], strict=True))):
            return None
        b = bias.numpy()
    n, h, tq, d = q.shape
    dims = np.array([n, h, tq, k.shape[2], d, h // k.shape[1]], np.int64)
    qs = np.array(q.stride()[:3], np.int64)
    ks = np.array(k.stride()[:3], np.int64)
    out = (np.empty((n, h), np.int32), np.empty((n, h), np.int64), np.empty((n, h)), np.empty((n, h), np.int64))
    kern.attention_summary(q.data_ptr(), qs, k.data_ptr(), ks, dims, np.float32(scale), b, *mask, stride, *out)
    maxbits, full, ent, rows = out
    top = maxbits.max(axis=0)
    if int(top.max()) >= INF_BITS:
        return None
    return {"max_logit": [_max_abs(int(b)) for b in top], "masked_rows": full.sum(axis=0).tolist(),
            "entropy_sum": ent.sum(axis=0).tolist(), "entropy_rows": rows.sum(axis=0).tolist()}
