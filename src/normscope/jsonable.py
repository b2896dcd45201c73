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


def document(data: Any, schema: str, what: str) -> dict[str, Any]:
    """``data`` when it is a JSON object with ``"schema": schema``; else one clear InputError naming ``what``."""
    from .errors import InputError

    got = data.get("schema") if isinstance(data, dict) else type(data).__name__
    if not isinstance(data, dict) or got != schema:
        raise InputError(f"not a {what}: expected a JSON object with schema {schema!r}, got {got!r}")
    return data


def parse(text: str, what: str) -> Any:
    """The JSON value in ``text``; one clear InputError naming ``what`` when it is not valid JSON."""
    import json

    from .errors import InputError

    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"not a {what}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
