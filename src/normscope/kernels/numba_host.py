"""The torch side of the numba kernels: tensors in, zero-copy NumPy views, tensors out."""

from __future__ import annotations

import numpy as np
import torch

from ..numba_threads import launch
from . import numba_cpu as k
from . import streaming
from .contract import RowContract


def _np(t: torch.Tensor, fmt: int, rs: int | None = None) -> np.ndarray:
    """(rows, hidden) rows with unit stride along hidden and row stride ``rs`` (None: contiguous) as the 1-D NumPy
    array of the memory they span, a view: float32 as is, 16-bit floats as their uint16 bit patterns. The views
    are taken on the NumPy side, where they cost a fraction of torch's (a small call's time is mostly such costs)."""
    a = t.numpy() if fmt == 0 else t.view(torch.int16).numpy().view(np.uint16)
    if rs is None or a.ndim < 2 or a.shape[0] < 2 or rs == a.shape[1]:
        return a.reshape(-1)
    rows, n = a.shape
    return np.lib.stride_tricks.as_strided(a, ((rows - 1) * rs + n,), (a.itemsize,))


def _streamed(out: torch.Tensor) -> bool:
    """Whether a kernel writes ``out`` with streaming stores: when it is too large to stay in cache for its reader
    (:data:`.streaming.STREAM_MIN_BYTES`, read at each call)."""
    return out.numel() * out.element_size() >= streaming.STREAM_MIN_BYTES


def _chunks(rows: int) -> int:
    """How many parallel chunks a kernel cuts its rows into: four per torch thread (a late chunk evens out the
    threads' finishing times), at most 64."""
    return max(1, min(rows, 4 * torch.get_num_threads(), 64))


_EMPTY_F32 = np.zeros(1, np.float32)
_EMPTY_U16 = np.zeros(1, np.uint16)


def forward(x2, x_rs, r2, r_rs, scale, shift, rc: RowContract, fmt: int):
    rows, n = x2.shape
    d = x2.dtype
    y = torch.empty((rows, n), dtype=d)
    h = torch.empty((rows, n), dtype=d) if r2 is not None else None
    stats = torch.empty((rows, 3), dtype=torch.float32)
    if rows == 0 or n == 0:
        return y, h, stats
    empty = _EMPTY_F32 if fmt == 0 else _EMPTY_U16
    xs = _np(x2, fmt, x_rs)
    rs = _np(r2, fmt, r_rs) if r2 is not None else empty
    hs = _np(h, fmt) if h is not None else empty
    sc = scale.contiguous().numpy() if scale is not None else _EMPTY_F32
    sh = shift.contiguous().numpy() if shift is not None else _EMPTY_F32
    common = (rows, n, sc, sh, scale is not None, shift is not None, rc.center, rc.one_pass, rc.unbiased,
              np.float32(rc.eps), rc.placement)
    if fmt == 0:
        launch(k.forward_f32, k.forward_f32_serial, xs, x_rs, rs, r_rs, r2 is not None, _np(y, 0), hs,
               stats.numpy(), rows, n, _chunks(rows), *common[2:], _streamed(y), elements=rows * n)
    else:
        launch(k.forward_16, k.forward_16_serial, xs, x_rs, rs, r_rs, r2 is not None, _np(y, fmt), hs,
               stats.numpy(), rows, n, _chunks(rows), *common[2:], rc.cast_then_scale, fmt, k.F16_TABLE,
               _streamed(y), elements=rows * n)
    return y, h, stats


def backward(h2, dy2, dh2, stats, scale, rc: RowContract, fmt: int, want_dg: bool, want_db: bool):
    rows, n = h2.shape
    d = h2.dtype
    dx = torch.empty((rows, n), dtype=d)
    chunks = _chunks(rows)
    dg = np.zeros((chunks if want_dg else 1, n if want_dg else 1), np.float32)
    db = np.zeros((chunks if want_db else 1, n if want_db else 1), np.float32)
    if rows and n:
        if dy2.dtype != d:
            dy2 = dy2.to(d)
        empty = _EMPTY_F32 if fmt == 0 else _EMPTY_U16
        dhs = _np(dh2.to(d).contiguous(), fmt) if dh2 is not None else empty
        sc = scale.contiguous().numpy() if scale is not None else _EMPTY_F32
        args = (_np(h2, fmt), _np(dy2, fmt), dhs, dh2 is not None, _np(dx, fmt),
                stats.numpy(), rows, n, chunks, sc, scale is not None, want_dg, want_db, rc.center, rc.one_pass,
                rc.unbiased, np.float32(rc.eps), rc.placement)
        if fmt == 0:
            launch(k.backward_f32, k.backward_f32_serial, *args, dg, db, _streamed(dx), elements=rows * n)
        else:
            launch(k.backward_16, k.backward_16_serial, *args, fmt, k.F16_TABLE, dg, db, _streamed(dx),
                   elements=rows * n)
    dgamma = torch.from_numpy(dg.sum(axis=0, dtype=np.float64).astype(np.float32)) if want_dg else None
    dbeta = torch.from_numpy(db.sum(axis=0, dtype=np.float64).astype(np.float32)) if want_db else None
    return dx, dgamma, dbeta
