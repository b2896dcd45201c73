"""GPU row kernels in Triton: the same contracts and the same arithmetic as the numba kernels.

One program normalizes one row, walking it in blocks of ``BLOCK`` columns (so any hidden size fits: a block
is at most 4096 wide and masked at the row's end, and masked lanes never enter a statistic). Statistics are
float32; outputs are rounded to the input dtype; ``cast_then_scale`` rounds x̂, the product and the sum to
the input dtype one after another, as the contract says. dγ/dβ come from a kernel over (column block, row
block) pairs that reads its rows again with the saved statistics and writes one partial sum per row block; the
partial sums are added in a fixed order (no atomics, deterministic). Element offsets are 64-bit: a row's offset
(row × stride) passes 2³¹ elements in a large activation or a strided view of one.

On CUDA tensors these are dispatched by :func:`normscope.kernels.norm`; with ``TRITON_INTERPRET=1`` (set
before triton is imported) they run on CPU tensors in Triton's interpreter, which is how the tests run them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contract import RowContract


def _block(n: int) -> int:
    return min(4096, triton.next_power_of_2(max(n, 1)))


@triton.jit
def _round(v, dt, BF16: tl.constexpr):
    """float32 ``v`` rounded to nearest-even in ``dt`` (kept as ``dt``). The interpreter's float32→bfloat16
    cast truncates, so bfloat16 is rounded by hand first (then the cast is exact on every backend)."""
    if BF16:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        r = u.to(tl.float32, bitcast=True)
        v = tl.where((v == v) & (tl.abs(v) < float("inf")), r, v)
    return v.to(dt)


@triton.jit
def _denominator(var, eps, PLACEMENT: tl.constexpr):
    if PLACEMENT == 0:
        d = tl.sqrt(var + eps)
    elif PLACEMENT == 1:
        d = tl.sqrt(var) + eps
    elif PLACEMENT == 2:
        r = tl.sqrt(var)
        d = tl.where(r < eps, eps, r)  # a NaN variance stays NaN
    else:
        d = tl.sqrt(var)
    return d


@triton.jit
def _forward_kernel(X, x_rs, R, r_rs, Y, H, STATS, W, B, n, eps,
                    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, CENTER: tl.constexpr,
                    ONE_PASS: tl.constexpr, UNBIASED: tl.constexpr, PLACEMENT: tl.constexpr,
                    CAST_THEN_SCALE: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row × stride passes 2³¹ in a large tensor
    cols = tl.arange(0, BLOCK)
    xrow = X + row * x_rs
    hrow = H + row * n
    dt = Y.dtype.element_ty
    s = tl.zeros([BLOCK], dtype=tl.float32)
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        c = start + cols
        m = c < n
        v = tl.load(xrow + c, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            v = _round(v + tl.load(R + row * r_rs + c, mask=m, other=0.0).to(tl.float32), dt, BF16)
            tl.store(hrow + c, v, mask=m)
            v = v.to(tl.float32)
        s += v
        ss += v * v
    src = hrow if HAS_RES else xrow  # later passes read the residual sum where there is one
    nf = n * 1.0
    n_var = nf - 1.0 if UNBIASED else nf
    mean = 0.0
    if not CENTER:
        var = tl.sum(ss, axis=0) / n_var
    elif ONE_PASS:
        mean = tl.sum(s, axis=0) / nf
        var = tl.sum(ss, axis=0) / nf - mean * mean
        if UNBIASED:
            var = var * (nf / (nf - 1.0))
        var = tl.where(var < 0.0, 0.0, var)
    else:
        mean = tl.sum(s, axis=0) / nf
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            c = start + cols
            m = c < n
            v = tl.load(src + c, mask=m, other=0.0).to(tl.float32)
            dv = tl.where(m, v - mean, 0.0)
            acc += dv * dv
        var = tl.sum(acc, axis=0) / n_var
    denom = _denominator(var, eps, PLACEMENT)
    tl.store(STATS + row * 3, mean)
    tl.store(STATS + row * 3 + 1, var)
    tl.store(STATS + row * 3 + 2, denom)
    inv = 1.0 / denom
    for start in range(0, n, BLOCK):
        c = start + cols
        m = c < n
        v = tl.load(src + c, mask=m, other=0.0).to(tl.float32)
        y = (v - mean) * inv
        if CAST_THEN_SCALE:
            y = _round(y, dt, BF16).to(tl.float32)
            if HAS_W:
                y = _round(y * tl.load(W + c, mask=m, other=0.0), dt, BF16).to(tl.float32)
            if HAS_B:
                y = _round(y + tl.load(B + c, mask=m, other=0.0), dt, BF16).to(tl.float32)
        else:
            if HAS_W:
                y = y * tl.load(W + c, mask=m, other=0.0)
            if HAS_B:
                y = y + tl.load(B + c, mask=m, other=0.0)
        tl.store(Y + row * n + c, _round(y, dt, BF16), mask=m)


@triton.jit
def _backward_kernel(Hx, DY, DH, DX, STATS, W, n, eps,
                     HAS_DH: tl.constexpr, HAS_W: tl.constexpr, CENTER: tl.constexpr, ONE_PASS: tl.constexpr,
                     UNBIASED: tl.constexpr, PLACEMENT: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    base = row * n
    mean = tl.load(STATS + row * 3)
    var = tl.load(STATS + row * 3 + 1)
    denom = tl.load(STATS + row * 3 + 2)
    inv = 1.0 / denom
    s_gdev = tl.zeros([BLOCK], dtype=tl.float32)
    s_g = tl.zeros([BLOCK], dtype=tl.float32)
    s_dev = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        c = start + cols
        m = c < n
        dev = tl.where(m, tl.load(Hx + base + c, mask=m, other=0.0).to(tl.float32) - mean, 0.0)
        g = tl.load(DY + base + c, mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            g = g * tl.load(W + c, mask=m, other=0.0)
        s_gdev += g * dev
        s_g += g
        s_dev += dev
    nf = n * 1.0
    n_var = nf - 1.0 if UNBIASED else nf
    r = tl.sqrt(var)
    if PLACEMENT == 0:
        d_denom = 0.5 / denom
    elif PLACEMENT == 2:
        d_denom = tl.where(r > eps, 0.5 / r, 0.0)
    else:
        d_denom = 0.5 / r
    if ONE_PASS:
        d_denom = tl.where(var > 0.0, d_denom, 0.0)  # the clamp at 0 has no gradient
    dvar = -tl.sum(s_gdev, axis=0) * inv * inv * d_denom
    k = 2.0 * dvar / n_var
    sub = 0.0
    if CENTER:
        sub = (tl.sum(s_g, axis=0) * inv + k * tl.sum(s_dev, axis=0)) / nf
    dt = DX.dtype.element_ty
    for start in range(0, n, BLOCK):
        c = start + cols
        m = c < n
        g = tl.load(DY + base + c, mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            g = g * tl.load(W + c, mask=m, other=0.0)
        dev = tl.load(Hx + base + c, mask=m, other=0.0).to(tl.float32) - mean
        dx = g * inv + k * dev - sub
        if HAS_DH:
            dx += tl.load(DH + base + c, mask=m, other=0.0).to(tl.float32)
        tl.store(DX + base + c, _round(dx, dt, BF16), mask=m)


@triton.jit
def _param_grad_kernel(Hx, DY, STATS, DG, DB, rows, n, rows_per, WANT_DG: tl.constexpr, WANT_DB: tl.constexpr,
                       BLOCK: tl.constexpr):
    """For one block of columns and one block of ``rows_per`` rows: Σ dy_ij · x̂_ij and Σ dy_ij over those rows,
    written to the row block's line of the partial sums DG/DB (row blocks × n)."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    part = tl.program_id(1).to(tl.int64)
    m = c < n
    dg = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    first = part * rows_per
    for r in range(0, tl.minimum(rows - first, rows_per)):  # the last block may be short
        i = first + r
        off = i * n
        g = tl.load(DY + off + c, mask=m, other=0.0).to(tl.float32)
        if WANT_DG:
            mean = tl.load(STATS + i * 3)
            inv = 1.0 / tl.load(STATS + i * 3 + 2)
            dg += g * ((tl.load(Hx + off + c, mask=m, other=0.0).to(tl.float32) - mean) * inv)
        if WANT_DB:
            db += g
    if WANT_DG:
        tl.store(DG + part * n + c, dg, mask=m)
    if WANT_DB:
        tl.store(DB + part * n + c, db, mask=m)


#: the row blocks of dγ/dβ: enough programs to fill a GPU (columns/256 alone gave 16 for a 4096-wide norm), each
#: at least ``MIN_ROWS_PER_BLOCK`` rows, at most ``MAX_ROW_BLOCKS`` partial lines (their memory is blocks × n)
MIN_ROWS_PER_BLOCK, MAX_ROW_BLOCKS = 32, 1024


def row_blocks(rows: int) -> tuple[int, int]:
    """(row blocks, rows per block) of the dγ/dβ kernel for ``rows`` rows."""
    blocks = max(1, min(MAX_ROW_BLOCKS, triton.cdiv(rows, MIN_ROWS_PER_BLOCK)))
    per = triton.cdiv(rows, blocks)
    return triton.cdiv(rows, per), per


def _dummy(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def forward(x2, x_rs, r2, r_rs, scale, shift, rc: RowContract, fmt: int):
    rows, n = x2.shape
    dev = x2.device
    y = torch.empty((rows, n), dtype=x2.dtype, device=dev)
    h = torch.empty((rows, n), dtype=x2.dtype, device=dev) if r2 is not None else None
    stats = torch.empty((rows, 3), dtype=torch.float32, device=dev)
    if rows == 0 or n == 0:
        return y, h, stats
    d = _dummy(dev)
    _forward_kernel[(rows,)](
        x2, x_rs, r2 if r2 is not None else x2, r_rs, y, h if h is not None else y, stats,
        scale.contiguous() if scale is not None else d, shift.contiguous() if shift is not None else d,
        n, rc.eps, HAS_RES=r2 is not None, HAS_W=scale is not None, HAS_B=shift is not None, CENTER=rc.center,
        ONE_PASS=rc.one_pass, UNBIASED=rc.unbiased, PLACEMENT=rc.placement,
        CAST_THEN_SCALE=rc.cast_then_scale and fmt != 0, BF16=fmt == 1, BLOCK=_block(n))
    return y, h, stats


def backward(h2, dy2, dh2, stats, scale, rc: RowContract, fmt: int, want_dg: bool, want_db: bool):
    rows, n = h2.shape
    dev = h2.device
    dx = torch.empty((rows, n), dtype=h2.dtype, device=dev)
    dg = torch.zeros(n if want_dg else 1, dtype=torch.float32, device=dev)
    db = torch.zeros(n if want_db else 1, dtype=torch.float32, device=dev)
    if rows and n:
        blocks, per = row_blocks(rows)
        d = _dummy(dev)
        dy2 = dy2.to(h2.dtype)
        _backward_kernel[(rows,)](
            h2, dy2, dh2.to(h2.dtype).contiguous() if dh2 is not None else dy2, dx, stats,
            scale.contiguous() if scale is not None else d, n, rc.eps, HAS_DH=dh2 is not None,
            HAS_W=scale is not None, CENTER=rc.center, ONE_PASS=rc.one_pass, UNBIASED=rc.unbiased,
            PLACEMENT=rc.placement, BF16=fmt == 1, BLOCK=_block(n))
        if want_dg or want_db:
            block = min(256, triton.next_power_of_2(n))
            pg = torch.empty((blocks, n) if want_dg else (1,), dtype=torch.float32, device=dev)
            pb = torch.empty((blocks, n) if want_db else (1,), dtype=torch.float32, device=dev)
            _param_grad_kernel[(triton.cdiv(n, block), blocks)](h2, dy2, stats, pg, pb, rows, n, per,
                                                                 WANT_DG=want_dg, WANT_DB=want_db, BLOCK=block)
            if want_dg:
                dg = pg.sum(0)  # the partial sums in a fixed order: deterministic
            if want_db:
                db = pb.sum(0)
    return dx, (dg if want_dg else None), (db if want_db else None)
