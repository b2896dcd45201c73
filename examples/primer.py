"""The primer's NumPy layer normalization, verbatim in behaviour: it divides by std + eps.

    normscope infer primer:layer_norm --framework numpy --shape 2,8,64
    normscope check primer:layer_norm --framework numpy --shape 2,8,64 --expect torch_layernorm
"""

import numpy as np


def layer_norm(x, eps=1e-6):
    return (x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + eps)


if __name__ == "__main__":
    print(np.round(layer_norm(np.array([0.6, 8.0, 0.4, 0.5])), 3).tolist())
