"""Turn a command-line TARGET into an object: ``package.module:attr`` or a ``.onnx`` path.

``--args``/``--kwargs`` are parsed as JSON (never evaluated). A class is instantiated with them; another
attribute (a factory) is called with them whenever either is given, ``--args '[]'`` included.
Importing the module runs its top-level code: naming a TARGET is running code.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

from .errors import InputError, TargetError
from .inputs import shorten


def _loads(text: str, what: str, example: str):
    """JSON from text, one clear TargetError otherwise (deep nesting included)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TargetError(f"{what} is not valid JSON ({exc.msg}, at character {exc.pos}); e.g. {example}") from None
    except RecursionError:
        raise TargetError(f"{what} is nested too deeply to parse; e.g. {example}") from None


def parse_json(text: str | None, kind: type, flag: str):
    if text is None:
        return kind()
    example = f"{flag} '[64]'" if kind is list else f"{flag} '{{\"eps\": 1e-6}}'"
    value = _loads(text, flag, example)
    if not isinstance(value, kind):
        raise TargetError(f"{flag} must be a JSON {'list' if kind is list else 'object'}; got {shorten(text)}")
    return value


def read_json_file(path: str | Path, what: str = "--expect"):
    """The JSON value in a file, or one clear InputError (not UTF-8, not JSON, nested too deeply)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        hint = (" (it looks like UTF-16, as some shells write with >; save it as UTF-8)"
                if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "")
        raise InputError(f"{what} {path} is not a UTF-8 text file{hint}; give a preset name or a spec JSON file") \
            from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} {path} is not JSON: {exc}") from None
    except RecursionError:
        raise InputError(f"{what} {path} is nested too deeply to be a spec JSON file") from None


def is_onnx_path(spec) -> bool:
    return str(spec).lower().endswith(".onnx")


def load_target(spec: str, args_json: str | None = None, kwargs_json: str | None = None):
    """The object named by ``spec``; ONNX paths are returned as paths."""
    args = parse_json(args_json, list, "--args")
    kwargs = parse_json(kwargs_json, dict, "--kwargs")
    if is_onnx_path(spec):
        if not Path(spec).exists():
            raise TargetError(f"no such ONNX file: {spec}")
        if not Path(spec).is_file():
            raise TargetError(f"{spec} is not a file")
        if args_json is not None or kwargs_json is not None:
            raise TargetError("--args/--kwargs construct a class or call a factory; an ONNX file takes neither")
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
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        where = ("the current directory is not on the import path: run with PYTHONPATH=. (or the module's folder)"
                 if missing == module_name.split(".")[0] and Path(missing + ".py").exists() else
                 "is it installed in this environment, or is its folder on PYTHONPATH?")
        raise TargetError(f"cannot import {module_name!r}: no module named {missing!r}; {where}") from None
    except (ImportError, TypeError, ValueError) as exc:
        raise TargetError(f"cannot import {module_name!r}: {exc}; is it installed in this environment?") from None
    except SyntaxError as exc:
        raise TargetError(f"cannot import {module_name!r}: syntax error in {exc.filename}, line {exc.lineno}: "
                          f"{exc.msg}") from None
    except Exception as exc:  # the module's own top-level code failed
        raise TargetError(f"importing {module_name!r} ran its top-level code, which raised "
                          f"{type(exc).__name__}: {shorten(exc, 200, as_text=True)}") from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(f"{module_name!r} has no attribute {attr!r}") from None
    if inspect.isclass(obj) or args_json is not None or kwargs_json is not None:
        if not callable(obj):
            raise TargetError(f"{spec} is a {type(obj).__name__}, which cannot be called with --args/--kwargs")
        try:
            obj = obj(*args, **kwargs)
        except Exception as exc:
            call = f"{spec}(*{shorten(args)}, **{shorten(kwargs)})"
            raise TargetError(f"{call} failed: {type(exc).__name__}: {shorten(exc, 200, as_text=True)}") from None
    return obj


def parse_shape(text: str) -> tuple[int, ...]:
    """``--shape 2,8,64`` as a tuple; every part must be a size ≥ 1 (no empty parts, no signs)."""
    from .inputs import probe_shape

    parts = [s.strip() for s in text.split(",")]
    bad = [p for p in parts if not (p.isascii() and p.isdigit())]
    if bad:
        what = "an empty size" if "" in bad else f"{shorten(bad[0], 30)}, not a size ≥ 1"
        raise InputError(f"--shape must be comma-separated sizes like 2,8,64; {shorten(text, 40)} has {what}")
    return probe_shape(tuple(int(p) for p in parts), "--shape")
