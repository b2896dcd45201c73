"""The scan's record of a forward holds the forward's tensors only while they are used, and what an inline norm
needs to the end: its temporaries die as in the plain forward (their ids reused by later tensors), and the inline
norm written after them is still found and inferred from the values it read. Large temporaries are let go sooner
(the bytes held beyond the forward's use are bounded); large calls shaped like a norm that are none (activations)
are judged when they return and their copies let go, with the same verdicts as when judged at the end."""

from __future__ import annotations

import weakref

import torch

from normscope.sites import scan
from normscope.sites import trace as trace_module
from normscope.sites.trace import HELD_BYTES, HELD_OPS, JUDGED_BYTES, RECENT_OPS, record

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


class Decoder(torch.nn.Module):
    """A convolutional decoder at audio length: a 4 MiB activation at almost every op, an ELU (shaped like a norm,
    none) after each convolution, and one GroupNorm-like module written by hand (a norm found by behaviour)."""

    class HandNorm(torch.nn.Module):
        def forward(self, x):
            mean = x.mean(dim=(1, 2), keepdim=True)
            var = (x - mean).pow(2).mean(dim=(1, 2), keepdim=True)
            return (x - mean) / (var + 1e-5).sqrt()

    def __init__(self, layers: int = 40) -> None:
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv1d(16, 16, 3, padding=1) for _ in range(layers))
        self.acts = torch.nn.ModuleList(torch.nn.ELU() for _ in range(layers))
        self.norm = self.HandNorm()

    def forward(self, x):
        for conv, act in zip(self.convs, self.acts, strict=True):
            x = act(conv(x)) * 0.5 + x
        return self.norm(x)


def test_the_bytes_held_after_the_forwards_use_are_bounded(monkeypatch):
    monkeypatch.setattr(trace_module, "HELD_BYTES", 16 << 20)
    model = Decoder()
    x = torch.randn(1, 16, 1 << 16)  # 4 MiB per activation
    most = []
    real = trace_module.Trace._age

    def age(self):
        real(self)
        most.append(self._held_bytes)

    monkeypatch.setattr(trace_module.Trace, "_age", age)
    with torch.no_grad():
        trace, _ = record(model, lambda: model(x))
    size = x.numel() * 4
    assert max(most) <= (16 << 20) + RECENT_OPS * 2 * size, max(most) / 2**20
    assert HELD_BYTES >= 64 << 20  # the default leaves an inline norm's statistics at model widths alone
    trace.release()


def test_large_calls_shaped_like_a_norm_are_judged_when_they_return():
    model = Decoder(layers=6).eval()
    x = torch.randn(1, 16, 1 << 15)  # 2 MiB per activation
    assert x.numel() * 4 >= JUDGED_BYTES
    with torch.no_grad():
        trace, _ = record(model, lambda: model(x), judge=lambda c: 1.0)
    acts = [c for c in trace.calls if isinstance(c.module, torch.nn.ELU)]
    assert acts and all(c.x is None and c.y is None and c.judged == 1.0 for c in acts)
    trace.release()

    early = scan(model, x, dtypes="float32", progress=False)
    sites = [s.name for s in early.sites]
    assert sites == ["norm"], sites
    assert early.sites[0].spec is not None and early.sites[0].spec.eps == 1e-5


def test_judged_early_or_at_the_end_the_verdicts_are_the_same(monkeypatch):
    model = Decoder(layers=6).eval()
    x = torch.randn(1, 16, 1 << 15)
    early = scan(model, x, dtypes="float32", progress=False)
    monkeypatch.setattr(trace_module, "JUDGED_BYTES", 1 << 40)  # none judged when it returns
    late = scan(model, x, dtypes="float32", progress=False)
    assert [s.name for s in early.sites] == [s.name for s in late.sites]
    assert early.stats["behaviour_candidates_tested"] == late.stats["behaviour_candidates_tested"] > 1
