"""An MLX candidate in ``diff``: a model as MLX runs it, its module calls mapped to the torch sites by name.

The candidate is an ``mlx.nn.Module`` (an mlx-lm port: its module names follow the Hugging Face ones), or
``"mlx"``: the reference ported here by mlx-lm from its own config and weights (``save_pretrained`` to a temporary
directory, ``mlx_lm.utils.load_model``). MLX has no hooks: for the candidate's forward, ``__call__`` of each class
in its module tree is wrapped (and restored after, even when the forward raises), and each call's output and
arguments are kept. Everything runs on MLX's CPU device.

Own errors (teacher forcing): a site's MLX module is called again with its first array argument replaced by the
reference's input to that site (converted at the module boundary, at the dtype the candidate's own call had);
its other arguments — an attention mask, which MLX builds from shapes — are the candidate's own. A call that
took a stateful argument (a KV cache object) is not run again.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import InputError, TargetError
from ...extras import require
from ...model import private_copy
from ...targets.mlx_target import cpu_stream, is_mlx_module, to_numpy
from ..candidate import Candidate, NotMeasured, kept_bytes
from ..execution import Memo, Record, input_of, stateless
from ..quantized import dequantized_twin, notes, per_element, step_fault

_PLAIN = (type(None), bool, int, float, str)
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


#: ``mlx``, or ``mlx:4bit`` / ``mlx:8bit``: the reference ported by mlx-lm, quantized as ``mlx_lm.convert -q`` does
_PORT = re.compile(r"mlx(?::(\d+)bit)?")


def port_bits(obj) -> tuple[bool, int | None]:
    """Whether ``obj`` asks for the reference ported by mlx-lm, and at how many bits (None: not quantized)."""
    m = _PORT.fullmatch(obj) if isinstance(obj, str) else None
    return (m is not None, int(m.group(1)) if m and m.group(1) else None)


def is_mlx_directory(obj) -> bool:
    """A directory mlx-lm wrote for a quantized model (``mlx_lm.convert -q``): its config.json has a
    ``quantization`` entry with the bits and group size, which a Hugging Face checkpoint does not."""
    if not isinstance(obj, str | Path):
        return False
    config = Path(obj) / "config.json"
    try:
        q = json.loads(config.read_text()).get("quantization") if config.is_file() else None
    except (OSError, ValueError):
        return False
    return isinstance(q, dict) and "bits" in q


def is_mlx(obj) -> bool:
    return port_bits(obj)[0] or is_mlx_module(obj) or is_mlx_directory(obj)


def dtype_of(value) -> str | None:
    """The dtype name of an ``mx.array`` (None for an integer one)."""
    name = str(value.dtype).rsplit(".", 1)[-1]
    return name if name in _TORCH else None


def model_dtype(model) -> str:
    """The dtype of the MLX model's first floating parameter (float32 without any)."""
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        name = dtype_of(p)
        if name is not None:
            return name
    return "float32"


def quantized_layers(model) -> dict[str, Any]:
    """The MLX model's quantized modules by path (``nn.quantize``, an mlx-lm 4- or 8-bit port): each holds its
    packed ``weight`` with ``scales`` (and ``biases`` in affine mode), ``group_size`` and ``bits``."""
    return {p: m for p, m in model.named_modules()
            if hasattr(m, "bits") and hasattr(m, "group_size") and "scales" in m and "weight" in m}


def quantization_of(module) -> str:
    """A quantized module's type in words: "4-bit, group 64" (its mode after it where not affine)."""
    mode = getattr(module, "mode", "affine")
    return f"{module.bits}-bit, group {module.group_size}" + ("" if mode in (None, "affine") else f", {mode}")


def dequantized_weight(module) -> torch.Tensor:
    """The weight a quantized MLX module multiplies by, dequantized by MLX from its own packed values, scales and
    biases, at the scales' dtype."""
    mx = require("mlx.core", "mlx")
    kw = {"group_size": module.group_size, "bits": module.bits}
    if getattr(module, "mode", None) is not None:
        kw["mode"] = module.mode
    with mx.stream(cpu_stream()):
        w = mx.dequantize(module["weight"], module["scales"], module.get("biases"), **kw)
    return floating(w)


def weight_fault(module, w: torch.Tensor, reference_weight: torch.Tensor) -> str | None:
    """:func:`..quantized.step_fault` of a quantized MLX module, ``w`` its dequantized weight: one step is its
    group's scale, and the rounding of the scales' dtype (times the largest level) and of the biases comes on top. A
    step, not half of one: MLX's affine quantization keeps zero exact, which costs up to a step. Checked for affine
    quantization (scales and biases stored as floats); None for other modes."""
    from ...dtypes import UNIT_ROUNDOFF

    if getattr(module, "mode", "affine") not in (None, "affine") or "biases" not in module:
        return None
    scales, biases = floating(module["scales"]), floating(module["biases"])
    if scales is None or biases is None:
        return None
    step = per_element(scales.abs(), w.shape)
    bias = per_element(biases.abs(), w.shape)
    u = UNIT_ROUNDOFF.get(str(scales.dtype).removeprefix("torch."), UNIT_ROUNDOFF["float32"])
    allowed = step * (1 + 2 ** module.bits * u) + u * (bias + reference_weight.detach().double().abs()) + 1e-30
    return step_fault(w, reference_weight, allowed, step)


def mlx_twin(reference: torch.nn.Module, layers: dict[str, Any], dtype: str) -> tuple[torch.nn.Module, dict[str, str]]:
    """:func:`..quantized.dequantized_twin` of an MLX model's quantized modules, each dequantized by MLX and checked
    by :func:`weight_fault`."""
    weights = {path: (dequantized_weight(m), quantization_of(m)) for path, m in layers.items()}
    return dequantized_twin(reference, _TORCH[dtype], weights.items(),
                            lambda path, w, ref_w: weight_fault(layers[path], w, ref_w))


def load_directory(path) -> Any:
    """An mlx-lm model directory (:func:`is_mlx_directory`) as ``mlx_lm.utils.load_model`` reads it."""
    require("mlx_lm", "mlx")
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(Path(path))
    except Exception as exc:
        raise InputError(f"mlx-lm could not load the model in {path}: {type(exc).__name__}: {exc}") from None
    require("mlx.core", "mlx").eval(model.parameters())
    return model


def port(reference: torch.nn.Module, bits: int | None = None):
    """The reference as mlx-lm ports it: its config and weights written as a Hugging Face checkpoint, loaded by
    ``mlx_lm.utils.load_model``; with ``bits``, quantized by ``mlx_lm.utils.quantize_model`` as ``mlx_lm.convert
    -q`` does (mlx-lm's default group size). Raises InputError when the reference is not a Hugging Face model
    mlx-lm has a port of."""
    require("mlx_lm", "mlx")
    from mlx_lm.utils import load_model, quantize_model

    from ...sources import quiet_libraries

    config = getattr(reference, "config", None)
    if config is None or not hasattr(reference, "save_pretrained"):
        raise InputError(f"the candidate 'mlx' ports a Hugging Face model with mlx-lm; a {type(reference).__name__} "
                         "has no Hugging Face config: give an mlx.nn.Module as the candidate")
    with tempfile.TemporaryDirectory(prefix="normscope-mlx-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with quiet_libraries():  # transformers' "Writing model shards" bar: normscope's doing, not the user's
            reference.save_pretrained(tmp, safe_serialization=True)
        try:
            model, mlx_config = load_model(Path(tmp))
        except ValueError as exc:  # mlx-lm names an architecture it has no port of with a ValueError
            raise InputError(f"mlx-lm could not port model_type {config.model_type!r}: {exc}") from None
        except Exception as exc:
            raise TargetError(f"mlx-lm could not load the reference's weights: {type(exc).__name__}: {exc}") from None
        if bits is not None:
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Quantized model with …" line
                    model, _ = quantize_model(model, mlx_config, group_size=None, bits=bits)
            except Exception as exc:  # a width the group size does not divide, a bit width MLX has no kernel for
                raise InputError(f"mlx-lm could not quantize the port at {bits} bits: {type(exc).__name__}: "
                                 f"{exc}") from None
        require("mlx.core", "mlx").eval(model.parameters())  # read now: the directory goes away
    return model


class Call:
    """One MLX module call of the candidate's forward: its arguments (for teacher forcing) and output."""

    __slots__ = ("module", "args", "kwargs")

    def __init__(self, module, args, kwargs):
        self.module, self.args, self.kwargs = module, args, kwargs


def floating(value) -> torch.Tensor | None:
    """A floating ``mx.array`` as a torch tensor at its own dtype (16-bit floats exactly, through float32); None for
    anything else (an integer array, no array)."""
    name = dtype_of(value) if value is not None else None
    if name is None:
        return None
    return torch.from_numpy(np.ascontiguousarray(to_numpy(value))).to(_TORCH[name])


def to_mlx(value, like=None):
    """A torch tensor as an ``mx.array`` (at the dtype of ``like``, the candidate's own argument there, when
    given); anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    mx = require("mlx.core", "mlx")
    a = value.detach().cpu()
    out = mx.array((a.float() if a.is_floating_point() else a).numpy())
    return out.astype(like.dtype) if like is not None else out


def run_candidate(model, args, kwargs, record) -> tuple[str | None, tuple[str, int] | None, list[str]]:
    """The MLX model's forward on the reference's inputs with each module call recorded:
    ``record(path, number, Call, output)`` in completion order (children before parents). Returns what the
    forward raised (or None), the innermost call that raised, and notes on the inputs it was given."""
    mx = require("mlx.core", "mlx")
    feeds, kw, notes = feeds_for(model, args, kwargs)
    paths = {id(m): p for p, m in model.named_modules()}
    counts: dict[str, int] = defaultdict(int)
    failed: list[tuple[str, int]] = []
    inside: set[int] = set()  # modules whose call is in flight: a subclass's __call__ calling super() is one call
    classes = {type(m) for _, m in model.named_modules()}
    originals = {cls: (cls.__dict__.get("__call__"), cls.__call__) for cls in classes}
    patched: list[type] = []

    def wrap(call):
        def recorded(self, *a, **k):
            path = paths.get(id(self))
            if path is None or id(self) in inside:
                return call(self, *a, **k)
            number = counts[path]
            counts[path] += 1
            inside.add(id(self))
            try:
                out = call(self, *a, **k)
            except Exception:
                if not failed:
                    failed.append((path, number))
                raise
            finally:
                inside.discard(id(self))
            record(path, number, Call(self, a, k), out)
            return out
        return recorded

    with mx.stream(cpu_stream()):
        try:
            for cls, (_, resolved) in originals.items():
                cls.__call__ = wrap(resolved)
                patched.append(cls)
            try:
                model(*feeds, **kw)
            except Exception as exc:
                where = f"{failed[0][0] or '(model)'}" if failed else "(model)"
                return f"the candidate's forward raised in {where}: {type(exc).__name__}: {exc}", \
                    (failed[0] if failed else None), notes
        finally:
            for cls in patched:  # only the classes patched: a failure half-way restores what it changed
                own = originals[cls][0]
                if own is None:
                    del cls.__call__
                else:
                    cls.__call__ = own
    return None, None, notes


_MAIN_INPUTS = ("input_ids", "inputs", "x", "hidden_states", "pixel_values")  # an HF model's main input, by name


def feeds_for(model, args, kwargs) -> tuple[list, dict, list[str]]:
    """The reference's arguments as the MLX model's ``__call__`` takes them: an HF keyword main input
    (``input_ids=``) becomes its first positional argument (mlx-lm's ``inputs``); a keyword it does not take is
    left out, and a tensor left out is named in a note (an attention mask with padding would change the
    result)."""
    import inspect

    try:
        params = dict(inspect.signature(type(model).__call__).parameters)
        params.pop("self", None)
    except (TypeError, ValueError):
        params = {}
    anything = not params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    feeds, kw, notes = [to_mlx(a) for a in args], {}, []
    first = next(iter(params), None)
    rest = dict(kwargs)
    if not feeds and first is not None and first not in rest:
        main = next((k for k in _MAIN_INPUTS if isinstance(rest.get(k), torch.Tensor)), None)
        if main is not None:
            feeds.append(to_mlx(rest.pop(main)))
    for k, v in rest.items():
        if anything or k in params:
            kw[k] = to_mlx(v)
        elif isinstance(v, torch.Tensor) and not (k == "attention_mask" and bool((v == 1).all())):
            notes.append(f"the MLX model takes no {k!r}: it ran without it")
    return feeds, kw, notes


def output(value) -> Any:
    """The primary array of an MLX call's output (an array, or the first array of a tuple/list)."""
    mx = require("mlx.core", "mlx")
    if isinstance(value, mx.array):
        return value
    if isinstance(value, list | tuple):
        return next((v for v in value if isinstance(v, mx.array)), None)
    return None


def _first_array_at(args) -> int | None:
    mx = require("mlx.core", "mlx")
    return next((i for i, a in enumerate(args) if isinstance(a, mx.array)), None)


def first_array(args) -> Any:
    """The first ``mx.array`` among a call's positional arguments (None without one)."""
    at = _first_array_at(args)
    return None if at is None else args[at]


def teacher_forced(call: Call, x: torch.Tensor) -> Any:
    """The call's module on the reference's input ``x`` in place of its first array argument; the other
    arguments its own. Raises ValueError with the reason when that cannot be done."""
    mx = require("mlx.core", "mlx")
    values = (mx.array, *_PLAIN)
    if not (stateless(call.args, values) and stateless(call.kwargs, values)):
        raise ValueError("the call takes a stateful argument (a cache object)")
    args = list(call.args)
    at = _first_array_at(args)
    if at is None:
        raise ValueError("the MLX call had no array argument to replace")
    if tuple(args[at].shape) != tuple(x.shape):
        raise ValueError(f"the MLX call's input {list(args[at].shape)} is not the reference's {list(x.shape)}")
    args[at] = to_mlx(x, args[at])
    with mx.stream(cpu_stream()):
        return output(call.module(*args, **call.kwargs))


class MlxCandidate(Candidate):
    """A model as MLX runs it on the CPU (this module): an ``mlx.nn.Module`` with the reference's module
    names (an mlx-lm port), or ``"mlx"``, the reference ported here by mlx-lm. Each site's own output is its MLX
    module called on the reference's input; at a dtype below the reference's, the twin is the reference's module
    at that dtype. A quantized model's twin is the reference with the candidate's own weights, dequantized
    (:func:`mlx_twin`), and each site is judged against it (:attr:`Candidate.quantized`)."""

    runner = " on MLX"
    torch_modules = False
    bound_suffix = " (MLX: the site's module on the reference's input)"

    def __init__(self, model, reference: torch.nn.Module, ref_dtype: str):
        from ...extras import require

        mx = require("mlx.core", "mlx")
        ported, bits = port_bits(model)
        if ported:
            self.mlx_model = port(reference, bits)
            what = "the reference ported by mlx-lm"
        elif is_mlx_directory(model):
            self.mlx_model, what = load_directory(model), f"mlx-lm's {model}"
        else:
            self.mlx_model, what = model, type(model).__name__
        dtype = model_dtype(self.mlx_model)
        layers = quantized_layers(self.mlx_model)
        if layers:
            kinds = sorted({quantization_of(m) for m in layers.values()})
            what += f"; quantized: {', '.join(kinds)}"
        super().__init__(f"MLX {mx.__version__} CPU ({what})", dtype)
        if layers:
            self.quantized = {path: quantization_of(m) for path, m in layers.items()}
            self.torch_dtype = getattr(torch, dtype)
            self.twin, self.weight_faults = mlx_twin(reference, layers, dtype)
            self.notes.extend(notes(self.quantized))
        elif dtype != ref_dtype:
            self.torch_dtype = getattr(torch, dtype)
            self.twin = private_copy(reference, dtype=self.torch_dtype)


    def run(self, args, kwargs) -> None:
        def record(path, number, call, out):
            self.records.append(Record(path, number, call, floating(output(out))))

        self.error, self.failed, notes = run_candidate(self.mlx_model, args, kwargs, record)
        self.notes.extend(notes)
        self.cache_bytes = kept_bytes(self.records)

    def recorded_input(self, r: Record) -> torch.Tensor | None:
        return floating(first_array(r.module.args))

    def own(self, r: Record, args, kw, memo: Memo, kids=(), state=None) -> tuple[torch.Tensor, str, Any]:
        x = input_of(args, kw, None)
        if x is None:  # an embedding's token ids
            x = next((a for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)), None)
        if x is None:
            raise NotMeasured("own error not measured: the reference's call has no tensor input")
        try:
            yc = teacher_forced(r.module, x)
        except ValueError as exc:
            raise NotMeasured(f"own error not measured: {exc}") from None
        except Exception as exc:
            raise NotMeasured(f"own error not measured: the candidate's {type(r.module.module).__name__} raised on "
                              f"the reference's input ({type(exc).__name__}: {exc}); its own forward ran it") from None
        y = floating(yc)
        if y is None:
            raise NotMeasured("the candidate's module returned no floating array on the reference's input")
        return y, dtype_of(yc), r.module.module


def is_candidate(obj) -> bool:
    return is_mlx(obj)


def candidate(obj, reference, ref_dtype: str, stack) -> MlxCandidate:
    return MlxCandidate(obj, reference, ref_dtype)
