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
differ from the reference in any module (a converter's lost ε is what one looks for), so its own modules are not
the candidate: a site's own output is the candidate's nodes under that site's scope, cut out of its graph as a
model of their own (:class:`Submodels`) and run by OpenVINO, compiled like the whole model, on the reference's
input to the site. Where the nodes cannot be cut out or fed, the site says why and is judged on its propagated
error.
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
from .onnx import NotExtractable, _fingerprint, scope_outputs
from .onnx import feeds as reference_feeds

_DTYPES = {"f32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16",
           "float16": "float16"}  # OpenVINO's names for its inference precision


def _openvino():
    """``import openvino`` with OpenVINO's usage telemetry off in this process. Its model converter reports usage
    through the ``openvino_telemetry`` package (processes that post to an analytics service, a client id written
    under the user's home) and falls back to its own no-op stub when that package cannot be imported; a ``None``
    entry in ``sys.modules`` makes it so. Nothing is written and the user's consent file is left as it is (``opt_in_out
    --opt_out`` turns it off for every OpenVINO tool). A process that imported the package already keeps it."""
    import sys

    sys.modules.setdefault("openvino_telemetry", None)
    return require("openvino", "openvino")


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


def run_candidate(obj, args, kwargs) -> dict[str, Any]:
    """Every intermediate value (``values``, the model's inputs among them), scope → the values it hands out
    (``scopes``), a description (``desc``), the dtype the runtime computes in (``dtype``), the value of the model's
    first declared output (``final``), the model as it ran (``model``: its inputs at the shapes it ran with) and how
    many weight constants it stores in 16 bits (``compressed``)."""
    ov = _openvino()
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
    for declared_out, out in zip(model.outputs, compiled.outputs, strict=True):
        # keyed by the model's nodes: the compiled graph's may be fused under other names
        values[_key(declared_out.get_node().input_value(0))] = result[out]
    given = [feeds.get(i.get_any_name()) for i in model.inputs] if isinstance(feeds, dict) else feeds
    for param, value in zip(model.get_parameters(), given, strict=False):  # the model's inputs, as fed
        if value is not None:
            values[_key(param.output(0))] = value
    graph_out = {declared} if declared else set()
    desc = f"OpenVINO {ov.__version__} CPU ({where}), inference precision {precision}"
    if compressed:  # openvino.save_model compresses weights to f16 by default
        desc += f"; {compressed} weight constants stored in 16 bits and converted up at run time"
    return {"values": values, "scopes": scope_outputs(nodes, graph_out), "desc": desc, "dtype": dtype,
            "final": values.get(declared), "model": model, "compressed": compressed}


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
    from ...sources import quiet_libraries

    ov = _openvino()
    try:
        import warnings

        # the converter's trace reads every attribute of a Hugging Face model, whose loss property logs a warning
        with warnings.catch_warnings(), torch.no_grad(), quiet_libraries():
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
    ov = _openvino()
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
            ov = _openvino()
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


class Submodels:
    """The nodes of one scope of a model converted elsewhere, cut out of its graph as a model of their own and
    compiled like the whole model: a site's own output on the reference's input (teacher forcing).

    The scope's nodes are those whose friendly names carry it (or a scope below it); what they read from outside
    becomes the sub-model's input — a floating value a parameter fed with the reference's tensor of its shape among
    the torch call's arguments (by value where several have it, :func:`.onnx.feeds`), an integer or boolean value
    (a mask, a shape, token ids: the same model inputs give the same) the candidate's own value as a constant —
    and constants (weights, a converted weight, ε) stay as they are. Compiled sub-models are cached per scope, value
    and input shapes."""

    def __init__(self, model, values: dict[str, Any]):
        self.work = model.clone()  # rewired for each cut, and restored
        self.ops = [op for op in self.work.get_ordered_ops()
                    if op.get_type_name() not in ("Parameter", "Constant", "Result")]
        self.by_name = {op.get_friendly_name(): op for op in self.ops}
        self.scoped = [(_scope(op.get_friendly_name()), op) for op in self.ops]
        self.meta = {k: (v.dtype, tuple(v.shape), _fingerprint(v)) for k, v in values.items()
                     if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating)}
        # the integer and boolean values the candidate computed: a sub-model reads them as constants
        self.fixed = {k: v for k, v in values.items() if isinstance(v, np.ndarray) and v.dtype.kind in "biu"}
        self.constant: dict[str, bool] = {}  # node name → whether its value depends on constants only
        self.compiled: dict[tuple, Any] = {}
        self.cut: dict[tuple, tuple[Any, list[str]]] = {}

    def extract(self, scope: str, out_key: str):
        """(the site's nodes as an ``openvino.Model`` of their own, its inputs' value keys in order); raises
        :class:`.onnx.NotExtractable`."""
        hit = self.cut.get((scope, out_key))
        if hit is None:
            hit = self.cut[(scope, out_key)] = self._cut(scope, out_key)
        return hit

    def _cut(self, scope: str, out_key: str):
        ov = _openvino()
        opset = ov.opset13
        inside = [op for sc, op in self.scoped if _within(sc, scope)]
        names = {op.get_friendly_name() for op in inside}
        node, _, index = out_key.rpartition(":")
        if node not in names:
            raise NotExtractable("the scope's output is produced outside it")
        if any(op.get_type_name() in _CONTROL for op in inside):
            raise NotExtractable("the scope holds a control-flow or stateful node")
        params: dict[str, Any] = {}
        rewired = []  # (port, its source before): restored once the cut is copied out
        try:
            for op in inside:
                for port in op.inputs():
                    source = port.get_source_output()
                    producer = source.get_node()
                    if producer.get_friendly_name() in names or _constant(producer, self.constant):
                        continue
                    key = _key(source)
                    if key in self.fixed:
                        new = opset.constant(self.fixed[key]).output(0)
                    elif key in self.meta:
                        if key not in params:
                            params[key] = opset.parameter(list(self.meta[key][1]), source.get_element_type())
                        new = params[key].output(0)
                    else:
                        raise NotExtractable(f"no value recorded for the scope's input {key!r}")
                    rewired.append((port, source))
                    port.replace_source_output(new)
            try:
                result = opset.result(self.by_name[node].output(int(index)))
                sub = ov.Model([result], list(params.values()), f"site {scope}").clone()
            except Exception as exc:
                raise NotExtractable(f"OpenVINO cannot build the site's nodes as a model: {type(exc).__name__}: "
                                     f"{str(exc)[:200]}") from None
        finally:
            for port, source in reversed(rewired):
                port.replace_source_output(source)
        return sub, list(params)

    def run(self, scope: str, out_key: str, args, kwargs) -> torch.Tensor:
        """The site's nodes on the reference's inputs (the call's ``args``/``kwargs``): their output."""
        sub, inputs = self.extract(scope, out_key)
        given = reference_feeds(self.meta, inputs, args, kwargs, nested=True)
        return torch.from_numpy(self.call(sub, (scope, out_key), given))

    def call(self, sub, key: tuple, given: list[np.ndarray]) -> np.ndarray:
        """``sub`` compiled for the shapes of ``given`` (cached) and run on them."""
        ov = _openvino()
        shapes = tuple(tuple(a.shape) for a in given)
        compiled = self.compiled.get((key, shapes))
        if compiled is None:
            sub = sub.clone()
            if given:
                _static(sub, list(given))
            try:
                compiled = ov.Core().compile_model(sub, "CPU")
            except Exception as exc:
                raise NotExtractable(f"OpenVINO cannot compile the site's nodes: {type(exc).__name__}: "
                                     f"{str(exc)[:200]}") from None
            self.compiled[(key, shapes)] = compiled
        try:
            out = compiled(list(given))
        except Exception as exc:
            raise NotExtractable(f"OpenVINO failed on the site's nodes: {type(exc).__name__}: {str(exc)[:200]}") \
                from None
        return np.asarray(out[compiled.outputs[0]]).copy()


#: nodes a scope's sub-model cannot hold: control flow and state
_CONTROL = {"If", "Loop", "TensorIterator", "ReadValue", "Assign", "RandomUniform", "Multinomial"}


def _within(sc: str | None, scope: str) -> bool:
    return sc is not None and (sc == scope or sc.startswith(scope + "."))


def _constant(node, memo: dict[str, bool]) -> bool:
    """Whether a node's value depends on constants only (a Parameter is not one)."""
    kind = node.get_type_name()
    if kind == "Constant":
        return True
    if kind in ("Parameter", "Result") or kind in _CONTROL:
        return False
    key = node.get_name()  # unique in a model (a node's Python wrapper is not kept)
    hit = memo.get(key)
    if hit is None:
        memo[key] = False  # a cycle guard; graphs are acyclic
        hit = all(_constant(port.get_source_output().get_node(), memo) for port in node.inputs())
        memo[key] = hit
    return hit


class Site:
    """One site of a model converted elsewhere (its scope and output value): its nodes as a NumPy function of the
    site's one floating input, what ``diff`` infers the candidate's contract from at a norm site that diverges."""

    def __init__(self, submodels: Submodels, scope: str, out_key: str):
        self.submodels, self.scope, self.out_key = submodels, scope, out_key

    def function(self):
        sub, inputs = self.submodels.extract(self.scope, self.out_key)
        if len(inputs) != 1:
            raise NotExtractable(f"the site's nodes take {len(inputs)} inputs, not one")
        dtype = self.submodels.meta[inputs[0]][0]

        def run(x):
            out = self.submodels.call(sub, (self.scope, self.out_key), [np.asarray(x).astype(dtype)])
            return out.astype(np.asarray(x).dtype)

        return run


class OpenVinoCandidate(GraphCandidate):
    """A model as OpenVINO runs it on the CPU, at the runtime's own inference precision (this module):
    the reference converted here (``"openvino"``; a site's own output is its module converted alone), or a model
    converted elsewhere (a site's own output is its nodes cut out of the graph, :class:`Submodels`)."""

    runner = " on OpenVINO"
    scopes_label = "openvino scopes"

    def __init__(self, model, reference: torch.nn.Module):
        super().__init__("", "float32")
        self.converted_here = isinstance(model, str) and model == "openvino"
        self.model_obj = reference if self.converted_here else model
        self.modules = Modules(reference) if self.converted_here else None
        self.submodels: Submodels | None = None
        self.bound_suffix = (" (OpenVINO: the site's module converted alone, on the reference's input)"
                             if self.converted_here else
                             " (OpenVINO: the site's nodes in the candidate's graph, on the reference's input)")
        self.output_hold: str | None = None  # why the model's output cannot be called faithful (judge.graph_output)

    def run(self, args, kwargs) -> None:
        run = run_candidate(self.model_obj, args, kwargs)
        self.values, self.scopes, self.desc, self.dtype, self.final = (run["values"], run["scopes"], run["desc"],
                                                                        run["dtype"], run["final"])
        if not self.converted_here:
            self.submodels = Submodels(run["model"], self.values)
            if run["compressed"] and self.dtype != "float32":
                self.output_hold = (f"the IR stores {run['compressed']} weight constants in 16 bits and OpenVINO "
                                    f"computes in {self.dtype} here: their rounding is inside every site's bound at "
                                    f"{self.dtype}, so whether the IR's weights are the reference's cannot be told; "
                                    "what would decide it: the IR compiled at f32 (INFERENCE_PRECISION_HINT), or "
                                    "saved with compress_to_fp16=False")

    def own(self, r: Record, args, kw, memo: Memo, kids=(), state=None) -> tuple[torch.Tensor, str, Any]:
        if self.modules is None:
            try:
                with torch.no_grad():
                    return self.submodels.run(*r.module, args, kw), self.dtype, Site(self.submodels, *r.module)
            except NotExtractable as exc:
                raise NotMeasured(None, missing=f"OpenVINO: {exc}") from None
        try:
            return self.modules.run(r.path, args, kw), self.dtype, None
        except NotConvertible as exc:
            raise NotMeasured(None, missing=f"OpenVINO: this module alone could not be converted ({exc})") from None


def is_candidate(obj) -> bool:
    return is_openvino(obj)


def candidate(obj, reference, ref_dtype: str, stack) -> OpenVinoCandidate:
    return OpenVinoCandidate(obj, reference)
