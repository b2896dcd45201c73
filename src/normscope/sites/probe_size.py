"""A smaller input to infer a site's contract on, where its recorded activation is large.

A site in a vision model sees activations of millions of elements (a 600×600 image's first stage), and inference
calls the module a few dozen times on inputs of that shape. Most of those axes carry independent rows: a
BatchNorm in evaluation mode or a LayerNorm over channels computes each position from that position alone. An
axis is cut when the module shows it by experiment: on the first ``CUT_TO`` entries along that axis of an input
with ``2 · CUT_TO`` there, it returns exactly the first ``CUT_TO`` entries of its output on that input. An axis
the statistics read (GroupNorm's spatial axes, a batch statistic) changes the output when cut and is kept; an
axis the module's parameters are shaped by refuses the cut input and is kept. In the module's own mode the size
of every statistic is therefore unchanged (a BatchNorm probed in training mode sees a smaller batch: its
contract does not depend on the batch's size), and the contract inferred on the smaller input is the module's
contract on the recorded one. A site with values is still held to its whole recorded activation afterwards.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..layout import Layout
from ..report.numbers import sig

BUDGET = 1 << 16  # elements: an input this small is probed as recorded
CUT_TO = 8  # entries kept along a cut axis
#: largest relative difference between the cut input's output and the cut output, by input dtype: rounding of
#: the same arithmetic in another vectorization; an axis the statistics read moves the output by percents
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


def smaller_shape(module: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype
                  ) -> tuple[tuple[int, ...], dict[str, Any] | None]:
    """The shape to infer ``module`` on for a recorded input of ``shape`` and ``dtype``, and the evidence of the
    cut (None where the recorded shape is kept: small already, a 16-bit dtype, a module in training mode, or no
    axis that can be cut)."""
    if math.prod(shape) <= BUDGET or dtype not in TOLERANCE or module.training:  # training: calls change its state
        return shape, None
    device = next((t.device for t in list(module.parameters()) + list(module.buffers())), torch.device("cpu"))
    if device.type == "meta":
        return shape, None
    gen = torch.Generator(device="cpu").manual_seed(0)
    sizes = list(shape)
    cut: list[dict[str, Any]] = []
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if math.prod(sizes) <= BUDGET:
            break
        if sizes[axis] < 2 * CUT_TO:
            continue
        # the module on 2·CUT_TO entries along the axis, and on the first CUT_TO of them
        x = torch.randn([2 * CUT_TO if a == axis else n for a, n in enumerate(sizes)], generator=gen,
                        dtype=dtype).to(device)
        xc = x.narrow(axis, 0, CUT_TO).contiguous()
        try:
            with torch.no_grad():
                y, yc = module(x), module(xc)
        except Exception:
            cut.append({"axis": axis, "size": shape[axis], "kept": "the module refuses an input cut along it"})
            continue
        if not (isinstance(y, torch.Tensor) and isinstance(yc, torch.Tensor) and y.shape == x.shape
                and yc.shape == xc.shape and bool(torch.isfinite(y).all())):
            cut.append({"axis": axis, "size": shape[axis], "kept": "its output is not one finite tensor of its shape"})
            continue
        expected = y.narrow(axis, 0, CUT_TO).double()
        diff = float((yc.double() - expected).abs().max()) / (float(expected.abs().max()) or 1.0)
        if not diff <= TOLERANCE[dtype]:
            cut.append({"axis": axis, "size": shape[axis], "kept": f"the output moves by {sig(diff)} (relative)"})
            continue
        cut.append({"axis": axis, "size": shape[axis], "cut_to": CUT_TO, "difference": diff})
        sizes[axis] = CUT_TO
    smaller = tuple(sizes)
    if smaller == tuple(shape):
        return shape, None
    return smaller, {
        "experiment": f"the module on {CUT_TO} entries along each large axis of a random input vs the first {CUT_TO} "
                      f"entries of its output on {2 * CUT_TO}: an axis whose entries are computed independently is cut "
                      "for inference",
        "measured": {"recorded_shape": list(shape), "probe_shape": list(smaller), "axes": cut},
        "confidence": "decisive",
        "note": f"inferred on an input of shape {smaller} (recorded: {tuple(shape)}): the cut axes carry independent "
                "rows, so every statistic keeps its size"}


def same_layout(spec, recorded: tuple[int, ...], probed: tuple[int, ...]) -> bool:
    """Whether ``spec`` shapes its parameters, running statistics and groups alike on both inputs (else the contract
    inferred on the smaller input is inferred again on the recorded shape)."""
    try:
        a, b = Layout.of(spec, recorded), Layout.of(spec, probed)
    except Exception:
        return False
    return (a.param_shape == b.param_shape and a.stats_shape == b.stats_shape and a.groups == b.groups
            and (a.group_axis is None or recorded[a.group_axis] == probed[a.group_axis]))
