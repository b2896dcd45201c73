"""Swap a model's norm layers for normscope's fused kernels, and check each swap with the battery.

    PYTHONPATH=src python examples/swap_norms.py

1. ``normscope.scan`` finds every norm site of the model and infers its contract (a NormSpec);
2. each site whose contract a row kernel honours becomes ``normscope.nn.Norm(spec, shape, backend="auto")``
   with the site's own γ/β (numba on the CPU, Triton on CUDA); the others are left as they are;
3. ``normscope.check`` runs the acceptance battery on each new module against the site's contract, forward
   and backward, at float32, float16 and bfloat16; and the model's output is compared before and after.
"""

from __future__ import annotations

import torch
from torch import nn

import normscope
from normscope.kernels import unsupported
from normscope.nn import Norm


class Block(nn.Module):
    """A pre-norm transformer-style block with two different norm contracts."""

    def __init__(self, d: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d, eps=1e-6)
        self.mlp_norm = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h):
        h = h + self.mix(self.attn_norm(h))
        return h + self.mlp(self.mlp_norm(h))


def swap_norms(model: nn.Module, inputs, backend: str = "auto"):
    """Replace every norm site the kernels can honour; return [(site name, spec, new module)]."""
    found = normscope.scan(model, inputs, progress=False)
    swapped = []
    for site in found.sites:
        if site.spec is None:
            continue
        old = model.get_submodule(site.name)
        reason = unsupported(site.spec, len(site.shape), "float32")
        if reason is not None:
            print(f"  {site.name}: kept ({reason})")
            continue
        weight, bias = getattr(old, "weight", None), getattr(old, "bias", None)
        new = Norm(site.spec, site.shape[-1] if (site.spec.gamma or site.spec.beta) else (), backend=backend)
        with torch.no_grad():
            if new.weight is not None:
                new.weight.copy_(weight)
            if new.bias is not None:
                new.bias.copy_(bias)
        parent_name, _, child = site.name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        swapped.append((site.name, site.spec, new, site.shape))
    return swapped


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(64), Block(64)).eval()
    with torch.no_grad():  # trained-looking γ/β, so the check sees them
        for m in model.modules():
            if isinstance(m, nn.RMSNorm | nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.2, 0.2)
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        before = model(x)
    swapped = swap_norms(model, x)
    for name, spec, new, shape in swapped:
        report = normscope.check(new, expect=spec, shape=shape, quick=False)
        counts = {s: sum(f.status == s for f in report.findings) for s in ("pass", "fail", "skip")}
        print(f"  {name}: {spec.summary()}\n    → Norm(backend={new.backend!r}), check {'ok' if report.ok else 'FAILED'} "
              f"at {', '.join(report.dtypes_run)}: {counts['pass']} passed, {counts['fail']} failed, "
              f"{counts['skip']} skipped")
    with torch.no_grad():
        after = model(x)
    print(f"model output before vs after the swap: max |difference| {(after - before).abs().max().item():.3g} "
          f"(float32, max |output| {before.abs().max().item():.3g})")


if __name__ == "__main__":
    main()
