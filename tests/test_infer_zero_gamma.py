"""``infer`` on a normalization whose γ is zero.

A γ of zero is a standard initialisation (the last BatchNorm of a residual block under ``zero_init_residual``, a
zero-initialised LayerNorm γ) and a trained channel that died. It moves no output, so no experiment saw the
normalization and ``infer`` answered "not a normalization" (exit 3), while ``scan`` probed its private copy with
re-drawn parameters and found the contract. Both now re-draw the same way (one home, ``targets.base.redraw``):
``infer`` probes its own private copy with re-drawn vector parameters, reports γ/β as the module's own (zero) and
validates the contract with them.
"""

from __future__ import annotations

import contextlib
import io
import os

import numpy as np
import pytest
import torch

import normscope
from normscope.errors import NotANormalization

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _zero_gamma(m: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        m.weight.zero_()
    return m


def _bias(m: torch.nn.Module) -> torch.nn.Module:
    """A β that is not zero, so it is seen to come back as the module's own."""
    with torch.no_grad():
        m.bias.copy_(torch.linspace(-1.0, 1.0, m.bias.numel()))
    return m


def _batchnorm() -> torch.nn.Module:
    bn = torch.nn.BatchNorm2d(4)
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
        bn.running_var.copy_(torch.tensor([1.0, 4.0, 0.25, 2.0]))
    return bn.eval()


# torch's own normalizations with γ zeroed: the module and the shape it is probed at
TORCH = {
    "LayerNorm": (lambda: torch.nn.LayerNorm(8), (4, 8)),
    "BatchNorm2d": (_batchnorm, (2, 4, 3, 3)),
    "GroupNorm": (lambda: torch.nn.GroupNorm(2, 4), (2, 4, 3, 3)),
}


def zeroed(kind: str = "LayerNorm") -> torch.nn.Module:
    """A command-line factory (``test_infer_zero_gamma:zeroed``): torch's ``kind`` with γ zeroed."""
    return _zero_gamma(_bias(TORCH[kind][0]()))


def _same_contract(module: torch.nn.Module, shape: tuple[int, ...]):
    """The module's inference with γ zeroed, beside the inference of the same module as it was."""
    expected = normscope.infer(module, shape=shape, progress=None)
    before = module.weight.detach().clone()
    _zero_gamma(module)
    got = normscope.infer(module, shape=shape, progress=None)
    assert torch.equal(module.weight, torch.zeros_like(before)), "the module passed is untouched"
    assert got.spec == expected.spec, (got.spec.summary(), expected.spec.summary())
    assert "parameters_probed" in got.evidence and got.evidence["parameters_probed"].measured["parameters"]
    np.testing.assert_allclose(got.params.gamma, 0.0, atol=1e-12)  # the module's own γ, not the drawn one
    assert got.validation["max_relative_error"] <= got.validation["tolerance"]
    return got, expected


@pytest.mark.parametrize("kind", list(TORCH))
def test_a_torch_norm_with_zero_gamma_is_inferred(kind):
    build, shape = TORCH[kind]
    module = _bias(build())
    got, _ = _same_contract(module, shape)
    np.testing.assert_allclose(got.params.beta, module.bias.detach().double().numpy(), atol=1e-9)
    if kind == "BatchNorm2d":  # the running statistics are read through the re-drawn copy and are the module's own
        np.testing.assert_allclose(got.params.running_var, module.running_var.double().numpy(), rtol=1e-6)


transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def test_the_norms_of_real_architectures_with_zero_gamma_are_inferred():
    """A Llama's RMSNorm (γ only: with γ = 0 its output is all zeros), and the last BatchNorm of a ResNet block, which
    ``zero_init_residual`` (torchvision's, timm's) initialises to γ = 0 so each block starts as the identity."""
    torch.manual_seed(0)
    llama = transformers.LlamaModel(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, pad_token_id=0))
    got, _ = _same_contract(llama.layers[0].input_layernorm, (2, 4, 32))
    assert got.spec.kind == "rmsnorm" and got.spec.eps == pytest.approx(1e-5, rel=0.01)

    resnet = transformers.ResNetModel(transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")).eval()
    last = resnet.encoder.stages[0].layers[0].layer[-1].normalization
    with torch.no_grad():
        last.running_var.uniform_(0.5, 2.0)
    got, _ = _same_contract(last, (2, 8, 4, 4))
    assert got.spec.kind == "batchnorm" and got.spec.batch_stats == "running"

    # the whole model under zero_init_residual: scan finds every block's last BatchNorm with its contract and γ = 0
    for stage in resnet.encoder.stages:
        for layer in stage.layers:
            _zero_gamma(layer.layer[-1].normalization)
    r = normscope.scan(resnet, torch.randn(2, 3, 32, 32), dtypes="float32", progress=False)
    zero = [s for s in r.sites if s.gamma and s.gamma["max"] == 0 == s.gamma["min"]]
    assert [s.name for s in zero] == ["encoder.stages.0.layers.0.layer.1.normalization",
                                      "encoder.stages.1.layers.0.layer.1.normalization"]
    assert all(s.spec.kind == "batchnorm" and s.activation["ok"] for s in zero) and r.findings == []


def test_not_a_normalization_is_still_refused_after_the_redraw():
    """A module with vector parameters that is no normalization fails again on the re-drawn copy: both reasons."""
    with pytest.raises(NotANormalization, match=r"\(and with re-drawn parameters: "):
        normscope.infer(torch.nn.PReLU(8), shape=(4, 8), progress=None)


def _cli(*argv: str) -> tuple[int, str]:
    from normscope import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(list(argv))
    return code, " ".join(out.getvalue().split())


@pytest.mark.parametrize("kind, shape, words", [
    ("LayerNorm", "4,8", "LayerNorm over [-1], ε=1e-05 inside √, biased two-pass, γ β over [-1]"),
    ("GroupNorm", "2,4,3,3", "GroupNorm over [1, 2, 3] in 2 groups along axis 1, ε=1e-05 inside √"),
])
def test_cli_infer_of_a_zero_gamma_is_its_contract_not_exit_3(kind, shape, words):
    code, out = _cli("infer", "test_infer_zero_gamma:zeroed", "--args", f'["{kind}"]', "--shape", shape)
    assert code == 0, out
    assert words in out and "parameters_probed" in out, out
    code, out = _cli("infer", "torch.nn:PReLU", "--args", "[8]", "--shape", "4,8")
    assert code == 3 and "not a normalization" in out
