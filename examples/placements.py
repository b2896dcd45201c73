"""Build every norm placement as an 8-layer decoder, measure its gradient flow, and plot them side by side.

Run: PYTHONPATH=src .venv/bin/python examples/placements.py [out.png]
Each design is two lines: ``TinyLM(..., placement=...)`` then ``gradflow(model, loss_fn, steps=...)``. The
plot shows, per layer, the gradient norm of the attention and MLP weights and of the residual stream entering
the block, at initialisation (solid) and after 10 Adam steps at lr 3e-3 without warm-up (dashed).
"""

from __future__ import annotations

import sys

import torch

from normscope.gradient_flow import gradflow, plot_flows
from normscope.nn import PLACEMENTS, TinyLM

torch.set_num_threads(1)
ids = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))
flows = {}
for placement in PLACEMENTS:
    torch.manual_seed(0)
    model = TinyLM(vocab_size=256, d=64, n_layers=8, heads=4, placement=placement, norm="torch_layernorm")
    flows[placement] = gradflow(model, lambda m: m.loss(ids), steps=10,
                                optimizer=lambda ps: torch.optim.Adam(ps, lr=3e-3))

print(f"{'placement':<10} {'loss 0 → 10':>14}   MLP weight gradient norm per layer at init (layer 0 … 7)")
for name, flow in flows.items():
    mlp = " ".join(f"{v:.3f}" for v in flow.column("mlp"))
    print(f"{name:<10} {flow.losses[0]:6.3f} → {flow.after.loss:5.3f}   {mlp}")
out = sys.argv[1] if len(sys.argv) > 1 else "placements.png"
plot_flows(flows, out, title="8-layer decoders, d=64: gradient norm per layer, init (solid) and after 10 steps "
                             "(dashed)")
print(f"wrote {out}")
