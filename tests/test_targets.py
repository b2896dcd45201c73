"""Target v2: named inputs and outputs, output dtypes with the values, declared capabilities, devices, require()."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import normscope
from normscope import InputError, MissingExtraError, TargetError
from normscope.extras import require
from normscope.targets import Capabilities, Outputs
from normscope.targets.torch_target import TorchFunctionTarget, module_device

RNG = np.random.default_rng(7)
X = RNG.normal(size=(2, 4, 16))
R = RNG.normal(size=(2, 4, 16))


def _layer_norm64(v):
    v = np.asarray(v, dtype=np.float64)
    mu = v.mean(-1, keepdims=True)
    return (v - mu) / np.sqrt(((v - mu) ** 2).mean(-1, keepdims=True) + 1e-5)


def fused_add_norm(x, residual):
    """A fused residual-add + LayerNorm as kernels return it: the normalized sum and the sum itself."""
    s = x + residual
    return torch.nn.functional.layer_norm(s, (s.shape[-1],), eps=1e-5), s


# ------------------------------------------------------------------------------------------ named in/out
def test_fused_residual_norm_takes_two_inputs_and_returns_two_outputs():
    t = normscope.targets.torch(fused_add_norm, inputs=("x", "residual"), outputs=("y", "residual_out"))
    out = t.run({"x": X, "residual": R}, "float32")
    assert isinstance(out, Outputs) and out.names == ("y", "residual_out")
    assert out.dtypes == {"y": "float32", "residual_out": "float32"}
    np.testing.assert_array_equal(out["residual_out"], X.astype(np.float32) + R.astype(np.float32))  # in float32
    assert np.abs(out["y"] - _layer_norm64(X + R)).max() < 1e-5
    assert t.calls == 1
    with pytest.raises(InputError, match=r"takes 2 inputs \(x, residual\); infer and check probe one"):
        t(X)
    with pytest.raises(InputError, match="takes the inputs x, residual; got x"):
        t.run({"x": X}, "float32")


def test_named_outputs_by_dict_and_too_few_values_are_clear():
    t = normscope.targets.numpy(lambda x: {"mean": x.mean(-1), "y": x - x.mean(-1, keepdims=True)},
                                outputs=("y", "mean"))
    out = t.run({"x": X}, "float64")
    assert out.names == ("y", "mean") and out["mean"].shape == (2, 4)
    np.testing.assert_array_equal(t(X), X - X.mean(-1, keepdims=True))  # the shortcut gives the first output
    short = normscope.targets.numpy(lambda x: (x,), outputs=("y", "mean"))
    with pytest.raises(TargetError, match="returned 1 values; its declared outputs are y, mean"):
        short.run({"x": X})
    with pytest.raises(InputError, match="distinct non-empty names"):
        normscope.targets.numpy(lambda x: x, inputs=("x", "x"))


def test_single_input_shortcut_keeps_copies_and_the_first_of_a_tuple():
    def in_place(x):
        x.mul_(2.0)
        return x, None  # a tuple: its first element is the output

    t = normscope.targets.torch(in_place)
    given = X.copy()
    out = t(given, "float64")
    np.testing.assert_array_equal(given, X)  # the caller's array is untouched
    np.testing.assert_array_equal(out, 2 * X)
    assert t.input_modifications == 1
    out[...] = 0.0  # the returned array is the caller's own
    np.testing.assert_array_equal(t(X, "float64"), 2 * X)


def test_output_dtype_comes_with_the_values_and_the_old_attribute_still_reads_it():
    t = normscope.targets.torch(lambda x: torch.nn.functional.layer_norm(x.float(), (16,)))
    out = t.run({"x": X}, "bfloat16")
    assert out.dtype == "float32" and t.output_dtype == "float32"  # promoted: reported, not hidden
    t(X, "float16")
    assert t.output_dtype == "float32"
    nt = normscope.targets.numpy(lambda x: x.astype(np.float16))
    assert nt.run({"x": X}, "float32").dtype == "float16" and nt.output_dtype == "float16"


def test_onnx_model_with_two_inputs_and_two_outputs():
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    scale = numpy_helper.from_array(np.ones(16, np.float32), "scale")
    nodes = [helper.make_node("Add", ["x", "skip"], ["sum"]),
             helper.make_node("LayerNormalization", ["sum", "scale"], ["y"], axis=-1, epsilon=1e-5)]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", 16]) for n in ("x", "skip", "y", "sum")]
    graph = helper.make_graph(nodes, "add_norm", info[:2], info[2:], [scale])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    t = normscope.targets.onnx(model)
    assert (t.inputs, t.outputs) == (("x", "skip"), ("y", "sum"))
    out = t.run({"x": X, "skip": R}, "float32")
    assert out.dtypes == {"y": "float32", "sum": "float32"}
    np.testing.assert_allclose(out["sum"], (X.astype(np.float32) + R.astype(np.float32)), rtol=0, atol=0)
    assert np.abs(out["y"] - _layer_norm64(X + R)).max() < 1e-5
    with pytest.raises(InputError, match="takes 2 inputs"):
        t(X)
    with pytest.raises(InputError, match=r"takes 2 inputs \(x, skip\); infer and check probe one"):
        normscope.infer(model, shape=(2, 4, 16))  # one clear error, not "ran on none of the dtypes"


def test_an_onnx_graph_runs_at_bfloat16():
    """onnxruntime runs a bfloat16 graph, but its NumPy binding takes and gives no bfloat16 array ("Numpy_type 256
    can't be converted to MLDataType"): the values go by their bits, and a check asked for bfloat16 ran nowhere
    and failed the target for it."""
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    scale = numpy_helper.from_array(np.linspace(0.5, 1.5, 16).astype(np.float32), "scale")
    node = helper.make_node("LayerNormalization", ["x", "scale"], ["y"], axis=-1, epsilon=1e-5)
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", 16]) for n in ("x", "y")]
    model = helper.make_model(helper.make_graph([node], "ln", info[:1], info[1:], [scale]),
                              opset_imports=[helper.make_opsetid("", 17)])
    t = normscope.targets.onnx(model)
    out = t.run({"x": X}, "bfloat16")
    assert out.dtypes == {"y": "bfloat16"}
    want = _layer_norm64(X) * np.linspace(0.5, 1.5, 16)
    assert np.abs(out["y"] - want).max() < 0.05 * np.abs(want).max()
    r = normscope.check(model, expect="onnxruntime_layernorm:beta=False", shape=(2, 4, 16),
                        dtypes=("float32", "bfloat16"))
    assert r.verdict == "pass", r.text()


def test_a_module_that_needs_more_arguments_says_how_to_fix_the_others():
    """A gated norm's forward(x, gate) called with one input failed at every dtype with Python's "missing 1
    required positional argument"; the error now names the arguments and how to hold them fixed."""
    class Gated(torch.nn.Module):
        def forward(self, hidden_states, gate, scale=1.0):
            return torch.nn.functional.rms_norm(hidden_states, hidden_states.shape[-1:]) * gate * scale

    with pytest.raises(TargetError, match=r"Gated.forward needs 2 arguments \(hidden_states, gate\) and is given 1.*"
                                          r"lambda x: module\(x, gate\)"):
        normscope.targets.torch(Gated())
    gate = torch.rand(16) + 0.5
    assert normscope.infer(lambda x: Gated()(x, gate.to(x.dtype)), shape=(2, 4, 16), framework="torch").spec.kind \
        == "rmsnorm"


# ------------------------------------------------------------------------------------------ capabilities
def test_capabilities_are_declared_once_per_kind_and_read_through_the_old_names():
    module = normscope.targets.torch(torch.nn.LayerNorm(16))
    function = normscope.targets.torch(fused_add_norm, inputs=("x", "r"))
    plain = normscope.targets.numpy(np.tanh)
    assert module.capabilities == Capabilities(differentiable=True, modes=True, noncontiguous=True, parameters=True,
                                               whole_state=True)
    assert function.capabilities == Capabilities(differentiable=True, noncontiguous=True)
    assert plain.capabilities == Capabilities()
    assert (module.has_modes, function.has_modes, plain.differentiable) == (True, False, False)
    assert plain.supported_dtypes == ("float64", "float32", "float16", "bfloat16")
    with pytest.raises(AttributeError):
        module.capabilities.modes = False  # frozen: one place says what a kind of target can do


# ------------------------------------------------------------------------------------------ devices
class _FakeCuda(torch.Tensor):
    """A CPU tensor that behaves like a CUDA one where it matters here: no ``.numpy()`` before ``.cpu()``."""

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                        "to host memory first.")

    def cpu(self, *args, **kwargs):
        return torch.Tensor.cpu(self).as_subclass(torch.Tensor)


def test_tensors_are_built_on_the_device_and_brought_back_with_cpu(monkeypatch):
    seen = []

    def norm(x):
        seen.append(type(x))
        return torch.nn.functional.layer_norm(x, (16,), eps=1e-5)

    monkeypatch.setattr(TorchFunctionTarget, "_place", lambda self, t: t.as_subclass(_FakeCuda))
    t = normscope.targets.torch(norm)
    out = t(X, "float32")  # the input is on the "device"; the copy made for the in-place check is too
    assert seen == [_FakeCuda] and np.abs(out - _layer_norm64(X)).max() < 1e-5
    assert t.call_noncontiguous(X, "float32").shape == X.shape and seen[-1] is _FakeCuda
    dx, _ = t.gradients(X, np.ones_like(X), "float64")
    assert np.abs(dx).max() < 1e-9  # d/dx of sum(LayerNorm(x)) is 0


def test_a_module_is_probed_on_its_own_device():
    ln = torch.nn.LayerNorm(16)
    t = normscope.targets.torch(ln)
    assert t.device == module_device(ln) == torch.device("cpu")
    assert normscope.targets.torch(torch.nn.ReLU()).device == torch.device("cpu")  # no parameters: the CPU
    assert normscope.targets.torch(fused_add_norm, device="cpu").device == torch.device("cpu")
    assert normscope.targets.numpy(np.tanh).device == "cpu"


# ------------------------------------------------------------------------------------------ require
def test_require_names_the_package_and_the_extra(monkeypatch, tmp_path):
    assert require("numpy", "x") is np
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(MissingExtraError, match=r"^onnxruntime is not installed; .*pip install 'normscope\[onnx\]'"):
        require("onnxruntime", "onnx")
    # an installed package whose own import fails is not "missing": its error passes through as it is
    (tmp_path / "broken_pkg_9t.py").write_text("raise ImportError('cannot import name x from y')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="cannot import name x from y") as info:
        require("broken_pkg_9t", "hf")
    assert not isinstance(info.value, MissingExtraError)


def test_a_targets_worker_thread_ends_with_the_target():
    """Every target's calls run on a worker thread that never ended: 50 targets left 51 threads (scan and diff make
    one per site). The worker holds nothing of its target between calls and ends when the target is collected."""
    import gc
    import threading
    import time

    import torch

    from normscope.targets import as_target

    before = threading.active_count()
    for _ in range(50):
        t = as_target(torch.nn.LayerNorm(8))
        t(np.random.default_rng(0).normal(size=(2, 8)), "float32")
        del t
    gc.collect()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]
