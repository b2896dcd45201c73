"""torch modules built from a NormSpec: agreement with the reference (float64 values and gradients, bit-exact
low precision) and with the torch.nn layers they stand for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from normscope import InputError, NormSpec
from normscope import reference as R
from normscope.nn import BatchNorm, GroupNorm, LayerNorm, Norm, RMSNorm
from normscope.presets import PRESETS

PRESET_NAMES = sorted(PRESETS)
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _input_shape(spec: NormSpec) -> tuple[int, ...]:
    return (3, 5, 64) if all(a < 0 for a in spec.axes) else (3, 4, 6, 5)


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().to(torch.float64).numpy()


def _module(spec: NormSpec, shape, rng: np.random.Generator, *, eval_mode: bool = False) -> Norm:
    """A float64 Norm with random weight, bias and running statistics."""
    pshape = R.param_shape(shape, spec)
    module = Norm(spec, pshape, dtype=torch.float64)
    with torch.no_grad():
        if module.weight is not None:
            module.weight.copy_(torch.from_numpy(rng.normal(size=pshape) * 0.7 + 0.5))
        if module.bias is not None:
            module.bias.copy_(torch.from_numpy(rng.normal(size=pshape)))
        if module.running_mean is not None:
            module.running_mean.copy_(torch.from_numpy(rng.normal(size=module.running_mean.shape)))
            module.running_var.copy_(torch.from_numpy(rng.uniform(0.3, 3.0, size=module.running_var.shape)))
    if eval_mode:
        module.eval()
    return module


def _reference_kwargs(module: Norm) -> dict:
    kwargs = dict(gamma=_np(module.weight), beta=_np(module.bias))
    if module.spec.batch_stats == "running":
        kwargs.update(running_mean=_np(module.running_mean), running_var=_np(module.running_var))
    return kwargs


# ------------------------------------------------------------------------------------------ float64
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_float64_forward_and_gradients_match_reference(name, rng):
    spec = NormSpec.preset(name)
    shape = _input_shape(spec)
    module = _module(spec, shape, rng, eval_mode=spec.batch_stats == "running")
    assert module.spec == spec
    x_np = rng.normal(size=shape) * 2 + 0.5
    dy = rng.normal(size=shape)
    x = torch.tensor(x_np, requires_grad=True)
    y = module(x)
    assert y.dtype == torch.float64 and y.shape == x.shape
    kwargs = _reference_kwargs(module)
    want = R.forward(x_np, spec, **kwargs)
    np.testing.assert_allclose(_np(y), want, rtol=1e-12, atol=1e-12)
    (y * torch.from_numpy(dy)).sum().backward()
    dx, dgamma, dbeta = R.backward(x_np, dy, spec, **kwargs)
    np.testing.assert_allclose(_np(x.grad), dx, rtol=1e-10, atol=1e-10)
    if spec.gamma:
        np.testing.assert_allclose(_np(module.weight.grad), dgamma, rtol=1e-10, atol=1e-10)
    else:
        assert module.weight is None and dgamma is None
    if spec.beta:
        np.testing.assert_allclose(_np(module.bias.grad), dbeta, rtol=1e-10, atol=1e-10)
    else:
        assert module.bias is None and dbeta is None


@pytest.mark.parametrize("name", ["torch_layernorm", "torch_rmsnorm", "gemma_rmsnorm", "torch_groupnorm"])
def test_default_parameters_are_identity(name, rng):
    spec = NormSpec.preset(name)
    shape = _input_shape(spec)
    module = Norm(spec, R.param_shape(shape, spec), dtype=torch.float64)
    x = rng.normal(size=shape)
    np.testing.assert_allclose(_np(module(torch.from_numpy(x))), R.forward(x, spec), rtol=1e-12, atol=1e-12)
    if spec.gamma_offset:
        np.testing.assert_array_equal(_np(module.weight), 1.0 - spec.gamma_offset)


# ------------------------------------------------------------------------------------------ low precision
@pytest.mark.parametrize("affine_order", ["cast_then_scale", "scale_then_cast"])
@pytest.mark.parametrize("stats_dtype", ["float32", "input"])
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_low_precision_bit_exact(name, dtype, stats_dtype, affine_order, rng):
    spec = NormSpec.preset(name, stats_dtype=stats_dtype, affine_order=affine_order)
    shape = _input_shape(spec)
    module = _module(spec, shape, rng, eval_mode=spec.batch_stats == "running").to(TORCH_DTYPES[dtype])
    x = torch.from_numpy(rng.normal(size=shape) * 3 + 1.0).to(TORCH_DTYPES[dtype])
    with torch.no_grad():
        y = module(x)
    promoted = spec.output_dtype == "float32" and dtype != "float32"  # flax's contract returns fp32
    assert y.dtype == (torch.float32 if promoted else TORCH_DTYPES[dtype])
    want = R.forward(_np(x), spec, dtype=dtype, **_reference_kwargs(module))
    got = _np(y)
    assert np.array_equal(got, want), f"{np.sum(got != want)} of {got.size} values differ"


@pytest.mark.parametrize("affine_order", ["cast_then_scale", "scale_then_cast"])
@pytest.mark.parametrize("stats_dtype", ["float32", "input"])
@pytest.mark.parametrize("name", ["torch_layernorm", "gemma_rmsnorm", "torch_groupnorm", "torch_batchnorm_eval"])
def test_float32_parameters_with_bf16_input_bit_exact(name, stats_dtype, affine_order, rng):
    """Parameters kept in float32 (mixed precision) are used as the input dtype sees them."""
    spec = NormSpec.preset(name, stats_dtype=stats_dtype, affine_order=affine_order)
    shape = _input_shape(spec)
    module = _module(spec, shape, rng, eval_mode=spec.batch_stats == "running").float()
    x = torch.from_numpy(rng.normal(size=shape) * 3 + 1.0).to(torch.bfloat16)
    with torch.no_grad():
        y = module(x)
    assert y.dtype == torch.bfloat16
    want = R.forward(_np(x), spec, dtype="bfloat16", **_reference_kwargs(module))
    got = _np(y)
    assert np.array_equal(got, want), f"{np.sum(got != want)} of {got.size} values differ"


def test_low_precision_variants_are_distinguishable(rng):
    """The bit-exact agreement above is meaningful: the variants give different bf16 outputs here."""
    shape = (3, 5, 64)
    outs = {}
    x = torch.from_numpy(256.0 + 4.0 * rng.normal(size=shape)).to(torch.bfloat16)
    weight = torch.from_numpy(rng.normal(size=64) * 3 + 1)
    for sd in ("float32", "input"):
        for order in ("cast_then_scale", "scale_then_cast"):
            module = Norm(NormSpec.preset("torch_layernorm", stats_dtype=sd, affine_order=order), 64)
            with torch.no_grad():
                module.weight.copy_(weight)
            module = module.to(torch.bfloat16)
            with torch.no_grad():
                outs[sd, order] = _np(module(x))
    assert not np.array_equal(outs["float32", "cast_then_scale"], outs["float32", "scale_then_cast"])
    assert not np.array_equal(outs["float32", "scale_then_cast"], outs["input", "scale_then_cast"])
    np.testing.assert_array_equal(outs["input", "cast_then_scale"], outs["input", "scale_then_cast"])


# ------------------------------------------------------------------------------------------ torch.nn parity
def _copy_params(ours: Norm, theirs: torch.nn.Module, rng: np.random.Generator) -> None:
    with torch.no_grad():
        w = torch.from_numpy(rng.normal(size=tuple(ours.weight.shape)) * 0.5 + 1.0)
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
        if ours.bias is not None:
            b = torch.from_numpy(rng.normal(size=tuple(ours.bias.shape)))
            ours.bias.copy_(b)
            theirs.bias.copy_(b)


def _assert_same_forward_backward(ours, theirs, x_np, rng, tol):
    dy = torch.from_numpy(rng.normal(size=x_np.shape)).to(torch.get_default_dtype())
    results = []
    for module in (ours, theirs):
        x = torch.tensor(x_np, dtype=module.weight.dtype, requires_grad=True)
        y = module(x)
        (y * dy.to(y.dtype)).sum().backward()
        bias = getattr(module, "bias", None)
        results.append((y.detach(), x.grad, module.weight.grad, None if bias is None else bias.grad))
    for a, b in zip(*results, strict=True):
        if a is None:
            assert b is None
            continue
        a, b = _np(a), _np(b)
        # relative to the largest magnitude, so float32 gradients of size ~1e3 are judged fairly
        assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()), np.abs(a - b).max()


@pytest.mark.parametrize("normalized_shape", [(64,), (5, 64)], ids=["1d", "2d"])
def test_layernorm_matches_torch(normalized_shape, rng):
    ours = LayerNorm(normalized_shape).double()
    theirs = torch.nn.LayerNorm(normalized_shape, dtype=torch.float64)
    assert ours.spec == NormSpec.preset("torch_layernorm", normalized_dims=len(normalized_shape))
    _copy_params(ours, theirs, rng)
    _assert_same_forward_backward(ours, theirs, rng.normal(size=(3, 5, 64)) * 2 + 1, rng, 1e-10)


def test_layernorm_without_bias_matches_torch(rng):
    ours = LayerNorm(64, eps=1e-3, bias=False).double()
    theirs = torch.nn.LayerNorm(64, eps=1e-3, bias=False, dtype=torch.float64)
    assert ours.bias is None
    _copy_params(ours, theirs, rng)
    _assert_same_forward_backward(ours, theirs, rng.normal(size=(3, 5, 64)), rng, 1e-10)


def test_rmsnorm_default_matches_torch_eps_none_at_float32(rng):
    ours = RMSNorm(64)
    theirs = torch.nn.RMSNorm(64, eps=None)
    assert ours.spec == NormSpec.preset("torch_rmsnorm")
    assert ours.weight.dtype == torch.float32
    _copy_params(ours, theirs, rng)
    # small inputs make the float32-eps ε visible: with another ε the outputs would differ by more than 1e-6
    x_np = rng.normal(size=(3, 5, 64)) * 1e-3
    _assert_same_forward_backward(ours, theirs, x_np, rng, 1e-6)


def test_rmsnorm_matches_torch_float64(rng):
    ours = RMSNorm(64, eps=1e-6).double()
    theirs = torch.nn.RMSNorm(64, eps=1e-6, dtype=torch.float64)
    _copy_params(ours, theirs, rng)
    _assert_same_forward_backward(ours, theirs, rng.normal(size=(3, 5, 64)) + 0.5, rng, 1e-10)


def test_groupnorm_matches_torch(rng):
    ours = GroupNorm(2, 4).double()
    theirs = torch.nn.GroupNorm(2, 4, dtype=torch.float64)
    assert ours.spec.kind == "groupnorm" and ours.spec.groups == 2
    _copy_params(ours, theirs, rng)
    _assert_same_forward_backward(ours, theirs, rng.normal(size=(3, 4, 6, 5)) * 3 - 1, rng, 1e-10)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum0.1", "cumulative"])
def test_batchnorm_matches_torch_train_running_stats_and_eval(momentum, rng):
    ours = BatchNorm(4, momentum=momentum).double()
    theirs = torch.nn.BatchNorm2d(4, momentum=momentum, dtype=torch.float64)
    _copy_params(ours, theirs, rng)
    ours.train()
    theirs.train()
    for step in range(3):
        x_np = rng.normal(size=(3, 4, 6, 5)) * (step + 1) + step
        _assert_same_forward_backward(ours, theirs, x_np, rng, 1e-10)
        np.testing.assert_allclose(_np(ours.running_mean), _np(theirs.running_mean), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_np(ours.running_var), _np(theirs.running_var), rtol=1e-10, atol=1e-12)
        assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == step + 1
    assert not np.allclose(_np(ours.running_mean), 0.0)  # the running statistics did move
    ours.eval()
    theirs.eval()
    _assert_same_forward_backward(ours, theirs, rng.normal(size=(3, 4, 6, 5)) * 2 + 1, rng, 1e-10)
    # eval mode must not touch the running statistics
    before = _np(ours.running_mean).copy()
    with torch.no_grad():
        ours(torch.from_numpy(rng.normal(size=(3, 4, 6, 5))))
    np.testing.assert_array_equal(_np(ours.running_mean), before)


def test_batchnorm_float32_matches_torch(rng):
    ours = BatchNorm(4)
    theirs = torch.nn.BatchNorm2d(4)
    _copy_params(ours, theirs, rng)
    _assert_same_forward_backward(ours, theirs, rng.normal(size=(3, 4, 6, 5)) * 2 + 1, rng, 1e-5)
    np.testing.assert_allclose(_np(ours.running_var), _np(theirs.running_var), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------ spec and errors
def test_batchnorm_spec_follows_mode():
    module = BatchNorm(4)
    assert module.training
    assert module.spec.batch_stats == "batch"
    module.eval()
    assert module.spec.batch_stats == "running"
    assert module.spec == NormSpec.preset("torch_batchnorm_eval")
    module.train()
    assert module.spec.batch_stats == "batch"
    assert module.spec == NormSpec.preset("torch_batchnorm", stats_dtype="float32")
    assert BatchNorm(4, stats_dtype="input").spec == NormSpec.preset("torch_batchnorm")
    # specs without batch statistics are returned as given, in any mode
    spec = NormSpec.preset("llama_rmsnorm")
    ln = Norm(spec, 8).eval()
    assert ln.spec is spec


def test_extra_repr_mentions_summary():
    assert NormSpec.preset("llama_rmsnorm").summary() in repr(Norm(NormSpec.preset("llama_rmsnorm"), 8))


@pytest.mark.parametrize(
    "spec, shape",
    [
        (NormSpec.preset("torch_layernorm"), (4, 64)),
        (NormSpec.preset("torch_layernorm", normalized_dims=2), 64),
        (NormSpec.preset("torch_groupnorm"), (4, 2)),
        (NormSpec.preset("llama_rmsnorm"), ()),
    ],
    ids=["ln-2-sizes", "ln2d-1-size", "gn-2-sizes", "rms-no-size"],
)
def test_wrong_shape_raises(spec, shape):
    with pytest.raises(InputError, match="shape"):
        Norm(spec, shape)


def test_other_module_errors():
    with pytest.raises(InputError, match="NormSpec"):
        Norm("layernorm", 8)
    with pytest.raises(InputError, match="floating-point"):
        Norm(NormSpec.preset("torch_layernorm"), 8)(torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(InputError, match="groups"):
        GroupNorm(2, 5)(torch.ones(2, 5, 3, 3))
