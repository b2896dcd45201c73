"""ONNX models as targets, run by onnxruntime (extra ``onnx``).

Inputs and outputs are the graph's, by name (initializers are parameters, not inputs); every input must be
a floating tensor, and ``target(x, dtype)`` needs exactly one. Symbolic dimensions are fine. The model runs
at the element type its first input declares; other precisions run a converted copy of the graph (inputs,
outputs and floating initializers cast), as a deployment at that precision would.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from ..dtypes import dtype_from_onnx, numpy_dtype, onnx_elem_type
from ..errors import TargetError
from ..extras import require
from .base import Capabilities, Target, redraw


def _onnx():
    return require("onnx", "onnx"), require("onnxruntime", "onnx")


def _floating(elem_type: int) -> bool:
    return dtype_from_onnx(elem_type) is not None


def load_model(model):
    onnx, _ = _onnx()
    if isinstance(model, onnx.ModelProto):
        private = onnx.ModelProto()
        private.CopyFrom(model)  # probing may rewrite initializers; never the caller's model
        return private, "ONNX model"
    if isinstance(model, bytes | bytearray):
        try:
            return onnx.load_model_from_string(bytes(model)), "ONNX model (bytes)"
        except Exception as exc:
            raise TargetError(f"the bytes are not an ONNX model: {exc}") from exc
    if isinstance(model, str | os.PathLike):
        path = Path(model)
        if not path.is_file():
            raise TargetError(f"no such ONNX file: {path}")
        try:
            return onnx.load(str(path)), f"ONNX model {path.name}"
        except Exception as exc:
            raise TargetError(f"{path} is not a readable ONNX model: {exc}") from exc
    raise TargetError(f"expected an ONNX path, bytes or onnx.ModelProto; got {type(model).__name__}")


class OnnxTarget(Target):
    framework = "onnx"
    capabilities = Capabilities(parameters=True)

    def __init__(self, model, description: str | None = None):
        onnx, ort = _onnx()
        self.model, default = load_model(model)
        graph = self.model.graph
        inits = {i.name for i in graph.initializer}
        inputs = [i for i in graph.input if i.name not in inits]
        if not inputs or not graph.output:
            raise TargetError(f"the ONNX model has {len(inputs)} inputs and {len(graph.output)} outputs; normscope "
                              "needs at least one float input and one output")
        for vi in inputs:
            elem = vi.type.tensor_type.elem_type
            if not _floating(elem):
                raise TargetError(f"the ONNX input {vi.name!r} is not a float tensor (element type {elem})")
        self.graph_inputs = inputs
        self.input = inputs[0]
        self.dtype = dtype_from_onnx(self.input.type.tensor_type.elem_type)
        self.fixed_dims = {vi.name: _dims(vi) for vi in inputs}  # None: no declared shape, any --shape is tried
        self._ort = ort
        self._sessions: dict[str, object] = {}
        super().__init__(description or default, [vi.name for vi in inputs], [o.name for o in graph.output])

    def _variant(self, dtype: str):
        """The model with its input, output and floating initializers converted to ``dtype``.

        This is how the same graph is deployed at another precision; attributes such as
        LayerNormalization's ``stash_type`` are kept, so the runtime's own precision rules apply.
        """
        if dtype == self.dtype:
            return self.model
        from onnx import numpy_helper

        code = onnx_elem_type(dtype)
        m = type(self.model)()
        m.CopyFrom(self.model)
        for init in m.graph.initializer:
            if _floating(init.data_type):
                arr = numpy_helper.to_array(init).astype(np.float64)
                init.CopyFrom(numpy_helper.from_array(arr.astype(np.float32).astype(numpy_dtype(dtype)), init.name))
        for vi in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
            if _floating(vi.type.tensor_type.elem_type):
                vi.type.tensor_type.elem_type = code
        return m

    def session(self, dtype: str | None = None):
        dtype = dtype or self.dtype
        if dtype not in self._sessions:
            opts = self._ort.SessionOptions()
            opts.log_severity_level = 3
            try:
                self._sessions[dtype] = self._ort.InferenceSession(
                    self._variant(dtype).SerializeToString(), opts, providers=["CPUExecutionProvider"])
            except Exception as exc:
                raise TargetError(f"onnxruntime cannot run {self.description} at {dtype}: {exc}") from exc
        return self._sessions[dtype]

    def check_shape(self, shape: tuple[int, ...], name: str | None = None) -> None:
        """A TargetError naming the --shape to pass when ``shape`` does not fit the input's declared one."""
        fixed = self.fixed_dims[name or self.input.name]
        if fixed is None:
            return
        if len(fixed) != len(shape) or any(d is not None and d != s for d, s in zip(fixed, shape, strict=False)):
            dims = ["?" if d is None else str(d) for d in fixed]
            hint = [d if d != "?" else (str(shape[i]) if i < len(shape) else "2") for i, d in enumerate(dims)]
            which = "" if len(self.inputs) == 1 else f" {name!r}"
            raise TargetError(
                f"the ONNX input{which} has shape ({', '.join(dims)}) but the probe shape is {tuple(shape)}; "
                f"pass --shape {','.join(hint)}"
            )

    def _run(self, inputs, dtype):
        feed = {}
        for name in self.inputs:
            x = inputs[name]
            self.check_shape(x.shape, name)
            feed[name] = x.astype(np.float32).astype(numpy_dtype(dtype)) if dtype != "float64" else x
        if dtype == "bfloat16":  # onnxruntime's numpy binding takes no bfloat16 array: its own values, by bits
            code = onnx_elem_type(dtype)
            values = {k: self._ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                np.ascontiguousarray(v).view(np.uint16), code) for k, v in feed.items()}
            out = [_array(v) for v in self.session(dtype).run_with_ort_values(None, values)]
        else:
            out = self.session(dtype).run(None, feed)
        return self.outputs_from(tuple(out), lambda v: np.asarray(v).astype(np.float64))

    def parameters(self):
        from onnx import numpy_helper

        return {i.name: numpy_helper.to_array(i).astype(np.float64) for i in self.model.graph.initializer
                if _floating(i.data_type)}

    @contextlib.contextmanager
    def redrawn_parameters(self):
        from onnx import numpy_helper

        vectors = [i for i in self.model.graph.initializer if _floating(i.data_type) and int(np.prod(i.dims or [1])) > 1]
        if not vectors:
            yield None
            return
        saved = [(i, numpy_helper.to_array(i).copy()) for i in vectors]
        drawn = redraw({i.name: tuple(arr.shape) for i, arr in saved})
        values = {}
        for init, arr in saved:
            v = drawn[init.name].astype(arr.dtype)
            init.CopyFrom(numpy_helper.from_array(v, init.name))
            values[init.name] = v.astype(np.float64)
        self._sessions.clear()
        try:
            yield values
        finally:
            for init, arr in saved:
                init.CopyFrom(numpy_helper.from_array(arr, init.name))
            self._sessions.clear()

    @contextlib.contextmanager
    def perturbed_parameters(self, rng):
        from onnx import numpy_helper

        floating = [i for i in self.model.graph.initializer if _floating(i.data_type) and
                    int(np.prod(i.dims or [1])) > 1]
        if not floating:
            yield None
            return
        saved = [(i, numpy_helper.to_array(i).copy()) for i in floating]
        values = {}
        for init, arr in saved:
            v = rng.uniform(0.5, 1.5, size=arr.shape) * rng.choice([-1.0, 1.0], size=arr.shape)
            init.CopyFrom(numpy_helper.from_array(v.astype(arr.dtype), init.name))
            values[init.name] = v.astype(arr.dtype).astype(np.float64)
        self._sessions.clear()
        try:
            yield values
        finally:
            for init, arr in saved:
                init.CopyFrom(numpy_helper.from_array(arr, init.name))
            self._sessions.clear()



def _array(value) -> np.ndarray:
    """An onnxruntime OrtValue as a NumPy array of its own dtype (a bfloat16 tensor read by its bits: the binding
    has no NumPy type for it)."""
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    import ctypes

    shape = tuple(value.shape())
    n = int(np.prod(shape))
    bits = np.frombuffer((ctypes.c_uint16 * n).from_address(value.data_ptr()), np.uint16, n) if n else \
        np.empty(0, np.uint16)
    return bits.copy().reshape(shape).view(numpy_dtype("bfloat16"))


def _dims(vi) -> list[int | None] | None:
    """An input's declared dimensions (None for a symbolic one); None when it declares no shape at all."""
    tensor = vi.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
