"""Use the acceptance battery from your own test suite.

    from normscope.testing import assert_conforms

    def test_my_kernel():
        assert_conforms(my_rmsnorm_module, "llama_rmsnorm", shape=(2, 16, 4096))

With the pytest plugin (installed with normscope) the same is the ``assert_norm_conforms`` fixture, and
``@pytest.mark.normscope(expect=..., shape=...)`` marks a test whose return value is checked.
"""

from __future__ import annotations

from .battery.check import check
from .results.check import Report


def assert_conforms(target, expect, *, shape, framework=None, dtypes=None, quick: bool = True, **kwargs) -> Report:
    """Raise ``AssertionError`` with the report when ``target`` does not honour ``expect``; else return it."""
    report = check(target, expect=expect, shape=shape, framework=framework, dtypes=dtypes, quick=quick, **kwargs)
    if not report.ok:
        raise AssertionError(report.text())
    return report
