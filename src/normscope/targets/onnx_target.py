"""ONNX models as targets, run by onnxruntime (extra ``onnx``).

A model with one floating input and one output; symbolic dimensions are fine. The model runs at the
element type its input declares; other precisions run a converted copy of the graph (input, output and
floating initializers cast), as a deployment at that precision would.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from ..errors import MissingExtraError, TargetError
from .base import Target, dtype_of

_ELEM = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}


def _onnx():
    try:
        import onnx
        import onnxruntime
    except ImportError as exc:
        raise MissingExtraError(exc.name or "onnx and onnxruntime", "onnx") from exc
    return onnx, onnxruntime


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

    def __init__(self, model, description: str | None = None):
        onnx, ort = _onnx()
        self.model, default = load_model(model)
        graph = self.model.graph
        inits = {i.name for i in graph.initializer}
        inputs = [i for i in graph.input if i.name not in inits]
        if len(inputs) != 1 or len(graph.output) != 1:
            raise TargetError(
                f"the ONNX model has {len(inputs)} inputs and {len(graph.output)} outputs; normscope needs "
                "one float input and one output (fold γ/β into initializers)"
            )
        self.input = inputs[0]
        elem = self.input.type.tensor_type.elem_type
        if elem not in _ELEM:
            raise TargetError(f"the ONNX input {self.input.name!r} is not a float tensor (element type {elem})")
        self.dtype = _ELEM[elem]
        tensor = self.input.type.tensor_type  # no declared shape at all: any --shape is tried
        self.fixed_dims = [d.dim_value if d.HasField("dim_value") else None
                           for d in tensor.shape.dim] if tensor.HasField("shape") else None
        self._ort = ort
        self._sessions: dict[str, object] = {}
        super().__init__(description or default)

    def _variant(self, dtype: str):
        """The model with its input, output and floating initializers converted to ``dtype``.

        This is how the same graph is deployed at another precision; attributes such as
        LayerNormalization's ``stash_type`` are kept, so the runtime's own precision rules apply.
        """
        if dtype == self.dtype:
            return self.model
        from onnx import numpy_helper

        code = {v: k for k, v in _ELEM.items()}[dtype]
        m = type(self.model)()
        m.CopyFrom(self.model)
        for init in m.graph.initializer:
            if init.data_type in _ELEM:
                arr = numpy_helper.to_array(init).astype(np.float64)
                init.CopyFrom(numpy_helper.from_array(arr.astype(np.float32).astype(_np_dtype(dtype)), init.name))
        for vi in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
            if vi.type.tensor_type.elem_type in _ELEM:
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

    def check_shape(self, shape: tuple[int, ...]) -> None:
        if self.fixed_dims is None:
            return
        if len(self.fixed_dims) != len(shape) or any(
            d is not None and d != s for d, s in zip(self.fixed_dims, shape, strict=False)
        ):
            dims = ["?" if d is None else str(d) for d in self.fixed_dims]
            hint = [d if d != "?" else (str(shape[i]) if i < len(shape) else "2") for i, d in enumerate(dims)]
            raise TargetError(
                f"the ONNX input has shape ({', '.join(dims)}) but the probe shape is {tuple(shape)}; "
                f"pass --shape {','.join(hint)}"
            )

    def _run(self, x, dtype):
        self.check_shape(x.shape)
        arr = x.astype(np.float32).astype(_np_dtype(dtype)) if dtype != "float64" else x
        (out,) = self.session(dtype).run(None, {self.input.name: arr})
        self.output_dtype = dtype_of(out)
        return np.asarray(out).astype(np.float64)

    def parameters(self):
        from onnx import numpy_helper

        return {i.name: numpy_helper.to_array(i).astype(np.float64) for i in self.model.graph.initializer
                if i.data_type in _ELEM}

    @contextlib.contextmanager
    def perturbed_parameters(self, rng):
        from onnx import numpy_helper

        floating = [i for i in self.model.graph.initializer if i.data_type in _ELEM and
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


def _np_dtype(name: str):
    import ml_dtypes

    return {"float32": np.float32, "float16": np.float16, "float64": np.float64,
            "bfloat16": ml_dtypes.bfloat16}[name]
