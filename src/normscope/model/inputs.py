"""The inputs a model is run on: the user's (copied, so nothing they passed is changed) or, for a Hugging Face
text model, a small default batch of token ids; and their description for a result."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..errors import InputError


def vocabulary_size(model: torch.nn.Module, embeddings: bool = True) -> int | None:
    """How many token ids a model takes: its own or its config's ``vocab_size`` (a multimodal config's text
    config's), else — with ``embeddings`` — the first ``nn.Embedding``'s size; None when nothing states one."""
    config = getattr(model, "config", None)
    owners = [model, config]
    if config is not None and hasattr(config, "get_text_config"):
        owners.append(config.get_text_config())
    for owner in owners:
        v = getattr(owner, "vocab_size", None)
        if isinstance(v, int) and v >= 2:
            return v
    if embeddings:
        return next((m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return None


def default_inputs(model: torch.nn.Module) -> dict[str, Any]:
    """A small batch of what a Hugging Face model's ``main_input_name`` says it takes: token ids for a text model,
    an image of the size its config states for a vision model (``pixel_values``: channels × image size²)."""
    config = getattr(model, "config", None)
    vocab = vocabulary_size(model, embeddings=False)
    main = getattr(model, "main_input_name", "input_ids")
    if config is not None and main == "pixel_values":
        size = getattr(config, "image_size", None)
        size = size[0] if isinstance(size, list | tuple) else size
        channels = getattr(config, "num_channels", 3)
        if isinstance(size, int) and isinstance(channels, int):
            return {"pixel_values": torch.zeros(1, channels, size, size, device=_device(model))}
    if config is None or vocab is None or main != "input_ids":
        raise InputError(
            f"{type(model).__name__} needs inputs: in Python pass them (scan/diff(model, inputs): a tensor, a tuple "
            "of positional arguments or a dict of keyword arguments), on the command line --shape or --inputs; "
            "only Hugging Face text models get input_ids by default")
    g = torch.Generator().manual_seed(0)
    lo = min(4, vocab - 1)
    return token_inputs(model, torch.randint(lo, min(vocab, 1000), (2, 8), generator=g))


def token_inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """Token ids as a Hugging Face model takes them: ``input_ids=`` on its device, the first ids as the decoder's
    too for an encoder–decoder, and no KV cache."""
    device = _device(model)
    kwargs: dict[str, Any] = {"input_ids": ids.to(device)}
    params = inspect.signature(model.forward).parameters
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) and "decoder_input_ids" in params:
        kwargs["decoder_input_ids"] = ids[:, :4].to(device)
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return kwargs


def _device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, tuple | list):
        return type(obj)(_clone(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


def arguments(model, inputs) -> tuple[tuple, dict[str, Any]]:
    if inputs is None:
        return (), default_inputs(model)
    if isinstance(inputs, torch.Tensor):
        return (inputs.detach().clone(),), {}
    if isinstance(inputs, tuple):
        return _clone(inputs), {}
    if isinstance(inputs, dict):
        if not all(isinstance(k, str) for k in inputs):
            raise InputError("inputs as a dict are keyword arguments: its keys must be strings")
        return (), _clone(inputs)
    raise InputError(f"inputs must be a tensor (passed positionally), a tuple (positional arguments) or a dict "
                     f"(keyword arguments); got a {type(inputs).__name__}")


def describe(args, kwargs) -> dict[str, Any]:
    def one(v):
        if isinstance(v, torch.Tensor):
            return {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
        return repr(v)[:40]
    return {"args": [one(a) for a in args], "kwargs": {k: one(v) for k, v in kwargs.items()}}
