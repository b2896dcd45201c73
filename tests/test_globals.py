"""Every public entry point leaves the caller's process as it found it: the random generators (torch, NumPy,
Python), torch's default dtype, thread count and grad mode, numba's thread count, and the log levels and
warning filters of the libraries it drives."""

from __future__ import annotations

import logging
import random
import warnings

import numpy as np
import pytest
import torch

import normscope

transformers = pytest.importorskip("transformers")


def _snapshot() -> dict:
    state = {
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "python_rng": random.getstate(),
        "default_dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "transformers_verbosity": transformers.logging.get_verbosity(),
        "log_levels": {name: logging.getLogger(name).level for name in ("transformers", "torch", "numba", "jax")},
        "warning_filters": list(warnings.filters),
    }
    try:
        import numba

        state["numba_threads"] = numba.get_num_threads()
    except ImportError:
        pass
    return state


def _same(a: dict, b: dict) -> list[str]:
    changed = []
    for key in a:
        x, y = a[key], b[key]
        equal = torch.equal(x, y) if isinstance(x, torch.Tensor) else (
            np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y)
        if not equal:
            changed.append(key)
    return changed


def _llama(tmp_path):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    cfg.save_pretrained(tmp_path)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg).eval()


def _gradflow(tmp_path):
    model = _llama(tmp_path)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return normscope.gradflow(model, lambda m: m(ids, labels=ids).loss, steps=1)


def _trace_and_diagnose(tmp_path):
    model = _llama(tmp_path)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with normscope.trace(model, tmp_path / "run") as tracer:
        for step in range(3):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            tracer.step(step, loss=float(loss))
    return normscope.diagnose(tmp_path / "run")


ENTRY_POINTS = {
    "infer": lambda tmp: normscope.infer(torch.nn.LayerNorm(16), shape=(2, 16)),
    "check": lambda tmp: normscope.check(torch.nn.LayerNorm(16), expect="torch_layernorm", shape=(2, 16),
                                         quick=True),
    "scan": lambda tmp: normscope.scan(_llama(tmp), progress=False),
    "contract": lambda tmp: (_llama(tmp), normscope.contract(tmp / "config.json")),
    "diff": lambda tmp: normscope.diff(_llama(tmp), candidate_dtype="bfloat16", progress=False),
    "gradflow": _gradflow,
    "trace and diagnose": _trace_and_diagnose,
}


@pytest.fixture(scope="module", autouse=True)
def _models_imported(tmp_path_factory):
    """transformers' modelling code imported before any snapshot: its import sets warning filters of its own."""
    _llama(tmp_path_factory.mktemp("warm"))


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_an_entry_point_leaves_the_callers_globals_as_it_found_them(entry, tmp_path):
    before = _snapshot()
    ENTRY_POINTS[entry](tmp_path)
    changed = _same(before, _snapshot())
    assert not changed, f"{entry} changed: {changed}"


def test_the_check_sees_a_changed_global():
    before = _snapshot()
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        assert _same(before, _snapshot()) == ["torch_rng"]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert _same(before, _snapshot()) == ["default_dtype"]
    finally:
        torch.set_default_dtype(previous)
