"""Turn a command-line TARGET into an object: ``package.module:attr`` or a ``.onnx`` path.

``--args``/``--kwargs`` are parsed as JSON (never evaluated). A class is instantiated with them; another
attribute is called with them only when they are given.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

from .errors import TargetError


def parse_json(text: str | None, kind: type, flag: str):
    if text is None:
        return kind()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        example = "[64]" if kind is list else '{"eps": 1e-6}'
        raise TargetError(f"{flag} is not valid JSON ({exc.msg}); e.g. {flag} '{example}'") from None
    if not isinstance(value, kind):
        raise TargetError(f"{flag} must be a JSON {'list' if kind is list else 'object'}; got {text!r}")
    return value


def load_target(spec: str, args_json: str | None = None, kwargs_json: str | None = None):
    """The object named by ``spec``; ONNX paths are returned as paths."""
    args = parse_json(args_json, list, "--args")
    kwargs = parse_json(kwargs_json, dict, "--kwargs")
    if spec.endswith(".onnx"):
        if not Path(spec).exists():
            raise TargetError(f"no such ONNX file: {spec}")
        if not Path(spec).is_file():
            raise TargetError(f"{spec} is not a file")
        return spec
    if ":" not in spec:
        raise TargetError(
            f"TARGET {spec!r} must be package.module:attr (e.g. torch.nn:LayerNorm) or a path ending in .onnx")
    module_name, attr = spec.split(":", 1)
    if not module_name or not attr or module_name.startswith(".") or "/" in module_name:
        raise TargetError(
            f"TARGET {spec!r} must be package.module:attr with an importable module name (e.g. torch.nn:LayerNorm); "
            "put a file's folder on PYTHONPATH and name it by module")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, TypeError, ValueError) as exc:
        raise TargetError(f"cannot import {module_name!r}: {exc}; is it installed in this environment?") from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(f"{module_name!r} has no attribute {attr!r}") from None
    if inspect.isclass(obj) or args or kwargs:
        try:
            obj = obj(*args, **kwargs)
        except Exception as exc:
            raise TargetError(f"{spec}(*{args}, **{kwargs}) failed: {type(exc).__name__}: {exc}") from None
    return obj


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise TargetError(f"--shape must be comma-separated sizes like 2,8,64; got {text!r}") from None
    if not shape or any(s < 1 for s in shape):
        raise TargetError(f"--shape must be positive sizes like 2,8,64; got {text!r}")
    return shape
