"""The float64 reference: hand numbers, invariances, ε behaviour, analytic backward vs finite differences,
low-precision emulation and error messages."""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from normscope import InputError, NormSpec
from normscope import reference as R

# ------------------------------------------------------------------------------------------ hand numbers
NO_AFFINE = dict(gamma=False, beta=False)


def test_layernorm_hand_numbers():
    spec = NormSpec(eps=0.0, **NO_AFFINE)
    y = R.forward([1.0, 2.0, 3.0], spec)
    np.testing.assert_allclose(y, [-1.2247449, 0.0, 1.2247449], atol=1e-7)
    assert y.dtype == np.float64
    stats = R.statistics([1.0, 2.0, 3.0], spec)
    np.testing.assert_allclose(stats.mean, [2.0, 2.0, 2.0], rtol=1e-15)
    np.testing.assert_allclose(stats.var, [2 / 3] * 3, rtol=1e-15)
    np.testing.assert_allclose(stats.denom, [0.8165] * 3, atol=5e-5)
    np.testing.assert_allclose(stats.denom, [math.sqrt(2 / 3)] * 3, rtol=1e-15)
    np.testing.assert_allclose(stats.xhat, y, rtol=1e-15)
    assert stats.count == 3


def test_rmsnorm_hand_numbers():
    spec = NormSpec(center=False, eps=0.0, eps_placement="none", **NO_AFFINE)
    y = R.forward([1.0, 2.0, 3.0], spec)
    np.testing.assert_allclose(y, [0.46291005, 0.9258201, 1.38873015], atol=1e-8)
    stats = R.statistics([1.0, 2.0, 3.0], spec)
    np.testing.assert_allclose(stats.mean, 0.0)
    np.testing.assert_allclose(stats.var, [14 / 3] * 3, rtol=1e-15)  # the mean square
    np.testing.assert_allclose(stats.denom, [2.1602] * 3, atol=5e-5)
    # the torch preset's tiny ε barely changes it
    np.testing.assert_allclose(R.forward([1.0, 2.0, 3.0], NormSpec.preset("torch_rmsnorm")), y, rtol=1e-7)


def test_affine_and_gamma_offset_hand_numbers():
    x = np.array([[1.0, 2.0, 3.0]])
    g, b = np.array([2.0, -1.0, 0.5]), np.array([0.1, 0.2, 0.3])
    xhat = R.forward(x, NormSpec(eps=0.0, **NO_AFFINE))
    np.testing.assert_allclose(R.forward(x, NormSpec(eps=0.0), gamma=g, beta=b), xhat * g + b, rtol=1e-15)
    spec = NormSpec(eps=0.0, beta=False, gamma_offset=1.0)
    np.testing.assert_allclose(R.forward(x, spec, gamma=g), xhat * (1.0 + g), rtol=1e-15)
    # gamma=None / beta=None mean the identity affine
    np.testing.assert_allclose(R.forward(x, NormSpec(eps=0.0)), xhat, rtol=1e-15)


# ------------------------------------------------------------------------------------------ explicit formulas
def _naive(x, axes, *, center, eps, placement, ddof):
    mu = x.mean(axis=axes, keepdims=True) if center else 0.0
    dev = x - mu
    n = math.prod(x.shape[a] for a in axes)
    var = (dev**2).sum(axis=axes, keepdims=True) / (n - ddof)
    s = np.sqrt(var)
    denom = {"inside_sqrt": np.sqrt(var + eps), "outside_sqrt": s + eps, "clamp": np.maximum(s, eps),
             "none": s}[placement]
    return dev / denom


@pytest.mark.parametrize("center", [True, False], ids=["center", "rms"])
@pytest.mark.parametrize("placement", ["inside_sqrt", "outside_sqrt", "clamp", "none"])
@pytest.mark.parametrize("variance", ["biased", "unbiased"])
@pytest.mark.parametrize("axes, shape", [((-1,), (2, 3, 5)), ((0, 2), (3, 2, 4)), ((-3, -1), (2, 3, 2, 4))],
                         ids=["last", "0-2", "noncontig-neg"])
def test_forward_matches_explicit_formula(center, placement, variance, axes, shape, rng):
    eps = 0.0 if placement == "none" else 0.7  # large enough that every placement differs
    spec = NormSpec(center=center, axes=axes, eps=eps, eps_placement=placement, variance=variance, **NO_AFFINE)
    x = rng.normal(size=shape) * 0.8 + 0.3
    nd_axes = tuple(a % len(shape) for a in axes)
    want = _naive(x, nd_axes, center=center, eps=eps, placement=placement, ddof=1 if variance == "unbiased" else 0)
    np.testing.assert_allclose(R.forward(x, spec), want, rtol=1e-13, atol=1e-14)
    if center:
        one_pass = R.forward(x, spec.replace(variance_algorithm="one_pass"))
        np.testing.assert_allclose(one_pass, want, rtol=1e-10, atol=1e-12)


def test_groupnorm_matches_explicit_reshape(rng):
    x = rng.normal(size=(2, 6, 3, 2)) + 1.0
    spec = NormSpec.preset("torch_groupnorm", groups=3)
    g, b = rng.normal(size=6), rng.normal(size=6)
    xg = x.reshape(2, 3, 2, 3, 2)
    mu = xg.mean(axis=(2, 3, 4), keepdims=True)
    var = xg.var(axis=(2, 3, 4), keepdims=True)
    want = ((xg - mu) / np.sqrt(var + 1e-5)).reshape(x.shape) * g[:, None, None] + b[:, None, None]
    np.testing.assert_allclose(R.forward(x, spec, gamma=g, beta=b), want, rtol=1e-13, atol=1e-14)
    # one group is LayerNorm over (C, H, W); C groups is InstanceNorm
    ln = NormSpec(axes=[1, 2, 3], **NO_AFFINE)
    np.testing.assert_allclose(R.forward(x, spec.replace(groups=1, gamma=False, beta=False, param_axes=[])),
                               R.forward(x, ln), rtol=1e-14, atol=1e-14)
    inst = NormSpec.preset("torch_instancenorm")
    np.testing.assert_allclose(R.forward(x, spec.replace(groups=6, gamma=False, beta=False, param_axes=[])),
                               R.forward(x, inst), rtol=1e-14, atol=1e-14)


def test_batchnorm_batch_and_running(rng):
    x = rng.normal(size=(5, 3, 2, 2)) * 2 + 1
    g, b = rng.normal(size=3), rng.normal(size=3)
    spec = NormSpec.preset("torch_batchnorm")
    mu = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    c = (slice(None), None, None)
    want = (x - mu) / np.sqrt(var + 1e-5) * g[c] + b[c]
    np.testing.assert_allclose(R.forward(x, spec, gamma=g, beta=b), want, rtol=1e-13, atol=1e-14)
    rm, rv = rng.normal(size=3), rng.uniform(0.5, 2.0, size=3)
    want = (x - rm[c]) / np.sqrt(rv[c] + 1e-5) * g[c] + b[c]
    got = R.forward(x, NormSpec.preset("torch_batchnorm_eval"), gamma=g, beta=b, running_mean=rm, running_var=rv)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
    assert R.stats_shape(x.shape, spec) == (3,)
    assert R.param_shape(x.shape, spec) == (3,)


def test_param_shape():
    assert R.param_shape((3, 5, 64), NormSpec.preset("torch_layernorm")) == (64,)
    assert R.param_shape((3, 5, 64), NormSpec.preset("torch_layernorm", normalized_dims=2)) == (5, 64)
    assert R.param_shape((2, 4, 2, 3), NormSpec.preset("torch_groupnorm")) == (4,)
    assert R.param_shape((2, 4, 2, 3), NormSpec.preset("torch_instancenorm")) == ()
    assert R.param_shape((3, 2, 4), NormSpec(axes=[0, 2], param_axes=[1])) == (2,)


# ------------------------------------------------------------------------------------------ invariances
def _vector(seed: int, n: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(2, n))
    return x


@given(seed=st.integers(0, 2**31), n=st.integers(3, 24),
       a=st.floats(1e-3, 1e3), b=st.floats(-1e2, 1e2))
def test_layernorm_invariant_under_scale_and_shift(seed, n, a, b):
    spec = NormSpec(eps=0.0, eps_placement="none", **NO_AFFINE)
    x = _vector(seed, n)
    y = R.forward(x, spec)
    np.testing.assert_allclose(R.forward(a * x + b, spec), y, rtol=0, atol=1e-9)


@given(seed=st.integers(0, 2**31), n=st.integers(3, 24), a=st.floats(1e-3, 1e3))
def test_rmsnorm_invariant_under_scale(seed, n, a):
    spec = NormSpec(center=False, eps=0.0, eps_placement="none", **NO_AFFINE)
    x = _vector(seed, n)
    np.testing.assert_allclose(R.forward(a * x, spec), R.forward(x, spec), rtol=0, atol=1e-9)


@given(seed=st.integers(0, 2**31), n=st.integers(4, 24),
       b=st.one_of(st.floats(0.5, 1e2), st.floats(-1e2, -0.5)))
def test_rmsnorm_not_invariant_under_shift(seed, n, b):
    spec = NormSpec(center=False, eps=0.0, eps_placement="none", **NO_AFFINE)
    x = _vector(seed, n)
    diff = np.abs(R.forward(x + b, spec) - R.forward(x, spec)).max()
    assert diff > 1e-3
    # while LayerNorm does not see the shift
    ln = NormSpec(eps=0.0, **NO_AFFINE)
    assert np.abs(R.forward(x + b, ln) - R.forward(x, ln)).max() < 1e-9


# ------------------------------------------------------------------------------------------ ε gain cap
def _gain(placement: str, x: np.ndarray, eps: float = 1e-5) -> float:
    spec = NormSpec(eps=eps, eps_placement=placement, **NO_AFFINE)
    dev = x - x.mean()
    return float(R.forward(x, spec)[-1] / dev[-1])


@pytest.mark.parametrize("offset", [0.0, 3.0])
def test_eps_caps_gain(offset):
    x = offset + np.array([-1e-6, 1e-6])  # variance 1e-12, std 1e-6
    assert R.statistics(x - offset, NormSpec(eps=0.0)).var[0] == pytest.approx(1e-12, rel=1e-12)
    rtol = 1e-12 if offset == 0 else 1e-8
    inside = _gain("inside_sqrt", x)
    assert inside == pytest.approx(1 / math.sqrt(1e-12 + 1e-5), rel=rtol)
    assert inside == pytest.approx(316.2, rel=1e-4)
    assert _gain("outside_sqrt", x) == pytest.approx(1 / (1e-6 + 1e-5), rel=rtol)
    assert _gain("clamp", x) == pytest.approx(1 / max(1e-6, 1e-5), rel=rtol)
    assert _gain("none", x, eps=0.0) == pytest.approx(1e6, rel=rtol)


# ------------------------------------------------------------------------------------------ backward vs FD
LAYOUTS = {
    # name: (spec fields, input shape)
    "last": (dict(axes=[-1]), (2, 3, 5)),
    "last2": (dict(axes=[-2, -1]), (2, 3, 4)),
    "noncontig": (dict(axes=[0, 2], param_axes=[1]), (3, 2, 4)),
    "group": (dict(axes=[1, 2, 3], groups=2, group_axis=1, param_axes=[1]), (2, 4, 2, 3)),
    "batch": (dict(axes=[0, 2, 3], param_axes=[1], batch_stats="batch"), (3, 2, 2, 3)),
}

AFFINES = {
    "noaffine": dict(gamma=False, beta=False),
    "gamma": dict(gamma=True, beta=False),
    "beta": dict(gamma=False, beta=True),
    "gamma_beta": dict(gamma=True, beta=True),
    "offset_gamma_beta": dict(gamma=True, beta=True, gamma_offset=1.0),
}


def _fit_params(fields: dict, affine: dict) -> dict:
    """Layout fields without param_axes when the spec has no affine (param_axes then must be empty)."""
    if affine.get("gamma") or affine.get("beta"):
        return fields
    return {k: v for k, v in fields.items() if k != "param_axes"}


def _stat_combos():
    for center, placement, variance, algorithm in itertools.product(
        (True, False), ("inside_sqrt", "outside_sqrt", "clamp", "none"), ("biased", "unbiased"),
        ("two_pass", "one_pass"),
    ):
        if algorithm == "one_pass" and not center:
            continue
        fields = dict(center=center, eps_placement=placement, variance=variance, variance_algorithm=algorithm,
                      eps=0.0 if placement == "none" else 0.1)
        name = f"{'center' if center else 'rms'}-{placement}-{variance}-{algorithm}"
        yield pytest.param(fields, id=name)


def _fd_grad(f, v: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central finite differences of the scalar function f at v (one perturbation per element)."""
    out = np.empty(v.size)
    flat = v.reshape(-1)
    for i in range(v.size):
        step = np.zeros_like(flat)
        step[i] = h
        out[i] = (f((flat + step).reshape(v.shape)) - f((flat - step).reshape(v.shape))) / (2 * h)
    return out.reshape(v.shape)


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _check_gradients(spec, x, dy, gamma, beta, running=None):
    running = running or {}
    dx, dgamma, dbeta = R.backward(x, dy, spec, gamma=gamma, beta=beta, **running)
    assert dx.shape == x.shape

    def loss_x(v):
        return float(np.sum(dy * R.forward(v, spec, gamma=gamma, beta=beta, **running)))

    fd = _fd_grad(loss_x, x)
    assert np.linalg.norm(fd) > 1e-3  # the check is not vacuous
    assert _rel_err(dx, fd) < 1e-6, (dx, fd)

    if spec.gamma:
        fd_g = _fd_grad(lambda g: float(np.sum(dy * R.forward(x, spec, gamma=g, beta=beta, **running))), gamma)
        assert dgamma.shape == gamma.shape
        assert _rel_err(dgamma, fd_g) < 1e-6
    else:
        assert dgamma is None
    if spec.beta:
        fd_b = _fd_grad(lambda b: float(np.sum(dy * R.forward(x, spec, gamma=gamma, beta=b, **running))), beta)
        assert dbeta.shape == beta.shape
        assert _rel_err(dbeta, fd_b) < 1e-6
        np.testing.assert_allclose(dbeta, fd_b, rtol=1e-6, atol=1e-8)
    else:
        assert dbeta is None
    return dx, dgamma, dbeta


def _params(spec, shape, rng):
    pshape = R.param_shape(shape, spec)
    gamma = rng.normal(size=pshape) + 0.5 if spec.gamma else None
    beta = rng.normal(size=pshape) if spec.beta else None
    return gamma, beta


@pytest.mark.parametrize("affine", list(AFFINES.values()), ids=list(AFFINES))
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("stats", list(_stat_combos()))
def test_backward_matches_finite_differences(stats, layout, affine, rng):
    fields, shape = LAYOUTS[layout]
    spec = NormSpec(**_fit_params(fields, affine), **stats, **affine)
    x = rng.normal(size=shape) * 1.5 + 0.4
    dy = rng.normal(size=shape)
    gamma, beta = _params(spec, shape, rng)
    _check_gradients(spec, x, dy, gamma, beta)


@pytest.mark.parametrize("center", [True, False], ids=["center", "rms"])
@pytest.mark.parametrize("layout", ["last", "group", "batch"])
def test_backward_clamp_active_region(center, layout, rng):
    """Where the clamp max(std, ε) is active the denominator is a constant: dx = γ·(dy − mean(dy))/ε."""
    fields, shape = LAYOUTS[layout]
    spec = NormSpec(**fields, center=center, eps=0.1, eps_placement="clamp")
    x = rng.normal(size=shape) * 0.01  # std ≈ 0.01 < ε
    dy = rng.normal(size=shape)
    gamma, beta = _params(spec, shape, rng)
    dx, _, _ = _check_gradients(spec, x, dy, gamma, beta)
    stats = R.statistics(x, spec)
    np.testing.assert_array_equal(stats.denom, 0.1)
    if layout == "last":
        g = dy * gamma
        want = (g - g.mean(axis=-1, keepdims=True)) / 0.1 if center else g / 0.1
        np.testing.assert_allclose(dx, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("affine", list(AFFINES.values()), ids=list(AFFINES))
@pytest.mark.parametrize("center", [True, False], ids=["center", "rms"])
@pytest.mark.parametrize("placement", ["inside_sqrt", "outside_sqrt", "clamp", "none"])
def test_backward_running_statistics(placement, center, affine, rng):
    shape = (3, 3, 2, 2)
    eps = 0.0 if placement == "none" else 0.1
    fields = _fit_params(dict(axes=[0, 2, 3], param_axes=[1], batch_stats="running"), affine)
    spec = NormSpec(**fields, center=center, eps=eps, eps_placement=placement, **affine)
    x = rng.normal(size=shape)
    dy = rng.normal(size=shape)
    gamma, beta = _params(spec, shape, rng)
    rm, rv = rng.normal(size=3), rng.uniform(0.05, 2.0, size=3)
    running = dict(running_mean=rm, running_var=rv)
    dx, _, _ = _check_gradients(spec, x, dy, gamma, beta, running)
    denom = {"inside_sqrt": np.sqrt(rv + eps), "outside_sqrt": np.sqrt(rv) + eps,
             "clamp": np.maximum(np.sqrt(rv), eps), "none": np.sqrt(rv)}[placement]
    scale = (spec.gamma_offset + gamma) if gamma is not None else np.ones(3)
    c = (slice(None), None, None)
    np.testing.assert_allclose(dx, dy * scale[c] / denom[c], rtol=1e-13, atol=1e-14)


def test_backward_shape_mismatch_raises():
    with pytest.raises(InputError, match="dy has shape"):
        R.backward(np.ones((2, 3)), np.ones((3, 2)), NormSpec())


# ------------------------------------------------------------------------------------------ low precision
def _representable(y: np.ndarray, dtype) -> bool:
    return np.array_equal(y.astype(np.float32).astype(dtype).astype(np.float64), y) and np.array_equal(
        y.astype(dtype).astype(np.float64), y)


@pytest.mark.parametrize("name", ["torch_layernorm", "llama_rmsnorm", "gemma_rmsnorm", "flax_layernorm",
                                  "torch_groupnorm"])
@pytest.mark.parametrize("dtype, np_dtype", [("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16),
                                             ("float32", np.float32)])
def test_low_precision_outputs_are_representable(name, dtype, np_dtype, rng):
    spec = NormSpec.preset(name)
    shape = (3, 4, 2, 5) if spec.groups else (3, 5, 16)
    gamma, beta = _params(spec, shape, rng)
    x = rng.normal(size=shape) * 3 + 1
    y = R.forward(x, spec, gamma=gamma, beta=beta, dtype=dtype)
    assert y.dtype == np.float64
    # the output's dtype: the input's, or fp32 where the contract promotes it (flax keeps fp32 parameters)
    out_np = np.float32 if spec.output_dtype == "float32" else np_dtype
    assert _representable(y, out_np)
    if out_np is not np_dtype:
        assert not _representable(y, np_dtype)  # promoted: not rounded back to the input dtype
    y64 = R.forward(x, spec, gamma=gamma, beta=beta)
    assert not _representable(y64, out_np)  # the check would catch unrounded values
    # close to the float64 result, to the dtype's precision
    tol = {"bfloat16": 0.1, "float16": 1e-2, "float32": 1e-5}[dtype]
    np.testing.assert_allclose(y, y64, rtol=tol, atol=tol)
    # the input is rounded first: pre-rounded inputs give the same answer
    x_round = x.astype(np.float32).astype(np_dtype).astype(np.float64)
    np.testing.assert_array_equal(R.forward(x_round, spec, gamma=gamma, beta=beta, dtype=dtype), y)


def test_dtype_aliases_and_float64():
    x = np.random.default_rng(1).normal(size=(2, 8))
    spec = NormSpec()
    np.testing.assert_array_equal(R.forward(x, spec, dtype="bf16"), R.forward(x, spec, dtype="bfloat16"))
    np.testing.assert_array_equal(R.forward(x, spec, dtype="float64"), R.forward(x, spec))
    with pytest.raises(InputError, match="unsupported dtype"):
        R.forward(x, spec, dtype="int8")


def test_stats_dtype_input_vs_float32_differ_in_bf16(rng):
    # large mean, small spread: bfloat16 statistics lose the spread, fp32 statistics keep it
    x = 256.0 + 4.0 * rng.normal(size=(4, 64))
    base = NormSpec(**NO_AFFINE)
    fp32 = R.forward(x, base, dtype="bfloat16")
    inp = R.forward(x, base.replace(stats_dtype="input"), dtype="bfloat16")
    exact = R.forward(x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64), base)
    assert not np.array_equal(fp32, inp)
    err_fp32 = np.abs(fp32 - exact).max()
    err_inp = np.abs(inp - exact).max()
    assert err_inp > 2 * err_fp32


def test_affine_order_differs_in_bf16(rng):
    x = rng.normal(size=(8, 64)) * 2 + 0.5
    gamma = rng.normal(size=64) * 3 + 1
    beta = rng.normal(size=64)
    spec = NormSpec.preset("torch_layernorm")
    scale_then_cast = R.forward(x, spec, gamma=gamma, beta=beta, dtype="bfloat16")
    cast_then_scale = R.forward(x, spec.replace(affine_order="cast_then_scale"), gamma=gamma, beta=beta,
                                dtype="bfloat16")
    assert not np.array_equal(scale_then_cast, cast_then_scale)
    # while at float64 the order cannot matter
    np.testing.assert_allclose(R.forward(x, spec, gamma=gamma, beta=beta),
                               R.forward(x, spec.replace(affine_order="cast_then_scale"), gamma=gamma, beta=beta),
                               rtol=0, atol=0)
    # and with input-dtype statistics both orders are identical (as canonical() claims)
    inp = spec.replace(stats_dtype="input")
    np.testing.assert_array_equal(
        R.forward(x, inp, gamma=gamma, beta=beta, dtype="bfloat16"),
        R.forward(x, inp.replace(affine_order="cast_then_scale"), gamma=gamma, beta=beta, dtype="bfloat16"))


def test_one_pass_cancellation_at_float32(rng):
    x = 1e4 + rng.normal(size=(8, 256))
    two = NormSpec(**NO_AFFINE)
    one = two.replace(variance_algorithm="one_pass")
    exact = R.forward(x.astype(np.float32).astype(np.float64), two)
    err_two = np.abs(R.forward(x, two, dtype="float32") - exact).max()
    err_one = np.abs(R.forward(x, one, dtype="float32") - exact).max()
    assert err_two < 1e-3
    assert err_one > 100 * err_two
    assert err_one > 1e-2
    # at float64 the two algorithms agree closely on the same data
    np.testing.assert_allclose(R.forward(x, one), R.forward(x, two), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------ errors
def test_wrong_gamma_shape_names_expected_shape():
    x = np.zeros((2, 5))
    with pytest.raises(InputError) as info:
        R.forward(x, NormSpec(), gamma=np.ones(4))
    assert "(5,)" in str(info.value) and "(4,)" in str(info.value)
    with pytest.raises(InputError, match=r"\(5,\)"):
        R.forward(x, NormSpec(), beta=np.ones(6))
    with pytest.raises(InputError, match=r"\(5,\)"):
        R.backward(x, x, NormSpec(), gamma=np.ones(4))


def test_gamma_with_same_size_is_reshaped():
    x = np.random.default_rng(3).normal(size=(2, 3, 4))
    spec = NormSpec(axes=[-2, -1])
    g = np.arange(12.0)
    np.testing.assert_array_equal(R.forward(x, spec, gamma=g), R.forward(x, spec, gamma=g.reshape(3, 4)))


def test_groupnorm_indivisible_channels():
    with pytest.raises(InputError, match="multiple of groups"):
        R.forward(np.zeros((2, 5, 2, 2)), NormSpec.preset("torch_groupnorm", groups=2))
    with pytest.raises(InputError, match="5 channels"):
        R.backward(np.zeros((2, 5, 2, 2)), np.zeros((2, 5, 2, 2)), NormSpec.preset("torch_groupnorm", groups=2))


def test_running_spec_without_running_stats():
    spec = NormSpec.preset("torch_batchnorm_eval")
    x = np.zeros((2, 3, 2, 2))
    with pytest.raises(InputError, match="running_mean"):
        R.forward(x, spec)
    with pytest.raises(InputError, match="running_var"):
        R.forward(x, spec, running_mean=np.zeros(3))


def test_other_input_errors():
    with pytest.raises(InputError, match="gamma was given"):
        R.forward(np.zeros((2, 3)), NormSpec(gamma=False), gamma=np.ones(3))
    with pytest.raises(InputError, match="beta was given"):
        R.forward(np.zeros((2, 3)), NormSpec(beta=False), beta=np.ones(3))
    with pytest.raises(InputError, match="spec must be a NormSpec"):
        R.forward(np.zeros(3), "layernorm")
    with pytest.raises(InputError, match="0-d"):
        R.forward(np.float64(1.0), NormSpec())
    with pytest.raises(InputError, match="real numeric"):
        R.forward(np.array(["a", "b"]), NormSpec())


def test_half_precision_sums_accumulate_in_float32():
    """A float16 sum beyond 65504 is no overflow: kernels accumulate in float32 and round the mean once."""
    from normscope.precision import Precision

    x = np.full((1, 64), 90.0)
    assert float(Precision("float16").mean(x * x, (1,), 64).ravel()[0]) == 8100.0
    assert math.isinf(float(Precision("float16").mean(np.full((1, 4), 7e4), (1,), 4).ravel()[0]))  # the mean
    spec = NormSpec.preset("llama_rmsnorm", stats_dtype="input")
    y = R.forward(np.full((2, 64), 90.0) + np.arange(64), spec, gamma=np.ones(64), dtype="float16")
    assert np.all(np.isfinite(y)) and np.all(np.abs(y) < 2)


def test_running_statistics_are_read_from_where_they_are_stored():
    """A module cast with .to(float16) keeps running statistics in float16, and its kernel reads them there."""
    spec = NormSpec.preset("torch_batchnorm_eval")
    x = np.linspace(-1, 5, 2 * 4 * 3).reshape(2, 4, 3)
    rm, rv = np.array([2.0001, 1.9, 2.3, 1.7]), np.array([9.0003, 8.7, 9.4, 8.1])
    stored = {k: np.asarray(v, dtype=np.float16).astype(np.float64) for k, v in (("rm", rm), ("rv", rv))}
    kw = dict(dtype="float16")
    spec1 = spec.replace(axes=[0, 2])
    a = R.forward(x, spec1, running_mean=rm, running_var=rv, **kw)
    b = R.forward(x, spec1, running_mean=stored["rm"], running_var=stored["rv"], **kw)
    assert np.array_equal(a, b)
    c = R.forward(x, spec1, running_mean=rm, running_var=rv, param_dtype="float32", **kw)
    assert not np.array_equal(a, c)  # the float32-stored statistics are read at full precision


@pytest.mark.parametrize("formula", ["rsqrt", "folded"])
def test_formula_variants_are_faithful_and_distinct(formula, rng):
    spec = NormSpec.preset("torch_layernorm", stats_dtype="input")
    x = rng.normal(size=(4, 256)) * 3 + 1
    g, b = rng.uniform(0.5, 1.5, 256), rng.uniform(-1, 1, 256)
    exact = R.forward(x, spec, gamma=g, beta=b)
    base = R.forward(x, spec, gamma=g, beta=b, dtype="bfloat16")
    other = R.forward(x, spec, gamma=g, beta=b, dtype="bfloat16", formula=formula)
    assert not np.array_equal(base, other)
    assert np.max(np.abs(other - exact)) < 4 * np.max(np.abs(base - exact))
    assert np.array_equal(R.forward(x, spec, gamma=g, beta=b, formula=formula), exact) or np.allclose(
        R.forward(x, spec, gamma=g, beta=b, formula=formula), exact, rtol=1e-13, atol=1e-13)
    with pytest.raises(InputError, match="formula"):
        R.forward(x, spec, formula="fma")
