"""Fused normalization kernels for any last-axis NormSpec: numba on the CPU, Triton on CUDA.

``normscope.kernels.norm(x, spec, gamma=None, beta=None, residual=None)`` normalizes the last axis of ``x``
as ``spec`` says, forward and backward (a ``torch.autograd.Function``), optionally fused with the residual
add of a pre-norm block. The kernels (``numba_cpu``, ``triton_gpu``) are kept apart from the module wrapper
``normscope.nn.Norm(spec, shape, backend=...)``. See docs/kernels.md.
"""

from __future__ import annotations

from .contract import KERNEL_DTYPES, unsupported
from .ops import BACKENDS, norm

__all__ = ["BACKENDS", "KERNEL_DTYPES", "norm", "unsupported"]
