"""Shared test configuration: a modest, deterministic hypothesis profile, a seeded RNG fixture, and one torch
thread for modules that time or compare training runs (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""

from __future__ import annotations

import os

# Triton's kernels run in its interpreter on the CPU. Set before anything imports triton: building a transformers
# model imports it (the generated diff cases build theirs while the tests are collected), triton's mode is fixed at
# its first import, and the kernel tests then fail with "Cannot call @triton.jit'd outside of the scope of a kernel".
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402

# The tests' own openvino.convert_model calls report no usage (OpenVINO's converter falls back to its no-op stub
# when openvino_telemetry cannot be imported), as normscope's own do.
sys.modules.setdefault("openvino_telemetry", None)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

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
