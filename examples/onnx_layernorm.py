"""Write a small ONNX LayerNormalization-17 model (γ, β as initializers) to probe with normscope.

    python examples/onnx_layernorm.py out/layernorm.onnx
    normscope infer out/layernorm.onnx --shape 2,8,64
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def build(hidden: int = 64, eps: float = 1e-5, seed: int = 0):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 1.5, hidden).astype(np.float32), "scale"),
             numpy_helper.from_array(rng.uniform(-0.5, 0.5, hidden).astype(np.float32), "B")]
    node = helper.make_node("LayerNormalization", ["x", "scale", "B"], ["y"], axis=-1, epsilon=eps)
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "seq", hidden]) for n in ("x", "y")]
    graph = helper.make_graph([node], "layernorm", [io[0]], [io[1]], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


if __name__ == "__main__":
    import onnx

    path = Path(sys.argv[1] if len(sys.argv) > 1 else "layernorm.onnx")
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build(), str(path))
    print(f"wrote {path}")
