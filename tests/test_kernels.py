"""The fused kernels (normscope.kernels), checked by normscope's own acceptance battery.

The numba kernels compile once into their on-disk cache (cache=True); after that a full battery (forward and
backward at float32, float16 and bfloat16) takes well under a second per contract.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from forked import in_forked_child
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from normscope import NormSpec, SpecError, check, reference
from normscope.errors import InputError
from normscope.kernels import norm
from normscope.nn import Norm

pytest.importorskip("numba")

DTYPES = ("float32", "float16", "bfloat16")


def _battery(module, spec, shape=(2, 3, 16), dtypes=DTYPES):
    report = check(module, expect=spec, shape=shape, dtypes=dtypes, quick=False, explain_failures=False)
    assert report.ok, report.text()
    assert report.dtypes_run == tuple(dtypes)
    backward = {f.name for f in report.findings if f.name.startswith("backward") and f.status == "pass"}
    for d in dtypes:  # forward and backward were measured at every dtype, not skipped
        assert f"backward dx {d}" in backward, sorted(backward)
        assert any(f.name.startswith("forward") and f.name.endswith(d) and f.status == "pass"
                   for f in report.findings)
    return report


def _random_params(spec, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    gamma = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype) if spec.gamma else None
    beta = (0.2 * torch.randn(n, generator=g)).to(dtype) if spec.beta else None
    return gamma, beta


def _module(spec, n, backend="numba", seed=0):
    m = Norm(spec, n if (spec.gamma or spec.beta) else (), backend=backend)
    gamma, beta = _random_params(spec, n, seed=seed)
    with torch.no_grad():
        if m.weight is not None:
            m.weight.copy_(gamma)
        if m.bias is not None:
            m.bias.copy_(beta)
    return m


class ResidualNorm(torch.nn.Module):
    """The fused residual path under the battery: h = x + 0 = x exactly (x/2 + x/2 is not, in float16's
    subnormal range), y = spec(h); the gradient reaches x through the fused backward."""

    def __init__(self, spec, n):
        super().__init__()
        self.spec = spec
        inner = _module(spec, n)
        self.weight, self.bias = inner.weight, inner.bias

    def forward(self, x):
        y, h = norm(x, self.spec, self.weight, self.bias, residual=torch.zeros_like(x))
        return y


# ------------------------------------------------------------------------------------------ dogfooding
@pytest.mark.parametrize("preset", ["torch_layernorm", "llama_rmsnorm", "gemma_rmsnorm", "t5_layernorm"])
def test_preset_kernels_pass_the_battery_at_every_dtype(preset):
    spec = NormSpec.preset(preset)
    _battery(_module(spec, 16), spec)


def test_fused_residual_path_passes_the_battery():
    spec = NormSpec.preset("gemma_rmsnorm")
    _battery(ResidualNorm(spec, 16), spec)


@st.composite
def last_axis_specs(draw):
    center = draw(st.booleans())
    placement = draw(st.sampled_from(["inside_sqrt", "outside_sqrt", "clamp", "none"]))
    eps = 0.0 if placement == "none" else draw(st.sampled_from([1e-6, 1e-5, 1e-3, 0.1]))
    gamma, beta = draw(st.booleans()), draw(st.booleans())
    return NormSpec(
        center=center, axes=[-1], eps=eps, eps_placement=placement,
        variance=draw(st.sampled_from(["biased", "unbiased"])),
        variance_algorithm=draw(st.sampled_from(["two_pass", "one_pass"])) if center else "two_pass",
        gamma=gamma, beta=beta, gamma_offset=draw(st.sampled_from([0.0, 1.0])) if gamma else 0.0,
        affine_order=draw(st.sampled_from(["scale_then_cast", "cast_then_scale"])),
        stats_dtype=draw(st.sampled_from(["float32", "float32", "input"])),
    )


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(spec=last_axis_specs(), n=st.sampled_from([3, 5, 16, 33, 100]))
def test_any_last_axis_contract_passes_the_battery(spec, n):
    # input-dtype statistics at 16 bits is a contract the kernels refuse (tested below); float32 only then
    dtypes = ("float32",) if spec.stats_dtype == "input" else DTYPES
    _battery(_module(spec, n), spec, shape=(2, 3, n), dtypes=dtypes)


def test_the_battery_tells_a_kernel_of_another_contract():
    # the dogfooding can fail: a kernel built for ε outside √ does not pass as ε inside √
    built = NormSpec.preset("llama_rmsnorm", eps=1e-2).replace(eps_placement="outside_sqrt")
    report = check(_module(built, 16), expect=NormSpec.preset("llama_rmsnorm", eps=1e-2), shape=(2, 3, 16),
                   quick=True, explain_failures=False)
    assert not report.ok
    assert any(f.status == "fail" for f in report.findings)


# ------------------------------------------------------------------------------------------ shapes and layouts
@pytest.mark.parametrize("n", [1, 2, 3, 1000, 65536])
@pytest.mark.parametrize("preset", ["torch_layernorm", "llama_rmsnorm"])
def test_hidden_sizes_match_the_reference(preset, n):
    spec = NormSpec.preset(preset)
    rows = 2 if n == 65536 else 5
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n))
    gamma, beta = _random_params(spec, n)
    y = norm(x, spec, gamma, beta)
    want = reference.forward(x.double().numpy(), spec, gamma=gamma.double().numpy(),
                             beta=None if beta is None else beta.double().numpy())
    # float32 accumulation over n values: the error grows like √n·u at most for random data
    assert np.abs(y.double().numpy() - want).max() <= 1e-5 * max(1.0, np.sqrt(n) / 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("spec", [NormSpec.preset("llama_rmsnorm"), NormSpec.preset("torch_layernorm"),
                                  NormSpec.preset("torch_layernorm").replace(variance_algorithm="one_pass")],
                         ids=["rms", "ln-two-pass", "ln-one-pass"])
def test_a_rows_output_does_not_depend_on_the_rows_around_it(monkeypatch, spec, stream, dtype):
    """The forward (and the float32 backward) take a row's sums in the loop that writes an earlier row, and the
    first rows of each parallel chunk behind rows of zeros: a row's y, h and dx are the same bits alone, first or
    last in a chunk, or anywhere between, with and without the fused add and streaming stores."""
    from normscope.kernels import streaming

    monkeypatch.setattr(streaming, "STREAM_MIN_BYTES", 0 if stream else 1 << 62)
    g = torch.Generator().manual_seed(11)
    x, r = torch.randn(37, 1000, generator=g) * 3 + 1, torch.randn(37, 1000, generator=g)
    x, r = x.to(dtype), r.to(dtype)
    gamma, beta = _random_params(spec, 1000, dtype)
    dy = torch.randn(37, 1000, generator=g).to(dtype)

    def dx(rows):  # the backward's dx of those rows, computed with nothing else
        xg = x[rows].clone().requires_grad_()
        norm(xg, spec, gamma, beta).backward(dy[rows])
        return xg.grad

    y = norm(x, spec, gamma, beta)  # 37 000 elements: the parallel build, in chunks of a few rows
    y_res, h = norm(x, spec, gamma, beta, residual=r)
    dx_all = dx(slice(None))
    for i in range(37):
        assert torch.equal(norm(x[i:i + 1], spec, gamma, beta), y[i:i + 1]), i
        alone, h_alone = norm(x[i:i + 1], spec, gamma, beta, residual=r[i:i + 1])
        assert torch.equal(alone, y_res[i:i + 1]) and torch.equal(h_alone, h[i:i + 1]), i
        assert torch.equal(dx(slice(i, i + 1)), dx_all[i:i + 1]), i
    assert torch.equal(norm(x[5:], spec, gamma, beta), y[5:])  # other chunk boundaries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_strided_rows_are_read_in_place_and_match_contiguous(dtype):
    spec = NormSpec.preset("torch_layernorm")
    base = torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = base[:, 5:45]  # row stride 80, hidden 40
    gamma, beta = _random_params(spec, 40, dtype)
    assert x.stride() == (80, 1)
    y = norm(x, spec, gamma, beta)
    assert torch.equal(y, norm(x.contiguous(), spec, gamma, beta))
    y3 = norm(base.view(2, 3, 80)[:, :, 5:45], spec, gamma, beta)  # leading axes merge to rows of stride 80
    assert torch.equal(y3.reshape(6, 40), y)


def test_residual_fusion_equals_the_unfused_sum_and_its_gradients():
    spec = NormSpec.preset("llama_rmsnorm")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 24, generator=g).bfloat16().requires_grad_()
    r = torch.randn(4, 24, generator=g).bfloat16().requires_grad_()
    w = torch.randn(24, generator=g).bfloat16().requires_grad_()
    y, h = norm(x, spec, w, residual=r)
    assert torch.equal(h, (x + r).detach())  # bf16 add, rounded once, as torch rounds it
    assert torch.equal(y, norm((x + r).detach(), spec, w.detach()))
    dy, dh = torch.randn(4, 24, generator=g).bfloat16(), torch.randn(4, 24, generator=g).bfloat16()
    torch.autograd.backward([y, h], [dy, dh])
    h0 = (x + r).detach().requires_grad_()
    w0 = w.detach().clone().requires_grad_()
    y0 = norm(h0, spec, w0)
    y0.backward(dy)
    want = (h0.grad.float() + dh.float()).bfloat16()
    assert torch.equal(x.grad, r.grad)
    assert (x.grad.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    assert torch.equal(w.grad, w0.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_call_with_nothing_to_differentiate_skips_autograd_with_the_same_numbers(dtype):
    """Under no_grad, or with no input that requires grad, the kernel runs without the autograd function: the same
    outputs, no graph. Any input that requires grad (γ alone, the residual alone) gets the graph."""
    spec = NormSpec.preset("torch_layernorm")
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(6, 40, generator=g).to(dtype), torch.randn(6, 40, generator=g).to(dtype)
    w, b = torch.randn(40, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    y, h = norm(x, spec, w, b, residual=r)
    assert y.grad_fn is None and h.grad_fn is None and not y.requires_grad
    plain = norm(x, spec, w, b)
    for needs in ("x", "gamma", "beta", "residual"):
        args = {"x": x, "gamma": w, "beta": b, "residual": r}
        args[needs] = args[needs].clone().requires_grad_()
        y1, h1 = norm(args["x"], spec, args["gamma"], args["beta"], residual=args["residual"])
        assert y1.grad_fn is not None and torch.equal(y1.detach(), y) and torch.equal(h1.detach(), h), needs
        y1.float().sum().backward()
        assert args[needs].grad is not None, needs
        with torch.no_grad():
            y2 = norm(args["x"], spec, args["gamma"], args["beta"])
        assert y2.grad_fn is None and torch.equal(y2, plain), needs


def test_small_inputs_run_the_serial_build_with_the_parallel_builds_numbers(monkeypatch):
    """Under SERIAL_BELOW elements a kernel runs on the calling thread (waking the pool costs more than a few rows):
    forward, fused add and backward give the parallel build's numbers bit for bit."""
    from normscope import numba_threads

    spec = NormSpec.preset("torch_layernorm")
    g = torch.Generator().manual_seed(9)
    x, r = torch.randn(3, 4096, generator=g), torch.randn(3, 4096, generator=g)
    w = torch.randn(4096, generator=g)
    assert x.numel() < numba_threads.SERIAL_BELOW

    def run():
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, h = norm(xg, spec, wg, residual=r)
        (y.square().sum() + h.sum()).backward()
        return y.detach(), h.detach(), xg.grad, wg.grad

    serial = run()
    monkeypatch.setattr(numba_threads, "SERIAL_BELOW", 0)
    for a, b in zip(serial, run(), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ streaming stores
@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
def test_stream_row_copies_exactly_at_every_alignment_and_length(dtype):
    from normscope.kernels.streaming import stream_row

    src = np.arange(1, 81).astype(dtype)
    for offset in range(16):  # every start address within a 32-byte vector (and, for uint16, within 4 bytes)
        for n in (0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 64):
            dst = np.zeros(96, dtype)
            stream_row(dst[offset:offset + n], src, n)
            want = np.zeros(96, dtype)
            want[offset:offset + n] = src[:n]
            assert np.array_equal(dst, want), (offset, n)  # the row, and nothing before or after it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [4096, 37])  # rows aligned to 32 bytes, and rows starting anywhere
def test_streamed_outputs_equal_ordinary_ones_forward_and_backward(monkeypatch, dtype, n):
    """Outputs at least ``STREAM_MIN_BYTES`` large are written with streaming stores; the numbers are the same."""
    from normscope.kernels import streaming

    spec = NormSpec.preset("torch_layernorm")
    g = torch.Generator().manual_seed(n)
    x = torch.randn(7, n, generator=g).to(dtype)
    r = torch.randn(7, n, generator=g).to(dtype)
    dy, dh = torch.randn(7, n, generator=g).to(dtype), torch.randn(7, n, generator=g).to(dtype)
    gamma, beta = _random_params(spec, n, dtype)

    def run():
        xs, rs = x.clone().requires_grad_(), r.clone().requires_grad_()
        y, h = norm(xs[:, :n], spec, gamma, beta, residual=rs)
        torch.autograd.backward([y, h], [dy, dh])
        return y, h, xs.grad, norm(x[1:], spec, gamma, beta)  # x[1:] starts one row in: another alignment

    monkeypatch.setattr(streaming, "STREAM_MIN_BYTES", 1 << 62)
    ordinary = run()
    monkeypatch.setattr(streaming, "STREAM_MIN_BYTES", 0)
    streamed = run()
    for a, b in zip(ordinary, streamed, strict=True):
        assert torch.equal(a, b)


def test_each_kernel_output_is_judged_against_the_streaming_threshold(monkeypatch):
    from normscope.kernels import streaming

    judged = []

    class Threshold:  # ``size >= threshold`` asks the threshold: record each output size the kernels judge
        def __le__(self, size):
            judged.append(size)
            return True

    assert streaming.STREAM_MIN_BYTES >= 1 << 20  # the last-level cache, or 32 MiB: never a small output
    monkeypatch.setattr(streaming, "STREAM_MIN_BYTES", Threshold())
    x = torch.randn(3, 40, requires_grad=True)
    norm(x, NormSpec.preset("llama_rmsnorm")).sum().backward()
    assert judged == [3 * 40 * 4, 3 * 40 * 4]  # y in the forward, dx in the backward


def test_a_second_derivative_through_a_kernel_raises_instead_of_coming_back_as_zeros():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    y = norm(x, NormSpec.preset("llama_rmsnorm"), gamma=w)
    gx, = torch.autograd.grad(y.pow(3).sum(), x, create_graph=True)  # the first derivative is the kernel's
    ref_x = x.detach().clone().requires_grad_()
    ref = ref_x * torch.rsqrt(ref_x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.detach()
    want, = torch.autograd.grad(ref.pow(3).sum(), ref_x)
    torch.testing.assert_close(gx.detach(), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.sum().backward()


# ------------------------------------------------------------------------------------------ storage formats
@pytest.mark.parametrize("fmt,dtype", [(1, torch.bfloat16), (2, torch.float16)])
def test_16_bit_rounding_and_encoding_match_torch(fmt, dtype):
    g = torch.Generator().manual_seed(fmt)
    v = torch.cat([torch.randn(4000, generator=g) * 10.0 ** torch.randint(-9, 6, (4000,), generator=g),
                   torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, 3e38, 1e-8, -6e-8, 2.98e-8,
                                 float("inf"), float("-inf"), float("nan")])]).float()
    _assert_rounded_and_encoded_as_torch(v, fmt, dtype)


def _assert_rounded_and_encoded_as_torch(v: torch.Tensor, fmt: int, dtype: torch.dtype) -> None:
    """The kernels' rounding of float32 values ``v`` to the storage format (``fmt``, as a float32 value) and their
    encoding (the nearest 16-bit pattern) equal torch's cast bit for bit (±0 told apart); NaN stays NaN."""
    from normscope.kernels import numba_cpu as k

    buf = np.array([k._rounded_16(x, fmt) for x in v.numpy()], np.float32)
    out = np.empty(buf.size, np.uint16)
    k._encode(v.numpy(), buf.size, fmt, out, 0)
    want = v.to(dtype)
    got = torch.from_numpy(out.view(np.int16)).view(dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(torch.isnan(torch.from_numpy(buf)), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.equal(torch.from_numpy(buf)[~nan].view(torch.int32), want[~nan].float().view(torch.int32))


@pytest.mark.parametrize("fmt,dtype", [(1, torch.bfloat16), (2, torch.float16)])
def test_16_bit_rounding_matches_torch_at_every_value_and_every_tie(fmt, dtype):
    """Every 16-bit pattern, the float32 midpoint between each two neighbours (a tie: to even) and the float32 values
    just either side of it round and encode as torch's cast does."""
    from normscope.kernels import numba_cpu as k

    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).float()
    finite = every[torch.isfinite(every)].unique()  # sorted
    mid = ((finite[:-1].double() + finite[1:].double()) / 2).float()  # exact in float32: one more bit
    bits = mid.view(torch.int32)
    # NaNs whose payload is only in the float32's lower half (bfloat16 keeps the upper half): still NaN
    nans = torch.tensor([0x7F800001, 0x7F80ABCD, -0x007F5433, 0x7FC00000], dtype=torch.int32).view(torch.float32)
    v = torch.cat([every, mid, (bits + 1).view(torch.float32), (bits - 1).view(torch.float32), nans])
    _assert_rounded_and_encoded_as_torch(v, fmt, dtype)
    if fmt == 2:  # the arithmetic decoding inside the rounding gives the table's value for every pattern
        decoded = np.array([k._f16_value(np.uint32(h)) for h in range(65536)], np.float32)
        nan = np.isnan(k.F16_TABLE)
        assert np.array_equal(np.isnan(decoded), nan)
        assert np.array_equal(decoded.view(np.uint32)[~nan], k.F16_TABLE.view(np.uint32)[~nan])


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("spec,shape,dtype,field", [
    (NormSpec.preset("torch_groupnorm", groups=2), (2, 4, 3, 3), torch.float32, "groups"),
    (NormSpec(axes=[-2, -1]), (2, 4, 8), torch.float32, "axes"),
    (NormSpec(axes=[-1], param_axes=[-2]), (2, 4, 8), torch.float32, "param_axes"),
    (NormSpec.preset("torch_batchnorm"), (4, 3, 2, 2), torch.float32, "batch_stats"),
    (NormSpec(stats_dtype="input"), (2, 8), torch.bfloat16, "stats_dtype"),
])
def test_contracts_a_row_kernel_cannot_honour_name_the_field(spec, shape, dtype, field):
    with pytest.raises(SpecError, match=field):
        norm(torch.zeros(shape, dtype=dtype), spec)
    with pytest.raises(SpecError, match=field):
        norm(torch.zeros(shape, dtype=dtype), spec, backend="numba")


def test_bad_inputs_get_one_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = NormSpec.preset("torch_layernorm")
    x = torch.randn(2, 8)
    with pytest.raises(InputError, match="float64"):
        norm(x.double(), spec)
    with pytest.raises(InputError, match=r"gamma has shape \(7,\)"):
        norm(x, spec, torch.ones(7))
    with pytest.raises(InputError, match="last axis of size"):
        norm(torch.zeros(3, 0), spec)
    assert norm(torch.zeros(0, 8), spec).shape == (0, 8)  # no rows: nothing to do, no error
    with pytest.raises(InputError, match="residual"):
        norm(x, spec, residual=torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(InputError, match="TRITON_INTERPRET"):
        norm(x, spec, backend="triton")
    with pytest.raises(InputError, match="backend"):
        Norm(spec, 8, backend="fast")
    before = x.clone()
    norm(x, spec)
    assert torch.equal(x, before)  # nothing the user passed is modified


def test_norm_auto_backend_uses_the_kernel_where_it_can_and_the_reference_elsewhere():
    spec = NormSpec.preset("llama_rmsnorm")
    auto, ref = _module(spec, 32, backend="auto"), _module(spec, 32, backend="reference")
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert torch.equal(auto(x), norm(x, spec, auto.weight))
    # float64 and BatchNorm have no kernel: auto computes them with the reference code, exactly
    assert torch.equal(auto(x.double()), ref(x.double()))
    bn_auto = Norm(NormSpec.preset("torch_batchnorm"), 3, backend="auto").eval()
    bn_ref = Norm(NormSpec.preset("torch_batchnorm"), 3, backend="reference").eval()
    xb = torch.randn(4, 3, 2, 2)
    assert torch.equal(bn_auto(xb), bn_ref(xb))


def test_the_numba_kernels_use_torchs_thread_count_and_leave_it_as_it_was():
    """numba's OpenMP layer can share torch's OpenMP runtime, where a launch on numba's own count (every core) set
    torch's thread count: the kernels run on torch's count — on one torch thread their serial build, on the calling
    thread — and leave both counts as the user made them."""
    import numba

    from normscope import numba_threads
    from normscope.kernels import numba_host

    before = torch.get_num_threads()
    x = torch.randn(256, 128, requires_grad=True)  # large enough for the parallel build (SERIAL_BELOW)
    ran = []
    original = numba_host.launch

    def spying(parallel, serial, *args, **kwargs):
        def spy(kernel, which):
            def run(*a):
                ran.append((which, numba.get_num_threads()))
                return kernel(*a)
            return run

        return original(spy(parallel, "parallel"), spy(serial, "serial"), *args, **kwargs)

    try:
        numba_host.launch = spying
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # numba's default: all of its threads
        torch.set_num_threads(1)
        norm(x, NormSpec.preset("torch_layernorm"), backend="numba").sum().backward()
        assert ran and {which for which, _ in ran} == {"serial"}  # one torch thread: the calling thread's build
        assert torch.get_num_threads() == 1 and numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS
        if numba.config.NUMBA_NUM_THREADS >= 2 and numba_threads.parallel_allowed():
            ran.clear()
            numba.set_num_threads(1)
            torch.set_num_threads(2)
            norm(x, NormSpec.preset("torch_layernorm"), backend="numba").sum().backward()
            assert ran and set(ran) == {("parallel", 2)}  # the kernels ran on torch's count
            assert torch.get_num_threads() == 2 and numba.get_num_threads() == 1
    finally:
        numba_host.launch = original
        torch.set_num_threads(before)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_runs_the_numba_kernels_serially_with_the_same_numbers():
    """GNU OpenMP terminates a forked child that launches parallel work after its parent did: the child runs each
    kernel's serial build, and gets the parent's numbers bit for bit."""
    x = torch.randn(512, 48, requires_grad=True)  # large enough for the parallel build (SERIAL_BELOW)
    spec = NormSpec.preset("torch_layernorm")
    y = norm(x, spec, backend="numba")
    (g,) = torch.autograd.grad(y.square().sum(), x)

    def child() -> bytes:
        yc = norm(x, spec, backend="numba")
        (gc,) = torch.autograd.grad(yc.square().sum(), x)
        return b"1" if torch.equal(yc, y) and torch.equal(gc, g) else b"0"

    assert in_forked_child(child) == b"1"


def test_every_parallel_kernel_is_transformed_for_parallel_execution(monkeypatch):
    """Each parallel kernel, compiled afresh for the signatures the calls below give, is transformed for parallel
    execution (:mod:`parallel_kernels`)."""
    from parallel_kernels import assert_transformed

    from normscope import numba_threads
    from normscope.kernels import numba_cpu as k

    if not numba_threads.parallel_allowed():
        pytest.skip("numba's threading layer here runs the serial builds only")
    monkeypatch.setattr(numba_threads, "SERIAL_BELOW", 0)  # the parallel builds, even for these few rows
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(8, 64, dtype=dtype, requires_grad=True)
        norm(x, NormSpec.preset("torch_layernorm"), torch.ones(64, dtype=dtype)).float().sum().backward()
    for name in ("forward_f32", "forward_16", "backward_f32", "backward_16"):
        assert_transformed(getattr(k, name), **k._OPTS)
