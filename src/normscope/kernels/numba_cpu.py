"""CPU row kernels in numba: forward (with the fused residual add) and backward for any last-axis contract.

Each kernel takes its rows as a flat buffer and a row stride (strided rows are read in place), runs the rows
in parallel (``prange``; each also has a ``*_serial`` build on the calling thread, for a forked child or numba's
``workqueue`` layer), keeps every statistic in float32 and rounds each output to the storage dtype.
numba has no 16-bit float type on the CPU, so bfloat16 and float16 arrays travel as their ``uint16`` bit
patterns: a row is decoded into a float32 scratch row (bfloat16 by a shift, float16 by the CPU's own conversion
where it has one — :data:`..numba_bits.HARDWARE_HALF` — else a 65536-entry table),
computed there, rounded to nearest-even into the storage dtype and encoded back. The same row functions
serve float32 rows, which are computed in place of the output row.

Reductions use ``fastmath={"reassoc", "contract"}`` only (several float32 accumulators, FMAs): NaN and ±inf
propagate as in the reference, and the error stays within what a float32-accumulating kernel may have.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..numba_bits import HARDWARE_HALF, as_float32, as_uint32, float32_to_half, half_to_float32
from .streaming import store_fence, stream_row

_FM = {"reassoc", "contract"}
_OPTS = {"cache": True, "fastmath": _FM, "error_model": "numpy"}

_U32 = np.uint32

#: float16 bit pattern → float32 value.
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


# ------------------------------------------------------------------------------------------- formats
@njit(inline="always", **_OPTS)
def _bf16_bits(v):
    """The bfloat16 bit pattern nearest to the float32 ``v`` (ties to even; overflow to ±inf, inf kept), a NaN made
    quiet (a payload only in the lower half would otherwise leave inf's pattern). Branch-free, in 32-bit lanes: numba
    widens integer arithmetic to 64 bits, so each step is cast back; the NaN test on the float and the shift before
    the narrowing (not a mask after it) kept the loops around it twice as wide (0.26 → 0.17 ns per value)."""
    u = as_uint32(v)
    r = _U32(_U32(u + _U32(0x7FFF) + _U32(_U32(u >> _U32(16)) & _U32(1))) >> _U32(16))
    return np.uint16(_U32(_U32(u >> _U32(16)) | _U32(0x0040)) if v != v else r)


@njit(inline="always", **_OPTS)
def _f16_bits(u):
    """The float16 bit pattern nearest (ties to even) to the float32 of bits ``u``: overflow to ±inf, NaN to a
    quiet NaN, subnormals exact. Branch-free (each case computed, one selected), so a row's loop vectorises."""
    sign = _U32(u & _U32(0x80000000))
    a = _U32(u ^ sign)
    # normal: the exponent rebased (127 → 15, mod 2^32) and half an ulp less one added, the odd bit breaking ties
    normal = _U32(_U32(a + _U32(0xC8000FFF) + _U32(_U32(a >> _U32(13)) & _U32(1))) >> _U32(13))
    # below 2^-14 (subnormal): adding 0.5 rounds |v| to float16's spacing 2^-24, which is 0.5's ulp in float32
    sub = _U32(as_uint32(as_float32(a) + np.float32(0.5)) - _U32(0x3F000000))
    special = _U32(0x7E00) if a > _U32(0x7F800000) else _U32(0x7C00)  # NaN, else ±inf (|v| >= 65536)
    o = sub if a < _U32(113 << 23) else normal
    o = special if a >= _U32(143 << 23) else o
    return np.uint16(o | _U32(sign >> _U32(16)))


@njit(inline="always", **_OPTS)
def _f16_value(h):
    """The float32 value of the float16 bit pattern ``h``, branch-free."""
    magnitude = _U32(h & _U32(0x7FFF))
    normal = as_float32(_U32(_U32(magnitude << _U32(13)) + _U32(0x38000000)))  # exponent rebased 15 → 127
    special = as_float32(_U32(_U32(magnitude << _U32(13)) + _U32(0x70000000)))  # exponent 31 → 255: ±inf, NaN
    sub = np.float32(magnitude) * np.float32(5.9604644775390625e-08)  # a multiple of 2^-24, exactly
    v = sub if magnitude < _U32(0x0400) else (special if magnitude >= _U32(0x7C00) else normal)
    return as_float32(_U32(as_uint32(v) | _U32(_U32(h & _U32(0x8000)) << _U32(16))))


@njit(inline="always", **_OPTS)
def _bits_16(v, fmt):
    """A float32 value's nearest bfloat16 (fmt 1) or float16 (fmt 2) bit pattern."""
    if fmt == 1:
        return _bf16_bits(v)
    if HARDWARE_HALF:
        return float32_to_half(v)
    return _f16_bits(as_uint32(v))


@njit(inline="always", **_OPTS)
def _rounded_16(v, fmt):
    """A float32 value rounded to the nearest bfloat16 (fmt 1) or float16 (fmt 2) value, as a float32."""
    if fmt == 1:
        return as_float32(_U32(_U32(_bf16_bits(v)) << _U32(16)))
    if HARDWARE_HALF:
        return half_to_float32(float32_to_half(v))
    return _f16_value(_f16_bits(as_uint32(v)))


@njit(inline="always", **_OPTS)
def _value_16(u, fmt, table):
    """The float32 value of a bfloat16 (fmt 1) or float16 (fmt 2) bit pattern (``_decode``'s, one value)."""
    if fmt == 1:
        return as_float32(_U32(_U32(u) << _U32(16)))
    if HARDWARE_HALF:
        return half_to_float32(u)
    return table[u]


@njit(**_OPTS)
def _decode(src, start, n, fmt, table, buf, bits):
    row = src[start:start + n]  # a view indexed from 0: an offset index (src[start + j]) did not vectorize
    if fmt == 1:
        for j in range(n):
            bits[j] = _U32(_U32(row[j]) << _U32(16))
    else:
        for j in range(n):
            buf[j] = _value_16(row[j], 2, table)


@njit(**_OPTS)
def _encode(buf, n, fmt, dst, start):
    """A float32 row as the 16-bit patterns nearest to it (``_bits_16``) in ``dst[start:start + n]``."""
    out = dst[start:start + n]  # indexed from 0, as in _decode
    for j in range(n):
        out[j] = _bits_16(buf[j], fmt)


@njit(**_OPTS)
def _store_16(buf, n, fmt, dst, start, stream):
    """``_encode`` into ``dst[start:start + n]``; with ``stream``, through a scratch row and streaming stores."""
    if not stream:
        _encode(buf, n, fmt, dst, start)
        return
    row = np.empty(n, np.uint16)
    _encode(buf, n, fmt, row, 0)
    stream_row(dst[start:start + n], row, n)


# ------------------------------------------------------------------------------------------- one row
@njit(**_OPTS)
def _row_stats(h, n, center, one_pass, unbiased, eps, placement):
    """(mean, var, denominator) of one float32 row, as the contract defines them."""
    s = np.float32(0.0)
    ss = np.float32(0.0)
    if not center:
        for j in range(n):
            ss += h[j] * h[j]
    elif not one_pass:
        for j in range(n):
            s += h[j]
    else:
        for j in range(n):
            s += h[j]
            ss += h[j] * h[j]
    return _finish_stats(h, n, s, ss, center, one_pass, unbiased, eps, placement)


@njit(**_OPTS)
def _finish_stats(h, n, s, ss, center, one_pass, unbiased, eps, placement):
    """The statistics from the row's sum ``s`` and sum of squares ``ss`` (each only where the contract reads it:
    ``ss`` without centring or in one pass, ``s`` when centring); the two-pass variance reads the row again."""
    n_var = np.float32(n - 1) if unbiased else np.float32(n)
    mean = np.float32(0.0)
    if not center:
        var = ss / n_var
    elif not one_pass:
        mean = s / np.float32(n)
        css = np.float32(0.0)
        for j in range(n):
            dv = h[j] - mean
            css += dv * dv
        var = css / n_var
    else:
        mean = s / np.float32(n)
        var = ss / np.float32(n) - mean * mean
        if unbiased:
            var = var * (np.float32(n) / np.float32(n - 1))
        if var < np.float32(0.0):
            var = np.float32(0.0)
    return mean, var, _denominator(var, eps, placement)


@njit(**_OPTS)
def _denominator(var, eps, placement):
    """The denominator of the contract's ε placement (0 inside the √, 1 outside, 2 a clamp, 3 none)."""
    if placement == 0:
        return np.sqrt(var + eps)
    if placement == 1:
        return np.sqrt(var) + eps
    if placement == 2:
        r = np.sqrt(var)
        return eps if r < eps else r  # a NaN variance stays NaN
    return np.sqrt(var)


@njit(**_OPTS)
def _affine_16(h, out, n, mean, denom, scale, shift, has_scale, has_shift, fmt):
    """The affine step (scale then cast; float32 rows: ``_write_row_sum_next``), the rounding to the storage format
    and the encoding in one pass: out gets the 16-bit patterns."""
    inv = np.float32(1.0) / denom
    if has_scale and has_shift:
        for j in range(n):
            out[j] = _bits_16((h[j] - mean) * inv * scale[j] + shift[j], fmt)
    elif has_scale:
        for j in range(n):
            out[j] = _bits_16((h[j] - mean) * inv * scale[j], fmt)
    elif has_shift:
        for j in range(n):
            out[j] = _bits_16((h[j] - mean) * inv + shift[j], fmt)
    else:
        for j in range(n):
            out[j] = _bits_16((h[j] - mean) * inv, fmt)


@njit(**_OPTS)
def _affine_cast_16(h, out, n, mean, denom, scale, shift, has_scale, has_shift, fmt):
    """``_affine_16`` for a contract that casts before it scales: x̂ rounded to the storage format, then each of
    γ and β applied in it (rounded after each), the last rounding being the encoding itself."""
    inv = np.float32(1.0) / denom
    if has_scale and has_shift:
        for j in range(n):
            out[j] = _bits_16(_rounded_16(_rounded_16((h[j] - mean) * inv, fmt) * scale[j], fmt) + shift[j], fmt)
    elif has_scale:
        for j in range(n):
            out[j] = _bits_16(_rounded_16((h[j] - mean) * inv, fmt) * scale[j], fmt)
    elif has_shift:
        for j in range(n):
            out[j] = _bits_16(_rounded_16((h[j] - mean) * inv, fmt) + shift[j], fmt)
    else:
        for j in range(n):
            out[j] = _bits_16((h[j] - mean) * inv, fmt)


# ------------------------------------------------------------------------------------------- forward
# A float32 row's statistics (loads) and then its output (stores) took turns on the memory bus. The forward
# instead writes each row in the loop that reads the next one: a row's sums are taken while the row before it
# is written, and under a two-pass variance its squared deviations one row later still, so every loop over
# memory both loads and stores. Every row's sums come from the same loop, wherever the row stands in the batch
# (the first rows of a chunk go through it behind rows of zeros), so a row's output does not depend on the rows
# around it. γ absent: a row of ones (x · 1 is exact), which halves the loops to write; each remaining case
# (β, the fused add) is a loop of its own, as in the 16-bit affine loops, so that none branches per element.


@njit(**_OPTS)
def _write_row_sum_next(h, out, n, mean, inv, scale, shift, has_shift, nx, nr, has_res, nh):
    """``out`` = (h − mean) · inv · γ [+ β], and the sums (s, ss) of the next row ``nx`` (``nx + nr`` when
    ``has_res``, stored in ``nh``), in one loop."""
    s = np.float32(0.0)
    ss = np.float32(0.0)
    if has_res and has_shift:
        for j in range(n):
            out[j] = (h[j] - mean) * inv * scale[j] + shift[j]
            v = nx[j] + nr[j]
            nh[j] = v
            s += v
            ss += v * v
    elif has_res:
        for j in range(n):
            out[j] = (h[j] - mean) * inv * scale[j]
            v = nx[j] + nr[j]
            nh[j] = v
            s += v
            ss += v * v
    elif has_shift:
        for j in range(n):
            out[j] = (h[j] - mean) * inv * scale[j] + shift[j]
            s += nx[j]
            ss += nx[j] * nx[j]
    else:
        for j in range(n):
            out[j] = (h[j] - mean) * inv * scale[j]
            s += nx[j]
            ss += nx[j] * nx[j]
    return s, ss


@njit(**_OPTS)
def _write_row_deviate_next_sum_after(h, out, n, mean, inv, scale, shift, has_shift, h1, mean1, nx, nr, has_res,
                                      nh):
    """``_write_row_sum_next`` one row further on, for a two-pass variance: this row's output, the next row's
    (``h1``, mean ``mean1``) squared deviations and the sum of the row after it (``nx [+ nr]``, stored in ``nh``)
    in one loop: (Σ(h1 − mean1)², s)."""
    css = np.float32(0.0)
    s = np.float32(0.0)
    if has_res and has_shift:
        for j in range(n):
            out[j] = (h[j] - mean) * inv * scale[j] + shift[j]
            d = h1[j] - mean1
            css += d * d
            v = nx[j] + nr[j]
            nh[j] = v
            s += v
    elif has_res:
        for j in range(n):
            out[j] = (h[j] - mean) * inv * scale[j]
            d = h1[j] - mean1
            css += d * d
            v = nx[j] + nr[j]
            nh[j] = v
            s += v
    elif has_shift:
        for j in range(n):
            out[j] = (h[j] - mean) * inv * scale[j] + shift[j]
            d = h1[j] - mean1
            css += d * d
            s += nx[j]
    else:
        for j in range(n):
            out[j] = (h[j] - mean) * inv * scale[j]
            d = h1[j] - mean1
            css += d * d
            s += nx[j]
    return css, s


@njit(inline="always", **_OPTS)
def _chunk_rows(c, chunks, rows):
    """The rows [lo, hi) of parallel chunk ``c`` of ``chunks`` (empty past the last row)."""
    per = (rows + chunks - 1) // chunks
    return c * per, min(rows, c * per + per)


@njit(inline="always", **_OPTS)
def _store_stats(stats, k, mean, var, denom):
    """Row ``k``'s (mean, var, denom) in ``stats[k]``; its 1 / denominator, for the loop that writes it."""
    stats[k, 0] = mean
    stats[k, 1] = var
    stats[k, 2] = denom
    return np.float32(1.0) / denom


@njit(**_OPTS)
def _stored_stats(stats, k, h, n, s, ss, center, one_pass, unbiased, eps, placement):
    """Row ``k``'s statistics from its sums (``_finish_stats``) stored in ``stats[k]``; its (mean, 1 / denominator)
    for the loop that writes it."""
    mean, var, denom = _finish_stats(h, n, s, ss, center, one_pass, unbiased, eps, placement)
    return mean, _store_stats(stats, k, mean, var, denom)


@njit(**_OPTS)
def _forward_f32_chunk(c, chunks, x, x_rs, res, res_rs, has_res, y, h_out, stats, rows, n, scale, shift, has_scale,
                       has_shift, center, one_pass, unbiased, eps, placement, stream):
    """Rows ``c·per … (c+1)·per`` of ``forward_f32``, pipelined as the section's comment says: a row is written
    ``depth`` loops after the loop that took its sums (1; 2 for a two-pass variance)."""
    lo, hi = _chunk_rows(c, chunks, rows)
    if lo >= hi:
        return
    two_pass = center and not one_pass
    depth = 2 if two_pass else 1
    n_var = np.float32(n - 1) if unbiased else np.float32(n)
    zeros = np.zeros(n, np.float32)
    sc = scale if has_scale else np.ones(n, np.float32)
    scratch = np.empty(n, np.float32)  # the output of a row of zeros; streamed: each row's output before its stores
    # what is stored past the last row: never an array the loop reads (overlapping arrays send a loop to its
    # unvectorized version, whose sums are added in another order)
    sink = np.empty(n if has_res else 0, np.float32)
    h_scratch = np.empty((3, n if (has_res and stream) else 0), np.float32)  # streamed h: rows i, i + 1, i + 2
    h0, mean0, inv0 = zeros, np.float32(0.0), np.float32(0.0)  # the row written in this loop
    h1, mean1 = zeros, np.float32(0.0)  # two-pass: the row whose deviations this loop sums
    for i in range(lo - depth, hi):
        out = scratch if (i < lo or stream) else y[i * n:(i + 1) * n]
        k = i + depth  # the row whose sums this loop takes
        nx, nr, nh = zeros, zeros, sink  # past the last row: zeros
        if k < hi:
            nx = x[k * x_rs:k * x_rs + n]
            if has_res:
                nr = res[k * res_rs:k * res_rs + n]
                nh = h_scratch[k % 3] if stream else h_out[k * n:(k + 1) * n]
        if two_pass:
            css, s = _write_row_deviate_next_sum_after(h0, out, n, mean0, inv0, sc, shift, has_shift, h1, mean1,
                                                       nx, nr, has_res, nh)
            ss = np.float32(0.0)
        else:
            s, ss = _write_row_sum_next(h0, out, n, mean0, inv0, sc, shift, has_shift, nx, nr, has_res, nh)
            css = np.float32(0.0)
        if i >= lo and stream:
            stream_row(y[i * n:(i + 1) * n], out, n)
        hk = nh if has_res else nx
        if k < hi and has_res and stream:
            stream_row(h_out[k * n:(k + 1) * n], hk, n)
        if two_pass:
            if lo <= i + 1 < hi:  # row i + 1's deviations are complete
                var = css / n_var
                inv0 = _store_stats(stats, i + 1, mean1, var, _denominator(var, eps, placement))
                h0, mean0 = h1, mean1
            h1, mean1 = hk, s / np.float32(n)
        elif k < hi:
            mean0, inv0 = _stored_stats(stats, k, hk, n, s, ss, center, one_pass, unbiased, eps, placement)
            h0 = hk
    if stream:
        store_fence()


@njit(parallel=True, **_OPTS)
def forward_f32(x, x_rs, res, res_rs, has_res, y, h_out, stats, rows, n, chunks, scale, shift, has_scale,
                has_shift, center, one_pass, unbiased, eps, placement, stream):
    """float32 rows: y = norm(x [+ res]); h_out gets x + res when ``has_res``; stats[i] = (mean, var, denom).
    The rows run in ``chunks`` parallel chunks; ``stream``: y and h_out written with streaming stores
    (:mod:`.streaming`)."""
    for c in prange(chunks):
        _forward_f32_chunk(c, chunks, x, x_rs, res, res_rs, has_res, y, h_out, stats, rows, n, scale, shift,
                           has_scale, has_shift, center, one_pass, unbiased, eps, placement, stream)


@njit(**_OPTS)
def forward_f32_serial(x, x_rs, res, res_rs, has_res, y, h_out, stats, rows, n, chunks, scale, shift, has_scale,
                       has_shift, center, one_pass, unbiased, eps, placement, stream):
    for c in range(chunks):
        _forward_f32_chunk(c, chunks, x, x_rs, res, res_rs, has_res, y, h_out, stats, rows, n, scale, shift,
                           has_scale, has_shift, center, one_pass, unbiased, eps, placement, stream)


@njit(**_OPTS)
def _forward_16_row(i, x, x_rs, res, res_rs, has_res, y, h_out, stats, n, scale, shift, has_scale, has_shift,
                    center, one_pass, unbiased, eps, placement, cast_then_scale, fmt, table, stream):
    hbuf = np.empty(n, np.float32)
    hbits = hbuf.view(np.uint32)
    _decode(x, i * x_rs, n, fmt, table, hbuf, hbits)
    if has_res:
        rbuf = np.empty(n, np.float32)
        _decode(res, i * res_rs, n, fmt, table, rbuf, rbuf.view(np.uint32))
        for j in range(n):  # h = x + residual in the storage dtype
            hbuf[j] = _rounded_16(hbuf[j] + rbuf[j], fmt)
        _store_16(hbuf, n, fmt, h_out, i * n, stream)
    mean, var, denom = _row_stats(hbuf, n, center, one_pass, unbiased, eps, placement)
    _store_stats(stats, i, mean, var, denom)
    # computed, rounded and encoded in one pass (into a scratch row when streamed)
    yr = y[i * n:(i + 1) * n]
    out = np.empty(n, np.uint16) if stream else yr
    if cast_then_scale:
        _affine_cast_16(hbuf, out, n, mean, denom, scale, shift, has_scale, has_shift, fmt)
    else:
        _affine_16(hbuf, out, n, mean, denom, scale, shift, has_scale, has_shift, fmt)
    if stream:
        stream_row(yr, out, n)
    if stream:
        store_fence()


@njit(inline="always", **_OPTS)
def _affine_value_16(hj, mean, inv, g, b, has_shift, cast_then_scale, fmt):
    """One value of ``_affine_16`` (``cast_then_scale``: of ``_affine_cast_16``) with γ = ``g`` (1 where the contract
    has none: exact) and β = ``b``, as its 16-bit pattern."""
    if cast_then_scale:
        v = _rounded_16(_rounded_16((hj - mean) * inv, fmt) * g, fmt)
        return _bits_16(v + b, fmt) if has_shift else _bits_16(v, fmt)
    v = (hj - mean) * inv * g
    return _bits_16(v + b, fmt) if has_shift else _bits_16(v, fmt)


@njit(**_OPTS)
def _write_16_decode_next(h, out, n, mean, inv, scale, shift, has_shift, cast_then_scale, fmt, table, nx, nh):
    """The 16-bit forward's rows in a pipeline, as the float32 one's (``_write_row_sum_next``): this row's output
    computed, rounded and encoded, and the next row's bit patterns ``nx`` decoded into ``nh`` with their sums, in
    one loop: (s, ss) of the next row."""
    s = np.float32(0.0)
    ss = np.float32(0.0)
    for j in range(n):
        out[j] = _affine_value_16(h[j], mean, inv, scale[j], shift[j], has_shift, cast_then_scale, fmt)
        v = _value_16(nx[j], fmt, table)
        nh[j] = v
        s += v
        ss += v * v
    return s, ss


@njit(**_OPTS)
def _forward_16_chunk(c, chunks, x, x_rs, y, stats, rows, n, scale, shift, has_scale, has_shift, center, one_pass,
                      unbiased, eps, placement, cast_then_scale, fmt, table, stream):
    """Rows ``c·per … (c+1)·per`` of ``forward_16`` without a residual: each row decoded, summed and written in
    the loop that writes the row before it, the chunk starting behind a row of zeros (every row's sums from the
    same loop, as in the float32 forward)."""
    lo, hi = _chunk_rows(c, chunks, rows)
    if lo >= hi:
        return
    zeros16 = np.zeros(n, np.uint16)
    sc = scale if has_scale else np.ones(n, np.float32)
    sh = shift if has_shift else np.zeros(n, np.float32)
    # the decoded row being written and the next one, in turn, and the row of zeros the chunk starts behind (never
    # one the same loop writes: overlapping arrays send it to its unvectorized version, which sums in another order)
    rows_f = np.zeros((3, n), np.float32)
    scratch = np.empty(n, np.uint16)  # the output of the row of zeros; streamed: each row's output before its stores
    h0 = rows_f[2]
    mean0, inv0 = np.float32(0.0), np.float32(0.0)
    for i in range(lo - 1, hi):
        out = scratch if (i < lo or stream) else y[i * n:(i + 1) * n]
        k = i + 1
        nx = x[k * x_rs:k * x_rs + n] if k < hi else zeros16
        nh = rows_f[k % 2]
        s, ss = _write_16_decode_next(h0, out, n, mean0, inv0, sc, sh, has_shift, cast_then_scale, fmt, table, nx,
                                      nh)
        if i >= lo and stream:
            stream_row(y[i * n:(i + 1) * n], out, n)
        if k < hi:
            mean0, inv0 = _stored_stats(stats, k, nh, n, s, ss, center, one_pass, unbiased, eps, placement)
            h0 = nh
    if stream:
        store_fence()


@njit(**_OPTS)
def _forward_16_unit(u, x, x_rs, res, res_rs, has_res, y, h_out, stats, rows, n, chunks, scale, shift, has_scale,
                     has_shift, center, one_pass, unbiased, eps, placement, cast_then_scale, fmt, table, stream):
    """Unit ``u`` of ``forward_16``: a row with the fused add, else a pipelined chunk of rows."""
    if has_res:
        _forward_16_row(u, x, x_rs, res, res_rs, has_res, y, h_out, stats, n, scale, shift, has_scale, has_shift,
                        center, one_pass, unbiased, eps, placement, cast_then_scale, fmt, table, stream)
    else:
        _forward_16_chunk(u, chunks, x, x_rs, y, stats, rows, n, scale, shift, has_scale, has_shift, center,
                          one_pass, unbiased, eps, placement, cast_then_scale, fmt, table, stream)


@njit(parallel=True, **_OPTS)
def forward_16(x, x_rs, res, res_rs, has_res, y, h_out, stats, rows, n, chunks, scale, shift, has_scale, has_shift,
               center, one_pass, unbiased, eps, placement, cast_then_scale, fmt, table, stream):
    """bfloat16 (fmt 1) / float16 (fmt 2) rows as uint16 patterns; float32 statistics; ``stream`` as in
    ``forward_f32``. Without a residual the rows run in ``chunks`` pipelined chunks (``_forward_16_chunk``); the
    fused add, one row at a time."""
    units = rows if has_res else chunks  # (a conditional inside prange's bound keeps numba from parallelising it)
    for u in prange(units):
        _forward_16_unit(u, x, x_rs, res, res_rs, has_res, y, h_out, stats, rows, n, chunks, scale, shift, has_scale,
                         has_shift, center, one_pass, unbiased, eps, placement, cast_then_scale, fmt, table, stream)


@njit(**_OPTS)
def forward_16_serial(x, x_rs, res, res_rs, has_res, y, h_out, stats, rows, n, chunks, scale, shift, has_scale,
                      has_shift, center, one_pass, unbiased, eps, placement, cast_then_scale, fmt, table, stream):
    units = rows if has_res else chunks
    for u in range(units):
        _forward_16_unit(u, x, x_rs, res, res_rs, has_res, y, h_out, stats, rows, n, chunks, scale, shift, has_scale,
                         has_shift, center, one_pass, unbiased, eps, placement, cast_then_scale, fmt, table, stream)


# ------------------------------------------------------------------------------------------- backward
@njit(**_OPTS)
def _dx_coefficients(s_gdev, s_g, s_dev, n, var, denom, center, one_pass, unbiased, eps, placement):
    """(inv, c, sub) of a row's dx = g·γ·inv + c·(h − mean) − sub, from its sums Σ g·γ·(h − mean), Σ g·γ and
    Σ (h − mean); mirrors ``reference.backward``."""
    inv = np.float32(1.0) / denom
    n_var = np.float32(n - 1) if unbiased else np.float32(n)
    r = np.sqrt(var)
    if placement == 0:
        d_denom = np.float32(0.5) / denom
    elif placement == 2:
        d_denom = np.float32(0.5) / r if r > eps else np.float32(0.0)
    else:
        d_denom = np.float32(0.5) / r
    if one_pass and not var > np.float32(0.0):
        d_denom = np.float32(0.0)  # the clamp at 0 has no gradient
    dvar = -s_gdev * inv * inv * d_denom
    c = np.float32(2.0) * dvar / n_var
    sub = np.float32(0.0)
    if center:
        sub = (s_g * inv + c * s_dev) / np.float32(n)
    return inv, c, sub


@njit(**_OPTS)
def _row_backward(h, g, dx, n, mean, var, denom, scale, has_scale, center, one_pass, unbiased, eps, placement,
                  dgamma, dbeta, want_dgamma, want_dbeta):
    """dx of one row from dy (``g``, float32), accumulating dγ and dβ (16-bit rows; float32 rows:
    ``_write_dx_sum_next``)."""
    inv = np.float32(1.0) / denom
    s_gdev = np.float32(0.0)
    s_g = np.float32(0.0)
    s_dev = np.float32(0.0)
    for j in range(n):
        dev = h[j] - mean
        gj = g[j] * scale[j] if has_scale else g[j]
        if want_dgamma:
            dgamma[j] += g[j] * (dev * inv)
        if want_dbeta:
            dbeta[j] += g[j]
        s_gdev += gj * dev
        s_g += gj
        s_dev += dev
    inv, c, sub = _dx_coefficients(s_gdev, s_g, s_dev, n, var, denom, center, one_pass, unbiased, eps, placement)
    for j in range(n):
        gj = g[j] * scale[j] if has_scale else g[j]
        dx[j] = gj * inv + c * (h[j] - mean) - sub


@njit(**_OPTS)
def _write_dx_sum_next(h, g, dh, has_dh, dx, n, mean, inv, c, sub, scale, h1, g1, mean1, inv1, dgamma, dbeta):
    """The float32 backward's rows in a pipeline, as the forward's: this row's dx (``_row_backward``'s last loop,
    plus ``dh`` when ``has_dh``) and the next row's sums (``h1``, ``g1``; its dγ and dβ accumulated) in one loop:
    (Σ g·γ·dev, Σ g·γ, Σ dev) of the next row. γ absent: a row of ones."""
    s_gdev = np.float32(0.0)
    s_g = np.float32(0.0)
    s_dev = np.float32(0.0)
    if has_dh:
        for j in range(n):
            dx[j] = g[j] * scale[j] * inv + c * (h[j] - mean) - sub + dh[j]
            dev = h1[j] - mean1
            gj = g1[j] * scale[j]
            dgamma[j] += g1[j] * (dev * inv1)
            dbeta[j] += g1[j]
            s_gdev += gj * dev
            s_g += gj
            s_dev += dev
    else:
        for j in range(n):
            dx[j] = g[j] * scale[j] * inv + c * (h[j] - mean) - sub
            dev = h1[j] - mean1
            gj = g1[j] * scale[j]
            dgamma[j] += g1[j] * (dev * inv1)
            dbeta[j] += g1[j]
            s_gdev += gj * dev
            s_g += gj
            s_dev += dev
    return s_gdev, s_g, s_dev


@njit(**_OPTS)
def _backward_f32_chunk(c, h, dy, dh, has_dh, dx, stats, rows, n, chunks, scale, has_scale, want_dgamma,
                        want_dbeta, center, one_pass, unbiased, eps, placement, dgamma_part, dbeta_part, stream):
    """Rows ``c·per … (c+1)·per`` of ``backward_f32``: row i's dx written in the loop that sums row i + 1; the
    chunk starts behind a row of zeros, and what the loop past the last row would accumulate goes to scratch rows
    (never into an array the same loop reads: see the forward)."""
    lo, hi = _chunk_rows(c, chunks, rows)
    if lo >= hi:
        return
    zeros = np.zeros(n, np.float32)
    sc = scale if has_scale else np.ones(n, np.float32)
    dg = dgamma_part[c] if want_dgamma else np.zeros(n, np.float32)
    db = dbeta_part[c] if want_dbeta else np.zeros(n, np.float32)
    sink = np.zeros((2, n), np.float32)  # dγ, dβ past the last row
    scratch = np.empty(n, np.float32)  # the dx of the row of zeros; streamed: each row's dx before its stores
    h0, g0, dh0 = zeros, zeros, zeros
    mean0, inv0, c0, sub0 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
    for i in range(lo - 1, hi):
        out = scratch if (i < lo or stream) else dx[i * n:(i + 1) * n]
        k = i + 1
        h1, g1, dg1, db1 = zeros, zeros, sink[0], sink[1]
        mean1, inv1 = np.float32(0.0), np.float32(0.0)
        if k < hi:
            h1, g1, dg1, db1 = h[k * n:(k + 1) * n], dy[k * n:(k + 1) * n], dg, db
            mean1, inv1 = stats[k, 0], np.float32(1.0) / stats[k, 2]
        s_gdev, s_g, s_dev = _write_dx_sum_next(h0, g0, dh0, has_dh, out, n, mean0, inv0, c0, sub0, sc, h1, g1,
                                                mean1, inv1, dg1, db1)
        if i >= lo and stream:
            stream_row(dx[i * n:(i + 1) * n], out, n)
        if k < hi:
            inv0, c0, sub0 = _dx_coefficients(s_gdev, s_g, s_dev, n, stats[k, 1], stats[k, 2], center, one_pass,
                                              unbiased, eps, placement)
            h0, g0, mean0 = h1, g1, mean1
            if has_dh:
                dh0 = dh[k * n:(k + 1) * n]
    if stream:
        store_fence()


@njit(parallel=True, **_OPTS)
def backward_f32(h, dy, dh, has_dh, dx, stats, rows, n, chunks, scale, has_scale, want_dgamma, want_dbeta,
                 center, one_pass, unbiased, eps, placement, dgamma_part, dbeta_part, stream):
    """dx (plus the incoming gradient of h, when ``has_dh``) for contiguous float32 rows; dγ/dβ as per-chunk
    partial sums (``chunks`` rows of the partial arrays), summed by the caller; ``stream``: dx written with
    streaming stores."""
    for c in prange(chunks):
        _backward_f32_chunk(c, h, dy, dh, has_dh, dx, stats, rows, n, chunks, scale, has_scale, want_dgamma,
                            want_dbeta, center, one_pass, unbiased, eps, placement, dgamma_part, dbeta_part, stream)


@njit(**_OPTS)
def backward_f32_serial(h, dy, dh, has_dh, dx, stats, rows, n, chunks, scale, has_scale, want_dgamma,
                        want_dbeta, center, one_pass, unbiased, eps, placement, dgamma_part, dbeta_part, stream):
    for c in range(chunks):
        _backward_f32_chunk(c, h, dy, dh, has_dh, dx, stats, rows, n, chunks, scale, has_scale, want_dgamma,
                            want_dbeta, center, one_pass, unbiased, eps, placement, dgamma_part, dbeta_part, stream)


@njit(**_OPTS)
def _backward_16_chunk(c, h, dy, dh, has_dh, dx, stats, rows, n, chunks, scale, has_scale, want_dgamma,
                       want_dbeta, center, one_pass, unbiased, eps, placement, fmt, table, dgamma_part, dbeta_part,
                       stream):
    per = (rows + chunks - 1) // chunks
    hbuf = np.empty(n, np.float32)
    gbuf = np.empty(n, np.float32)
    dbuf = np.empty(n, np.float32)
    tbuf = np.empty(n, np.float32)
    scratch = np.empty(n if stream else 0, np.uint16)
    dg = dgamma_part[c]
    db = dbeta_part[c]
    for i in range(c * per, min(rows, (c + 1) * per)):
        _decode(h, i * n, n, fmt, table, hbuf, hbuf.view(np.uint32))
        _decode(dy, i * n, n, fmt, table, gbuf, gbuf.view(np.uint32))
        _row_backward(hbuf, gbuf, dbuf, n, stats[i, 0], stats[i, 1], stats[i, 2], scale, has_scale, center,
                      one_pass, unbiased, eps, placement, dg, db, want_dgamma, want_dbeta)
        if has_dh:
            _decode(dh, i * n, n, fmt, table, tbuf, tbuf.view(np.uint32))
            for j in range(n):
                dbuf[j] += tbuf[j]
        dxr = dx[i * n:(i + 1) * n]
        out = scratch if stream else dxr
        for j in range(n):  # rounded and encoded in one pass
            out[j] = _bits_16(dbuf[j], fmt)
        if stream:
            stream_row(dxr, out, n)
    if stream:
        store_fence()


@njit(parallel=True, **_OPTS)
def backward_16(h, dy, dh, has_dh, dx, stats, rows, n, chunks, scale, has_scale, want_dgamma, want_dbeta,
                center, one_pass, unbiased, eps, placement, fmt, table, dgamma_part, dbeta_part, stream):
    """``backward_f32`` for bfloat16 (fmt 1) / float16 (fmt 2) rows as uint16 patterns; dx rounded once."""
    for c in prange(chunks):
        _backward_16_chunk(c, h, dy, dh, has_dh, dx, stats, rows, n, chunks, scale, has_scale, want_dgamma,
                           want_dbeta, center, one_pass, unbiased, eps, placement, fmt, table, dgamma_part,
                           dbeta_part, stream)


@njit(**_OPTS)
def backward_16_serial(h, dy, dh, has_dh, dx, stats, rows, n, chunks, scale, has_scale, want_dgamma,
                       want_dbeta, center, one_pass, unbiased, eps, placement, fmt, table, dgamma_part,
                       dbeta_part, stream):
    for c in range(chunks):
        _backward_16_chunk(c, h, dy, dh, has_dh, dx, stats, rows, n, chunks, scale, has_scale, want_dgamma,
                           want_dbeta, center, one_pass, unbiased, eps, placement, fmt, table, dgamma_part,
                           dbeta_part, stream)
