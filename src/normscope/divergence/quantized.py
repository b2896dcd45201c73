"""Quantized candidates in ``diff``: what is common to every runtime's quantized weights.

A quantized candidate's twin is the reference with the candidate's own weights, dequantized (each runtime reads its
own packed form: :func:`.runtimes.mlx.mlx_twin`, :func:`torch_twin` for torchao's weight tensors, both through
:func:`dequantized_twin`), and each
site is judged against the twin (``Walk._judge_quantized``). Here: the check that a dequantized weight is the
reference's weight quantized (:func:`step_fault`), the notes that say what the quantization is and name a module
quantized otherwise than its peers (:func:`notes`), and the torch side (torchao).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

from ..errors import InputError
from ..model import private_copy


def role(path: str) -> str:
    """A module path with its layer indices taken out (``model.layers.3.self_attn.q_proj`` →
    ``model.layers.*.self_attn.q_proj``): the same module in every layer has one role."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def notes(kinds: dict[str, str]) -> list[str]:
    """What the candidate's quantization is (``kinds``: module path → its quantization in words), and each module
    quantized otherwise than the other modules of its role (one layer's projection at 8 bits where the rest are at
    4; a tie goes to the model's most common kind): named, since a recipe may mean it, never a verdict by itself."""
    count: dict[str, int] = defaultdict(int)
    by_role: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path, kind in kinds.items():
        count[kind] += 1
        by_role[role(path)][kind].append(path)
    what = ", ".join(f"{n} at {q}" for q, n in sorted(count.items(), key=lambda kv: -kv[1]))
    out = [f"quantized candidate: {len(kinds)} modules ({what}); each site is judged against the reference run "
           "with the candidate's own dequantized weights at the candidate's dtype (what quantization explains), "
           "within float rounding"]
    for r, types in by_role.items():
        if len(types) < 2:
            continue
        common = max(types, key=lambda q: (len(types[q]), count[q]))
        for q, paths in types.items():
            if q != common:
                out.append(f"{', '.join(paths[:3])}{' …' if len(paths) > 3 else ''} quantized at {q} where the "
                           f"{len(types[common])} other {r} are at {common}")
    return out


def per_element(values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A per-row or per-group quantity (a scale: one per row, or one per group of consecutive columns) spread over
    the weight's elements."""
    v = values.double().reshape(shape[0], -1) if values.dim() else values.double().reshape(1, 1)
    groups = v.shape[-1]
    width = -(-shape[-1] // groups)
    return v.repeat_interleave(width, dim=-1)[..., :shape[-1]].expand(shape[0], shape[-1]).reshape(shape)


def step_fault(w: torch.Tensor, reference: torch.Tensor, allowed: torch.Tensor, step: torch.Tensor) -> str | None:
    """None when every element of the dequantized weight ``w`` is within ``allowed`` (one quantization step,
    ``step``, with the rounding of the stored scales on top) of the reference's weight; else where and by how much it
    is not: the weights are not the reference's, quantized (a conversion that scaled, swapped or mis-packed a
    tensor)."""
    w, r = w.double().reshape(reference.shape), reference.detach().double()
    off = (w - r).abs() > allowed
    if not bool(off.any()):
        return None
    excess = torch.where(off, (w - r).abs() / allowed, torch.zeros_like(w))
    at = tuple(int(i) for i in torch.unravel_index(torch.argmax(excess), w.shape))
    return (f"its dequantized weight is not the reference's, quantized: {int(off.sum())} of {w.numel()} elements "
            f"further than one quantization step from the reference's (largest at {at}: {w[at].item():.4g} against "
            f"{r[at].item():.4g}, step {step[at].item():.3g}; ‖Δ‖/‖r‖ of the weight "
            f"{float((w - r).norm() / max(float(r.norm()), 1e-30)):.3g})")


# ------------------------------------------------------------------------------------------- torch (torchao)
def torch_quantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The modules whose weight is a quantized tensor that dequantizes itself (torchao's ``quantize_``: a tensor
    subclass holding ``qdata`` and ``scale``), by path."""
    out = {}
    for path, m in model.named_modules():
        w = m.__dict__.get("_parameters", {}).get("weight")
        if isinstance(w, torch.Tensor) and callable(getattr(w, "dequantize", None)) and hasattr(w, "qdata") \
                and hasattr(w, "scale"):
            out[path] = w
    return out


def undecodable(model: torch.nn.Module) -> list[str]:
    """The modules whose weight is stored as integers in a form :func:`torch_quantized` does not read
    (bitsandbytes' ``Int8Params``/``Params4bit``, a quantization library's own packing): judged against float
    bounds they would fail for their quantization alone, so the caller refuses them."""
    out = []
    for path, m in model.named_modules():
        w = m.__dict__.get("_parameters", {}).get("weight")
        if isinstance(w, torch.Tensor) and not w.is_floating_point() and not w.is_complex() \
                and not (callable(getattr(w, "dequantize", None)) and hasattr(w, "qdata")):
            out.append(f"{path} ({type(m).__name__}, {type(w).__name__} of {str(w.dtype).removeprefix('torch.')})")
    return out


def torch_kind(w: torch.Tensor) -> str:
    """A torchao weight's quantization in words: its type, the stored integer dtype and the scale's grouping."""
    groups = w.scale.numel() // max(w.shape[0], 1) if w.scale.dim() else 1
    grouping = "per row" if groups == 1 else f"{groups} groups per row"
    stored = getattr(w, "target_dtype", None) or w.qdata.dtype  # int4 values travel unpacked in int8
    return f"{type(w).__name__} ({str(stored).removeprefix('torch.')}, {grouping})"


def _activation_quantized(w: torch.Tensor) -> bool:
    """Whether the tensor also quantizes the activations it meets (torchao's dynamic-activation configs): then the
    candidate's matmul is not the dequantized weight's, and no twin reproduces it."""
    return any(getattr(w, name, None) is not None for name in ("act_quant_kwargs", "input_quant_func"))


def dequantized_twin(reference: torch.nn.Module, dtype: torch.dtype,
                     weights: Iterable[tuple[str, tuple[torch.Tensor, str]]],
                     fault: Callable[[str, torch.Tensor, torch.Tensor], str | None]
                     ) -> tuple[torch.nn.Module, dict[str, str]]:
    """The twin of a quantized candidate: a private copy of the reference at ``dtype`` whose weight at each path of
    ``weights`` ((path, (the candidate's weight there, dequantized by its runtime, its quantization in words))
    pairs, taken one at a time: a generator holds one dequantized weight at a time) is that weight; and the paths
    whose weight is not the reference's, quantized (``fault(path, dequantized, reference's weight)``: why, or None).
    Raises InputError naming a quantized module the reference has no weight of that shape for (the candidate is not
    of this model)."""
    twin = private_copy(reference, dtype=dtype)
    modules = dict(twin.named_modules())
    ref_modules = dict(reference.named_modules())
    faults: dict[str, str] = {}
    for path, (w, kind) in weights:
        target = getattr(modules.get(path), "weight", None)
        if not isinstance(target, torch.Tensor) or tuple(target.shape) != tuple(w.shape):
            have = "no module" if path not in modules else (
                "no weight" if not isinstance(target, torch.Tensor) else f"weight {list(target.shape)}")
            raise InputError(f"the candidate's quantized {path} ({kind}, dequantized {list(w.shape)}) has no "
                             f"counterpart in the reference ({have} at {path!r}): its dequantized weights cannot be "
                             "compared with the reference's module")
        why = fault(path, w, ref_modules[path].weight.detach())
        if why is not None:
            faults[path] = why
        with torch.no_grad():
            target.copy_(w.to(target.dtype))
    return twin, faults


def torch_twin(reference: torch.nn.Module, layers: dict[str, torch.Tensor], dtype: torch.dtype
               ) -> tuple[torch.nn.Module, dict[str, str]]:
    """:func:`dequantized_twin` of torchao's weights, each dequantized by its own tensor type, one step of the weight
    check being the tensor's ``scale``. Raises InputError for a weight that quantizes its activations too."""
    from ..dtypes import UNIT_ROUNDOFF

    moving = [p for p, w in layers.items() if _activation_quantized(w)]
    if moving:
        raise InputError(f"the candidate quantizes its activations at run time too ({moving[0]}: "
                         f"{type(layers[moving[0]]).__name__} with an activation quantizer): diff models weight-only "
                         "quantization, whose matmul is the dequantized weight's; compare a weight-only "
                         "quantization of the model")

    def fault(path: str, w: torch.Tensor, ref_w: torch.Tensor) -> str | None:
        q = layers[path]
        step = per_element(q.scale.detach().abs(), w.shape)
        u = UNIT_ROUNDOFF.get(str(q.scale.dtype).removeprefix("torch."), UNIT_ROUNDOFF["float32"])
        return step_fault(w, ref_w, step * (1 + 256 * u) + u * ref_w.double().abs() + 1e-30, step)

    weights = {path: (q.dequantize().detach(), torch_kind(q)) for path, q in layers.items()}
    return dequantized_twin(reference, dtype, weights.items(), fault)
