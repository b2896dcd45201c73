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
    """flax.linen.LayerNorm (default dtypes: fp32 parameters, ``dtype=None``): fp32 statistics with the fast
    (one-pass) variance, × γ in fp32 with γ/β kept in fp32; the output stays fp32 (promoted with the parameters)."""
    return NormSpec(center=True, axes=[-1], eps=eps, variance_algorithm="one_pass", param_axes=[-1],
                    stats_dtype="float32", affine_order="scale_then_cast", output_dtype="float32",
                    param_dtype="float32")


def flax_rmsnorm(eps: float = 1e-6):
    """flax.linen.RMSNorm (default dtypes): mean of squares in fp32, × γ in fp32 with γ kept in fp32; the output
    stays fp32."""
    return _rms_over_hidden(eps, "scale_then_cast").replace(output_dtype="float32", param_dtype="float32")


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


def knobs(name: str) -> dict[str, Any]:
    """The preset's knobs (the implementation's own arguments) with their defaults."""
    return {k: p.default for k, p in inspect.signature(PRESETS[name]).parameters.items()}


def _knob_value(text: str) -> Any:
    """A knob's value as written on the command line: a JSON number or bool (True/False too), else text."""
    import json

    if text in ("True", "False"):
        return text == "True"
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, int | float | bool) or value is None else text


def preset_from_text(text: str, shape: tuple[int, ...] | None = None) -> NormSpec:
    """``name`` or ``name:knob=value,knob=value`` (CLI ``--expect``); with ``shape``, ``spatial_dims`` follows it.

    ``torch_batchnorm`` at shape (N, C) is BatchNorm1d's contract, at (N, C, D, H, W) BatchNorm3d's: a preset
    with a ``spatial_dims`` knob that is not given takes the input's rank minus 2.
    """
    name, _, rest = text.partition(":")
    overrides: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SpecError(f"--expect {text!r}: knobs are written name:knob=value,knob=value, e.g. "
                            "torch_groupnorm:groups=32,eps=1e-6")
        overrides[key.strip()] = _knob_value(value.strip())
    spec_name = name.strip().lower().replace("-", "_")
    if spec_name in PRESETS:
        own = knobs(spec_name)
        fields = set(NormSpec.__dataclass_fields__)
        unknown = [k for k in overrides if k not in own and k not in fields]
        if unknown:
            raise SpecError(f"{spec_name} has no knob {unknown[0]!r}; its knobs are "
                            f"{', '.join(f'{k}={v}' for k, v in own.items())} (or any NormSpec field)")
        if shape is not None and "spatial_dims" in own and "spatial_dims" not in overrides and len(shape) >= 2:
            overrides["spatial_dims"] = len(shape) - 2
    try:
        return preset(name, **overrides)
    except TypeError as exc:  # a knob of the wrong type reaches the factory
        raise SpecError(f"--expect {text!r}: {exc}") from None


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
