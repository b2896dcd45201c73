"""Result types: NormParams (γ, β, running statistics as one value)."""

from __future__ import annotations

import numpy as np
import pytest

from normscope import InputError, NormSpec, reference
from normscope.results.params import NormParams


def test_norm_params_copies_and_reads_like_the_old_dict():
    g = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    p = NormParams(gamma=g)
    g[0] = 9.0  # the caller's array is not shared
    assert p.gamma.dtype == np.float64 and p.gamma[0] == 1.0
    assert "gamma" in p and "beta" not in p and p.get("beta") is None
    assert set(p.to_dict()) == {"gamma"} and bool(p) and not NormParams()
    q = p.replace(beta=[0.5, 0.5, 0.5])
    assert "beta" in q and "beta" not in p  # replace returns a new value
    assert q.merged({"gamma": [4.0, 5.0, 6.0]}).gamma.tolist() == [4.0, 5.0, 6.0]
    assert NormParams.from_dict(q.to_json()) == q and q != p
    with pytest.raises(InputError, match="unknown parameter"):
        NormParams.from_dict({"weight": [1.0]})


def test_norm_params_feed_the_reference_and_the_error_model():
    spec = NormSpec.preset("gemma_rmsnorm")  # γ stored with an offset of 1
    x = np.random.default_rng(0).normal(size=(2, 3))
    p = NormParams(gamma=[-2.0, 0.0, 1.0])
    np.testing.assert_array_equal(reference.forward(x, spec, **p.kwargs()),
                                  reference.forward(x, spec, gamma=p.gamma))
    np.testing.assert_array_equal(p.effective_gamma(spec, x.shape), np.array([[1.0, 1.0, 2.0]]))
    assert p.abs_beta(spec, x.shape) == 0.0 and NormParams().effective_gamma(spec, x.shape) == 1.0
    with pytest.raises(InputError, match=r"must have shape \(3,\)"):
        NormParams(gamma=[1.0, 2.0]).check_shapes(spec, x.shape)
    with pytest.raises(InputError, match="beta=False"):
        NormParams(beta=[1.0, 2.0, 3.0]).check_shapes(spec, x.shape)


def test_finding_ids_keys_and_status():
    from normscope.results.check import Finding, Status

    f = Finding("tiny variance 1e-12 at float16", "extreme", "fail", 0.5, None, 0.1, "why",
                "extreme.tiny_variance", {"variance": 1e-12, "dtype": "float16"})
    assert f.status is Status.FAIL and f.status == "fail" and f"{f.status}" == "fail"
    assert f.key == "extreme.tiny_variance[variance=1e-12; dtype=float16]"
    g = Finding("forward (2, 8, 64) float32", "reference", "pass", id="reference.forward",
                params={"shape": (2, 8, 64), "dtype": "float32"})
    assert g.key == "reference.forward[shape=(2, 8, 64); dtype=float32]"
    back = Finding.from_dict(g.to_dict())  # the shape comes back as a list; the key is the same
    assert back.key == g.key and back.status is Status.PASS
    with pytest.raises(ValueError):
        Finding("x", "s", "passed")  # a closed set: a typo is an error, not a fourth status
