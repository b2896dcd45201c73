"""Shared test configuration: a modest, deterministic hypothesis profile and a seeded RNG fixture."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "normscope",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("normscope")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240601)

pytest_plugins = ["pytester"]
