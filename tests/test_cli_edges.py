"""The command line and the API at their edges, run in-process (``main(argv)`` returns the exit code).

Exit 1 means only "a check failed"; every usage or input problem is one line on stderr with exit 2; a hung
target is exit 4, Ctrl-C 130, a closed pipe 141. No traceback, no warning reaches the user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import normscope
from normscope import InputError, NormSpec, SpecError, TargetTimeout
from normscope.cli import EXIT_CODES, build_parser, main
from normscope.loading import parse_shape
from normscope.sources import load_target


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run ``normscope ARGS`` in-process at 80 columns: (exit code, stdout, stderr)."""
    monkeypatch.setenv("COLUMNS", "80")

    def run(*args: str):
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Write Python modules into a folder on sys.path: modules(name=source)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(**sources: str):
        for name, src in sources.items():
            (tmp_path / f"{name}.py").write_text(textwrap.dedent(src))
            sys.modules.pop(name, None)
        return tmp_path

    yield write


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def numpy_ln(x):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)


LN = ("torch.nn:LayerNorm", "--args", "[16]", "--shape", "2,16")


# ---------------------------------------------------------------------------------------- errors → exit 2
def spec_file(path, **changes):
    data = NormSpec.preset("torch_groupnorm").to_dict()
    data.update(changes)
    path.write_text(json.dumps(data))
    return str(path)


def test_groups_that_do_not_divide_the_channels_are_one_clear_error(cli, tmp_path):
    gn4 = spec_file(tmp_path / "gn4.json", groups=4)
    for expect in (gn4, "torch_groupnorm:groups=4"):
        code, _, err = cli("check", "torch.nn:GroupNorm", "--args", "[2, 6]", "--shape", "2,6,4,4", "--expect",
                           expect, "--quick")
        assert code == 2
        assert "6 channels, which do not split into 4 groups" in one_line(err)
    with pytest.raises(InputError, match="do not split into 4 groups"):
        normscope.check(numpy_ln, expect=NormSpec.preset("torch_groupnorm", groups=4), shape=(2, 6, 4, 4),
                        framework="numpy")


@pytest.mark.parametrize("source, words", [
    ("raise RuntimeError('boom at import')", "RuntimeError: boom at import"),
    ("def f(:\n    pass", "syntax error in"),
    ("import math\nmath.no_such_thing", "AttributeError"),
    ("import no_such_dependency_xyz", "no module named 'no_such_dependency_xyz'"),
])
def test_a_module_that_fails_at_import_is_exit_2(cli, modules, source, words):
    modules(brokenmod=source)
    code, _, err = cli("infer", "brokenmod:f", "--shape", "2,16")
    assert code == 2
    line = one_line(err)
    assert words in line and "brokenmod" in line


def test_current_directory_hint_when_the_module_is_there_but_not_importable(cli, tmp_path, monkeypatch):
    (tmp_path / "herenorm.py").write_text("def f(x):\n    return x\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("infer", "herenorm:f", "--shape", "2,16")
    assert code == 2 and "PYTHONPATH=." in one_line(err)


def test_expect_file_that_is_not_utf8(cli, tmp_path):
    utf16 = tmp_path / "spec.json"
    utf16.write_text(json.dumps(NormSpec.preset("torch_layernorm").to_dict()), encoding="utf-16")
    binary = tmp_path / "model.onnx"
    binary.write_bytes(bytes(range(256)))
    for path, words in ((utf16, "looks like UTF-16"), (binary, "not a UTF-8 text file")):
        code, _, err = cli("check", *LN, "--expect", str(path))
        assert code == 2 and words in one_line(err)


@pytest.mark.parametrize("flag", ["--args", "--kwargs", "--expect"])
def test_deeply_nested_json_is_exit_2(cli, tmp_path, flag):
    deep = "[" * 100_000 + "]" * 100_000
    args = list(LN) + ["--expect", "torch_layernorm"]
    if flag == "--expect":
        path = tmp_path / "deep.json"
        path.write_text(deep)
        args[-1] = str(path)
    else:
        args += [flag, deep]
    code, _, err = cli("check", *args)
    assert code == 2 and "nested too deeply" in one_line(err)


def test_a_huge_args_list_is_not_echoed(cli):
    code, _, err = cli("check", "torch.nn:LayerNorm", "--args", json.dumps(list(range(30_000))), "--shape", "2,16",
                       "--expect", "torch_layernorm")
    assert code == 2 and len(one_line(err)) < 600


@pytest.mark.parametrize("shape, words", [
    ("99999999999999999999,64", "memory"),
    ("-1,64", "'-1', not a size"),
    ("2,,64", "an empty size"),
    ("2,0,64", "sizes must be ≥ 1"),
    ("2,x,64", "'x', not a size"),
])
def test_bad_shapes_are_exit_2(cli, shape, words):
    code, _, err = cli("infer", "torch.nn:LayerNorm", "--args", "[64]", "--shape", shape)
    assert code == 2 and words in one_line(err)


def test_a_shape_too_large_for_memory_is_refused_up_front(cli, monkeypatch):
    import normscope.inputs as inputs

    monkeypatch.setattr(inputs, "available_bytes", lambda: 4 * 2**30)  # 4 GB free
    code, _, err = cli("check", "torch.nn:LayerNorm", "--args", "[1024]", "--shape", "64,1024,1024", "--expect",
                       "torch_layernorm")
    assert code == 2
    line = one_line(err)
    assert "needs about 20.0 GB" in line and "4.0 GB is available" in line
    assert inputs.probe_bytes((64, 1024, 1024)) == 64 * 1024 * 1024 * 8 * inputs.COPIES_AT_PEAK


@pytest.mark.parametrize("shape, words", [
    ("2,8,64", "not the string '2,8,64'"),
    (None, "shape is required"),
    ((0, 64), "sizes must be ≥ 1"),
    ((2.5, 64), "whole numbers"),
    ((), "empty"),
    ((10**12, 10**12), "memory"),
])
def test_the_api_gives_the_same_clear_shape_errors(shape, words):
    for fn in (lambda: normscope.check(numpy_ln, expect="torch_layernorm", shape=shape, framework="numpy"),
               lambda: normscope.infer(numpy_ln, shape=shape, framework="numpy")):
        with pytest.raises(InputError, match=words):
            fn()


def test_junit_path_is_checked_before_anything_runs(cli):
    # the target does not even exist: the --junit problem is reported first
    code, _, err = cli("check", "no_such_module_xyz:X", "--shape", "2,16", "--expect", "torch_layernorm",
                       "--junit", "/nonexistent/x.xml")
    assert code == 2 and "--junit" in one_line(err)
    code, _, err = cli("check", *LN, "--expect", "torch_layernorm", "--junit", "/proc/normscope-x.xml")
    assert code == 2 and "cannot write there" in one_line(err)


def test_explain_overflow_is_refused_and_json_has_no_infinity(cli):
    code, out, err = cli("explain", "1e308", "1e308", "-1e308")
    assert code == 2 and "layernorm.mean overflows" in one_line(err) and out == ""
    code, out, _ = cli("explain", "--json", "1e150", "1", "2")
    assert code == 0 and "Infinity" not in out and "NaN" not in out
    json.loads(out)


def test_a_closed_pipe_is_exit_141_without_traceback(cli, monkeypatch):
    class ClosedPipe:
        def write(self, _text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            raise ValueError("no file")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    code = main(["presets", "--json"])
    monkeypatch.undo()
    assert code == 141


@pytest.mark.parametrize("argv", [["explain"], ["presets"], ["check", "torch.nn:LayerNorm", "--args", "[16]",
                                                                  "--shape", "2,16", "--quick", "--expect",
                                                                  "torch_layernorm"]])
def test_a_closed_pipe_under_text_output_is_exit_141(argv):
    """`normscope … | head -1`: text output (rich's console, not --json) into a closed pipe exits 141, never 1
    ("check failed"), and prints no traceback. The pipe is closed before the command writes (head having
    exited), so the test does not depend on timing."""
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(Path(normscope.__file__).resolve().parents[1])}
    p = subprocess.Popen([sys.executable, "-m", "normscope", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env)
    p.stdout.close()  # the reader is gone, as after head -1
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert "Traceback" not in err


def test_a_target_that_returns_nan_fails_the_check_not_the_usage(cli, modules):
    """A target that runs and returns all NaN: exit 1 (the target failed its check) with a finding per dtype, not
    exit 2 (a usage or input error)."""
    modules(allnan="import numpy as np\ndef f(x):\n    return np.full_like(x, np.nan)\n")
    code, out, err = cli("check", "allnan:f", "--framework", "numpy", "--shape", "2,16", "--expect",
                         "torch_layernorm", "--quick")
    assert code == 1, err
    assert "the output is not finite" in out and "FAIL" in out


def test_a_target_that_raises_on_a_valid_input_fails_the_check_not_the_usage(cli, modules):
    """A target that runs on ordinary inputs and raises on one the battery builds (a constant row): exit 1 with a
    failed finding carrying the exception's type and its message line, not exit 2; the user's own mistakes (a
    shape the target does not take) stay exit 2."""
    modules(picky="""
        import numpy as np
        def f(x):
            v = x.var(-1, keepdims=True)
            if (v < 1e-6).any():
                raise ZeroDivisionError("variance too small\\nsecond line")
            return (x - x.mean(-1, keepdims=True)) / np.sqrt(v + 1e-5)
    """)
    code, out, err = cli("check", "picky:f", "--framework", "numpy", "--shape", "2,16", "--expect",
                         "torch_layernorm:affine=false", "--quick")
    assert code == 1, err
    flat = " ".join(out.split())
    assert "FAIL target / raised during degenerate and extreme inputs" in flat, out
    assert "the target raised ZeroDivisionError: variance too small — on a float32 input of shape (2, 16)" in flat
    assert "second line" not in out.split("inference could not")[0] and "The battery stopped here" in flat
    import picky

    r = normscope.check(picky.f, expect="torch_layernorm:affine=false", shape=(2, 16), framework="numpy",
                        quick=True, explain_failures=False)
    (f,) = r.find("target.raised")
    assert f.status == "fail" and f.params == {"section": "extreme"} and f.measured.startswith("ZeroDivisionError")
    assert r.verdict == "fail" and r.failures == [f]
    code, _, err = cli("check", "torch.nn:LayerNorm", "--args", "[64]", "--shape", "2,32", "--expect",
                       "torch_layernorm", "--quick")
    assert code == 2 and one_line(err).endswith("(check --shape)")


def test_ctrl_c_is_one_line_and_exit_130(cli, modules):
    modules(ctrlc="def f(x):\n    raise KeyboardInterrupt\n")
    code, _, err = cli("infer", "ctrlc:f", "--framework", "numpy", "--shape", "2,16")
    assert code == 130 and one_line(err).endswith("interrupted")


def test_ctrl_c_swallowed_by_native_code_still_exits_130(cli, monkeypatch):
    """Native callbacks (llvmlite's, OpenVINO's) print "Exception ignored" and return: the interrupt still counts."""
    import signal

    from normscope.cli import presets

    calls = []

    def swallows_the_interrupt(args, console):
        calls.append(args)
        if len(calls) == 1:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs here
            except KeyboardInterrupt:
                pass
        return 0

    monkeypatch.setattr(presets, "run", swallows_the_interrupt)
    # as in a fresh `normscope` process: Python's own handler, SIGINT not blocked (whatever earlier tests left)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        before = signal.getsignal(signal.SIGINT)
        code, _, err = cli("presets")
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        signal.signal(signal.SIGINT, outer)
    assert code == 130 and one_line(err).endswith("interrupted"), (code, err, outer, blocked)
    assert after is before  # the caller's handler is back
    code, _, _ = cli("presets", "--json")  # a later run is not marked by the earlier interrupt
    assert code == 0


# ------------------------------------------------------------------------------------------------ time
def test_a_hung_target_is_reported_as_such(cli, modules):
    modules(hangs="""
        import threading
        release = threading.Event()

        def f(x):
            release.wait(30)
            return x
    """)
    import time

    started = time.perf_counter()
    try:
        code, _, err = cli("infer", "hangs:f", "--framework", "numpy", "--shape", "2,16", "--timeout", "0.3")
    finally:
        sys.modules["hangs"].release.set()
    assert code == 4
    line = one_line(err)
    assert "the target hung" in line and "did not return within 0.3 s" in line and "--timeout" in line
    assert time.perf_counter() - started < 10


def test_a_hung_target_in_the_api_raises_target_timeout_not_a_refusal():
    release = threading.Event()

    def hangs(x):
        release.wait(30)
        return numpy_ln(x)

    t = normscope.targets.numpy(hangs)
    t.timeout = 0.2
    try:
        with pytest.raises(TargetTimeout, match="did not return within 0.2 s"):
            normscope.check(t, expect="torch_layernorm", shape=(2, 16), quick=True)
    finally:
        release.set()
    assert not isinstance(TargetTimeout("x"), normscope.TargetError)  # no probe may read it as a refusal


def test_the_deadline_runs_the_target_in_the_callers_context_and_passes_errors_through():
    import contextvars

    flag = contextvars.ContextVar("flag", default="unset")

    def needs_context(x):
        if flag.get() != "set by the caller":
            raise AssertionError(f"the caller's context was lost in the worker thread: {flag.get()}")
        return numpy_ln(x)

    t = normscope.targets.numpy(needs_context)
    with pytest.raises(normscope.TargetError, match="context was lost"):
        t(np.ones((2, 16)), "float32")
    token = flag.set("set by the caller")
    try:
        assert t(np.random.default_rng(0).normal(size=(2, 16)), "float32").shape == (2, 16)
    finally:
        flag.reset(token)


def test_every_call_of_a_target_runs_on_one_thread():
    """A library whose state belongs to the thread that created it (a compile cache opened at the first call)
    works: every call of one target runs on the same long-lived worker, not a fresh thread each."""
    local, opened = threading.local(), []

    def thread_bound(x):
        if not hasattr(local, "cache"):  # thread idents are reused; a thread-local object is not
            if opened:
                raise RuntimeError("this cache was opened on another thread")
            local.cache = True
            opened.append(threading.current_thread())
        return numpy_ln(x)

    t = normscope.targets.numpy(thread_bound)
    spec = normscope.infer(t, shape=(2, 16)).spec
    assert spec.kind == "layernorm" and spec.center and not spec.gamma
    assert opened[0] is not threading.current_thread() and t.calls > 10


def test_slow_targets_get_a_time_estimate_on_stderr(capsys, monkeypatch):
    import normscope.cli.common as cli_module

    class Slow:
        description, calls = "NumPy function slow", 0

    t = Slow()
    monkeypatch.setattr(cli_module, "SLOW_CALL_S", 0.0)
    shown = []
    update = cli_module._progress("check --quick", t, shown.append)
    t.calls = 3
    update("hand case")
    update("invariances")
    err = capsys.readouterr().err
    assert shown[-1].startswith("check --quick: invariances · 3 calls,")
    assert err.count("s per call") == 1 and "about 45 calls" in err


def test_help_and_explain_do_not_load_the_probes_or_numpy():
    code = ("import sys, normscope.cli as c; c.build_parser(); "
            "print(sorted(m for m in ('numpy', 'torch', 'normscope.battery', 'rich') if m in sys.modules))")
    src = str(Path(normscope.__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": src}).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------ knobs, inputs
def test_preset_knobs_on_the_command_line(cli):
    from normscope.presets import preset_from_text

    assert preset_from_text("torch_groupnorm:groups=32,eps=1e-6") == NormSpec.preset("torch_groupnorm", groups=32,
                                                                                     eps=1e-6)
    with pytest.raises(SpecError, match="no knob 'group'.*groups=2"):
        preset_from_text("torch_groupnorm:group=32")
    gn = ("torch.nn:GroupNorm", "--args", "[4, 8]", "--shape", "2,8,3,3", "--quick")
    assert cli("check", *gn, "--expect", "torch_groupnorm:groups=4")[0] == 0
    assert cli("check", *gn, "--expect", "torch_groupnorm")[0] == 1  # 2 groups expected, 4 found
    code, out, _ = cli("presets")
    assert code == 0 and "knobs: groups=2, eps=1e-05, spatial_dims=2, affine=True" in out


@pytest.mark.parametrize("layer, shape", [("BatchNorm1d", "8,4"), ("BatchNorm1d", "8,4,5"), ("BatchNorm3d", "4,3,2,2,2")])
def test_torch_batchnorm_fits_1d_and_3d_shapes(cli, layer, shape):
    code, out, err = cli("check", f"torch.nn:{layer}", "--args", f"[{shape.split(',')[1]}]", "--shape", shape,
                         "--expect", "torch_batchnorm", "--quick")
    assert code == 0, out + err


def test_zero_argument_factory_is_called_with_empty_args(modules):
    modules(factories="import torch\ndef make():\n    return torch.nn.LayerNorm(16)\n")
    import torch

    assert isinstance(load_target("factories:make", "[]"), torch.nn.LayerNorm)
    assert callable(load_target("factories:make")) and not isinstance(load_target("factories:make"), torch.nn.Module)


def test_onnx_without_declared_shape_and_upper_case_suffix(cli, tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.full(16, 1.5, np.float32), "scale"),
             numpy_helper.from_array(np.full(16, 0.25, np.float32), "B")]
    node = helper.make_node("LayerNormalization", ["x", "scale", "B"], ["y"], axis=-1, epsilon=1e-5)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)  # no declared shape at all
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    path = tmp_path / "LN.ONNX"
    onnx.save(helper.make_model(helper.make_graph([node], "g", [x], [y], inits),
                                opset_imports=[helper.make_opsetid("", 17)]), str(path))
    assert normscope.targets.as_target(str(path)).framework == "onnx"
    code, out, err = cli("check", str(path), "--shape", "2,4,16", "--expect", "onnxruntime_layernorm", "--quick")
    assert code == 0, out + err


def test_spec_json_eps_must_be_a_stated_number(cli, tmp_path):
    data = NormSpec.preset("torch_layernorm").to_dict()
    for changes, words in (({"eps": "1e-5"}, '"eps" must be a JSON number'), ({"eps": True}, "must be a"),
                           ({"eps": None}, "must be a")):
        with pytest.raises(SpecError, match=words):
            NormSpec.from_dict({**data, **changes})
    with pytest.raises(SpecError, match='no "eps"'):
        NormSpec.from_dict({k: v for k, v in data.items() if k != "eps"})
    path = tmp_path / "s.json"
    path.write_text(json.dumps({**data, "eps": "1e-5"}))
    code, _, err = cli("check", *LN, "--expect", str(path))
    assert code == 2 and "JSON number" in one_line(err)


def test_repeated_dtypes_run_once(cli, tmp_path):
    from normscope.targets.base import check_dtype_list

    assert check_dtype_list("float32,float32,bf16") == ("float32", "bfloat16")
    junit = tmp_path / "out.xml"
    code, _, _ = cli("check", *LN, "--expect", "torch_layernorm", "--quick", "--dtypes", "float32,float32",
                     "--junit", str(junit))
    assert code == 0
    import xml.etree.ElementTree as ET

    names = [(c.get("classname"), c.get("name")) for c in ET.parse(junit).getroot().iter("testcase")]
    assert len(names) == len(set(names)) > 10


def test_refused_dtypes_are_named(cli, modules):
    modules(nobf16="""
        import numpy as np
        def f(x):
            if x.dtype.name not in ("float32", "float64"):
                raise TypeError(f"no {x.dtype.name} here")
            return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    """)
    code, out, err = cli("check", "nobf16:f", "--framework", "numpy", "--shape", "2,16", "--expect",
                         "torch_layernorm:affine=false", "--quick")
    assert "not checked at float16: the target refuses it" in out and "no float16 here" in out, out + err


def test_numpy_and_torch_warnings_never_reach_the_user(cli, modules):
    # warnings.warn-style warnings, which np.errstate does not cover (the old code leaked 218 in the API)
    modules(noisy="""
        import numpy as np
        def f(x):
            np.mean(x[..., :0])                     # RuntimeWarning: Mean of empty slice
            y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
            return y + 0j                           # ComplexWarning when normscope casts the output to real
    """)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code, out, err = cli("check", "noisy:f", "--framework", "numpy", "--shape", "2,16", "--expect",
                             "torch_layernorm", "--quick")
        import noisy

        normscope.check(noisy.f, expect="torch_layernorm", shape=(2, 16), framework="numpy", quick=True)
        normscope.infer(noisy.f, shape=(2, 16), framework="numpy")
    assert code == 1 and "Warning" not in err
    assert [str(w.message) for w in seen] == []


def test_missing_extra_names_the_missing_package(monkeypatch):
    from normscope.errors import MissingExtraError
    from normscope.targets import onnx_target

    assert "onnx and onnxruntime are not installed" in str(MissingExtraError("onnx and onnxruntime", "onnx"))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(MissingExtraError, match=r"^onnxruntime is not installed"):
        onnx_target._onnx()


def test_shape_hint_only_when_the_shape_is_the_cause(cli, modules):
    modules(refuses="def f(x):\n    raise ValueError('refusing this input on principle')\n")
    code, _, err = cli("infer", "refuses:f", "--framework", "numpy", "--shape", "2,16")
    assert code == 2 and "(check --shape)" not in one_line(err)
    code, _, err = cli("infer", "torch.nn:LayerNorm", "--args", "[64]", "--shape", "2,32")
    assert code == 2 and one_line(err).endswith("(check --shape)")


def test_parse_shape_round_trip():
    assert parse_shape(" 2, 8 ,64") == (2, 8, 64)


# ------------------------------------------------------------------------------------------------ output
def test_check_output_fits_a_screen_and_verbose_shows_everything(cli):
    code, out, _ = cli("check", "torch.nn:RMSNorm", "--args", "[64]", "--shape", "2,8,64", "--expect",
                       "torch_rmsnorm", "--quick")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) <= 30 and max(len(line) for line in lines) <= 80
    assert not any(line != line.rstrip() for line in lines if line.strip())
    assert "  reference" in out and "PASS reference / forward" not in out
    assert out.count("passes folded") == 1  # said once, with the verdict; the closing count line repeats no hint
    assert lines[-1].startswith("PASS: ") and "folded" not in lines[-1]
    assert not any(ch in out for ch in "┏│━")  # plain lines: readable in CI logs
    code, verbose, _ = cli("check", "torch.nn:RMSNorm", "--args", "[64]", "--shape", "2,8,64", "--expect",
                           "torch_rmsnorm", "--quick", "--verbose")
    assert code == 0 and "PASS reference / forward" in verbose and len(verbose.splitlines()) > len(lines) + 15


def test_failures_are_shown_in_full(cli):
    code, out, _ = cli("check", "zoo:seed_layer_norm", "--framework", "numpy", "--shape", "2,8,64", "--expect",
                       "torch_layernorm", "--quick")
    assert code == 1
    assert "FAIL extreme / constant vector: measured" in out and "tolerance" in out
    assert "found ε outside √ (std+ε)" in out


# ------------------------------------------------------------------------------------------- help, usage
def test_no_subcommand_prints_usage_exit_2(cli):
    code, out, _ = cli()
    assert code == 2 and "usage: normscope" in out and "exit codes" in out


def test_every_option_says_its_default_and_the_exit_codes_are_listed():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.dest in ("help", "json", "values", "target"):
                continue
            assert action.help, (name, action.dest)
            if action.option_strings and not action.required:
                assert "default" in action.help, (name, action.option_strings)
    for code in ("0 ", "1 ", "2 ", "3 ", "4 ", "5 ", "130", "141"):
        assert f"\n  {code}" in EXIT_CODES
    assert "a check failed" in EXIT_CODES or "finding failed" in EXIT_CODES


def test_a_crash_is_its_own_exit_code_never_a_failed_check(monkeypatch, capsys):
    """A bug raising out of a command was exit 1 (with a traceback), which CI reads as "the check failed"."""
    from normscope import cli
    from normscope.cli import presets

    def boom(args, console):
        raise RuntimeError("a bug")

    monkeypatch.setattr(presets, "run", boom)
    assert cli.main(["presets"]) == 70
    err = capsys.readouterr().err
    assert "RuntimeError: a bug" in err and "internal error" in err and "not a verdict" in err


def test_an_unknown_verdict_is_an_internal_error_never_a_pass(monkeypatch, capsys):
    """The verdict → exit code map read anything but fail or inconclusive as 0: a verdict it does not know (a bug)
    passed CI. It is exit 70, with one line saying so."""
    import importlib
    from types import SimpleNamespace

    from normscope.exitcodes import EXIT_CRASH, EXIT_DIVERGED, EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_OK
    from normscope.results.verdict import exit_code

    assert [exit_code(v) for v in ("pass", "fail", "inconclusive")] == [EXIT_OK, EXIT_FAIL, EXIT_INCONCLUSIVE]
    assert exit_code("fail", fail=EXIT_DIVERGED) == EXIT_DIVERGED
    assert exit_code("passed") == exit_code("") == exit_code(None) == EXIT_CRASH == 70
    battery = importlib.import_module("normscope.battery.check")
    monkeypatch.setattr(battery, "check", lambda *a, **k: SimpleNamespace(verdict="maybe", to_json=lambda: "{}"))
    assert main(["check", "torch.nn:LayerNorm", "--args", "[16]", "--shape", "2,16", "--expect", "torch_layernorm",
                 "--json"]) == 70
    assert "internal error" in capsys.readouterr().err


def test_diff_against_random_bytes_named_onnx_is_an_input_error(tmp_path):
    """A corrupt .onnx candidate was a protobuf DecodeError traceback (exit 1)."""
    bad = tmp_path / "random.onnx"
    bad.write_bytes(bytes(range(256)) * 8)
    r = subprocess.run([sys.executable, "-m", "normscope", "diff", "scan_models:pre_model", str(bad),
                        "--inputs", "ids:2,6"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert r.returncode == 2 and "not an ONNX model" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_every_model_level_command_takes_the_same_inputs_flag(tmp_path, capsys):
    """scan had --shape, diff --inputs, gradflow --tokens/--shape: one --inputs for all (the old spellings stay)."""
    from normscope import cli

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "max_position_embeddings": 32, "rms_norm_eps": 1e-6}))
    assert cli.main(["scan", str(cfg), "--inputs", "ids:2,12", "--json"]) == 0
    scanned = json.loads(capsys.readouterr().out)
    assert scanned["inputs"]["kwargs"]["input_ids"]["shape"] == [2, 12]
    assert cli.main(["gradflow", str(cfg), "--inputs", "ids:2,12", "--json"]) == 0
    assert "random ids (2, 12)" in capsys.readouterr().out
    assert cli.main(["diff", str(cfg), "--candidate-dtype", "bfloat16", "--inputs", "ids:2,12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["kwargs"]["input_ids"]["shape"] == [2, 12]
    assert cli.main(["scan", str(cfg), "--inputs", "ids:2,12", "--shape", "2,4,16"]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli.main(["contract", "--live", str(cfg), str(cfg), "--inputs", "ids:2,12", "--json"]) == 0
    assert "scanned" in json.loads(capsys.readouterr().out)["contracts"][0]["source"]
    assert cli.main(["contract", str(cfg), "--inputs", "ids:2,12"]) == 2
    assert "applies to --live" in capsys.readouterr().err


def test_token_inputs_for_an_encoder_decoder_include_the_decoders():
    """--inputs ids:B,T handed a T5 only input_ids (its forward then refuses to run): one helper builds token
    inputs for both the default batch and --inputs."""
    transformers = pytest.importorskip("transformers")
    from normscope.model_options import model_inputs

    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0))
    inputs = model_inputs("ids:2,6", t5, "scan")
    assert set(inputs) == {"input_ids", "decoder_input_ids", "use_cache"} and inputs["use_cache"] is False
    assert tuple(inputs["input_ids"].shape) == (2, 6) and tuple(inputs["decoder_input_ids"].shape) == (2, 4)
    t5.eval()(**inputs)  # runs


def test_shaped_inputs_take_the_models_parameter_dtype():
    """--inputs 2,16 gave a float32 tensor whatever the model: a float64 or bfloat16 model refused it (mixed dtypes)."""
    import torch

    from normscope.model_options import model_inputs

    for dtype in (torch.float64, torch.bfloat16, torch.float32):
        ln = torch.nn.LayerNorm(16).to(dtype)
        x = model_inputs("2,16", ln, "scan")
        assert x.dtype == dtype and tuple(x.shape) == (2, 16)
        ln(x)  # runs
    assert model_inputs("2,16", torch.nn.ReLU(), "scan").dtype == torch.float32  # no parameters: float32


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the finalizer's ignored exception
def test_a_command_deadline_that_fires_inside_a_finalizer_still_ends_the_command():
    """The timer's exception raised inside a ``__del__`` (a finalizer the garbage collector runs at any point) is
    one Python ignores: the work then ran past its deadline unnoticed and the command reported success (a flaky
    ``scan --timeout 0.01``). The deadline that fired is reported when the work ends."""
    import time

    from normscope.errors import TargetTimeout
    from normscope.model_options import deadline

    class SlowFinalizer:
        def __del__(self):
            time.sleep(0.05)  # the 10 ms timer fires in here

    with pytest.raises(TargetTimeout, match="did not finish within 0.01 s"):
        with deadline(0.01, "scan"):
            SlowFinalizer()  # dropped at once: its finalizer runs now
    with deadline(5, "scan"):
        SlowFinalizer()  # within its time: nothing raised


@pytest.mark.parametrize("argv", [["diff", "m:f", "--layers", "-1"], ["scan", "m:f", "--vocab", "-5"],
                                  ["gradflow", "m:f", "--layers", "two"]])
def test_model_size_options_refuse_negative_or_non_integer_counts(argv, capsys):
    """--layers -1 acted as 0 (the config's own depth) and --vocab -5 was ignored: now a usage error naming it."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert argv[-2] in err and ("negative" in err or "whole number" in err)


def test_diff_help_names_every_exit_and_no_other_commands_options():
    """`diff --help` listed exits 0, 5 and 2 though diff exits 6 too; its --timeout help spoke of scan's probes."""
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("diff", "gradflow"):
        text = sub.choices[name].format_help()
        assert "probe" not in text, name
    assert "6 inconclusive" in " ".join(sub.choices["diff"].format_help().split())
    assert "probe call" in " ".join(sub.choices["scan"].format_help().split())


def test_no_bench_script_shadows_an_installed_package():
    """`python bench/diff.py` failed: the script's folder comes first on sys.path, and bench/kernels.py shadowed the
    `kernels` package recent transformers probes for. No bench script is named like a package installed here."""
    import importlib.util
    import sysconfig

    site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    bench = Path(__file__).resolve().parent.parent / "bench"
    for script in bench.glob("*.py"):
        spec = importlib.util.find_spec(script.stem)
        origin = str(getattr(spec, "origin", "") or "")
        assert not any(origin.startswith(s) for s in site), f"bench/{script.name} shadows {origin}"


@pytest.mark.parametrize("command", ["scan", "contract"])
def test_a_truncated_safetensors_file_is_one_line_and_exit_2(cli, capsys, tmp_path, command):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    capsys.readouterr()  # what saving printed
    code, _, err = cli(command, str(tmp_path))
    assert code == 2
    line = one_line(err)
    assert "safetensors" in line or "model.safetensors" in line, line


@pytest.mark.parametrize("command, inputs", [(c, i) for c in ("scan", "gradflow", "diff") for i in ("ids:2,0", "2,x")]
                         + [("gradflow", "ids:2")])  # gradflow needs a sequence to predict the next token of
def test_a_bad_inputs_value_names_the_flag_it_came_from(cli, tmp_path, command, inputs):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64).save_pretrained(tmp_path)
    extra = ["--candidate-dtype", "bfloat16"] if command == "diff" else []
    code, _, err = cli(command, str(tmp_path / "config.json"), "--inputs", inputs, *extra)
    line = one_line(err)
    assert code == 2 and "--inputs" in line and "--shape" not in line and "--tokens" not in line, line


def test_check_leads_with_its_verdict_and_brief_stops_there(cli):
    args = ("check", "torch.nn:LayerNorm", "--args", "[16]", "--kwargs", '{"eps": 1e-3}', "--shape", "2,16",
            "--expect", "torch_layernorm", "--quick")
    code, full, _ = cli(*args)
    lines = full.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("FAIL:"))
    assert code == 1 and verdict <= 5, full  # after the target and the expected contract
    assert any("expected ε=1e-05; found ε=0.001" in line for line in lines[verdict:verdict + 5]), full
    assert lines[-1].startswith("FAIL:") or lines[-2].startswith("FAIL:")
    code, brief, _ = cli(*args, "--brief")
    assert code == 1 and "inferred: LayerNorm" in brief and "cast" in brief.splitlines()[-1]
    assert "extreme" not in brief and len(brief.splitlines()) < len(lines) / 2


def test_infer_brief_prints_the_contract_and_its_validation(cli):
    code, out, _ = cli("infer", "torch.nn:LayerNorm", "--args", "[16]", "--shape", "2,16", "-q")
    lines = out.splitlines()
    assert code == 0 and len(lines) <= 12, out
    assert any(line.startswith("contract: LayerNorm") for line in lines)
    assert any("fields decisive" in line for line in lines) and lines[-1] != "" and "validation" in out


@pytest.mark.parametrize("command", ["scan", "contract"])
def test_an_unknown_model_type_is_one_short_line_with_the_nearest_names(cli, tmp_path, command):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "lama", "hidden_size": 8}))
    code, _, err = cli(command, str(path))
    line = one_line(err)
    assert code == 2 and len(line) < 400 and "'lama'" in line and "llama" in line, line


def test_a_whole_model_onnx_file_is_refused_with_each_reason_once(cli, tmp_path):
    pytest.importorskip("onnxruntime")
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    path = tmp_path / "whole.onnx"
    torch.onnx.export(model, (torch.randn(2, 16),), str(path), dynamo=False)
    code, _, err = cli("infer", str(path), "--shape", "2,16")
    line = one_line(err)
    assert code == 2 and line.count("returned shape (2, 4)") == 1 and len(line) < 600, line
