"""``diff`` on quantized candidates, held as one property over generated cases: mlx-lm ports of three
architectures, quantized by MLX at 4 and 8 bits, × fault kinds × sites chosen from the port's own module tree by
structure (a norm: a module with ``eps`` and a float ``weight``; a quantized projection: a module with ``bits``; an
attention: a module holding a ``rope``):

- a clean quantized port is a PASS (its error is its quantization's);
- a fault that moves the logits away from the clean quantized port's is never a PASS;
- a FAIL names the module the fault was put into, or the ancestor whose own code holds it.
"""

from __future__ import annotations

import pytest
from runtime_models import QuantizedCase, skip_without_mlx, tiny_causal_lm

skip_without_mlx()
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

FAMILIES = ("llama", "qwen3", "gemma3")
FAULTS = ("clean", "norm_eps", "norm_gamma", "weight_scales", "rope_base")


def _norms(port) -> list[str]:
    return [p for p, m in port.named_modules() if hasattr(m, "eps") and "weight" in m and not hasattr(m, "bits")]


def _quantized(port) -> list[str]:
    return sorted(p for p, m in port.named_modules() if hasattr(m, "bits") and "scales" in m)


def _attentions(port) -> list[str]:
    return [p for p, m in port.named_modules() if hasattr(m, "rope")]


def _at(port, path: str):
    return dict(port.named_modules())[path]


class Case(QuantizedCase):
    @property
    def bits(self) -> int:
        return int(self.scheme.removesuffix("bit"))

    def build(self):
        """The reference, its quantized port with the fault put in, the clean quantized port, and the faulted
        module's path (None when clean)."""
        import mlx.core as mx
        import mlx.nn as mnn

        from normscope.divergence.runtimes.mlx import port

        model = tiny_causal_lm(self.family)
        ports = []
        for _ in range(2):
            p = port(model)
            mnn.quantize(p, group_size=32, bits=self.bits)
            ports.append(p)
        cand, clean = ports
        site = None
        if self.fault in ("norm_eps", "norm_gamma"):
            names = _norms(cand)
            site = names[len(names) // 2]
            m = _at(cand, site)
            if self.fault == "norm_eps":
                m.eps = 1e-2
            else:  # one channel's γ off by a quarter: a bad conversion of one value
                w = mx.array(m.weight)
                w[5] = w[5] * 1.25 + 0.25
                m.weight = w
        elif self.fault == "weight_scales":  # one group of one row dequantized at twice its scale
            names = _quantized(cand)
            site = names[len(names) // 2]
            m = _at(cand, site)
            s = mx.array(m.scales)
            s[3, 0] = s[3, 0] * 2
            m.scales = s
        elif self.fault == "rope_base":
            names = _attentions(cand)
            site = names[-1]
            _at(cand, site).rope.base *= 4
        return model, cand, clean, site


CASES = [Case(f, f"{b}bit", x) for f in FAMILIES for b in (4, 8) for x in FAULTS]


def _logits(port, ids):
    import mlx.core as mx
    import numpy as np

    return np.array(port(mx.array(ids["input_ids"].numpy())).astype(mx.float32)).astype("float64")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_diff_judges_a_quantized_candidate_by_what_its_quantization_explains(case: Case):
    case.check(_logits)
