"""Random contracts, executed by the reference's own emulation: inference must recover every field, the
battery must pass a faithful implementation and fail one whose contract differs in one observable field."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from normscope import NormSpec, check, infer, reference
from normscope.spec import differences

LAYOUTS = [
    ((2, 8, 64), dict(axes=[-1])),
    ((2, 8, 16), dict(axes=[-2, -1])),
    ((4, 6, 5, 5), dict(axes=[1, 2, 3], groups=3, group_axis=1, param_axes=[1])),
    ((2, 8, 16), dict(axes=[-2])),
    ((6, 4, 3), dict(axes=[0, 2], param_axes=[1])),
]
PLACEMENTS = ("inside_sqrt", "outside_sqrt", "clamp", "none")


def random_case(seed: int, *, with_none: bool = True, free_variance: bool = True):
    rng = np.random.default_rng(seed)
    shape, layout = LAYOUTS[seed % len(LAYOUTS)]
    center = bool(rng.integers(2))
    placement = PLACEMENTS[rng.integers(4 if with_none else 3)]
    eps = 0.0 if placement == "none" else float(10.0 ** rng.uniform(-9 if not with_none else -12, -2))
    gamma, beta = bool(rng.integers(2)), bool(rng.integers(2))
    kw = dict(layout)
    if not (gamma or beta):
        kw["param_axes"] = []
    # with a learned γ, ÷d vs ÷(d−1) is only γ's scale for a pure black box: keep those biased
    variance = ("biased", "unbiased")[rng.integers(2)] if (free_variance and not gamma) else "biased"
    spec = NormSpec(center=center, eps=eps, eps_placement=placement, variance=variance,
                    variance_algorithm="one_pass" if center and rng.integers(2) else "two_pass",
                    gamma=gamma, beta=beta, stats_dtype=("float32", "input")[rng.integers(2)],
                    affine_order=("cast_then_scale", "scale_then_cast")[rng.integers(2)], **kw)
    pshape = reference.param_shape(shape, spec)
    g = rng.uniform(0.5, 1.5, pshape) if gamma else None
    b = rng.uniform(-1, 1, pshape) if beta else None
    return rng, shape, spec, g, b


def emulated(spec: NormSpec, gamma, beta):
    """A NumPy implementation that is exactly faithful to ``spec`` at every dtype it is called with."""

    def fn(x):
        name = "bfloat16" if x.dtype == ml_dtypes.bfloat16 else str(x.dtype)
        y = reference.forward(x.astype(np.float64), spec, gamma=gamma, beta=beta,
                              dtype=None if name == "float64" else name)
        return y.astype(x.dtype)

    return fn


@pytest.mark.parametrize("seed", range(30))
def test_infer_recovers_random_contracts(seed):
    _, shape, spec, g, b = random_case(seed)
    r = infer(emulated(spec, g, b), shape=shape, framework="numpy")
    assert differences(r.spec, spec, len(shape)) == [], (spec.summary(), r.spec.summary())
    if g is not None:
        np.testing.assert_allclose(r.params.gamma, g, rtol=1e-6)
    if b is not None:
        np.testing.assert_allclose(r.params.beta, b, atol=1e-6)


@pytest.mark.parametrize("seed", range(100, 125))
def test_check_passes_faithful_implementations(seed):
    _, shape, spec, g, b = random_case(seed)
    r = check(emulated(spec, g, b), expect=spec, shape=shape, framework="numpy", explain_failures=False)
    assert r.ok, r.text()


@pytest.mark.parametrize("seed", range(200, 225))
def test_check_fails_a_contract_that_differs_in_one_field(seed):
    rng, shape, spec, g, b = random_case(seed, with_none=False)
    mutations = {
        "eps ×10": dict(eps=spec.eps * 10),
        "placement": dict(eps_placement=[p for p in PLACEMENTS[:3] if p != spec.eps_placement][rng.integers(2)]),
        "stats dtype": dict(stats_dtype="input" if spec.stats_dtype == "float32" else "float32"),
    }
    if spec.center:
        mutations["algorithm"] = dict(
            variance_algorithm="two_pass" if spec.variance_algorithm == "one_pass" else "one_pass")
    name = list(mutations)[rng.integers(len(mutations))]
    actual = spec.replace(**mutations[name])
    r = check(emulated(actual, g, b), expect=spec, shape=shape, framework="numpy", explain_failures=False)
    assert not r.ok, f"{name}: {spec.summary()} passed an implementation of {actual.summary()}"
