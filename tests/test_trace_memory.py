"""The scan's record of a forward holds the forward's tensors only while they are used, and what an inline norm
needs to the end: its temporaries die as in the plain forward (their ids reused by later tensors), and the inline
norm written after them is still found and inferred from the values it read."""

from __future__ import annotations

import weakref

import torch

from normscope.sites import scan
from normscope.sites.trace import HELD_OPS, record

STEPS = 3 * HELD_OPS


class Churn(torch.nn.Module):
    """A forward that makes and drops a 1 MiB temporary per step, then an inline RMSNorm (ε = 1e-5)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)
        self.weight = torch.nn.Parameter(torch.ones(64) * 1.5)
        self.made: list[weakref.ref] = []

    def forward(self, x):
        for _ in range(STEPS):
            big = self.proj(x).repeat(1, 256, 1)  # (1, 4096, 64): 1 MiB
            self.made.append(weakref.ref(big))
            x = x + 0.01 * big[:, :x.shape[1]]
        v = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(v + 1e-5) * self.weight


def test_the_forwards_temporaries_die_while_it_is_recorded():
    model = Churn()
    x = torch.randn(1, 16, 64)
    with torch.no_grad():
        trace, _ = record(model, lambda: model(x))
    alive = sum(r() is not None for r in model.made)
    assert alive <= HELD_OPS // 2, f"{alive} of {len(model.made)} temporaries kept alive by the record"
    trace.release()
    assert all(r() is None for r in model.made)


def test_an_inline_norm_after_them_is_found_and_read_from_its_values():
    model = Churn().eval()
    result = scan(model, torch.randn(1, 16, 64), dtypes="float32", progress=False)
    inline = [s for s in result.sites if "inline" in s.name]
    assert len(inline) == 1, [s.name for s in result.sites]
    spec = inline[0].spec
    assert spec is not None and spec.center is False and spec.eps == 1e-5 and spec.axes == (-1,), spec
