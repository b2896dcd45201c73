"""torch modules built from a NormSpec (requires torch)."""

from .blocks import MLP, PLACEMENTS, Attention, Block, TinyLM, deepnorm_constants
from .modules import BatchNorm, GroupNorm, LayerNorm, Norm, RMSNorm

__all__ = ["MLP", "PLACEMENTS", "Attention", "BatchNorm", "Block", "GroupNorm", "LayerNorm", "Norm", "RMSNorm",
           "TinyLM", "deepnorm_constants"]
