"""Shared test configuration: a modest, deterministic hypothesis profile, a seeded RNG fixture, and one torch
thread for modules that time or compare training runs (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""

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


@pytest.fixture(scope="module")
def one_torch_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

pytest_plugins = ["pytester"]
