"""The public error model, called directly: faithful implementations sit inside the bounds, wrong ones outside,
and a Comparison reports the right numbers."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from normscope import NormSpec, reference
from normscope.dtypes import UNIT_ROUNDOFF
from normscope.numerics import constants, tolerance
from normscope.precision import Precision
from normscope.results.params import NormParams

SPEC = NormSpec.preset("torch_layernorm")
H = 64


@pytest.fixture
def case(rng):
    x = Precision("bfloat16").round(rng.normal(size=(4, H)) * 2 + 0.5).astype(np.float64)
    params = NormParams(gamma=rng.uniform(0.5, 1.5, H), beta=rng.uniform(-0.5, 0.5, H))
    return x, params


def _torch_layer_norm(x, params, dtype):
    t = getattr(torch, dtype)
    y = torch.nn.functional.layer_norm(torch.from_numpy(x).to(t), (H,), torch.from_numpy(params.gamma).to(t),
                                       torch.from_numpy(params.beta).to(t), SPEC.eps)
    return y.double().numpy()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_faithful_implementations_are_inside_the_forward_bound(case, dtype):
    x, params = case
    x = Precision(dtype).round(x).astype(np.float64)
    exact = reference.forward(x, SPEC, **params.kwargs())
    emulated = reference.forward(x, SPEC, dtype=dtype, **params.kwargs())
    bound = tolerance.forward_bound(x, SPEC, dtype, params)
    for got in (_torch_layer_norm(x, params, dtype),  # torch's own kernel
                reference.forward(x, SPEC, dtype=dtype, formula="rsqrt", **params.kwargs())):  # x·(1/σ)
        c = tolerance.compare(got, exact, emulated, bound)
        assert c.ok and c.outside == 0 and c.total == x.size, c.summary()
        assert 0 < c.max_ratio <= 1 and c.worst_error <= c.worst_bound
    # the bound is a few roundings of the dtype, not a loose constant: ≤ 2⁸ u(dtype) at outputs of size ~3
    assert float(bound.max()) < 256 * UNIT_ROUNDOFF[dtype] * 3


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_wrong_eps_is_outside_the_forward_bound(rng, dtype):
    u = rng.choice([-1.0, 1.0], size=(4, H))  # zero-mean-ish, unit spread; variance 1e-5 at the knee
    x = Precision(dtype).round(math.sqrt(1e-5) * (u - u.mean(-1, keepdims=True))).astype(np.float64)
    spec = SPEC.without_affine()
    exact = reference.forward(x, spec)
    wrong = reference.forward(x, spec.replace(eps=1e-4), dtype=dtype)
    c = tolerance.compare(wrong, exact, None, tolerance.forward_bound(x, spec, dtype))
    assert not c.ok and c.outside == c.total, c.summary()
    assert c.max_ratio > 10  # far outside, not at the edge


def test_the_one_pass_term_covers_its_cancellation_and_only_it(rng):
    x = Precision("float32").round(1e4 + rng.normal(size=(4, H))).astype(np.float64)
    spec = SPEC.without_affine()
    one = spec.replace(variance_algorithm="one_pass")
    exact = reference.forward(x, spec)
    one_pass = reference.forward(x, one, dtype="float32")
    inside_own = tolerance.compare(one_pass, exact, None, tolerance.forward_bound(x, one, "float32"))
    outside_two = tolerance.compare(one_pass, exact, None, tolerance.forward_bound(x, spec, "float32"))
    assert inside_own.ok and not outside_two.ok, (inside_own.max_ratio, outside_two.max_ratio)


def test_recovery_noise_widens_the_bound_by_twice_the_noise(case):
    x, params = case
    plain = tolerance.forward_bound(x, SPEC, "float32", params)
    noisy = tolerance.forward_bound(x, SPEC, "float32", params, recovery_noise=(1e-3, 2e-3))
    xhat = np.abs(reference.statistics(x, SPEC.without_affine()).xhat)
    np.testing.assert_allclose(noisy - plain, 2 * (1e-3 * xhat + 2e-3), rtol=1e-9)


def test_backward_bound_holds_torch_and_catches_a_one_percent_error(case):
    x, params = case
    dy = np.random.default_rng(1).normal(size=x.shape)
    for dtype in ("float32", "bfloat16"):
        xd = Precision(dtype).round(x).astype(np.float64)
        t = getattr(torch, dtype)
        xt = torch.from_numpy(xd).to(t).requires_grad_(True)
        w = torch.from_numpy(params.gamma).to(t).requires_grad_(True)
        b = torch.from_numpy(params.beta).to(t).requires_grad_(True)
        torch.nn.functional.layer_norm(xt, (H,), w, b, SPEC.eps).backward(torch.from_numpy(dy).to(t))
        got = {"dx": xt.grad.double().numpy(), "dgamma": w.grad.double().numpy(), "dbeta": b.grad.double().numpy()}
        exact = dict(zip(("dx", "dgamma", "dbeta"), reference.backward(xd, dy, SPEC, **params.kwargs()), strict=True))
        bounds = tolerance.backward_bound(xd, dy, SPEC, dtype, params)
        assert set(bounds) == {"dx", "dgamma", "dbeta"}
        for label, g in got.items():
            assert tolerance.compare(g, exact[label], None, bounds[label]).ok, (dtype, label)
    wrong = tolerance.compare(exact["dx"] * 1.01, exact["dx"], None,
                              tolerance.backward_bound(x, dy, SPEC, "float32", params)["dx"])
    assert not wrong.ok
    no_beta = tolerance.backward_bound(x, dy, NormSpec.preset("torch_rmsnorm"), "float32",
                                       NormParams(gamma=params.gamma))
    assert set(no_beta) == {"dx", "dgamma"}


def test_comparison_fields_on_a_hand_made_case():
    exact = np.array([[1.0, 2.0], [3.0, 4.0]])
    got = np.array([[1.0, 2.05], [3.5, 4.0]])
    faithful = np.array([[1.0, 2.0], [3.1, 4.0]])
    c = tolerance.compare(got, exact, faithful, np.array([[0.1, 0.1], [0.25, 0.1]]))
    assert c.worst == (1, 0) and c.worst_error == pytest.approx(0.5) and c.worst_bound == 0.25
    assert c.worst_faithful == pytest.approx(0.1) and c.max_ratio == pytest.approx(2.0)
    assert c.max_error == pytest.approx(0.5) and (c.outside, c.total, c.nonfinite) == (1, 4, 0)
    assert not c.ok and c.summary() == "1 of 4 elements outside"
    np.testing.assert_allclose(c.ratio, [[0.0, 0.5], [2.0, 0.0]])
    inside = tolerance.compare(got, exact, None, 0.5)  # one bound for every element
    assert inside.ok and inside.worst_faithful is None and inside.worst_bound == 0.5
    nan = tolerance.compare(np.array([1.0, np.nan]), np.array([1.0, 2.0]), None, 1.0)
    assert nan.nonfinite == 1 and nan.worst == (1,) and nan.worst_error == math.inf and not nan.ok


def test_an_empty_comparison_is_never_ok():
    """Nothing compared is neither within the bound nor outside it: it was ok (max ratio 0 of 0 elements)."""
    from normscope.errors import InputError

    for got, exact in ((np.zeros((0, 4)), np.zeros((0, 4))), (np.zeros(0), np.zeros(0)),
                       (np.zeros((2, 0)), np.zeros((2, 0)))):
        with pytest.raises(InputError, match="nothing to compare"):
            tolerance.compare(got, exact, None, 1.0)
    with pytest.raises(InputError, match="empty comparison is neither a pass nor a failure"):
        tolerance.compare(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0))


def test_scalar_rules():
    assert tolerance.atol("float32", 0.5) == 16 * 2.0**-24  # never below the rounding at 1
    assert tolerance.atol("bf16", 10.0) == 4 * 2.0**-8 * 10
    assert tolerance.noise_floor(0.0, 100.0) == 0.0 and tolerance.noise_floor(1e-7, 10.0) == 2e-6
    assert tolerance.recovery_tolerance("float32") == 1e-3
    assert tolerance.recovery_tolerance("bfloat16") == 8 * 2.0**-8  # coarser than 1e-3 at bf16
    assert tolerance.recovery_tolerance("float32", (0.01, 0.0)) == 0.02
    assert tolerance.summation_factor(1) == tolerance.summation_factor(2) == 10.0
    assert tolerance.summation_factor(64) == 20.0


def test_every_constant_has_a_name_and_a_reason():
    lines = inspect.getsource(constants).splitlines()
    names = [i for i, line in enumerate(lines) if line and line[0].isupper() and " = " in line]
    assert len(names) >= 25
    for i in names:
        assert lines[i - 1].startswith("#: ") and len(lines[i - 1]) > 20, lines[i]
