"""Implementations the suite probes: real ones, deliberately wrong ones, and non-normalizations.

The wrong ones are the silent errors normscope exists to catch: each keeps shapes right and produces
finite numbers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

H = 64


def seed_layer_norm(x, eps=1e-6):
    """The primer's NumPy layer_norm: divides by std + eps (ε outside the square root)."""
    return (x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + eps)


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Give γ/β distinct values so the affine is observable from outside."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) + 0.5)
    return module


class UnbiasedLayerNorm(nn.Module):
    """LayerNorm with the unbiased variance (÷(d−1)), as torch.var's default would give."""

    def __init__(self, d=H, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True)  # unbiased by default
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


def sequence_axis_layernorm(x, eps=1e-5):
    """Statistics over the sequence axis (-2) instead of hidden."""
    mu = x.mean(-2, keepdim=True)
    var = x.var(-2, keepdim=True, unbiased=False)
    return (x - mu) / torch.sqrt(var + eps)


def batch_axis_layernorm(x, eps=1e-5):
    """Statistics over the batch axis (0)."""
    mu = x.mean(0, keepdim=True)
    var = x.var(0, keepdim=True, unbiased=False)
    return (x - mu) / torch.sqrt(var + eps)


class SequenceGammaLayerNorm(nn.Module):
    """γ/β indexed by the sequence axis (shape (S, 1)) instead of hidden."""

    def __init__(self, seq=8, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(seq, 1) + 0.5)
        self.bias = nn.Parameter(torch.rand(seq, 1) - 0.5)
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


def eps_outside_layernorm(x, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / (x.var(-1, keepdim=True, unbiased=False).sqrt() + eps)


def one_pass_layernorm(x, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) - mu * mu
    return (x - mu) / torch.sqrt(var.clamp_min(0) + eps)


class InputDtypeStatsRMSNorm(nn.Module):
    """RMSNorm whose statistics stay in the input dtype (no fp32 upcast)."""

    def __init__(self, d=H, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        ms = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(ms + self.eps))


class ScaleThenCastRMSNorm(nn.Module):
    """A Llama-style RMSNorm that multiplies by γ in fp32 before casting back (Gemma's order, no offset)."""

    def __init__(self, d=H, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


# Not normalizations --------------------------------------------------------------------------------
def softmax(x):
    return torch.softmax(x, -1)


def max_abs_scale(x):
    return x / x.abs().amax(-1, keepdim=True)


def causal_mean_center(x):
    """Subtracts a running (prefix) mean along the sequence: a dependency no axis set explains."""
    n = torch.arange(1, x.shape[-2] + 1, dtype=x.dtype).reshape(-1, 1)
    c = x - x.cumsum(-2) / n
    return c / (c.norm(dim=-1, keepdim=True) + 1e-6)


def numpy_tanh(x):
    return np.tanh(x)


class _LNBase(nn.Module):
    def __init__(self, d=H, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.bias = nn.Parameter(torch.rand(d) - 0.5)
        self.eps = eps


class DoubledWeightLayerNorm(_LNBase):
    """Uses 2·weight as γ: behaves like a LayerNorm, but not with its own parameter."""

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), 2 * self.weight, self.bias, self.eps)


class HalfWithoutEpsLayerNorm(_LNBase):
    """Drops ε for float16 inputs only: constant rows become NaN at half precision."""

    def forward(self, x):
        eps = 0.0 if x.dtype == torch.float16 else self.eps
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, eps)


class NoGradLayerNorm(_LNBase):
    """Right forward, no backward (computed under no_grad)."""

    def forward(self, x):
        with torch.no_grad():
            return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class ContiguousOnlyLayerNorm(_LNBase):
    """Wrong on strided views only."""

    def forward(self, x):
        y = torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return y if x.is_contiguous() else y * 1.01


class Float32InsideLayerNorm(_LNBase):
    """A correct LayerNorm that computes in float32 whatever the input dtype (float64 included)."""

    def forward(self, x):
        return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(),
                                              self.eps).to(x.dtype)


class FrozenBatchNorm2d(nn.Module):
    """torchvision-style frozen BatchNorm: statistics and affine are buffers, used the same way in both modes."""

    def __init__(self, n=4, eps=1e-5, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("weight", torch.rand(n, generator=g) + 0.5)
        self.register_buffer("bias", torch.rand(n, generator=g) - 0.5)
        self.register_buffer("running_mean", torch.randn(n, generator=g) * 2)
        self.register_buffer("running_var", torch.rand(n, generator=g) * 4 + 0.5)
        self.eps = eps

    def forward(self, x):
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        bias = self.bias - self.running_mean * scale
        return x * scale.reshape(1, -1, 1, 1) + bias.reshape(1, -1, 1, 1)


class ZeroesInputLayerNorm(_LNBase):
    """A correct LayerNorm that zeroes its input tensor after use (an in-place "free the activation" trick)."""

    def forward(self, x):
        y = torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        x.zero_()
        return y


class NondeterministicLayerNorm(_LNBase):
    """A correct LayerNorm in float32 whose reductions run in a new order on every call (as GPU atomics do):
    identical calls differ by about one float32 ulp."""

    def forward(self, x):
        h = x.float()
        perm = torch.randperm(h.shape[-1])
        hp = h[..., perm]
        mu = hp.sum(-1, keepdim=True) / h.shape[-1]
        var = ((hp - mu) ** 2).sum(-1, keepdim=True) / h.shape[-1]
        y = (h - mu) * torch.rsqrt(var + self.eps) * self.weight.float() + self.bias.float()
        return y.to(x.dtype)


def exits_layernorm(x):
    """A target whose code calls sys.exit() (a script's forward reached by accident)."""
    raise SystemExit(3)


class PerHeadLayerNorm(nn.Module):
    """qk-norm style: LayerNorm over head_dim of a (B, S, H, D) tensor, with γ/β per head and channel."""

    def __init__(self, heads=4, head_dim=16, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(heads, head_dim) + 0.5)
        self.bias = nn.Parameter(torch.rand(heads, head_dim) - 0.5)
        self.eps = eps

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=self.eps) * self.weight + self.bias

# Written the way other people write them: each is correct for its contract unless its docstring says otherwise.
class NanAtHalfLayerNorm(nn.LayerNorm):
    """Right at float32; returns NaN at float16/bfloat16 (a broken half-precision path)."""

    def forward(self, x):
        y = super().forward(x)
        return y if x.dtype in (torch.float32, torch.float64) else y * float("nan")


class RaisesAtHalfLayerNorm(nn.LayerNorm):
    """Right at float32; refuses half precision with an error that names the dtype."""

    def forward(self, x):
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype {x.dtype} is not supported")
        return super().forward(x)


class BFloat16OnlyLayerNorm(nn.LayerNorm):
    """Runs at bfloat16 only: γ/β can only be matched at bfloat16's resolution."""

    def forward(self, x):
        if x.dtype != torch.bfloat16:
            raise TypeError("bfloat16 only")
        return super().forward(x)


class MomentumBatchNorm(nn.BatchNorm2d):
    """A BatchNorm2d whose running statistics move by ``factor`` although it states momentum 0.1."""

    def __init__(self, channels=4, factor=0.0):
        super().__init__(channels)
        self.factor = factor

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(1 - self.factor).add_(self.factor * x.mean((0, 2, 3)))
                self.running_var.mul_(1 - self.factor).add_(self.factor * x.var((0, 2, 3)))
            return nn.functional.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        return super().forward(x)


def trained_batchnorm(channels=4, steps=20, seed=0) -> nn.BatchNorm2d:
    """BatchNorm2d after ``steps`` training steps on N(2, 3²) data, in evaluation mode."""
    g = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm2d(channels)
    for _ in range(steps):
        bn(torch.randn(8, channels, 5, 5, generator=g) * 3 + 2)
    return bn.eval()


class RsqrtLayerNorm(nn.Module):
    """An eager LayerNorm in the input dtype that multiplies by rsqrt (no fp32 upcast)."""

    def __init__(self, d=H, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.bias = nn.Parameter(torch.rand(d) - 0.5)
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        xc = x - mu
        var = (xc * xc).mean(-1, keepdim=True)
        return xc * torch.rsqrt(var + self.eps) * self.weight + self.bias


class FoldedAffineLayerNorm(nn.Module):
    """fp32 statistics with the affine folded into one multiply-add, y = x·a + b, then one cast."""

    def __init__(self, d=H, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.bias = nn.Parameter(torch.rand(d) - 0.5)
        self.eps = eps

    def forward(self, x):
        h = x.float()
        mu = h.mean(-1, keepdim=True)
        var = (h - mu).pow(2).mean(-1, keepdim=True)
        a = self.weight.float() * torch.rsqrt(var + self.eps)
        b = self.bias.float() - mu * a
        return (h * a + b).to(x.dtype)


class FoldedInputDtypeLayerNorm(_LNBase):
    """Eager code in the input dtype with the affine folded: a = γ·rsqrt(v + ε), b = β − μ·a, y = x·a + b."""

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        a = self.weight * torch.rsqrt(var + self.eps)
        return x * a + (self.bias - mu * a)


class PerGroupAffineGroupNorm(nn.Module):
    """GroupNorm whose scale and bias are per group (shape (G,)), as older ONNX GroupNormalization had."""

    def __init__(self, groups=2, channels=4, eps=1e-5):
        super().__init__()
        self.groups, self.channels, self.eps = groups, channels, eps
        self.weight = nn.Parameter(torch.rand(groups) + 0.5)
        self.bias = nn.Parameter(torch.rand(groups) - 0.5)

    def forward(self, x):
        rep = self.channels // self.groups
        w = self.weight.repeat_interleave(rep)
        b = self.bias.repeat_interleave(rep)
        return nn.functional.group_norm(x, self.groups, w, b, self.eps)


class RefusesNonFiniteLayerNorm(nn.LayerNorm):
    """Validates its input and raises on NaN/Inf, as data-validation code does."""

    def forward(self, x):
        if not torch.isfinite(x).all():
            raise ValueError("input contains NaN or Inf")
        return super().forward(x)


def scaled_layer_norm(x, gain=1.7):
    """A LayerNorm with one scalar gain (param_axes=[]): what infer reports for a constant γ."""
    return gain * nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5)


class NoisyLayerNorm(nn.LayerNorm):
    """A correct LayerNorm whose outputs move by about an ulp between calls (non-deterministic reductions)."""

    def forward(self, x):
        y = super().forward(x)
        step = torch.randint(-1, 2, y.shape).to(y.dtype)
        return y * (1 + step * torch.finfo(y.dtype).eps)
