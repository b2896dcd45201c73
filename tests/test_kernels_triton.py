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


def test_a_row_offset_past_2_to_the_31_is_addressed_in_64_bits():
    """Three rows 2³⁰ + 64 elements apart — a row stride that fits 32 bits, a third row's offset that does not —
    as a strided view into a 4 GiB float16 buffer that is reserved, not touched (only the rows' pages are
    written). With 32-bit offsets the third row's address wraps (in the interpreter: a read outside the buffer)."""
    n, gap = 64, 2 ** 30 + 64
    try:
        big = torch.empty(2 * gap + n, dtype=torch.float16)
    except RuntimeError as exc:  # a machine that cannot reserve 4 GiB of address space
        pytest.skip(f"4 GiB of address space not available: {exc}")
    x = big.as_strided((3, n), (gap, 1))
    g = torch.Generator().manual_seed(3)
    x.copy_(torch.randn(3, n, generator=g).to(torch.float16))
    spec = NormSpec.preset("torch_layernorm")
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(torch.float16)
    y = norm(x, spec, w, None, backend="triton")
    expect = torch.nn.functional.layer_norm(x.float(), (n,), w.float()).to(torch.float16)
    assert (y.float() - expect.float()).abs().max() <= 2 ** -8 * 4
    assert x.stride(0) == gap  # the view was used as it is, not copied to contiguous rows


def test_param_grads_are_summed_over_row_blocks_deterministically():
    """dγ/dβ over 65 rows: three row blocks of 22 (the last one short: 21) written as partial sums, then added in
    a fixed order — equal to the float64 sum and bitwise equal from run to run."""
    from normscope.kernels import triton_gpu

    n = 48
    assert triton_gpu.row_blocks(100) == (4, 25)
    assert triton_gpu.row_blocks(65) == (3, 22)  # a short last block
    spec = NormSpec.preset("torch_layernorm")
    g = torch.Generator().manual_seed(5)
    for r in (65,):
        x = torch.randn(r, n, generator=g, dtype=torch.float32).requires_grad_()
        w = (1 + 0.3 * torch.randn(n, generator=g)).requires_grad_()
        b = (0.2 * torch.randn(n, generator=g)).requires_grad_()
        dy = torch.randn(r, n, generator=g)
        runs = []
        for _ in range(2):
            y = norm(x, spec, w, b, backend="triton")
            runs.append(torch.autograd.grad(y, [w, b], dy))
        assert all(torch.equal(a, c) for a, c in zip(runs[0], runs[1], strict=True))
        xd = x.detach().double()
        xhat = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5)
        dw, db = runs[0]
        assert torch.allclose(dw.double(), (dy.double() * xhat).sum(0), rtol=1e-5, atol=1e-4)
        assert torch.allclose(db.double(), dy.double().sum(0), rtol=1e-5, atol=1e-4)
