"""Normalization classes known without running them: torch's own, and the classes named like one."""

from __future__ import annotations

import re

import torch

_KNOWN_TORCH = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._BatchNorm,
                torch.nn.modules.instancenorm._InstanceNorm) + ((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm")
                                                               else ())
# LlamaRMSNorm, T5LayerNorm, BatchNorm2d, …, and the gated RMSNorms of state-space mixers (MambaRMSNormGated)
_KNOWN_NAME = re.compile(r"(RMS|Rms|Layer|Group|Batch|Instance)Norm(\dd)?(Gated)?$")


def known_class(module: torch.nn.Module) -> bool:
    """torch's normalization classes and the classes named like one (LlamaRMSNorm, T5LayerNorm, …) whose
    parameters are their own, as a normalization's γ and β are: a class named like a norm whose submodules hold
    parameters is a larger module (wav2vec2's ``Wav2Vec2EncoderLayerStableLayerNorm`` is a whole layer), or a
    wrapper around the norm that is found itself."""
    if isinstance(module, _KNOWN_TORCH):
        return True
    return (any(_KNOWN_NAME.search(k.__name__) for k in type(module).__mro__[:-1])
            and not any(True for child in module.children() for _ in child.parameters()))


def holds_norm(module: torch.nn.Module) -> bool:
    """Whether one of the module's submodules (not itself) is a known normalization class."""
    return any(known_class(m) for m in module.modules() if m is not module)
