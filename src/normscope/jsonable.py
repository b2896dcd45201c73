"""Turn results (NumPy arrays and scalars, non-finite floats, nested containers) into JSON-ready values."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    if isinstance(v, np.ndarray):
        return jsonable(v.tolist())
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
