"""torch modules built from a NormSpec (requires torch)."""

from .modules import BatchNorm, GroupNorm, LayerNorm, Norm, RMSNorm

__all__ = ["BatchNorm", "GroupNorm", "LayerNorm", "Norm", "RMSNorm"]
