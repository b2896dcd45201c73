"""``norm``: the fused kernels behind one autograd function, dispatched by device.

CPU tensors run the numba kernels (:mod:`normscope.kernels.numba_cpu`), CUDA tensors the Triton kernels
(:mod:`normscope.kernels.triton_gpu`; on the CPU too with ``TRITON_INTERPRET=1``, as the tests run them).
Both take rows: the input is viewed as (rows, hidden) without a copy where its strides allow it (a row stride
larger than the hidden size is read in place), and the backward reads the rows the forward normalized (the
input, or ``x + residual``) with the per-row float32 mean, variance and denominator it saved.
"""

from __future__ import annotations

import functools
import os

import torch
from torch.autograd.function import once_differentiable

from ..dtypes import dtype_name
from ..errors import InputError
from ..numba_threads import load
from ..spec import NormSpec
from .contract import FORMATS, RowContract, row_contract

BACKENDS = ("auto", "numba", "triton")


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` as (rows, hidden) with unit stride along hidden, and its row stride (no copy when possible)."""
    n = t.shape[-1]
    if t.stride(-1) != 1 and n > 1:
        t = t.contiguous()
    try:
        t2 = t.view(-1, n)
    except RuntimeError:  # leading axes that cannot be merged without a copy
        t2 = t.reshape(-1, n)
    rs = t2.stride(0) if t2.shape[0] > 1 else n
    return t2, rs


@functools.lru_cache(maxsize=256)
def _row_contract(spec: NormSpec, ndim: int, dtype: str) -> RowContract:
    """:func:`.contract.row_contract`, kept per (spec, ndim, dtype): a spec is immutable, and a model calls its
    norms with the same few."""
    return row_contract(spec, ndim, dtype)


def _param(p, name: str, n: int, want: bool, x: torch.Tensor) -> torch.Tensor | None:
    if p is None:
        return None
    if not want:
        raise InputError(f"{name} was given but the spec has {name}=False")
    if not isinstance(p, torch.Tensor):
        raise InputError(f"{name} must be a torch tensor of shape ({n},); got {type(p).__name__}")
    if tuple(p.shape) != (n,):
        raise InputError(f"{name} has shape {tuple(p.shape)}, but an input with last axis {n} needs ({n},)")
    if p.device != x.device:
        raise InputError(f"{name} is on {p.device} but x is on {x.device}; move them to one device")
    return p


def pick_backend(x: torch.Tensor, backend: str) -> str:
    """The kernel family for ``x``'s device (``backend='auto'``), or ``backend`` checked against the device."""
    if backend == "auto":
        return "numba" if x.device.type == "cpu" else "triton"
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}; got {backend!r}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "numba" and x.device.type != "cpu":
        raise InputError(f"backend='numba' runs on the CPU; x is on {x.device} (use backend='triton')")
    if backend == "triton" and x.device.type != "cuda" and not interpret:
        raise InputError(f"backend='triton' needs a CUDA tensor (x is on {x.device}), or TRITON_INTERPRET=1 "
                         "to run the Triton kernels in the interpreter on the CPU")
    return backend


def _numba_host():
    from ..extras import require

    require("numba", "kernels")
    from . import numba_host

    return numba_host


def _impl(backend: str):
    if backend == "numba":
        return load("fused norm kernels", _numba_host, required=True)
    from . import triton_gpu

    return triton_gpu


def _forward(x, gamma, beta, residual, rc: RowContract, fmt: int, backend: str):
    """The forward kernel: ``(y, h, what the backward needs: (the normalized rows, their statistics, γ as the
    backward applies it))``, y and h in x's shape (h None without a residual)."""
    impl = _impl(backend)
    d = x.dtype
    scale_fwd = scale_bwd = shift = None
    if gamma is not None:
        wd = gamma.detach().to(d)
        scale_bwd = (rc.gamma_offset + wd.float()) if rc.gamma_offset else wd.float()
        # cast_then_scale multiplies by γ in the input dtype: γ_offset + w is rounded there
        scale_fwd = (rc.gamma_offset + wd).float() if (rc.cast_then_scale and rc.gamma_offset) else scale_bwd
    if beta is not None:
        shift = beta.detach().to(d).float()
    x2, x_rs = _rows(x.detach())
    r2, r_rs = _rows(residual.detach()) if residual is not None else (None, 0)
    y2, h2, stats = impl.forward(x2, x_rs, r2, r_rs, scale_fwd, shift, rc, fmt)
    h = h2.view(x.shape) if h2 is not None else None
    return y2.view(x.shape), h, (h2 if h2 is not None else x2, stats, scale_bwd)


class _FusedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, residual, rc: RowContract, fmt: int, backend: str):
        ctx.set_materialize_grads(False)
        y, h, saved = _forward(x, gamma, beta, residual, rc, fmt, backend)
        ctx.save_for_backward(*saved)
        ctx.meta = (rc, fmt, backend, x.shape, gamma is not None and ctx.needs_input_grad[1],
                    beta is not None and ctx.needs_input_grad[2], residual is not None,
                    None if gamma is None else gamma.dtype, None if beta is None else beta.dtype, x.shape[-1])
        return y if h is None else (y, h)

    @staticmethod
    @once_differentiable  # the kernels' backward is not differentiable: a second derivative raises, never zeros
    def backward(ctx, dy, dh=None):
        rc, fmt, backend, shape, want_dg, want_db, has_res, g_dtype, b_dtype, n = ctx.meta
        h2, stats, scale = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros(shape, dtype=h2.dtype, device=h2.device)
        dy2 = dy.reshape(-1, n).contiguous()
        dh2 = dh.reshape(-1, n).contiguous() if dh is not None else None
        dx2, dg, db = _impl(backend).backward(h2.contiguous(), dy2, dh2, stats, scale, rc, fmt, want_dg, want_db)
        dx = dx2.view(shape)
        dgamma = dg.to(g_dtype) if want_dg else None
        dbeta = db.to(b_dtype) if want_db else None
        return dx, dgamma, dbeta, (dx if has_res else None), None, None, None


def norm(x: torch.Tensor, spec: NormSpec, gamma: torch.Tensor | None = None, beta: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, *, backend: str = "auto"):
    """``spec`` applied to the last axis of ``x`` by a fused kernel, with autograd.

    Returns ``y``, or ``(y, h)`` when ``residual`` is given: the prenorm fusion ``h = x + residual`` (rounded
    to the input dtype), ``y = spec(h)``; the gradient reaching ``h`` flows back to both ``x`` and
    ``residual``. ``gamma``/``beta`` have shape (hidden,) (``None``: the identity scale / no shift). Inputs are
    float32, bfloat16 or float16, with float32 statistics. ``backend``: ``"auto"`` (numba on the CPU, Triton
    on CUDA), ``"numba"`` or ``"triton"``. A contract a row kernel cannot honour (statistics over other
    axes, groups, batch statistics, γ over other axes, input-dtype statistics at 16 bits) raises
    :class:`~normscope.SpecError` naming the field; use :mod:`normscope.reference` or
    ``normscope.nn.Norm(spec, shape, backend="reference")`` for those.
    """
    if not isinstance(x, torch.Tensor):
        raise InputError(f"x must be a torch tensor; got {type(x).__name__}")
    if not isinstance(spec, NormSpec):
        raise InputError(f"spec must be a NormSpec; got {type(spec).__name__} (try NormSpec.preset(...))")
    if not torch.is_floating_point(x):
        raise InputError(f"x must be a floating-point tensor; got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise InputError(f"x must have a last axis of size ≥ 1 to normalize; got shape {tuple(x.shape)}")
    name = dtype_name(x.dtype)
    rc = _row_contract(spec, x.dim(), name)
    be = pick_backend(x, backend)
    n = x.shape[-1]
    gamma = _param(gamma, "gamma", n, spec.gamma, x)
    beta = _param(beta, "beta", n, spec.beta, x)
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != x.shape or residual.dtype != x.dtype:
            got = (f"{tuple(residual.shape)} {residual.dtype}" if isinstance(residual, torch.Tensor)
                   else type(residual).__name__)
            raise InputError(f"residual must be a tensor of x's shape and dtype ({tuple(x.shape)} {x.dtype}); "
                             f"got {got}")
        if residual.device != x.device:
            raise InputError(f"residual is on {residual.device} but x is on {x.device}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, gamma, beta, residual)):
        return _FusedNorm.apply(x, gamma, beta, residual, rc, FORMATS[name], be)
    # nothing to differentiate: the kernel without the autograd function's cost (a third of a small call's time)
    y, h, _ = _forward(x, gamma, beta, residual, rc, FORMATS[name], be)
    return y if h is None else (y, h)
