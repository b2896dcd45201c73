"""The dtype table: names, aliases, unit roundoff, ranges, the compute-dtype rule and the framework maps."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from normscope import dtypes, precision
from normscope.dtypes import (
    ALIASES,
    DTYPES,
    MAX_FINITE,
    ONNX_ELEM_TYPES,
    PRECISION_BITS,
    TRITON_NAMES,
    UNIT_ROUNDOFF,
    compute_dtype,
    dtype_from_onnx,
    dtype_name,
    numpy_dtype,
    onnx_elem_type,
    torch_dtype,
    triton_dtype,
    wider,
)
from normscope.errors import InputError
from normscope.precision import Precision
from normscope.spec import NormSpec


def _finfo(name):
    return ml_dtypes.finfo(ml_dtypes.bfloat16) if name == "bfloat16" else np.finfo(name)


@pytest.mark.parametrize("name", DTYPES)
def test_constants_match_the_formats(name):
    info = _finfo(name)
    assert PRECISION_BITS[name] == info.nmant + 1
    # the unit roundoff is half the machine epsilon (spacing at 1), not the epsilon itself
    assert UNIT_ROUNDOFF[name] == float(info.eps) / 2 == 2.0 ** -PRECISION_BITS[name]
    assert MAX_FINITE[name] == float(info.max)
    p = Precision(name)
    assert np.isfinite(p.round(MAX_FINITE[name])) and np.isinf(p.round(MAX_FINITE[name] * 2))


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_unit_roundoff_bounds_one_rounding_and_is_reached(name):
    u = UNIT_ROUNDOFF[name]
    p = Precision(name)
    x = np.random.default_rng(0).uniform(-4, 4, size=20000)
    rel = np.abs(p.round(x).astype(np.float64) - x) / np.abs(x)
    assert rel.max() <= u
    # just below the midpoint between 1 and its successor 1 + 2u: rounds down with a relative error near u
    near = 1 + u * (1 - 2.0**-20)
    assert float(p.round(near)) == 1.0
    assert abs(float(p.round(near)) - near) / near > 0.99 * u  # the bound is u, not half of it


@pytest.mark.parametrize("spelling, name", sorted(ALIASES.items()))
def test_aliases(spelling, name):
    assert dtype_name(spelling) == name
    assert dtype_name(spelling.upper()) == name


@pytest.mark.parametrize("name", DTYPES)
def test_framework_maps_round_trip(name):
    assert dtype_name(numpy_dtype(name)) == name  # the scalar type (ml_dtypes.bfloat16 for bfloat16)
    assert dtype_name(np.dtype(numpy_dtype(name))) == name
    assert dtype_name(np.zeros(2, dtype=numpy_dtype(name)).dtype) == name
    assert torch_dtype(name) == getattr(torch, name)
    assert dtype_name(torch_dtype(name)) == name
    assert dtype_from_onnx(onnx_elem_type(name)) == name
    assert TRITON_NAMES[name] in ("fp64", "fp32", "fp16", "bf16")


def test_onnx_element_types_are_tensorproto_codes():
    onnx = pytest.importorskip("onnx")
    tp = onnx.TensorProto
    assert ONNX_ELEM_TYPES == {"float32": tp.FLOAT, "float16": tp.FLOAT16, "float64": tp.DOUBLE,
                               "bfloat16": tp.BFLOAT16}
    assert dtype_from_onnx(tp.INT64) is None


def test_jax_dtypes():
    jnp = pytest.importorskip("jax.numpy")
    for name in DTYPES:
        assert dtype_name(getattr(jnp, name)) == name  # the scalar type, <class 'jax.numpy.float32'>
    assert dtype_name(jnp.zeros(2, jnp.bfloat16).dtype) == "bfloat16"


def test_triton_map():
    if importlib.util.find_spec("triton") is None:
        with pytest.raises(ImportError, match="triton is not installed"):
            triton_dtype("bf16")
    else:
        import triton.language as tl

        assert triton_dtype("bf16") is tl.bfloat16


def test_unknown_dtypes_are_one_clear_error():
    assert dtype_name(None) == "float64"
    for bad in ("int8", np.int32, torch.int64, "float8", torch.float8_e4m3fn, "complex64"):
        with pytest.raises(InputError, match="unsupported dtype .*use one of float64, float32, float16, bfloat16"):
            dtype_name(bad)


@given(st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.integers(0, 2**32 - 1))
def test_wider_holds_both_operands_exactly(a, b, seed):
    w = wider(a, b)
    assert w == wider(b, a) and wider(w, w) == w and wider(a, a) == a
    x = np.random.default_rng(seed).normal(size=64) * 10.0 ** np.random.default_rng(seed).integers(-3, 4)
    for operand in (a, b):
        v = Precision(operand).round(x).astype(np.float64)
        np.testing.assert_array_equal(Precision(w).round(v).astype(np.float64), v)


def test_wider_table():
    assert wider("bfloat16", "float16") == "float32"
    assert wider("bf16", "float64") == "float64"
    assert wider("float16", "float32") == "float32"


@given(st.sampled_from(DTYPES), st.sampled_from(("float32", "input")))
def test_compute_dtype_is_the_rule_the_copies_wrote(dtype, stats):
    """The one rule equals each copy it replaces (reference, nn.Norm, the battery's conditioning)."""
    spec = NormSpec(stats_dtype=stats)
    c = compute_dtype(spec, dtype)
    assert c == compute_dtype(stats, dtype)
    # reference: wider("float32", d) with fp32 statistics, else d
    assert c == (wider("float32", dtype) if stats == "float32" else dtype)
    # battery: float32 for fp32 statistics at bf16/fp16, else the input dtype
    assert c == ("float32" if stats == "float32" and dtype in ("float16", "bfloat16") else dtype)
    # nn.Norm: torch.float32 when the input is narrower than float32
    width = {"bfloat16": 0, "float16": 0, "float32": 1, "float64": 2}
    assert c == ("float32" if stats == "float32" and width[dtype] < 1 else dtype)


def test_compute_dtype_errors():
    with pytest.raises(InputError, match="stats_dtype must be"):
        compute_dtype("float16", "float32")
    with pytest.raises(InputError, match="unsupported dtype"):
        compute_dtype("input", "int8")


def test_precision_keeps_its_names():
    for name in ("DTYPES", "UNIT_ROUNDOFF", "MAX_FINITE", "dtype_name", "wider"):
        assert getattr(precision, name) is getattr(dtypes, name)


def test_importing_the_table_needs_no_framework():
    code = ("import sys, normscope.dtypes, normscope.layout; "
            "print(sorted(m for m in ('torch', 'onnx', 'jax', 'triton') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(Path(dtypes.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"
