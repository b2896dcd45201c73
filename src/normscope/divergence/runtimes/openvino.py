"""An OpenVINO candidate in ``diff``: a model as OpenVINO runs it, its intermediate values mapped to the torch sites.

The candidate is ``"openvino"`` — the reference itself as OpenVINO runs it (``openvino.convert_model`` on the
reference with the diff's inputs) — or a model converted elsewhere: an ``openvino.Model`` or an IR ``.xml``. A
private clone gets every intermediate value as an output and is compiled for the CPU with the runtime's own
defaults — its inference precision included (bf16 on CPUs with AMX, f32 elsewhere): that is the execution being
judged, and the description says which. Node friendly names carry the torch module scope
(``__module.model.layers.0.input_layernorm/aten::mul/Multiply`` from the PyTorch frontend,
``/model/layers.0/input_layernorm/Mul`` from an ONNX file), so each value maps to a torch site as an ONNX
candidate's do (:func:`.onnx.records`).

Own errors (teacher forcing): when the candidate is the reference converted here, a site's own output is the
reference's module at that site converted alone and run by OpenVINO on the reference's input to it (cached per
module and input shapes) — the same conversion and runtime, one module at a time. A model converted elsewhere may
differ from the reference in any module (a converter's lost ε is what one looks for), so its sites have no own
error: each is judged on its propagated error and says so; a clean run is then inconclusive, never a pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import InputError, TargetError
from ...extras import require
from ..candidate import GraphCandidate, NotMeasured
from ..execution import Memo, Record, primary
from .onnx import scope_outputs

OWN_MISSING = "OpenVINO model converted elsewhere: no site runs alone"
_DTYPES = {"f32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16",
           "float16": "float16"}  # OpenVINO's names for its inference precision


def is_openvino(obj) -> bool:
    if isinstance(obj, str | Path):
        return str(obj) == "openvino" or str(obj).endswith(".xml")
    return type(obj).__module__.startswith("openvino") and type(obj).__name__ == "Model"


def _scope(name: str) -> str | None:
    """A node's torch scope, dotted, from its friendly name; None for a node outside every module."""
    if name.startswith("__module."):
        return name[len("__module."):].split("/", 1)[0] or None
    if "/" in name:
        return name.strip("/").rsplit("/", 1)[0].replace("/", ".") or None
    return None


def _key(output) -> str:
    return f"{output.get_node().get_friendly_name()}:{output.get_index()}"


def run_candidate(obj, args, kwargs) -> tuple[dict[str, Any], dict[str, list[str]], str, str, Any]:
    """Every intermediate value, scope → the values it hands out, a description, the dtype the runtime computes
    in, and the model's first declared output (the key of its value)."""
    ov = require("openvino", "openvino")
    core = ov.Core()
    feeds = None
    converted_here = isinstance(obj, torch.nn.Module)
    if converted_here:
        try:
            wrapped, example = prepare(obj, args, kwargs)
            model, feeds = convert(wrapped, example), [t.numpy() for t in example]
        except NotConvertible as exc:
            raise TargetError(f"OpenVINO could not convert the reference ({exc}); convert it yourself and give the "
                              "openvino.Model (or its IR .xml) as the candidate") from None
        where = f"{type(obj).__name__} converted by openvino.convert_model"
    elif isinstance(obj, str | Path):
        if not Path(obj).is_file():
            raise InputError(f"{obj}: no such OpenVINO IR file")
        try:
            model = core.read_model(str(obj))
        except Exception as exc:
            raise InputError(f"{obj}: not an OpenVINO IR ({type(exc).__name__}: {exc})") from None
        where = str(obj)
    else:
        model, where = obj, "an openvino.Model"
    model = model.clone()  # the user's model keeps its outputs
    compressed = sum(1 for op in model.get_ordered_ops() if op.get_type_name() == "Constant"
                     and str(op.get_output_element_type(0)) in ("<Type: 'float16'>", "<Type: 'bfloat16'>")
                     and op.get_output_size() and len(op.output(0).get_target_inputs()) > 0
                     and all(t.get_node().get_type_name() == "Convert" for t in op.output(0).get_target_inputs()))
    declared = _key(model.outputs[0].get_node().input_value(0)) if model.outputs else None
    nodes, extra = [], []
    for op in model.get_ordered_ops():
        kind = op.get_type_name()
        if kind in ("Parameter", "Constant", "Result"):
            continue
        sc = _scope(op.get_friendly_name())
        if converted_here and sc is not None:  # the wrapper's own level is the reference's root
            sc = None if sc == _Primary.ATTRIBUTE else sc.removeprefix(_Primary.ATTRIBUTE + ".")
        outs = [op.output(i) for i in range(op.get_output_size())]
        nodes.append((sc, [_key(i.get_source_output()) for i in op.inputs()], [_key(o) for o in outs]))
        extra.extend(outs)
    model.add_outputs(extra)
    if feeds is None:
        feeds = _feeds(model, args, kwargs)
    _static(model, feeds)
    try:
        compiled = core.compile_model(model, "CPU")
    except Exception as exc:
        raise TargetError(f"OpenVINO could not compile the candidate: {type(exc).__name__}: {exc}") from None
    precision = str(compiled.get_property("INFERENCE_PRECISION_HINT")).replace("<Type: '", "").replace("'>", "")
    dtype = _DTYPES.get(precision, "float32")  # an unnamed precision: judged at float32, the strictest bound
    try:
        result = compiled(feeds)
    except Exception as exc:
        raise TargetError(f"OpenVINO could not run the candidate: {type(exc).__name__}: {exc}") from None
    values = {}
    for out in compiled.outputs:
        source = out.get_node().input_value(0)
        values[_key(source)] = result[out]
    graph_out = {declared} if declared else set()
    desc = f"OpenVINO {ov.__version__} CPU ({where}), inference precision {precision}"
    if compressed:  # openvino.save_model compresses weights to f16 by default
        desc += f"; {compressed} weight constants stored in 16 bits and converted up at run time"
    return values, scope_outputs(nodes, graph_out), desc, dtype, values.get(declared)


def prepare(module: torch.nn.Module, args, kwargs) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """``module`` wrapped to take positional tensors and return its primary output, and the tensors to call it
    with. Keyword arguments that are not tensors (flags, numbers) are fixed in the wrapper; a Hugging Face model
    runs without a KV cache (``use_cache=False``), as ``diff`` runs it, and with its attention mask stated."""
    import inspect

    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    fixed = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor) and v is not None}
    if any(isinstance(v, list | tuple | dict) for v in fixed.values()) or \
            any(not isinstance(a, torch.Tensor) for a in args):
        raise NotConvertible("an argument that is neither a tensor nor a plain value")
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "use_cache" in params:
        fixed.setdefault("use_cache", False)
    ids = tensors.get("input_ids")
    if "attention_mask" in params and "attention_mask" not in tensors and isinstance(ids, torch.Tensor):
        # stated as all ones (what its absence means): without it, the mask code looks for packed sequences
        # with ops the converter does not take
        tensors["attention_mask"] = torch.ones_like(ids)
    return _Primary(module, len(args), list(tensors), fixed), tuple(args) + tuple(tensors.values())


def convert(wrapped: torch.nn.Module, example: tuple[torch.Tensor, ...]):
    r"""A :func:`prepare`\ d module as OpenVINO's PyTorch frontend converts it, traced on ``example``."""
    ov = require("openvino", "openvino")
    try:
        import warnings

        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            model = ov.convert_model(wrapped, example_input=example)
    except Exception as exc:
        raise NotConvertible(f"openvino.convert_model: {type(exc).__name__}: {str(exc)[:200]}") from None
    _static(model, [t.numpy() for t in example])
    return model


def _static(model, feeds: dict[str, np.ndarray] | list[np.ndarray]) -> None:
    """``model``'s inputs fixed to the shapes of the arrays it will be run with. The converter leaves every
    dimension dynamic, and some CPU plugin passes refuse dynamic shapes on some CPUs (the fused LLM MLP of AMX
    machines: "Check 'feature.is_static()' failed"); a model that will not take the shapes keeps its own."""
    ov = require("openvino", "openvino")
    items = feeds.items() if isinstance(feeds, dict) else enumerate(feeds)
    try:
        model.reshape({key: ov.PartialShape(list(np.shape(a))) for key, a in items})
    except Exception:  # noqa: S110 - the model's own shapes then: compiling reports what fails
        pass


class _Primary(torch.nn.Module):
    """A module called with positional tensors only, returning only its primary output: the converter traces a
    tuple of tensors into tensors, not keyword arguments into an HF ModelOutput. The ``model.`` level it adds to
    the scopes is taken off again when the sites are mapped."""

    ATTRIBUTE = "model"  # the scope level the wrapper adds

    def __init__(self, model: torch.nn.Module, n_args: int, keywords: list[str], fixed: dict[str, Any]):
        super().__init__()
        self.model, self.n_args, self.keywords, self.fixed = model, n_args, keywords, fixed

    def forward(self, *tensors):
        kwargs = dict(zip(self.keywords, tensors[self.n_args:], strict=True))
        return primary(self.model(*tensors[:self.n_args], **kwargs, **self.fixed))


class NotConvertible(Exception):
    """A module OpenVINO's converter cannot take with these arguments; the message says why."""


class Modules:
    """The reference's modules converted one at a time and compiled like the whole model (per module and input
    shapes): a site's own output on the reference's input."""

    def __init__(self, reference: torch.nn.Module):
        self.modules = dict(reference.named_modules())
        self.compiled: dict[tuple, Any] = {}

    def run(self, path: str, args, kwargs) -> torch.Tensor:
        module = self.modules.get(path)
        if module is None:
            raise NotConvertible(f"no module {path!r} in the reference")
        key = (path, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)),
               tuple((k, tuple(v.shape)) for k, v in kwargs.items() if isinstance(v, torch.Tensor)))
        wrapped, example = prepare(module, args, kwargs)
        if key not in self.compiled:
            ov = require("openvino", "openvino")
            self.compiled[key] = ov.Core().compile_model(convert(wrapped, example), "CPU")
        compiled = self.compiled[key]
        out = compiled([t.numpy() for t in example])
        return torch.from_numpy(np.asarray(out[compiled.outputs[0]]).copy())


def _feeds(model, args, kwargs) -> dict[str, np.ndarray] | list[np.ndarray]:
    names = [i.get_any_name() for i in model.inputs]
    feeds = {k: v.numpy() for k, v in kwargs.items() if k in names and isinstance(v, torch.Tensor)}
    if feeds:
        return feeds
    tensors = [a for a in list(args) + [v for v in kwargs.values() if v is not None] if isinstance(a, torch.Tensor)]
    if len(tensors) < len(model.inputs):
        raise InputError(f"the OpenVINO model takes {len(model.inputs)} inputs ({', '.join(names)}); got "
                         f"{len(tensors)} tensors")
    return [t.numpy() for t in tensors[:len(model.inputs)]]


class OpenVinoCandidate(GraphCandidate):
    """A model as OpenVINO runs it on the CPU, at the runtime's own inference precision (this module):
    the reference converted here (``"openvino"``; a site's own output is its module converted alone), or a model
    converted elsewhere (sites judged on their propagated error)."""

    runner = " on OpenVINO"
    scopes_label = "openvino scopes"
    bound_suffix = " (OpenVINO: the site's module converted alone, on the reference's input)"

    def __init__(self, model, reference: torch.nn.Module):
        super().__init__("", "float32")
        self.converted_here = isinstance(model, str) and model == "openvino"
        self.model_obj = reference if self.converted_here else model
        self.modules = Modules(reference) if self.converted_here else None

    def run(self, args, kwargs) -> None:
        self.values, self.scopes, self.desc, self.dtype, self.final = run_candidate(
            self.model_obj, args, kwargs)

    def own(self, r: Record, args, kw, memo: Memo, kids=(), state=None) -> tuple[torch.Tensor, str, Any]:
        if self.modules is None:
            raise NotMeasured(None, missing=OWN_MISSING)
        try:
            return self.modules.run(r.path, args, kw), self.dtype, None
        except NotConvertible as exc:
            raise NotMeasured(None, missing=f"OpenVINO: this module alone could not be converted ({exc})") from None


def is_candidate(obj) -> bool:
    return is_openvino(obj)


def candidate(obj, reference, ref_dtype: str, stack) -> OpenVinoCandidate:
    return OpenVinoCandidate(obj, reference)
