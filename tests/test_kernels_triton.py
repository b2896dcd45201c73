"""The Triton kernels in Triton's interpreter on the CPU (TRITON_INTERPRET=1), under the acceptance battery.

The interpreter runs each program in NumPy, so shapes stay tiny; on a CUDA machine the same kernels are
dispatched for CUDA tensors by ``normscope.kernels.norm``.
"""

from __future__ import annotations

import os

import pytest

# Read when triton.jit decorates the kernels and again when they run, so it stays set for the session (in
# the other test modules it only lets backend="triton" accept CPU tensors; test_kernels.py unsets it where
# it tests that refusal).
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch  # noqa: E402

from normscope import NormSpec, check  # noqa: E402
from normscope.kernels import norm  # noqa: E402
from normscope.nn import Norm  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _module(spec, n, backend="triton"):
    m = Norm(spec, n if (spec.gamma or spec.beta) else (), backend=backend)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if m.weight is not None:
            m.weight.copy_(1 + 0.3 * torch.randn(n, generator=g))
        if m.bias is not None:
            m.bias.copy_(0.2 * torch.randn(n, generator=g))
    return m


# The interpreter costs ~0.3–0.6 s a call and a full battery makes ~70 calls: one contract always, the
# other three when NORMSCOPE_SLOW_TESTS=1 (each passed when this was written; 20–70 s apiece on 2 cores).
_SLOW = pytest.mark.skipif(os.environ.get("NORMSCOPE_SLOW_TESTS") != "1",
                           reason="a full battery in Triton's interpreter takes 20-70 s; NORMSCOPE_SLOW_TESTS=1")


@pytest.mark.parametrize("spec", [
    NormSpec.preset("torch_layernorm"),
    pytest.param(NormSpec.preset("gemma_rmsnorm"), marks=_SLOW),
    pytest.param(NormSpec.preset("llama_rmsnorm", eps=1e-3).replace(eps_placement="outside_sqrt"), marks=_SLOW),
    pytest.param(NormSpec.preset("flax_layernorm").replace(variance="unbiased", affine_order="cast_then_scale"),
                 marks=_SLOW),
], ids=["torch_layernorm", "gemma_rmsnorm", "rms_eps_outside", "ln_one_pass_unbiased_cast_first"])
def test_triton_kernels_pass_the_battery_at_every_dtype(spec):
    report = check(_module(spec, 16), expect=spec, shape=(2, 3, 16), dtypes=DTYPES, quick=False,
                   explain_failures=False)
    assert report.ok, report.text()
    passed = {f.name for f in report.findings if f.status == "pass"}
    for d in DTYPES:
        assert f"backward dx {d}" in passed and f"forward (2, 3, 16) {d}" in passed, sorted(passed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_and_numba_agree_with_residual_and_gradients(dtype):
    pytest.importorskip("numba")
    spec = NormSpec.preset("torch_layernorm")
    g = torch.Generator().manual_seed(7)
    n = 4100  # more than one 4096-wide block: the row is walked in masked blocks
    x = torch.randn(3, n, generator=g).to(dtype).requires_grad_()
    r = torch.randn(3, n, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype).requires_grad_()
    b = (0.2 * torch.randn(n, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(3, n, generator=g).to(dtype)
    out = {}
    for backend in ("triton", "numba"):
        y, h = norm(x, spec, w, b, residual=r, backend=backend)
        out[backend] = (y, h, *torch.autograd.grad(y, [x, w, b], dy))
    y_t, h_t, dx_t, dw_t, db_t = out["triton"]
    y_n, h_n, dx_n, dw_n, db_n = out["numba"]
    assert torch.equal(h_t, h_n)  # the same add, rounded to nearest-even in both
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    for a, c in ((y_t, y_n), (dx_t, dx_n), (dw_t, dw_n), (db_t, db_n)):
        assert (a.float() - c.float()).abs().max() <= 4 * tol * max(1.0, c.float().abs().max().item())
