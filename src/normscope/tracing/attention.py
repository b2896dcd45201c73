"""Attention statistics for the tracer: per head, max |logit| over the unmasked entries, fully masked query rows,
non-finite logits, and the softmax entropy on sampled query rows.

Eager attention hands the tracer its logits (the softmax input). ``F.scaled_dot_product_attention`` never
materialises them, so they are recomputed from the call's q and k when the call is made: on the CPU (numba) row
by row inside one kernel that also takes every statistic, so the (Tq, Tk) matrix is never written and a causal
row stops at its query; elsewhere with torch into one buffer the tracer reuses. The calls of one forward that
share shapes, mask and scale (every layer of a transformer, as a rule) form a :class:`Group` that prepares the
mask once.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import fused
from .fused import absmax

ENTROPY_ROWS = 16  # query rows per (sample, head) the softmax entropy is averaged over
MASK_BIAS = -1e4  # an additive attention-mask value at or below this is a masked key (softmax weight 0)

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class SdpaCall:
    """The arguments of one ``scaled_dot_product_attention`` call that its logits depend on."""

    __slots__ = ("q", "k", "kv_group", "mask", "causal", "scale", "group")

    def __init__(self, args, kwargs):
        b = dict(zip(_SDPA_ARGS, args, strict=False))
        b.update(kwargs)
        q, k = b["query"].detach(), b["key"].detach()
        mask = b.get("attn_mask")
        self.kv_group = 1  # query heads per key head (grouped-query attention)
        if q.dim() >= 3 and k.dim() == q.dim() and k.shape[-3] != q.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
            self.kv_group = q.shape[-3] // k.shape[-3]
        scale = b.get("scale")
        self.q, self.k = q, k
        self.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        self.mask = mask if isinstance(mask, torch.Tensor) else None
        self.causal = bool(b.get("is_causal"))
        # calls that can share one mask
        self.group = (tuple(q.shape), tuple(k.shape), q.dtype, k.dtype, q.device, self.scale, self.causal,
                      None if self.mask is None else id(mask))  # the caller's mask object: one for every layer

    def keys(self) -> torch.Tensor:
        """k with one head per query head."""
        return self.k if self.kv_group == 1 else self.k.repeat_interleave(self.kv_group, dim=-3)


def sdpa_logits(call: SdpaCall, buffer=None, mask=None) -> tuple[torch.Tensor, tuple[torch.Tensor, Any]]:
    """The logits of one SDPA call (a private float32 tensor, in ``buffer("attention logits", shape, dtype,
    device)`` when given, memory the tracer reuses) and their mask in its own broadcastable shape (not expanded).

    A boolean ``attn_mask`` masks its False entries; a float one is added to the logits, and its entries at or
    below ``MASK_BIAS`` (``-inf``, ``finfo.min``, the ``-10000`` of older code) count as masked keys.
    Returns the logits and ``(masked, bias)``, which a call of the same group may pass as ``mask`` to skip
    building them again.
    """
    q, k = call.q, call.keys()

    def memory(name, shape):
        return buffer(name, torch.Size(shape), torch.float32, q.device) if buffer is not None else torch.empty(
            shape, dtype=torch.float32, device=q.device)

    # q scaled and k copied into contiguous memory (a pass over q and k, not over the logits): a strided batched
    # matmul is slower
    qs = torch.mul(q.float(), call.scale, out=memory("attention q", q.shape))
    ks = memory("attention k", k.shape).copy_(k)
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    logits = torch.matmul(qs, ks.transpose(-2, -1), out=memory("attention logits", (*lead, q.shape[-2], k.shape[-2])))
    masked, bias = mask if mask is not None else _mask(call, logits.shape[-2], logits.shape[-1])
    if bias is not None:  # a real bias (ALiBi, relative positions) on the unmasked keys
        logits = logits.add_(bias) if torch.broadcast_shapes(bias.shape, logits.shape) == logits.shape \
            else logits + bias
    return logits, (masked, bias)


def _mask(call: SdpaCall, tq: int, tk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(masked keys in their broadcastable shape, the float mask's additive bias on the other keys or None)."""
    device = call.q.device
    masked = torch.zeros((1, 1), dtype=torch.bool, device=device)
    bias = None
    m = call.mask
    if m is not None:
        m = m.detach()
        if m.dtype == torch.bool:
            masked = masked | ~m
        else:
            m = m.float()
            hard = m <= MASK_BIAS
            masked = masked | hard
            soft = m.masked_fill(hard, 0)
            bias = soft if bool(soft.any()) else None
    if call.causal:
        # aligned top-left, as SDPA's is_causal is: query i sees keys 0..i whatever the key length
        masked = masked | ~torch.ones(tq, tk, dtype=torch.bool, device=device).tril()
    return masked, bias


class Group:
    """The SDPA calls of one forward that share shapes, scale and mask (every layer of a transformer, as a rule):
    the mask is prepared once for all of them, and on the CPU with numba their statistics are taken together.

    The tracer keeps each call's q and k (:meth:`fast` says whether the call qualifies) and hands the forward's
    calls to :meth:`stats_batch` when the forward's statistics are taken: one kernel launch computes and summarises
    every call's logits four query rows at a time (:func:`.fused.attention_summaries`: no (Tq, Tk) matrix, a causal
    block only up to its last query). Elsewhere, or when a logit is not finite, a call's logits are recomputed with
    torch (:func:`sdpa_logits`) and get :func:`logit_stats`.
    """

    def __init__(self, buffer=None):
        self.buffer = buffer
        self.mask = self.array = self.bias = self.held = None  # built by the group's first call
        self.uniform: dict | None = None  # the entropy of uniform attention on the sampled rows (one per group)

    def _prepare(self, call: SdpaCall) -> None:
        q, k = call.q, call.k
        if self.held is None:
            self.held = (call.mask,)  # alive while the group is: its identity is part of the group's key
            self.mask = _mask(call, q.shape[-2], k.shape[-2])
            if q.dim() == 4 and k.dim() == 4 and q.shape[0] == k.shape[0] and q.device.type == "cpu":
                shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
                self.array = fused.mask_array(self.mask[0], shape)
                self.bias = _bias_array(self.mask[1], shape)

    def fast(self, call: SdpaCall) -> bool:
        """Whether the call's statistics may wait for the forward's batch (the kernel's path: its mask prepared)."""
        self._prepare(call)
        return self.array is not None and self.bias is not False

    def stats(self, call: SdpaCall) -> dict:
        return self.stats_batch([call])[0]

    def stats_batch(self, calls: list[SdpaCall]) -> list[dict]:
        """The statistics of each call (every one of this group), in one kernel launch where it applies (one per
        ``COPY_BUDGET`` of copied q and k)."""
        self._prepare(calls[0])
        got: list[dict | None] = [None] * len(calls)
        if self.array is not None and self.bias is not False:
            q, k = calls[0].q, calls[0].k
            tq = q.shape[-2]
            got = []
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            copied = 0
            for i, c in enumerate(calls):  # a launch per COPY_BUDGET of copies: they are held until it returns
                pair = (_readable(c.q), _readable(c.k))
                copied += sum(x.nbytes for x, own in zip(pair, (c.q, c.k), strict=True) if x is not own)
                pairs.append(pair)
                if copied >= COPY_BUDGET or i == len(calls) - 1:
                    got += fused.attention_summaries(pairs, calls[0].scale, self.bias, self.array,
                                                     max(1, tq // ENTROPY_ROWS))
                    pairs, copied = [], 0
            n, h = q.shape[0], q.shape[1]
            got = [None if g is None else with_focus({**g, "rows": [n * tq] * h, "nonfinite": 0,
                                                      "nonfinite_heads": [0] * h}, self._uniform(q, k)) for g in got]
        return [g if g is not None else self._exact(c) for g, c in zip(got, calls, strict=True)]

    def _exact(self, call: SdpaCall) -> dict:
        """torch's path: the logits recomputed into the tracer's buffer (a non-finite logit counted, not lost)."""
        logits, self.mask = sdpa_logits(call, self.buffer, self.mask)
        return with_focus(logit_stats(logits, self.mask[0], owned=True), self._uniform(call.q, call.k))

    def _uniform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[list, list]:
        if self.uniform is None:
            tq, tk = q.shape[-2], k.shape[-2]
            m = self.mask[0]
            while m.dim() < 4:
                m = m.unsqueeze(0)
            m = m[:, :, ::max(1, tq // ENTROPY_ROWS)] if m.shape[2] > 1 else m
            rows = len(range(0, tq, max(1, tq // ENTROPY_ROWS)))
            live = (~m).expand(m.shape[0], m.shape[1], rows if m.shape[2] == 1 else m.shape[2], tk)
            n = math.prod(q.shape[:-3]) if q.dim() > 3 else 1
            self.uniform = uniform_entropy(live, q.shape[-3], n if m.shape[0] == 1 else 1)
        return self.uniform


#: q or k with at least this many elements, split from one fused projection (short rows kilobytes apart), is copied
#: before the kernel reads it: one pass with many loads in flight costs less than the kernel waiting on each row
#: (20-25 % of the attention probe on the bench decoder); a small one is read where it is
COPY_FROM = 1 << 15
#: the copies one launch may hold (a forward's layers are summarised together: their copies are not)
COPY_BUDGET = 64 << 20


def _readable(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() or x.numel() < COPY_FROM else x.float().contiguous()


def _bias_array(bias: torch.Tensor | None, shape: tuple[int, ...]):
    """A float mask's bias as :func:`.fused.attention_summary` takes it (contiguous float32, 4 dimensions, each 1
    or the logits'), None for no bias, False where it cannot be put in that form."""
    if bias is None:
        return None
    b = fused.broadcast_keys(bias.detach().float(), shape)
    return False if b is None else b.contiguous()


def logit_stats(logits: torch.Tensor, masked: torch.Tensor, owned: bool = False) -> dict[str, Any]:
    """Per head (dim -3): max |logit| over unmasked entries, fully masked query rows (and samples whose every row
    is), rows, entropy sum and rows, non-finite entries — torch's path. A key more than ``fused.SOFTMAX_SPAN`` below
    its row's largest unmasked logit counts as masked (:func:`below_softmax_span`), as on the numba kernels' paths.

    ``masked`` need only broadcast to ``logits``. The maximum and the masked rows cover every query row; the
    entropy (a mean) is taken on at most ``ENTROPY_ROWS`` evenly spaced query rows per sample and head, which bounds
    its cost on long sequences. ``owned``: the logits are the tracer's own copy and may be overwritten.
    """
    lg = logits.detach()
    if lg.dim() < 3:
        lg = lg.reshape(1, *lg.shape)
    m = masked.detach()
    while m.dim() < lg.dim():
        m = m.unsqueeze(0)
    lg = lg.reshape(-1, *lg.shape[-3:])  # (N, H, Tq, Tk)
    if all(d == 1 for d in m.shape[:-3]):
        m = m.reshape(1, *m.shape[-3:])
    else:
        m = m.expand(*logits.shape[:-3] if logits.dim() >= 3 else (), *m.shape[-3:]).reshape(-1, *m.shape[-3:])
    m = m | below_softmax_span(lg, m)  # before ``owned`` logits are overwritten below
    heads, tq = lg.shape[1], lg.shape[2]
    # masked entries zeroed by a product with the small keep-mask (a broadcast masked_fill/where is 5-10x slower);
    # exact while the logits are finite; otherwise (inf * 0 is NaN) the exact where-path below takes over
    keep = (~m).to(lg.dtype)
    live = lg.mul_(keep) if owned and lg.is_contiguous() else lg * keep
    mx = absmax(live, dim=(0, 2, 3))
    bad = [0] * heads
    if not bool(torch.isfinite(mx).all()):
        live = torch.where(m, torch.zeros((), dtype=lg.dtype, device=lg.device), live)
        nan = ~torch.isfinite(live)
        bad = nan.sum(dim=(0, 2, 3)).tolist()
        live = live.masked_fill(nan, 0)
        mx = absmax(live, dim=(0, 2, 3))
    full = m.all(-1).expand(lg.shape[:3])  # (N, H, Tq), a view when the mask is shared
    stride = max(1, tq // ENTROPY_ROWS)
    msub = m[:, :, ::stride] if m.shape[2] > 1 else m
    sub = live[:, :, ::stride].float()  # masked entries are 0 here
    # entropy H = lse - sum(p * z) with lse = top + log(sum(e)), e = exp(z - top) on the unmasked keys, top their
    # maximum; exp sees no -inf or far-negative argument (both take a slow path): masked keys are zeroed after it
    top = (sub + torch.zeros(msub.shape, dtype=sub.dtype, device=sub.device).masked_fill_(msub, -math.inf)).amax(
        -1, keepdim=True)
    e = (sub - top).clamp_(max=0).exp_().mul_((~msub).to(sub.dtype))
    s = e.sum(-1)
    pz = torch.linalg.vecdot(e, sub).div_(s)
    ent = s.log_().add_(top.squeeze(-1)).sub_(pz)  # (N, H, rows)
    ok = torch.isfinite(ent) & ~full[:, :, ::stride]
    ent = ent.masked_fill(~ok, 0)
    return {"max_logit": mx.tolist(), "masked_rows": full.sum(dim=(0, 2)).tolist(),
            "masked_samples": (full.all(-1) & (tq > 0)).sum(0).tolist(),
            "rows": [lg.shape[0] * tq] * heads, "entropy_sum": ent.sum(dim=(0, 2)).tolist(),
            "entropy_rows": ok.sum(dim=(0, 2)).tolist(), "nonfinite": sum(bad), "nonfinite_heads": bad}


def eager_logit_stats(logits: torch.Tensor) -> dict:
    """The statistics of logits an eager softmax is given: entries at or below half the dtype's lowest value (the
    ``-inf`` or ``finfo.min`` a mask fills in) are masked, and so are those more than ``fused.SOFTMAX_SPAN`` below their
    row's largest (a finite additive mask: their weight is 0). On the CPU with numba, float32 logits are read once per
    row by one kernel (:func:`.fused.logits_summary`); elsewhere, or when a logit is not finite, torch's path."""
    lowest = torch.finfo(logits.dtype).min / 2
    stride = max(1, logits.shape[-2] // ENTROPY_ROWS) if logits.dim() >= 2 else 1
    if logits.dim() == 4 and logits.dtype == torch.float32:
        got = fused.logits_summary(logits.detach(), stride)
        if got is not None:
            return with_focus(got, _uniform_of_logits(logits, lowest, stride))
    return with_focus(logit_stats(logits, logits <= lowest), _uniform_of_logits(logits, lowest, stride))


def _uniform_of_logits(logits: torch.Tensor, lowest: float, stride: int) -> tuple[list, list]:
    """:func:`uniform_entropy` of given logits: on the sampled rows, the keys above ``lowest`` and within
    ``fused.SOFTMAX_SPAN`` of their row's largest (the keys their softmax entropy is taken over)."""
    lg = logits.detach()
    if lg.dim() < 3:
        lg = lg.reshape(1, *lg.shape)
    lg = lg.reshape(-1, *lg.shape[-3:])
    sub = lg[:, :, ::stride].float()
    live = sub > lowest
    top = sub.masked_fill(~live, -math.inf).amax(-1, keepdim=True)
    live &= sub >= top - fused.SOFTMAX_SPAN  # NaN compares false: a NaN key takes no part
    return uniform_entropy(live, lg.shape[1], 1)


def uniform_entropy(live: torch.Tensor, heads: int, repeat: int) -> tuple[list[float], list[int]]:
    """Per head, the entropy uniform attention would have on the sampled query rows — Σ log(keys that take part)
    over the rows with at least one — and those rows: the ceiling a head's softmax entropy reaches when it stops
    attending to anything in particular. ``live``: (N, H or 1, rows, Tk) booleans; ``repeat``: how many samples
    each of its N stands for (a mask shared by the batch)."""
    counts = live.sum(-1)  # (N, H, rows)
    ok = counts > 0
    logs = torch.where(ok, counts.clamp(min=1).double().log(), torch.zeros((), dtype=torch.float64))
    total, rows = logs.sum(dim=(0, 2)) * repeat, ok.sum(dim=(0, 2)) * repeat
    if total.numel() == 1 and heads > 1:
        total, rows = total.expand(heads), rows.expand(heads)
    return total.tolist(), rows.tolist()


def with_focus(stats: dict, uniform: tuple[list, list]) -> dict:
    """``stats`` with each head's focus — uniform attention's entropy minus its softmax entropy, summed over the
    sampled rows (``focus_sum``, in float64 before any rounding: a difference of two sums) and those rows
    (``focus_rows``); a head whose entropy rows are not the uniform's (a row whose entropy was not finite) has
    none (0 rows)."""
    total, rows = uniform
    ok = [r == u for r, u in zip(stats["entropy_rows"], rows, strict=False)]
    stats["focus_sum"] = [t - e if good else 0.0 for t, e, good in zip(total, stats["entropy_sum"], ok, strict=False)]
    stats["focus_rows"] = [r if good else 0 for r, good in zip(rows, ok, strict=False)]
    return stats


def below_softmax_span(logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """The keys more than ``fused.SOFTMAX_SPAN`` below their row's largest unmasked logit: a weight under 1e-13 of the
    largest's, nothing to the softmax (a finite additive mask such as Swin's -100 puts its keys there; NaN compares false and
    stays; a row whose largest logit is not finite keeps every key)."""
    top = logits.float().masked_fill(masked, -math.inf).amax(-1, keepdim=True)
    return torch.isfinite(top) & (logits.float() < top - fused.SOFTMAX_SPAN)  # a row with an infinity: as it is
