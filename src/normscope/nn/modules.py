"""torch modules built from a NormSpec.

``Norm(spec, shape)`` computes exactly what the reference computes: at float64 it agrees with
:func:`normscope.reference.forward` and :func:`normscope.reference.backward` to rounding, and at
bfloat16/float16/float32 it follows the same sequence of roundings (statistics accumulated in float64 and
rounded once to the statistics dtype, elementwise steps rounded after each operation), so it matches the
reference's low-precision emulation bit for bit. It is the executable form of a contract, not a fast
kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..dtypes import ACCUMULATOR, MAX_FINITE, compute_dtype, dtype_name, torch_dtype
from ..errors import InputError
from ..layout import Layout
from ..spec import NormSpec

#: What computes a Norm: its own reference code, or a fused kernel (``"auto"``: the kernel where it can).
BACKENDS = ("auto", "reference", "numba", "triton")


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    # torch's float32 sqrt on CPU is not always correctly rounded; a float64 sqrt rounded once is.
    return torch.sqrt(v.double()).to(v.dtype)


def _shape_tuple(shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, int):
        return (shape,)
    return tuple(int(s) for s in shape)


class Norm(nn.Module):
    """A normalization layer for any NormSpec.

    ``shape`` gives the sizes of the axes the parameters are indexed by (``spec.param_axes``), e.g.
    ``Norm(NormSpec.preset("llama_rmsnorm"), 4096)`` or ``Norm(NormSpec.preset("torch_groupnorm",
    groups=8), 64)``. For BatchNorm-style specs it is also the shape of the running statistics, which are
    updated in training mode with ``momentum`` and the unbiased batch variance, as torch does; training
    mode then uses batch statistics and evaluation mode the running ones, whatever ``spec.batch_stats``
    says.

    ``backend`` picks what computes it: ``"reference"`` (this module's own torch code, bit for bit the
    reference's emulation), ``"numba"`` / ``"triton"`` (the fused kernels of :mod:`normscope.kernels`; a spec or
    dtype they cannot honour raises an error naming the field) or ``"auto"`` (the fused kernel for the
    tensor's device where it honours the spec and dtype, else the reference code).
    """

    def __init__(
        self,
        spec: NormSpec,
        shape: int | Sequence[int] = (),
        *,
        momentum: float | None = 0.1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        backend: str = "reference",
    ):
        super().__init__()
        if not isinstance(spec, NormSpec):
            raise InputError(f"spec must be a NormSpec; got {type(spec).__name__}")
        if backend not in BACKENDS:
            raise InputError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}; got {backend!r}")
        self.backend = backend
        self._spec = spec
        self.shape = _shape_tuple(shape)
        if (spec.gamma or spec.beta) and len(self.shape) != len(spec.param_axes):
            raise InputError(
                f"the spec indexes γ/β by {len(spec.param_axes)} axes {list(spec.param_axes)}, so shape "
                f"must have {len(spec.param_axes)} sizes; got {self.shape}"
            )
        factory = {"device": device, "dtype": dtype}
        identity = 1.0 - spec.gamma_offset  # the stored weight that makes the effective γ equal 1
        self.weight = nn.Parameter(torch.full(self.shape, identity, **factory)) if spec.gamma else None
        self.bias = nn.Parameter(torch.zeros(self.shape, **factory)) if spec.beta else None
        self.momentum = momentum
        if spec.batch_stats is not None:
            self.register_buffer("running_mean", torch.zeros(self.shape, **factory))
            self.register_buffer("running_var", torch.ones(self.shape, **factory))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    @property
    def spec(self) -> NormSpec:
        """The contract this module computes now (BatchNorm: batch statistics only in training mode)."""
        if self._spec.batch_stats in (None, "frozen"):
            return self._spec
        return self._spec.replace(batch_stats="batch" if self.training else "running")

    def extra_repr(self) -> str:
        text = f"{self.spec.summary()}, shape={self.shape}"
        return text if self.backend == "reference" else f"{text}, backend={self.backend!r}"

    def _kernel_backend(self, x: torch.Tensor, spec: NormSpec) -> str | None:
        """The fused kernel family to run ``x`` with, or ``None`` for the reference code."""
        if self.backend == "reference" or not torch.is_floating_point(x):
            return None
        import importlib.util

        from ..kernels import unsupported

        if self.backend != "auto":
            return self.backend  # kernels.norm raises naming what it cannot honour
        if unsupported(spec, x.dim(), dtype_name(x.dtype)) is not None:
            return None
        if x.device.type == "cpu":
            return "numba" if importlib.util.find_spec("numba") is not None else None
        return "triton" if x.device.type == "cuda" and importlib.util.find_spec("triton") is not None else None

    # ---------------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if not torch.is_floating_point(x):
            raise InputError(f"Norm expects a floating-point tensor; got {x.dtype}")
        kernel = self._kernel_backend(x, spec)
        if kernel is not None:
            from ..kernels import norm

            return norm(x, spec, self.weight, self.bias, backend=kernel)
        shape = tuple(x.shape)
        lay = Layout.of(spec, shape)
        reduce, n = lay.reduce_axes, lay.count
        n_var = n - 1 if spec.variance == "unbiased" else n
        d = x.dtype
        c_name = compute_dtype(spec, dtype_name(d))
        c = torch_dtype(c_name)
        half = d in (torch.bfloat16, torch.float16)
        # where γ/β (and running statistics) are read from: the input dtype, or fp32 where the contract keeps them
        stored = c if spec.param_dtype == "float32" and half else d
        xg = lay.group(x.to(c))

        c_max = MAX_FINITE[ACCUMULATOR[c_name]]

        def mean(t: torch.Tensor, count: int) -> torch.Tensor:  # exact accumulation, one rounding
            total = t.double().sum(dim=reduce, keepdim=True)
            total = torch.where(total.abs() > c_max, total.sign() * math.inf, total)  # the accumulator's range
            return (total / count).to(c)

        if spec.uses_running_statistics:
            rm, rv = self._running_view(lay)
            # read as the input dtype sees them, as γ/β are (a module cast with .to(dtype) stores them there)
            mu = rm.to(stored).to(c) if spec.center else None
            var = rv.to(stored).to(c)
            dev = xg - mu if spec.center else xg
        elif not spec.center:
            dev, var = xg, mean(xg * xg, n_var)
        elif spec.variance_algorithm == "two_pass":
            mu = mean(xg, n)
            dev = xg - mu
            var = mean(dev * dev, n_var)
        else:
            mu = mean(xg, n)
            var = mean(xg * xg, n) - mu * mu
            if spec.variance == "unbiased":
                var = var * (n / (n - 1) if n > 1 else math.inf)
            var = torch.clamp_min(var, 0.0)
            dev = xg - mu
        if spec.batch_stats == "batch" and self.training:
            self._update_running(xg, reduce, n)

        if spec.eps_placement == "inside_sqrt":
            denom = _sqrt(var + spec.eps)
        elif spec.eps_placement == "outside_sqrt":
            denom = _sqrt(var) + spec.eps
        elif spec.eps_placement == "clamp":
            denom = torch.clamp_min(_sqrt(var), spec.eps)
        else:
            denom = _sqrt(var)
        xhat = lay.ungroup(dev / denom)

        w = self._expand(self.weight, lay, "weight") if self.weight is not None else None
        b = self._expand(self.bias, lay, "bias") if self.bias is not None else None
        if spec.affine_order == "cast_then_scale":
            y = xhat.to(d)
            if w is not None:
                wd = w.to(d)
                y = y * (spec.gamma_offset + wd if spec.gamma_offset else wd)
            if b is not None:
                y = y + b.to(d)
            return y.to(torch.float32) if spec.output_dtype == "float32" and half else y
        y = xhat
        if w is not None:
            wc = w.to(stored).to(c)
            y = y * (spec.gamma_offset + wc if spec.gamma_offset else wc)
        if b is not None:
            y = y + b.to(stored).to(c)
        return y.to(torch.float32 if spec.output_dtype == "float32" and half else d)

    # ---------------------------------------------------------------------------------------- helpers
    def _expand(self, p: torch.Tensor, lay: Layout, name: str) -> torch.Tensor:
        """γ or β reshaped to broadcast against the input."""
        if tuple(p.shape) != lay.param_shape:
            raise InputError(
                f"{name} has shape {tuple(p.shape)}, but an input of shape {lay.shape} needs {lay.param_shape} "
                f"(its sizes along the parameter axes {list(lay.param_axes)}); build the module for that shape"
            )
        return p.reshape(lay.view_shape(lay.param_axes))

    def _running_view(self, lay: Layout):
        """Running mean and variance, broadcast to the input and in its grouped shape."""
        full = lay.view_shape(lay.stats_axes)
        rm = lay.group(self.running_mean.reshape(full).expand(lay.shape))
        rv = lay.group(self.running_var.reshape(full).expand(lay.shape))
        return rm, rv

    @torch.no_grad()
    def _update_running(self, xg, reduce, n):
        xd = xg.double()
        mu = xd.mean(dim=reduce)
        var = xd.var(dim=reduce, correction=1) if n > 1 else torch.zeros_like(mu)
        size = self.running_mean.shape
        self.num_batches_tracked += 1
        m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - m).add_(m * mu.reshape(size).to(self.running_mean.dtype))
        self.running_var.mul_(1 - m).add_(m * var.reshape(size).to(self.running_var.dtype))


def _spec(preset: str, **kwargs) -> NormSpec:
    return NormSpec.preset(preset, **kwargs)


class LayerNorm(Norm):
    """LayerNorm over the trailing ``len(shape)`` axes (torch.nn.LayerNorm's contract by default)."""

    def __init__(self, shape: int | Sequence[int], eps: float = 1e-5, *, affine: bool = True,
                 bias: bool = True, **kwargs):
        shape = _shape_tuple(shape)
        super().__init__(_spec("torch_layernorm", eps=eps, normalized_dims=len(shape), affine=affine,
                               bias=bias, **kwargs), shape if affine else ())


class RMSNorm(Norm):
    """RMSNorm over the trailing ``len(shape)`` axes (torch.nn.RMSNorm's contract by default)."""

    def __init__(self, shape: int | Sequence[int], eps: float = 1.1920928955078125e-07, *,
                 affine: bool = True, **kwargs):
        shape = _shape_tuple(shape)
        super().__init__(_spec("torch_rmsnorm", eps=eps, normalized_dims=len(shape), affine=affine,
                               **kwargs), shape if affine else ())


class GroupNorm(Norm):
    """GroupNorm(groups, channels) over (N, C, *spatial), torch.nn.GroupNorm's contract."""

    def __init__(self, groups: int, channels: int, eps: float = 1e-5, *, spatial_dims: int = 2,
                 affine: bool = True, **kwargs):
        super().__init__(_spec("torch_groupnorm", groups=groups, eps=eps, spatial_dims=spatial_dims,
                               affine=affine, **kwargs), channels if affine else ())


class BatchNorm(Norm):
    """BatchNorm over (N, C, *spatial) with running statistics, torch.nn.BatchNorm{1,2,3}d's contract.

    Statistics are fp32 in both modes (torch's CPU kernels keep training statistics in bf16/fp16 instead;
    pass ``stats_dtype="input"`` to reproduce that).
    """

    def __init__(self, channels: int, eps: float = 1e-5, momentum: float | None = 0.1, *,
                 spatial_dims: int = 2, affine: bool = True, stats_dtype: str = "float32"):
        spec = _spec("torch_batchnorm", eps=eps, spatial_dims=spatial_dims, affine=affine, stats_dtype=stats_dtype)
        super().__init__(spec, channels, momentum=momentum)
