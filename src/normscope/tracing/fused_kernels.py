"""The numba kernels behind :mod:`.fused` (imported only when numba is installed).

The batch kernels take tensors as arrays of data addresses and element counts, so a recorded step pays one call
for all of a model's gradients, parameters or activations instead of one per tensor. The work is cut into chunks
of whole rows (about ``CHUNK`` elements) that run on numba's threads (``*_parallel``) or on the calling thread
(``*_serial``); partial results are combined per tensor in chunk order. The caller guarantees that every
address is a live, contiguous float32 buffer of the stated size for the duration of the call.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from ..numba_bits import as_float32
from . import fused

# reassociation lets the sums vectorise; no "nnan"/"ninf": a NaN or an infinity still reaches the results
_FAST = {"reassoc", "contract", "nsz"}
_ABS = np.int32(0x7FFFFFFF)
# numba widens int32 arithmetic to int64; each integer reduction's operand is cast back, so LLVM keeps it in 32-bit
# lanes (twice as many per vector: the sums kernel 5 → 8 Gelem/s, a row's range 2.2 → 3.7, same results)
_I32 = np.int32
CHUNK = 1 << 16  # elements per unit of work
_ROWS = 4  # query rows whose attention logits are computed together (its passes are unrolled for 4)
_STAGE = 1024  # update differences staged per block, so the max |d| runs on their bit patterns (vectorised)
_JIT = {"cache": True, "nogil": True, "fastmath": _FAST, "boundscheck": False}


@intrinsic
def _f32_at(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.float32)))

    return types.CPointer(types.float32)(types.int64), codegen


@intrinsic
def _i32_at(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.int32)))

    return types.CPointer(types.int32)(types.int64), codegen


@numba.njit(**_JIT)
def _plan(sizes, row_sizes):  # pragma: no cover - compiled
    """Chunks of whole rows: (owner tensor, first element, element count) per chunk, tensor by tensor."""
    per = np.empty(sizes.size, np.int64)
    total = 0
    for t in range(sizes.size):
        per[t] = max(1, CHUNK // row_sizes[t]) * row_sizes[t]
        total += (sizes[t] + per[t] - 1) // per[t]
    owner = np.empty(total, np.int64)
    first = np.empty(total, np.int64)
    count = np.empty(total, np.int64)
    c = 0
    for t in range(sizes.size):
        for start in range(0, sizes[t], per[t]):
            owner[c] = t
            first[c] = start
            count[c] = min(per[t], sizes[t] - start)
            c += 1
    return owner, first, count


@numba.njit(**_JIT)
def _chunk_sums(address, start, count, row):  # pragma: no cover - compiled
    """Σx², the largest |x| bit pattern (sign cleared: an integer maximum that a NaN or an infinity also reaches)
    and the smallest row Σx² of ``count`` elements from ``start``, rows of ``row`` elements."""
    s = 0.0
    low = np.inf
    m = np.int32(0)
    for r0 in range(start, start + count, row):
        k = min(row, start + count - r0)
        # a view per row, indexed from 0: the form of loop LLVM vectorises (an offset index range is not)
        x = numba.carray(_f32_at(address + 4 * r0), (k,))
        bits = numba.carray(_i32_at(address + 4 * r0), (k,))
        rs = 0.0
        for i in range(k):
            v = np.float64(x[i])
            rs += v * v
            m = max(m, _I32(bits[i] & _ABS))
        s += rs
        low = min(low, rs)
    return s, m, low


@numba.njit(**_JIT)
def _chunk_update(old_address, new_address, start, count):  # pragma: no cover - compiled
    """Σ(old - new)², the largest |old - new| bit pattern and Σnew² of ``count`` elements from ``start``."""
    stage = np.empty(_STAGE, np.float32)
    stage_bits = stage.view(np.int32)
    su = 0.0
    sp = 0.0
    m = np.int32(0)
    for b0 in range(start, start + count, _STAGE):
        k = min(_STAGE, start + count - b0)
        old = numba.carray(_f32_at(old_address + 4 * b0), (k,))
        new = numba.carray(_f32_at(new_address + 4 * b0), (k,))
        for i in range(k):
            w = new[i]
            d = old[i] - w
            stage[i] = d
            su += np.float64(d) * np.float64(d)
            sp += np.float64(w) * np.float64(w)
        for i in range(k):
            m = max(m, _I32(stage_bits[i] & _ABS))
    return su, m, sp


@numba.njit(**_JIT)
def _combine(owner, p0, p1, p2, out0, out1, out2, low_is_min):  # pragma: no cover - compiled
    """Per tensor: the chunks' first and third results added (or the third's minimum), the second's maximum."""
    for t in range(out0.size):
        out0[t] = 0.0
        out1[t] = 0
        out2[t] = np.inf if low_is_min else 0.0
    for c in range(owner.size):
        t = owner[c]
        out0[t] += p0[c]
        out1[t] = max(out1[t], p1[c])
        out2[t] = min(out2[t], p2[c]) if low_is_min else out2[t] + p2[c]


@numba.njit(**_JIT)
def _sums_chunk(c, owner, first, count, addresses, row_sizes, p0, p1, p2):  # pragma: no cover - compiled
    t = owner[c]
    p0[c], p1[c], p2[c] = _chunk_sums(addresses[t], first[c], count[c], row_sizes[t])


@numba.njit(**_JIT)
def _update_chunk(c, owner, first, count, olds, news, p0, p1, p2):  # pragma: no cover - compiled
    t = owner[c]
    p0[c], p1[c], p2[c] = _chunk_update(olds[t], news[t], first[c], count[c])


@numba.njit(**_JIT)
def _partials(n):  # pragma: no cover - compiled
    return np.empty(n), np.empty(n, np.int32), np.empty(n)


_SIGN = np.int32(0x7FFFFFFF)
_KEY_LOW, _KEY_HIGH = np.int32(-(1 << 31)), np.int32((1 << 31) - 1)
_INF_BITS = np.int32(0x7F800000)
_EVERY_KEY = np.float32(np.nan)  # as ``lowest`` of :func:`_row_range`: no value compares at or below it


@numba.njit(**_JIT)
def _key(bits):  # pragma: no cover - compiled
    """A float32's bit pattern as an int32 that orders as the floats do (negative ones' magnitude bits flipped), so
    a row's largest and smallest values are integer reductions, which vectorise (a float max does not without
    fastmath's no-NaN flag). Its own inverse."""
    return _I32(bits ^ ((bits >> np.int32(31)) & _SIGN))


@numba.njit(**_JIT)
def _row_range(rows, bits, r, n, lowest):  # pragma: no cover - compiled
    """One pass over the first n float32 values of row ``r`` of ``rows`` (``bits``: the same memory as int32), the
    entries above ``lowest`` live (NaN is; a NaN ``lowest`` makes every entry live): (live entries, the largest and
    the smallest live value as keys (:func:`_key`), the largest live |x| bit pattern). A pattern at or above the
    infinity's means a live entry is not finite, and the keys are then not the floats' order. Indexed in the 2-D
    block, not through a view of the row: a view's reference counting cost as much as the row's statistics."""
    count = np.int32(0)
    high, low, top = _KEY_LOW, _KEY_HIGH, np.int32(0)
    for j in range(n):
        w = bits[r, j]
        a = np.int32(0) if rows[r, j] <= lowest else np.int32(1)
        k = _key(w)
        count = _I32(count + a)
        high = max(high, k if a else _KEY_LOW)
        low = min(low, k if a else _KEY_HIGH)
        top = max(top, _I32((w & _ABS) * a))
    return count, high, low, top


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 in two parts: t * _LN2_HI is exact for the |t| < 127 used here
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LOW = np.float32(-87.0)  # exp below this is under float32's normal range: taken as exp(-87) ~ 1.6e-38
SOFTMAX_SPAN = np.float32(fused.SOFTMAX_SPAN)  # a key further below its row's largest logit takes no part


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _exp_shifted(x, top, out, n):  # pragma: no cover - compiled
    """out[j] = exp(x[j] - top) for j < n, to about 4e-7 relative: 2^t * p(r) with t = rint((x - top) / ln 2) and
    a degree-6 polynomial on |r| <= ln(2) / 2, in float32 and branch-free, so the loop vectorises (libm's exp, one
    scalar call per element, was most of the attention summary's time). Built without fastmath: the rounding must
    not be reassociated away. Arguments are clamped to [-87, 0] before the integer conversion, which is therefore
    always defined; below -87 (float32's normal range) and for NaN the result is 0."""
    for j in range(n):
        y = x[j] - top
        low = y > _EXP_LOW  # False for NaN
        y = y if low else _EXP_LOW
        y = y if y < 0 else np.float32(0.0)
        t = np.rint(y * _LOG2E)
        r = y - t * _LN2_HI - t * _LN2_LO
        p = np.float32(1.0 / 720.0)
        p = p * r + np.float32(1.0 / 120.0)
        p = p * r + np.float32(1.0 / 24.0)
        p = p * r + np.float32(1.0 / 6.0)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        p = p * r + np.float32(1.0)
        e = p * as_float32((np.int32(t) + np.int32(127)) << np.int32(23))
        out[j] = e if low else np.float32(0.0)


@numba.njit(**_JIT, error_model="numpy")
def _entropy(ex, z, top, n):  # pragma: no cover - compiled
    """A softmax row's entropy from its shifted exponentials e = exp(z - top) (0 at a masked key):
    log Σe + top - Σ e·z / Σe, summed in float64; NaN for a row of NaN (Σe = 0: numpy's error model, not an
    exception)."""
    se = 0.0
    sz = 0.0
    for j in range(n):
        e = np.float64(ex[j])
        se += e
        sz += e * np.float64(z[j])
    return np.log(se) + np.float64(top) - sz / se


@numba.njit(**_JIT)
def _attention_scratch(dims):  # pragma: no cover - compiled
    """The working memory of :func:`_attention_unit`, allocated once per thread of a launch and reused by its units
    (allocated per unit, it was most of a small model's attention summary): the head's keys transposed (its zero
    padding stays zero: a unit writes only its ``tk`` columns), a block's logits, its scaled queries, their ends, a
    row's exponentials."""
    tk, d = dims[3], dims[4]
    width = (tk + 7) // 8 * 8  # rows computed in whole vectors: the zero padding of kt makes the tail harmless
    return (np.zeros((d, width), np.float32), np.empty((_ROWS, width), np.float32), np.zeros((_ROWS, d), np.float32),
            np.zeros(_ROWS, np.int64), np.empty(width, np.float32))


@numba.njit(**_JIT)
def _attention_unit(u, q, qs, k, ks, dims, scale, bias, masked, extent, prefix, stride, maxbits, full_rows,
                    entropy_sum, entropy_rows, scratch):  # pragma: no cover - compiled
    """One (sample, head) of :func:`attention_summary_serial`: its logits four query rows at a time into a small
    buffer (never the whole (Tq, Tk) matrix), each block only up to its rows' last unmasked key; ``scratch`` from
    :func:`_attention_scratch`."""
    h, tq, tk, d, group = dims[1], dims[2], dims[3], dims[4], dims[5]
    a, b = u // h, u % h
    mn, mh, mq = masked.shape[0] > 1, masked.shape[1] > 1, masked.shape[2] > 1
    kt, block, qb, ends, ex = scratch  # kt: this head's keys transposed, a row's logits are then sums of axpys
    base = k + 4 * (a * ks[0] + (b // group) * ks[1])
    for j in range(tk):
        key = numba.carray(_f32_at(base + 4 * j * ks[2]), (d,))
        for c in range(d):
            kt[c, j] = key[c]
    block_bits = block.view(np.int32)  # block: a block's logits, one query row each; qb: its queries, scaled
    d4 = d - d % 4
    m = np.int32(0)
    full = 0
    es = 0.0
    er = 0
    for i0 in range(0, tq, _ROWS):
        n = min(_ROWS, tq - i0)
        span = 0
        for r in range(_ROWS):  # a block past the last query row repeats that row, its results unread
            i = min(i0 + r, tq - 1)
            ends[r] = extent[a if mn else 0, b if mh else 0, i if mq else 0] if r < n else 0
            span = max(span, ends[r])
            query = numba.carray(_f32_at(q + 4 * (a * qs[0] + b * qs[1] + i * qs[2])), (d,))
            for c in range(d):
                qb[r, c] = query[c] * scale
        span = (span + 7) // 8 * 8
        for j in range(span):
            block[0, j] = 0.0
            block[1, j] = 0.0
            block[2, j] = 0.0
            block[3, j] = 0.0
        # four keys' dimensions per pass over the block: each key value loaded once for the four rows
        for c in range(0, d4, 4):
            a0, a1, a2, a3 = qb[0, c], qb[0, c + 1], qb[0, c + 2], qb[0, c + 3]
            b0, b1, b2, b3 = qb[1, c], qb[1, c + 1], qb[1, c + 2], qb[1, c + 3]
            c0, c1, c2, c3 = qb[2, c], qb[2, c + 1], qb[2, c + 2], qb[2, c + 3]
            e0, e1, e2, e3 = qb[3, c], qb[3, c + 1], qb[3, c + 2], qb[3, c + 3]
            k0, k1, k2, k3 = kt[c], kt[c + 1], kt[c + 2], kt[c + 3]
            for j in range(span):
                x0, x1, x2, x3 = k0[j], k1[j], k2[j], k3[j]
                block[0, j] += (a0 * x0 + a1 * x1) + (a2 * x2 + a3 * x3)
                block[1, j] += (b0 * x0 + b1 * x1) + (b2 * x2 + b3 * x3)
                block[2, j] += (c0 * x0 + c1 * x1) + (c2 * x2 + c3 * x3)
                block[3, j] += (e0 * x0 + e1 * x1) + (e2 * x2 + e3 * x3)
        for c in range(d4, d):
            a0, b0, c0, e0 = qb[0, c], qb[1, c], qb[2, c], qb[3, c]
            kc = kt[c]
            for j in range(span):
                x0 = kc[j]
                block[0, j] += a0 * x0
                block[1, j] += b0 * x0
                block[2, j] += c0 * x0
                block[3, j] += e0 * x0
        for r in range(n):
            i = i0 + r
            end = ends[r]
            if end == 0:
                full += 1
                continue
            hb, e, sampled = _row_summary(block, block_bits, r, ex, end, a, b, i, bias, masked, prefix,
                                          i % stride == 0)
            m = max(m, hb)
            if sampled:
                es += e
                er += 1
    maxbits[a, b] = m
    full_rows[a, b] = full
    entropy_sum[a, b] = es
    entropy_rows[a, b] = er


@numba.njit(inline="always", **_JIT)
def _row_summary(block, bits, r, ex, end, a, b, i, bias, masked, prefix, sample):  # pragma: no cover - compiled
    """Query row ``r`` of a :func:`_attention_unit` block (``bits``: the block as int32), its logits (the bias not
    yet added) with an unmasked key before ``end``: (the largest live |logit| bit pattern, the softmax entropy,
    whether it was taken (``sample``)). Indexed in the block, not through a view per row (see
    :func:`_row_range`)."""
    mn, mh, mq = masked.shape[0] > 1, masked.shape[1] > 1, masked.shape[2] > 1
    ma, mb, mi = a if mn else 0, b if mh else 0, i if mq else 0
    if bias.shape[3] > 1:
        brow = bias[a if bias.shape[0] > 1 else 0, b if bias.shape[1] > 1 else 0, i if bias.shape[2] > 1 else 0]
        for j in range(end):
            block[r, j] += brow[j]
    m = np.int32(0)
    top = np.float32(-np.inf)
    # a key more than SOFTMAX_SPAN below the row's largest logit has a weight too small to count: masked (a
    # finite additive mask such as Swin's -100); NaN compares false and stays, as does every key of a NaN row
    if prefix[ma, mb, mi]:  # every key before ``end`` unmasked (causal, padding on the right, no mask)
        _, high, low, hb = _row_range(block, bits, r, end, _EVERY_KEY)
        if hb < _INF_BITS and as_float32(_key(low)) >= as_float32(_key(high)) - SOFTMAX_SPAN:
            top = as_float32(_key(high))  # finite, every key within the span of the largest: all of them count
            m = hb
        else:
            for j in range(end):
                top = max(top, block[r, j])
            floor = top - SOFTMAX_SPAN
            for j in range(end):
                m = max(m, _I32((bits[r, j] & _ABS) * (np.int32(0) if block[r, j] < floor else np.int32(1))))
        if not sample:
            return m, 0.0, False
        row = block[r]
        _exp_shifted(row, top, ex, end)
    else:
        mrow = masked[ma, mb, mi]  # the key at end - 1 is unmasked: the row has a live key
        for j in range(end):
            if mrow[j] == 0:
                top = max(top, block[r, j])
        floor = top - SOFTMAX_SPAN
        for j in range(end):  # a masked entry (even NaN): 0
            m = max(m, _I32((bits[r, j] & _ABS) * (np.int32(1) - np.int32(mrow[j]))
                            * (np.int32(0) if block[r, j] < floor else np.int32(1))))
        if not sample:
            return m, 0.0, False
        row = block[r]
        for j in range(end):  # a masked key's logit (any value, inf or NaN) replaced: weight 0 below
            row[j] = row[j] if mrow[j] == 0 else top
        _exp_shifted(row, top, ex, end)
        for j in range(end):
            ex[j] *= np.float32(1 - mrow[j])
    return m, _entropy(ex, row, top, end), True


@numba.njit(**_JIT)
def _attention_units(dims):  # pragma: no cover - compiled
    n, h = dims[0], dims[1]
    return (np.empty((n, h), np.int32), np.empty((n, h), np.int64), np.empty((n, h)), np.empty((n, h), np.int64))


@numba.njit(**_JIT)
def _batch_units(calls, dims):  # pragma: no cover - compiled
    n, h = dims[0], dims[1]
    return (np.empty((calls, n, h), np.int32), np.empty((calls, n, h), np.int64), np.empty((calls, n, h)),
            np.empty((calls, n, h), np.int64))


@numba.njit(**_JIT)
def _batch_lane(lane, lanes, q, qs, k, ks, dims, scale, bias, masked, extent, prefix, stride,
                units):  # pragma: no cover - compiled
    """Every ``lanes``-th unit of a batch launch from ``lane`` on, with one scratch: unit u is (sample, head)
    ``u % (N·H)`` of call ``u // (N·H)``, into that call's units."""
    per = dims[0] * dims[1]
    scratch = _attention_scratch(dims)
    for u in range(lane, q.size * per, lanes):
        c = u // per
        _attention_unit(u % per, q[c], qs[c], k[c], ks[c], dims, scale, bias, masked, extent, prefix, stride,
                        units[0][c], units[1][c], units[2][c], units[3][c], scratch)


@numba.njit(**_JIT)
def _per_call(units, dims, maxbits, full_rows, full_samples, entropy_sum,
              entropy_rows):  # pragma: no cover - compiled
    """:func:`_per_head` of each call of a batch launch, into row c of the (calls, H) results."""
    for c in range(maxbits.shape[0]):
        _per_head((units[0][c], units[1][c], units[2][c], units[3][c]), dims[2], maxbits[c], full_rows[c],
                  full_samples[c], entropy_sum[c], entropy_rows[c])


@numba.njit(**_JIT)
def _per_head(units, tq, maxbits, full_rows, full_samples, entropy_sum,
              entropy_rows):  # pragma: no cover - compiled
    """The (sample, head) results combined per head: the maximum and the sums, and the samples whose ``tq`` query
    rows are all fully masked."""
    mb, fr, es, er = units
    for b in range(mb.shape[1]):
        maxbits[b] = 0
        full_rows[b] = 0
        full_samples[b] = 0
        entropy_sum[b] = 0.0
        entropy_rows[b] = 0
        for a in range(mb.shape[0]):
            maxbits[b] = max(maxbits[b], mb[a, b])
            full_rows[b] += fr[a, b]
            if tq > 0 and fr[a, b] == tq:
                full_samples[b] += 1
            entropy_sum[b] += es[a, b]
            entropy_rows[b] += er[a, b]


@numba.njit(**_JIT)
def _logits_lane(lane, lanes, x, xs, dims, stride, lowest, units):  # pragma: no cover - compiled
    """Every ``lanes``-th (sample, head) of a logits summary from ``lane`` on, with one scratch (a row's values, its
    keep flags, its exponentials: every unit writes a row's before reading them)."""
    tk = dims[3]
    scratch = (np.empty(tk, np.float32), np.empty(tk, np.float32), np.empty(tk, np.float32))
    for u in range(lane, dims[0] * dims[1], lanes):
        _logits_unit(u, x, xs, dims, stride, lowest, *units, scratch)


@numba.njit(**_JIT)
def _logits_unit(u, x, xs, dims, stride, lowest, maxbits, full_rows, entropy_sum,
                 entropy_rows, scratch):  # pragma: no cover - compiled
    """One (sample, head) of :func:`logits_summary_serial`: its rows of given logits read once each; an entry at
    or below ``lowest`` is masked (the ``-inf`` or ``finfo.min`` a mask fills in; NaN is not masked), and so is one
    more than ``SOFTMAX_SPAN`` below its row's largest unmasked logit."""
    h, tq, tk = dims[1], dims[2], dims[3]
    a, b = u // h, u % h
    buf, keep, ex = scratch
    bits = buf.view(np.int32)
    m = np.int32(0)
    full = 0
    es = 0.0
    er = 0
    for i in range(tq):
        address = x + 4 * (a * xs[0] + b * xs[1] + i * xs[2])
        row = numba.carray(_f32_at(address), (tk,))
        live, high, low, hb = _row_range(numba.carray(_f32_at(address), (1, tk)),
                                         numba.carray(_i32_at(address), (1, tk)), 0, tk, lowest)
        if live == 0:
            full += 1
            continue
        if hb < _INF_BITS and i % stride != 0 and as_float32(_key(low)) >= as_float32(_key(high)) - SOFTMAX_SPAN:
            m = max(m, hb)  # finite, and every live key within the span of the row's largest: all of them count
            continue
        # a row with a key below the span, a non-finite logit, or one whose entropy is taken: entry by entry
        for j in range(tk):
            v = row[j]
            buf[j] = v
            k = np.float32(0.0) if v <= lowest else np.float32(1.0)
            keep[j] = k
        top = np.float32(-np.inf)
        for j in range(tk):
            top = max(top, buf[j] if keep[j] > 0 else np.float32(-np.inf))
        # a key more than SOFTMAX_SPAN below the row's largest logit has a weight too small to count: masked (a finite
        # additive mask such as Swin's -100); NaN compares false and stays, as does every key of a NaN row
        floor = top - SOFTMAX_SPAN
        for j in range(tk):
            keep[j] = np.float32(0.0) if buf[j] < floor else keep[j]
        for j in range(tk):
            m = max(m, _I32((bits[j] & _ABS) * np.int32(keep[j])))  # a masked entry: 0
        if i % stride != 0:
            continue
        for j in range(tk):  # a masked key's logit replaced: weight 0 below
            buf[j] = buf[j] if keep[j] > 0 else top
        _exp_shifted(buf, top, ex, tk)
        for j in range(tk):
            ex[j] *= keep[j]
        es += _entropy(ex, buf, top, tk)
        er += 1
    maxbits[a, b] = m
    full_rows[a, b] = full
    entropy_sum[a, b] = es
    entropy_rows[a, b] = er


# Each kernel in two builds, serial and on numba's threads (``prange``), as separate module-level functions: numba
# caches a function by its name and closure, and keys on neither its ``parallel`` flag nor a stable closure.

@numba.njit(**_JIT)
def sums_serial(addresses, sizes, row_sizes, sumsq, maxbits, min_row):  # pragma: no cover - compiled
    """Per tensor t: Σx², the largest |x| bit pattern and the smallest Σx² of a row of ``row_sizes[t]``
    consecutive elements."""
    owner, first, count = _plan(sizes, row_sizes)
    p0, p1, p2 = _partials(owner.size)
    for c in range(owner.size):
        _sums_chunk(c, owner, first, count, addresses, row_sizes, p0, p1, p2)
    _combine(owner, p0, p1, p2, sumsq, maxbits, min_row, True)


@numba.njit(parallel=True, **_JIT)
def sums_parallel(addresses, sizes, row_sizes, sumsq, maxbits, min_row):  # pragma: no cover - compiled
    owner, first, count = _plan(sizes, row_sizes)
    p0, p1, p2 = _partials(owner.size)
    for c in numba.prange(owner.size):
        _sums_chunk(c, owner, first, count, addresses, row_sizes, p0, p1, p2)
    _combine(owner, p0, p1, p2, sumsq, maxbits, min_row, True)


@numba.njit(**_JIT)
def update_sums_serial(olds, news, sizes, update_sumsq, update_maxbits, new_sumsq):  # pragma: no cover - compiled
    """Per tensor t: Σ(old - new)², the largest |old - new| bit pattern and Σnew², in one read of both copies
    (neither is written)."""
    owner, first, count = _plan(sizes, np.ones(sizes.size, np.int64))
    p0, p1, p2 = _partials(owner.size)
    for c in range(owner.size):
        _update_chunk(c, owner, first, count, olds, news, p0, p1, p2)
    _combine(owner, p0, p1, p2, update_sumsq, update_maxbits, new_sumsq, False)


@numba.njit(parallel=True, **_JIT)
def update_sums_parallel(olds, news, sizes, update_sumsq, update_maxbits, new_sumsq):  # pragma: no cover
    owner, first, count = _plan(sizes, np.ones(sizes.size, np.int64))
    p0, p1, p2 = _partials(owner.size)
    for c in numba.prange(owner.size):
        _update_chunk(c, owner, first, count, olds, news, p0, p1, p2)
    _combine(owner, p0, p1, p2, update_sumsq, update_maxbits, new_sumsq, False)


@numba.njit(**_JIT)
def attention_summary_serial(q, qs, k, ks, dims, scale, bias, masked, extent, prefix, stride, maxbits, full_rows,
                             full_samples, entropy_sum, entropy_rows):  # pragma: no cover - compiled
    """Per call c and (sample, head) of the attention logits ``scale · q kᵀ + bias`` of (N, H, Tq, d) float32 queries
    at address ``q[c]`` and (N, H / group, Tk, d) float32 keys at ``k[c]`` (``qs[c]``, ``ks[c]``: the element strides
    of their first three dimensions; the last is contiguous; ``dims`` = N, H, Tq, Tk, d, group, shared by the calls;
    query head h reads key head h // group): the largest |logit| bit pattern over the unmasked entries, the number of
    query rows with every key masked (and of samples whose every row is), and the softmax entropy summed over every
    ``stride``-th query row that has an unmasked key (and their number), each per call and head in row c of the
    (calls, H) results (samples combined: the maximum, the sums). One launch for every call of a forward that shares
    shapes, scale and mask (every layer of a transformer, as a rule).

    ``bias`` is a contiguous float32 (N or 1, H or 1, Tq or 1, Tk) array added to the logits, or any array of key
    dimension 1 for none. ``masked`` is a contiguous uint8 (N or 1, H or 1, Tq or 1, Tk) array, 1 where masked (a
    dimension of 1 is shared); ``extent`` (same leading shape) is one past each mask row's last unmasked key, so a
    causal row computes only its keys, and ``prefix`` says a row has no masked key before its extent (its mask is
    then not read). A result at or above the infinity's bit pattern means a non-finite logit: the caller discards the
    entropy and takes its exact path."""
    units = _batch_units(q.size, dims)
    _batch_lane(0, 1, q, qs, k, ks, dims, scale, bias, masked, extent, prefix, stride, units)
    _per_call(units, dims, maxbits, full_rows, full_samples, entropy_sum, entropy_rows)


@numba.njit(parallel=True, **_JIT)
def attention_summary_parallel(q, qs, k, ks, dims, scale, bias, masked, extent, prefix, stride, maxbits, full_rows,
                               full_samples, entropy_sum, entropy_rows, threads):  # pragma: no cover - compiled
    """:func:`attention_summary_serial` on ``threads`` threads (numba's count, passed in: reading it here would keep
    the kernel from numba's cache)."""
    units = _batch_units(q.size, dims)
    lanes = min(threads, q.size * dims[0] * dims[1])  # one scratch per thread
    for lane in numba.prange(lanes):
        _batch_lane(lane, lanes, q, qs, k, ks, dims, scale, bias, masked, extent, prefix, stride, units)
    _per_call(units, dims, maxbits, full_rows, full_samples, entropy_sum, entropy_rows)


@numba.njit(**_JIT)
def logits_summary_serial(x, xs, dims, stride, lowest, maxbits, full_rows, full_samples, entropy_sum,
                          entropy_rows):  # pragma: no cover - compiled
    """Per head of the (N, H, Tq, Tk) float32 logits at address ``x`` that an eager softmax is given (``xs``: the element
    strides of the first three dimensions; the last is contiguous; ``dims`` = N, H, Tq, Tk): the largest |logit| bit
    pattern over the entries above ``lowest`` (the others are masked), the query rows with every key masked (and the
    samples whose every row is), and the softmax entropy summed over every ``stride``-th query row with an unmasked
    key (and their number); one read of each row. A result at or above the infinity's bit pattern means a non-finite
    logit."""
    units = _attention_units(dims)
    _logits_lane(0, 1, x, xs, dims, stride, lowest, units)
    _per_head(units, dims[2], maxbits, full_rows, full_samples, entropy_sum, entropy_rows)


@numba.njit(parallel=True, **_JIT)
def logits_summary_parallel(x, xs, dims, stride, lowest, maxbits, full_rows, full_samples, entropy_sum,
                            entropy_rows, threads):  # pragma: no cover - compiled
    """:func:`logits_summary_serial` on ``threads`` threads (see :func:`attention_summary_parallel`)."""
    units = _attention_units(dims)
    lanes = min(threads, dims[0] * dims[1])  # one scratch per thread
    for lane in numba.prange(lanes):
        _logits_lane(lane, lanes, x, xs, dims, stride, lowest, units)
    _per_head(units, dims[2], maxbits, full_rows, full_samples, entropy_sum, entropy_rows)


def _warm(sums, update_sums, attention_summary, logits_summary, *threads) -> None:
    x = np.ones(4, np.float32)
    a = np.array([x.ctypes.data], np.int64)
    n = np.array([4], np.int64)
    out = (np.zeros(1), np.zeros(1, np.int32), np.zeros(1))
    sums(a, n, n, *out)
    update_sums(a, a, n, *out)
    x = np.zeros((1, 1, 2, 2), np.float32)
    one = (np.zeros(1, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1), np.zeros(1, np.int64))
    st = np.array([4, 4, 2], np.int64)
    dims = np.array([1, 1, 2, 2, 2, 1], np.int64)
    at, sts = np.array([x.ctypes.data], np.int64), st.reshape(1, 3)
    attention_summary(at, sts, at, sts, dims, np.float32(1), x, np.zeros((1, 1, 2, 2), np.uint8),
                      np.full((1, 1, 2), 2, np.int64), np.ones((1, 1, 2), np.uint8), 1,
                      *(a.reshape(1, 1) for a in one), *threads)
    dims = np.array([1, 1, 2, 2], np.int64)
    logits_summary(x.ctypes.data, st, dims, 1, np.float32(-1e30), *one, *threads)


def warm_up(parallel: bool) -> None:
    """Compile (or load from the cache) now, not inside a probe's first call."""
    _warm(sums_serial, update_sums_serial, attention_summary_serial, logits_summary_serial)
    if parallel:
        _warm(sums_parallel, update_sums_parallel, attention_summary_parallel, logits_summary_parallel, 1)
