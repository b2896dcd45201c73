"""The one table of floating dtypes normscope knows: names, aliases, constants, rules and framework maps.

A dtype is named everywhere by one of :data:`DTYPES` (``"float64"``, ``"float32"``, ``"float16"``,
``"bfloat16"``); :func:`dtype_name` turns anything a user or a framework hands over (``"bf16"``,
``np.float16``, ``torch.bfloat16``, a jax dtype) into that name. From the name come

- its constants: :data:`PRECISION_BITS` p (significand bits, the implicit one included),
  :data:`UNIT_ROUNDOFF` u = 2^-p (the largest relative error of rounding to nearest; *half* the machine
  epsilon 2^(1-p), the spacing at 1) and :data:`MAX_FINITE`;
- its rules: :func:`wider` (the dtype two operands promote to) and :func:`compute_dtype` (the dtype a spec's
  statistics are computed in for a given input dtype);
- its spelling in each framework: :func:`numpy_dtype`, :func:`torch_dtype`, :func:`onnx_elem_type` /
  :func:`dtype_from_onnx` (ONNX ``TensorProto`` element types) and :func:`triton_dtype`.

Frameworks are imported inside the functions that need them, so ``import normscope.dtypes`` needs only NumPy
and ml_dtypes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import InputError

__all__ = [
    "DTYPES", "ALIASES", "PRECISION_BITS", "UNIT_ROUNDOFF", "MAX_FINITE", "ONNX_ELEM_TYPES", "TRITON_NAMES",
    "dtype_name", "wider", "compute_dtype", "numpy_dtype", "torch_dtype", "onnx_elem_type", "dtype_from_onnx",
    "triton_dtype",
]

#: The dtypes normscope computes, emulates and probes, widest first.
DTYPES = ("float64", "float32", "float16", "bfloat16")

#: Every accepted spelling (lower case) → its name in :data:`DTYPES`.
ALIASES = {
    "float64": "float64", "fp64": "float64", "f64": "float64", "double": "float64",
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}

#: Significand bits p of each dtype, the implicit leading one included.
PRECISION_BITS = {"float64": 53, "float32": 24, "float16": 11, "bfloat16": 8}

#: Unit roundoff u = 2^-p: the largest relative error of one rounding to nearest, |fl(x) − x| ≤ u·|x| (in the
#: normal range). It is half the machine epsilon (the spacing at 1, np.finfo(...).eps = 2^(1−p)); the
#: tolerances and error models are written in u.
UNIT_ROUNDOFF = {name: 2.0 ** -bits for name, bits in PRECISION_BITS.items()}

#: The largest finite value of each dtype; beyond it a rounding (or an accumulator in that dtype) gives ±inf.
MAX_FINITE = {
    "float64": float(np.finfo(np.float64).max),
    "float32": float(np.finfo(np.float32).max),
    "float16": 65504.0,
    "bfloat16": float(ml_dtypes.finfo(ml_dtypes.bfloat16).max),
}

#: The type a kernel accumulates a reduction of this dtype in (half-precision sums live in float32 registers).
ACCUMULATOR = {"float64": "float64", "float32": "float32", "float16": "float32", "bfloat16": "float32"}

#: ONNX ``TensorProto.DataType`` element types (FLOAT, FLOAT16, DOUBLE, BFLOAT16), fixed by the ONNX standard.
ONNX_ELEM_TYPES = {"float32": 1, "float16": 10, "float64": 11, "bfloat16": 16}

#: Triton's short type names, as kernel signatures spell them (``"*fp32"`` is a pointer to float32).
TRITON_NAMES = {"float64": "fp64", "float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

_WIDTH_ORDER = ("bfloat16", "float16", "float32", "float64")


def dtype_name(dtype: object) -> str:
    """Normalise a dtype given as a string, NumPy dtype or type, torch dtype or jax dtype to one of DTYPES.

    ``None`` means float64 (the reference's own precision). Raises :class:`InputError` naming the supported
    dtypes for anything else (integers, float8, ...).
    """
    if dtype is None:
        return "float64"
    text = str(dtype)
    if text.startswith("<class '"):  # a scalar type: numpy.float32, ml_dtypes.bfloat16, jax.numpy.float16
        text = text.removeprefix("<class '").rstrip("'>").rsplit(".", 1)[-1]
    for prefix in ("torch.", "jnp.", "numpy.", "np."):
        text = text.removeprefix(prefix)
    name = ALIASES.get(text.lower())
    if name is None:
        raise InputError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return name


def wider(a: str, b: str) -> str:
    """The dtype two operands of dtypes ``a`` and ``b`` promote to (bfloat16 with float16 gives float32)."""
    a, b = dtype_name(a), dtype_name(b)
    if {a, b} == {"bfloat16", "float16"}:
        return "float32"
    return max(a, b, key=_WIDTH_ORDER.index)


def compute_dtype(spec: object, dtype: object) -> str:
    """The dtype the statistics of ``spec`` are computed in for an input of ``dtype``.

    ``spec`` is a NormSpec or its ``stats_dtype`` (``"float32"`` or ``"input"``). With ``"float32"`` the
    statistics are at least float32 (bfloat16/float16 inputs are widened, float64 stays float64); with
    ``"input"`` they are computed in the input dtype.
    """
    stats = getattr(spec, "stats_dtype", spec)
    name = dtype_name(dtype)
    if stats == "float32":
        return wider("float32", name)
    if stats == "input":
        return name
    raise InputError(f"stats_dtype must be 'float32' or 'input'; got {stats!r}")


def numpy_dtype(name: object) -> type:
    """The NumPy scalar type of a dtype (``ml_dtypes.bfloat16`` for bfloat16)."""
    return {"float64": np.float64, "float32": np.float32, "float16": np.float16,
            "bfloat16": ml_dtypes.bfloat16}[dtype_name(name)]


def torch_dtype(name: object):
    """The ``torch.dtype`` of a dtype (imports torch)."""
    import torch

    return {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[dtype_name(name)]


def onnx_elem_type(name: object) -> int:
    """The ONNX ``TensorProto`` element type of a dtype (1, 10, 11 or 16)."""
    return ONNX_ELEM_TYPES[dtype_name(name)]


def dtype_from_onnx(elem_type: int) -> str | None:
    """The dtype of an ONNX ``TensorProto`` element type; None for a type that is not one of DTYPES."""
    for name, code in ONNX_ELEM_TYPES.items():
        if code == elem_type:
            return name
    return None


def triton_dtype(name: object):
    """The ``triton.language`` dtype of a dtype (``tl.float32`` ...; imports triton)."""
    try:
        import triton.language as tl
    except ImportError as exc:
        raise ImportError("triton is not installed; it comes with the CUDA builds of torch on Linux "
                          "(or: pip install triton)") from exc
    return getattr(tl, dtype_name(name))
