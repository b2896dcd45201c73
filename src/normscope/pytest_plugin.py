"""pytest plugin: the ``assert_norm_conforms`` fixture and the ``normscope`` marker.

    def test_kernel(assert_norm_conforms):
        assert_norm_conforms(MyRMSNorm(4096), "llama_rmsnorm", shape=(2, 8, 4096))

    @pytest.mark.normscope(expect="torch_layernorm", shape=(2, 8, 64))
    def test_layernorm():
        return torch.nn.LayerNorm(64)      # the returned target is checked after the test body
"""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "normscope(expect, shape, **kwargs): check the target the test returns against a contract")


@pytest.fixture
def assert_norm_conforms():
    from .testing import assert_conforms

    return assert_conforms


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    marker = pyfuncitem.get_closest_marker("normscope")
    if marker is None:
        yield
        return
    from .testing import assert_conforms

    testfunction = pyfuncitem.obj
    funcargs = pyfuncitem.funcargs
    names = pyfuncitem._fixtureinfo.argnames
    target = testfunction(**{n: funcargs[n] for n in names})
    if target is None:
        raise pytest.UsageError(f"{pyfuncitem.name}: a @pytest.mark.normscope test must return the target to check")
    assert_conforms(target, *marker.args, **marker.kwargs)
    pyfuncitem.obj = lambda *a, **k: None
    yield
    pyfuncitem.obj = testfunction
