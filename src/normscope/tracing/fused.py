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

from collections.abc import Sequence

import numpy as np
import torch

from ..numba_threads import launch, load, matched, parallel_allowed

INF_BITS = 0x7F800000
_F32 = torch.float32
#: how far below its row's largest logit a key still counts in a softmax: further below, its weight is under 1e-13
#: of the largest key's, nothing to a float32 sum that resolves 6e-8. A finite additive mask (Swin's -100) puts its
#: keys there; with the span at 87 (float32's underflow) a masked key whose own logit sat 13 above the row's largest
#: came back within it, and a clean Swin run's max logit jumped 8.5 → 93 in one step; at 30 that takes a spread of
#: 70, past the danger level already
SOFTMAX_SPAN = 30.0
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
        launch(self._on_threads(self.k.attention_summary_parallel), self.k.attention_summary_serial, *args)

    def logits_summary(self, *args) -> None:
        launch(self._on_threads(self.k.logits_summary_parallel), self.k.logits_summary_serial, *args)

    @staticmethod
    def _on_threads(parallel):
        """A parallel build that takes numba's thread count as its last argument, given it as the launch sets it."""
        import numba

        return lambda *args: parallel(*args, numba.get_num_threads())


def _kernels() -> _Kernels | None:
    """The kernels, or None (numba missing or unable to compile here): torch's reductions."""
    return load("tracing statistics", _Kernels)


def available() -> bool:
    return _kernels() is not None


def eligible(x: torch.Tensor) -> bool:
    """A contiguous CPU float32 tensor whose storage holds all of it: the kernels read raw addresses, so a view of
    freed or shrunk storage (FSDP resizes a parameter's storage to 0 between uses) must never reach them."""
    return _extent(x, True) is not None


def _extent(x: torch.Tensor, contiguous: bool) -> int | None:
    """The element count of a CPU float32 tensor the kernels may read by address (contiguous, or with a contiguous
    last dimension and no negative stride, as asked), else None."""
    # called for every tensor of every batch (a few hundred per step): each attribute read here costs a tenth of
    # a microsecond or more
    if x.dtype is not _F32 or not x.is_cpu:
        return None
    n = x.numel()
    if n == 0:
        return None
    if contiguous:
        if not x.is_contiguous():
            return None
        last = x.storage_offset() + n
    else:
        stride = x.stride()
        if not stride or stride[-1] != 1 or min(stride) < 0:
            return None
        last = x.storage_offset() + 1 + sum((k - 1) * st for k, st in zip(x.shape, stride, strict=True))
    try:
        storage = x.untyped_storage()
        return n if storage.nbytes() >= last * 4 and storage.data_ptr() != 0 else None
    except Exception:  # a tensor subclass without plain storage
        return None


def absmax(x: torch.Tensor, dim=None) -> torch.Tensor:
    """max |x| (over ``dim``, else all) in float32, NaN-propagating, as ``max(amax(x), -amin(x))``: torch's path.

    On the CPU ``amax``/``amin`` are vectorised reductions, while ``vector_norm(x, inf)`` and ``abs().max()`` run
    a slow generic kernel: about 45x slower on a (8, 128, 256) activation.
    """
    if dim is None:
        return torch.maximum(torch.amax(x), -torch.amin(x)).float()
    return torch.maximum(torch.amax(x, dim=dim), -torch.amin(x, dim=dim)).float()


def sum_columns(xs: Sequence[torch.Tensor], rows: bool = False
                ) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray] | None:
    """Σx², max |x| and the smallest Σx² over its rows (the last dimension) of each tensor this path takes, in one
    read each and one call for all, as columns: the indices of the tensors taken (the others are the caller's, on
    torch's path), and per taken tensor its Σx² (float64), max |x| as float32 bits (``INF_BITS`` or above: the tensor
    holds a NaN or an infinity) and smallest row Σx²; None without numba. ``rows=False``: the whole tensor is one
    row (its smallest row Σx² is Σx²), which keeps the loop vectorised when the last dimension is short."""
    k = _kernels()
    if k is None:
        return None
    take, addresses, sizes, row_sizes = [], [], [], []
    for i, x in enumerate(xs):  # the caller's list keeps each alive (its address valid) until the call returns
        n = _extent(x, True)
        if n is not None:
            take.append(i)
            addresses.append(x.data_ptr())
            sizes.append(n)
            row_sizes.append(x.shape[-1] if rows and x.dim() else n)
    return (take, *_run_batch(k.sums, addresses, sizes, row_sizes))


def update_columns(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor]
                   ) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """Per pair, in one read of both (neither is written): Σ(old - new)², max |old - new| as float32 bits (at or
    above ``INF_BITS`` when a difference is not finite) and Σnew², as columns over the pairs this path took (their
    indices first; none without numba). Each old is the caller's own contiguous copy of its new (same shape and
    dtype, made with :class:`.buffers.Buffers`): only the new is checked."""
    k = _kernels()
    take, a, b, sizes = [], [], [], []
    if k is None:
        return take, np.empty(0), np.empty(0, np.int32), np.empty(0)
    for i, (o, w) in enumerate(zip(olds, news, strict=True)):  # the caller's lists keep them alive
        n = _extent(w, True)
        if n is not None:
            take.append(i)
            a.append(o.data_ptr())
            b.append(w.data_ptr())
            sizes.append(n)
    return (take, *_run_batch(k.update_sums, a, b, sizes))


def max_abs_values(bits: np.ndarray) -> np.ndarray:
    """max |x| from a column of float32 bit patterns (sign cleared): float64 values, inf where the bits are those of
    a NaN or an infinity."""
    return np.where(bits >= INF_BITS, np.inf, bits.view(np.float32).astype(np.float64))


def _run_batch(kernel, *columns: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run a batch kernel on int64 columns (addresses, sizes, one entry per tensor); its three result columns (a
    float64 sum, an int32 bit pattern, a float64 sum). Nothing to run for an empty batch."""
    m = len(columns[0])
    first, bits, third = np.empty(m), np.empty(m, np.int32), np.empty(m)
    if m:
        kernel(*(np.array(c, np.int64) for c in columns), first, bits, third)
    return first, bits, third


def mask_array(masked: torch.Tensor, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A boolean mask that broadcasts to (N, H, Tq, Tk) logits, as :func:`attention_summary` reads it: a contiguous
    uint8 array (a dimension of 1 shared) and, per row, one past its last unmasked key and whether no key before
    that is masked. None where this path does not apply."""
    if _kernels() is None or masked.device.type != "cpu" or len(shape) != 4:
        return None
    m = broadcast_keys(masked.detach().to(torch.bool), shape)
    if m is None:
        return None
    keys = torch.arange(1, m.shape[3] + 1, device=m.device)
    extent = torch.where(m, 0, keys).amax(-1)
    prefix = (~m).sum(-1) == extent
    # uint8, not bool: the kernel's loop vectorises
    return m.contiguous().view(torch.uint8).numpy(), extent.numpy(), prefix.view(torch.uint8).numpy()


def broadcast_keys(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``x`` (a mask or a bias) with the 4 dimensions of (N, H, Tq, Tk) logits: a leading dimension of 1 stays
    shared, a key dimension of 1 is expanded to every key. None when ``x`` does not broadcast to ``shape``."""
    if x.dim() > 4:
        return None
    while x.dim() < 4:
        x = x.unsqueeze(0)
    if any(d not in (1, s) for d, s in zip(x.shape, shape, strict=True)):
        return None
    return x.expand(*x.shape[:3], shape[3]) if x.shape[3] != shape[3] else x


_NO_BIAS = np.zeros((1, 1, 1, 1), np.float32)


def attention_summary(q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None,
                      mask: tuple[np.ndarray, np.ndarray, np.ndarray], stride: int,
                      copy=None) -> dict[str, list] | None:
    """Per head of the attention logits ``scale · q kᵀ + bias`` ((N, H, Tq, d) queries, (N, H / g, Tk, d) keys on
    the CPU), computed and read in one pass without the (Tq, Tk) matrix: max |logit| over the unmasked entries,
    fully masked query rows (and samples whose every row is), and the softmax entropy summed over every
    ``stride``-th query row with an unmasked key (float64 sums of float32 terms) and their number; ``mask`` from
    :func:`mask_array` for these shapes, ``bias`` None or contiguous float32 (N or 1, H or 1, Tq or 1, Tk). q and k
    are read in place when float32 with a contiguous last dimension (strides not negative), else as ``copy(x,
    name)`` (contiguous float32; by default a new tensor). None where this path does not apply or a logit is not
    finite (the caller's exact path)."""
    return attention_summaries([(q, k)], scale, bias, mask, stride, copy)[0]


def attention_summaries(calls: Sequence[tuple[torch.Tensor, torch.Tensor]], scale: float, bias: torch.Tensor | None,
                        mask: tuple[np.ndarray, np.ndarray, np.ndarray], stride: int,
                        copy=None) -> list[dict[str, list] | None]:
    """:func:`attention_summary` of several (q, k) calls that share shapes, scale, bias and mask (the layers of one
    forward), in one kernel launch; per call its summary, or None where this path does not take it (the caller's
    exact path for that call). A ``copy`` must give each call's tensors memory of their own."""
    out: list[dict[str, list] | None] = [None] * len(calls)
    kern = _kernels()
    if kern is None or not calls:
        return out
    q0, k0 = calls[0]
    if (q0.dim() != 4 or k0.dim() != 4 or q0.shape[-1] != k0.shape[-1] or q0.shape[0] != k0.shape[0]
            or k0.shape[1] == 0 or q0.shape[1] % k0.shape[1]):
        return out
    masked, extent, _ = mask
    if (masked.ndim != 4 or masked.shape[3] != k0.shape[2] or extent.shape != masked.shape[:3]
            or any(d not in (1, s) for d, s in zip(masked.shape[:3], q0.shape[:3], strict=True))):
        return out  # a mask built for other shapes: the kernel would read outside it
    if bias is None:
        b = _NO_BIAS
    else:
        if (not eligible(bias) or bias.dim() != 4 or bias.shape[3] != k0.shape[2] or bias.shape[3] == 1
                or any(d not in (1, s) for d, s in zip(bias.shape[:3], q0.shape[:3], strict=True))):
            return out
        b = bias.numpy()
    take, held, qa, qs, ka, ks = [], [], [], [], [], []
    shape_q, shape_k = q0.shape, k0.shape
    for i, (q, k) in enumerate(calls):
        if (q.shape != shape_q or k.shape != shape_k or not q.is_cpu or not k.is_cpu
                or not q.is_floating_point() or not k.is_floating_point()):
            continue
        q, k = _rows(q, "attention q", copy), _rows(k, "attention k", copy)
        if q is None or k is None:
            continue
        take.append(i)
        held.append((q, k))  # alive (their addresses valid) until the kernel returns
        qa.append(q.data_ptr())
        ka.append(k.data_ptr())
        qs.append(q.stride()[:3])
        ks.append(k.stride()[:3])
    if not take:
        return out
    n, h, tq, d = q0.shape
    dims = np.array([n, h, tq, k0.shape[2], d, h // k0.shape[1]], np.int64)
    m = len(take)
    res = (np.empty((m, h), np.int32), np.empty((m, h), np.int64), np.empty((m, h), np.int64), np.empty((m, h)),
           np.empty((m, h), np.int64))
    kern.attention_summary(np.array(qa, np.int64), np.array(qs, np.int64), np.array(ka, np.int64),
                           np.array(ks, np.int64), dims, np.float32(scale), b, *mask, stride, *res)
    bad = (res[0] >= INF_BITS).any(1).tolist()
    tops, full, samples, ent, rows = max_abs_values(res[0]).tolist(), *(a.tolist() for a in res[1:])
    for r, i in enumerate(take):
        if not bad[r]:
            out[i] = {"max_logit": tops[r], "masked_rows": full[r], "masked_samples": samples[r],
                      "entropy_sum": ent[r], "entropy_rows": rows[r]}
    return out


def logits_summary(logits: torch.Tensor, stride: int) -> dict[str, list] | None:
    """Per head of the (N, H, Tq, Tk) logits an eager softmax is given, in one read of each row: max |logit| over the
    entries above half the dtype's lowest value and within ``SOFTMAX_SPAN`` of their row's largest (the others are
    masked), fully masked query rows (and samples whose every row is), and the softmax entropy summed over every
    ``stride``-th query row with an unmasked key and their number (float64 sums of float32 terms). CPU float32
    logits with a contiguous last dimension only; None where this path does not apply or a logit is not finite (the
    caller's exact path)."""
    kern = _kernels()
    if (kern is None or logits.dim() != 4 or logits.shape[3] == 0 or logits.shape[2] == 0
            or _extent(logits, False) is None):
        return None
    n, h, tq, tk = logits.shape
    out = (np.empty(h, np.int32), np.empty(h, np.int64), np.empty(h, np.int64), np.empty(h), np.empty(h, np.int64))
    kern.logits_summary(logits.data_ptr(), np.array(logits.stride()[:3], np.int64),
                        np.array([n, h, tq, tk], np.int64), stride,
                        np.float32(torch.finfo(torch.float32).min / 2), *out)
    if (out[0] >= INF_BITS).any():
        return None
    full, samples, ent, rows = (a.tolist() for a in out[1:])
    return {"max_logit": max_abs_values(out[0]).tolist(), "masked_rows": full, "masked_samples": samples,
            "rows": [n * tq] * h, "entropy_sum": ent, "entropy_rows": rows, "nonfinite": 0, "nonfinite_heads": [0] * h}


def _rows(x: torch.Tensor, name: str, copy) -> torch.Tensor | None:
    """x itself when the attention kernel may read its rows in place, else ``copy(x, name)`` (a new contiguous
    float32 tensor without ``copy``); None when neither can be read (empty)."""
    if _extent(x, False) is not None:
        return x
    x = copy(x, name) if copy is not None else x.float().contiguous()
    return x if _extent(x, False) is not None else None
