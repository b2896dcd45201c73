"""Random weights for a model built only to be read: large fills drawn as windows of one random block.

A model that ``contract`` builds with values (its forward reads them) spends most of its build drawing random
numbers: every ``nn.Linear`` draws its weight in its constructor, and a Hugging Face model draws it again in
``post_init`` (a 410 M-parameter build: 5.1 s of CPU, 1.5 s with this). Inside :func:`window_draws`,
``Tensor.uniform_`` and ``Tensor.normal_`` on a large contiguous CPU float tensor copy windows at random offsets of
one block of independent draws (of the same distribution: scaled and shifted as asked), 2¹⁸ elements at a time:
each window's elements are independent draws, and the offsets come from torch's generator, so a seeded build is
reproducible. A norm's contract does not depend on the weights before it; what the read needs of them is values
of the usual scale. Small tensors, other devices and dtypes, and fills given a generator draw as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: elements per window (1 MiB of float32: a window is copied, scaled and shifted while it is in cache)
WINDOW = 1 << 18
#: tensors smaller than this draw as usual
LEAST = 1 << 16
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@contextlib.contextmanager
def window_draws() -> Iterator[None]:
    """Within: large CPU float fills by ``uniform_``/``normal_`` from windows of one drawn block (see the module)."""
    uniform, normal = torch.Tensor.uniform_, torch.Tensor.normal_
    blocks = {"uniform": torch.rand(2 * WINDOW), "normal": torch.randn(2 * WINDOW)}

    def fill(t: torch.Tensor, block: torch.Tensor, scale: float, shift: float) -> bool:
        if (t.device.type != "cpu" or t.dtype not in _FLOATS or t.numel() < LEAST or not t.is_contiguous()
                or t.requires_grad and torch.is_grad_enabled()):
            return False  # drawn as usual (an in-place fill of a leaf that requires grad raises there, as it should)
        flat = t.view(-1)
        offsets = torch.randint(WINDOW, (-(-flat.numel() // WINDOW),)).tolist()
        with torch.no_grad():
            for i, off in enumerate(offsets):
                piece = flat[i * WINDOW:(i + 1) * WINDOW]
                piece.copy_(block[off:off + piece.numel()]).mul_(scale).add_(shift)
        return True

    def uniform_(self, a=0.0, b=1.0, *, generator=None):
        if generator is None and fill(self, blocks["uniform"], b - a, a):
            return self
        return uniform(self, a, b, generator=generator)

    def normal_(self, mean=0.0, std=1.0, *, generator=None):
        if generator is None and fill(self, blocks["normal"], std, mean):
            return self
        return normal(self, mean, std, generator=generator)

    torch.Tensor.uniform_, torch.Tensor.normal_ = uniform_, normal_
    try:
        yield
    finally:
        torch.Tensor.uniform_, torch.Tensor.normal_ = uniform, normal
