"""Contiguous memory the tracer reuses while steps in a row are recorded (a parameter's copy before the optimizer
step, the attention recompute's operands and logits): fresh memory each step would cost its page faults."""

from __future__ import annotations

from typing import Any

import torch


class Buffers:
    def __init__(self) -> None:
        self._store: dict[Any, torch.Tensor] = {}

    def __call__(self, key, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        b = self._store.get(key)
        if b is None or b.shape != shape or b.dtype != dtype or b.device != device:
            b = self._store[key] = torch.empty(shape, dtype=dtype, device=device)
        return b

    def clear(self) -> None:
        self._store.clear()
