"""Contracts of well-known normalization implementations.

Each preset is a function of the few knobs the implementation itself exposes (``eps``, the number of
normalized dims, ``groups``...) returning a NormSpec; any NormSpec field can then be overridden by keyword.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .errors import SpecError
from .spec import NormSpec

TORCH_FLOAT32_EPS = 1.1920928955078125e-07  # torch.finfo(torch.float32).eps: torch RMSNorm's eps=None


def _trailing(n: int) -> list[int]:
    if n < 1:
        raise SpecError(f"normalized_dims must be ≥ 1; got {n}")
    return list(range(-n, 0))


def torch_layernorm(eps: float = 1e-5, normalized_dims: int = 1, affine: bool = True, bias: bool = True):
    """torch.nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias)."""
    axes = _trailing(normalized_dims)
    return NormSpec(center=True, axes=axes, eps=eps, gamma=affine, beta=affine and bias,
                    param_axes=axes if affine else [])


def torch_rmsnorm(eps: float = TORCH_FLOAT32_EPS, normalized_dims: int = 1, affine: bool = True):
    """torch.nn.RMSNorm(normalized_shape, eps=None → finfo(float32).eps for float32 inputs)."""
    axes = _trailing(normalized_dims)
    return NormSpec(center=False, axes=axes, eps=eps, gamma=affine, beta=False,
                    param_axes=axes if affine else [])


def torch_groupnorm(groups: int = 2, eps: float = 1e-5, spatial_dims: int = 2, affine: bool = True):
    """torch.nn.GroupNorm(num_groups, num_channels) over (N, C, *spatial)."""
    axes = list(range(1, 2 + spatial_dims))
    return NormSpec(center=True, axes=axes, groups=groups, group_axis=1, eps=eps, gamma=affine,
                    beta=affine, param_axes=[1] if affine else [])


def _batchnorm(batch_stats: str, eps: float, spatial_dims: int, affine: bool, stats_dtype: str) -> NormSpec:
    axes = [0, *range(2, 2 + spatial_dims)]
    return NormSpec(center=True, axes=axes, eps=eps, gamma=affine, beta=affine,
                    param_axes=[1] if affine else [], batch_stats=batch_stats, stats_dtype=stats_dtype)


# torch's CPU batch_norm kernels keep the batch statistics of a bfloat16/float16 module in that dtype
# (measured with `normscope infer`); other devices may compute them in float32: override stats_dtype there.
def torch_batchnorm(eps: float = 1e-5, spatial_dims: int = 2, affine: bool = True):
    """torch.nn.BatchNorm{1,2,3}d in training on CPU: batch statistics over N and space, held in the input dtype."""
    return _batchnorm("batch", eps, spatial_dims, affine, "input")


def torch_batchnorm_eval(eps: float = 1e-5, spatial_dims: int = 2, affine: bool = True):
    """torch.nn.BatchNorm{1,2,3}d in evaluation: running statistics, applied in fp32."""
    return _batchnorm("running", eps, spatial_dims, affine, "float32")


def torch_instancenorm(eps: float = 1e-5, spatial_dims: int = 2, affine: bool = False):
    """torch.nn.InstanceNorm{1,2,3}d on CPU (affine=False by default; statistics held in the input dtype)."""
    return NormSpec(center=True, axes=list(range(2, 2 + spatial_dims)), eps=eps, gamma=affine,
                    beta=affine, param_axes=[1] if affine else [], stats_dtype="input")


def _rms_over_hidden(eps: float, affine_order: str, gamma_offset: float = 0.0) -> NormSpec:
    """RMSNorm over the last axis with γ only and fp32 statistics: the shape most frameworks share."""
    return NormSpec(center=False, axes=[-1], eps=eps, gamma=True, beta=False, param_axes=[-1],
                    gamma_offset=gamma_offset, stats_dtype="float32", affine_order=affine_order)


def llama_rmsnorm(eps: float = 1e-6):
    """Hugging Face LlamaRMSNorm: fp32 statistics, x̂ cast to the input dtype, then × γ."""
    return _rms_over_hidden(eps, "cast_then_scale")


def gemma_rmsnorm(eps: float = 1e-6):
    """Hugging Face GemmaRMSNorm: weight w acts as (1 + w), × in fp32, then cast."""
    return _rms_over_hidden(eps, "scale_then_cast", gamma_offset=1.0)


def t5_layernorm(eps: float = 1e-6):
    """Hugging Face T5LayerNorm: an RMSNorm without bias, fp32 statistics, cast then × γ."""
    return _rms_over_hidden(eps, "cast_then_scale")


def bert_layernorm(eps: float = 1e-12):
    """BERT's LayerNorm (torch.nn.LayerNorm with layer_norm_eps=1e-12)."""
    return torch_layernorm(eps=eps)


def gpt2_layernorm(eps: float = 1e-5):
    """GPT-2's LayerNorm (layer_norm_epsilon=1e-5)."""
    return torch_layernorm(eps=eps)


def flax_layernorm(eps: float = 1e-6):
    """flax.linen.LayerNorm: fp32 statistics with the fast (one-pass) variance, × γ in fp32 then cast."""
    return NormSpec(center=True, axes=[-1], eps=eps, variance_algorithm="one_pass", param_axes=[-1],
                    stats_dtype="float32", affine_order="scale_then_cast")


def flax_rmsnorm(eps: float = 1e-6):
    """flax.linen.RMSNorm: mean of squares in fp32, × γ in fp32 then cast."""
    return _rms_over_hidden(eps, "scale_then_cast")


def keras_layernorm(eps: float = 1e-3):
    """keras.layers.LayerNormalization (epsilon=1e-3)."""
    return torch_layernorm(eps=eps)


def onnx_layernorm(eps: float = 1e-5):
    """ONNX LayerNormalization-17 (axis=-1, stash_type=1: fp32 statistics; x̂ cast, then × scale + B)."""
    return NormSpec(center=True, axes=[-1], eps=eps, param_axes=[-1], stats_dtype="float32",
                    affine_order="cast_then_scale")


def onnx_rmsnorm(eps: float = 1e-5):
    """ONNX RMSNormalization-23 (axis=-1, stash_type=1: fp32 statistics; x̂ cast, then × scale)."""
    return _rms_over_hidden(eps, "cast_then_scale")


def onnxruntime_layernorm(eps: float = 1e-5):
    """onnxruntime's CPU LayerNormalization: as ONNX's, but × scale + B in fp32 before the one cast."""
    return onnx_layernorm(eps).replace(affine_order="scale_then_cast")


def onnxruntime_rmsnorm(eps: float = 1e-5):
    """onnxruntime's CPU RMSNormalization: as ONNX's, but × scale in fp32 before the one cast."""
    return onnx_rmsnorm(eps).replace(affine_order="scale_then_cast")


PRESETS: dict[str, Callable[..., NormSpec]] = {
    "torch_layernorm": torch_layernorm,
    "torch_rmsnorm": torch_rmsnorm,
    "torch_groupnorm": torch_groupnorm,
    "torch_batchnorm": torch_batchnorm,
    "torch_batchnorm_eval": torch_batchnorm_eval,
    "torch_instancenorm": torch_instancenorm,
    "llama_rmsnorm": llama_rmsnorm,
    "gemma_rmsnorm": gemma_rmsnorm,
    "t5_layernorm": t5_layernorm,
    "bert_layernorm": bert_layernorm,
    "gpt2_layernorm": gpt2_layernorm,
    "flax_layernorm": flax_layernorm,
    "flax_rmsnorm": flax_rmsnorm,
    "keras_layernorm": keras_layernorm,
    "onnx_layernorm": onnx_layernorm,
    "onnx_rmsnorm": onnx_rmsnorm,
    "onnxruntime_layernorm": onnxruntime_layernorm,
    "onnxruntime_rmsnorm": onnxruntime_rmsnorm,
}


def presets() -> dict[str, NormSpec]:
    """Every preset name with its default contract."""
    return {name: factory() for name, factory in PRESETS.items()}


def describe(name: str) -> str:
    """The preset's one-line origin (its docstring's first line)."""
    return (PRESETS[name].__doc__ or "").strip().splitlines()[0]


def preset(name: str, **overrides: Any) -> NormSpec:
    """The contract of a known implementation; knobs of the preset or NormSpec fields as overrides."""
    key = name.strip().lower().replace("-", "_")
    if key not in PRESETS:
        import difflib

        close = [p for p in PRESETS if key and key in p][:3] or difflib.get_close_matches(key, PRESETS, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise SpecError(f"unknown preset {name!r}.{hint} Known presets: {', '.join(PRESETS)}")
    factory = PRESETS[key]
    knobs = set(inspect.signature(factory).parameters)
    spec = factory(**{k: v for k, v in overrides.items() if k in knobs})
    fields = {k: v for k, v in overrides.items() if k not in knobs}
    return spec.replace(**fields) if fields else spec
