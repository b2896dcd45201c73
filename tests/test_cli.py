"""The command line: output, JSON and exit codes, through ``normscope.cli.main`` (the console script's own
function: the same parser, output and exit codes), and through a real ``python -m normscope`` subprocess where
what is tested is the process itself (an exit code as the shell sees it, a timer's signal)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import normscope

TESTS = Path(__file__).resolve().parent
SRC = Path(normscope.__file__).resolve().parents[1]  # the normscope under test, not whichever is installed


def run(*args: str, cwd: Path | None = None, process: bool = False) -> subprocess.CompletedProcess:
    """The command's exit code, stdout and stderr: in-process through ``cli.main`` at 200 columns, or with
    ``process=True`` as a ``python -m normscope`` subprocess."""
    if process:
        env = {"COLUMNS": "200", "PYTHONPATH": os.pathsep.join((str(TESTS), str(SRC))), "PATH": "/usr/bin:/bin"}
        return subprocess.run([sys.executable, "-m", "normscope", *args], capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=300)
    from normscope import cli

    out, err, here, columns = io.StringIO(), io.StringIO(), os.getcwd(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "200"
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(list(args))
    finally:
        os.chdir(here)
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def test_explain_defaults_show_the_seed_numbers():
    r = run("explain")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for text in ("μ = 2", "σ² = 0.6667", "σ = 0.8165", "[−1.2247, 0, 1.2247]", "RMS = 2.1602",
                 "[0.4629, 0.9258, 1.3887]", "316.2", "1e6"):
        assert text in out, text


def test_explain_json():
    r = run("explain", "--json", "2", "4", "9")
    data = json.loads(r.stdout)
    assert data["schema"] == "normscope.explain/1"
    assert data["layernorm"]["mean"] == pytest.approx(5.0)
    shift, scale = data["invariances"]
    assert shift["layernorm_unchanged"] and not shift["rmsnorm_unchanged"]
    assert scale["layernorm_unchanged"] and scale["rmsnorm_unchanged"]
    assert not scale["layernorm_unchanged_with_eps"]
    assert data["eps_gain"]["gain_without_eps"] == pytest.approx(1e6, rel=1e-6)
    assert data["eps_gain"]["gain_eps_inside_sqrt"] == pytest.approx(316.2, rel=1e-3)


@pytest.mark.parametrize("args, words", [
    (("explain", "1", "abc"), "'abc' is not a number"),
    (("explain", "nan", "1"), "not a finite number"),
    (("explain", "5"), "at least two numbers"),
    (("explain", "1", "2", "--gamma", "1", "2", "3"), "--gamma needs 1 or 2 numbers"),
])
def test_explain_bad_input_is_one_line_exit_2(args, words):
    r = run(*args)
    assert r.returncode == 2
    assert words in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_presets_table_and_json():
    r = run("presets")
    assert r.returncode == 0 and "llama_rmsnorm" in r.stdout and "E[x²]−E[x]²" in r.stdout
    data = json.loads(run("presets", "--json").stdout)
    assert data["schema"] == "normscope.presets/1"  # as every JSON document normscope prints
    assert data["presets"]["torch_rmsnorm"]["eps"] == 1.1920928955078125e-07


def test_infer_layernorm():
    r = run("infer", "torch.nn:LayerNorm", "--args", "[64]", "--shape", "2,8,64")
    assert r.returncode == 0, r.stderr
    assert "LayerNorm over [-1], ε=1e-05 inside √, biased two-pass, γ β over [-1]" in r.stdout
    assert "validation" in r.stdout


def test_infer_json():
    r = run("infer", "torch.nn:RMSNorm", "--args", "[64]", "--shape", "2,8,64", "--json")
    data = json.loads(r.stdout)
    assert data["schema"] == "normscope.inference/1"
    assert data["spec"]["center"] is False and data["spec"]["eps"] == pytest.approx(1.1920928955078125e-07, rel=1e-3)


def test_infer_onnx_file(tmp_path):
    onnx = pytest.importorskip("onnx")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.full(64, 1.5, np.float32), "scale"),
             numpy_helper.from_array(np.full(64, 0.25, np.float32), "B")]
    node = helper.make_node("LayerNormalization", ["x", "scale", "B"], ["y"], axis=-1, epsilon=1e-5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 64])], inits)
    path = tmp_path / "ln.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    r = run("infer", str(path), "--shape", "2,8,64", "--json")
    assert r.returncode == 0, r.stderr
    spec = json.loads(r.stdout)["spec"]
    assert spec["kind"] == "layernorm" and spec["eps"] == pytest.approx(1e-5, rel=0.01)


def test_infer_not_a_normalization_exit_3():
    r = run("infer", "torch:softmax", "--kwargs", '{"dim": -1}', "--shape", "2,8,64", "--framework", "torch")
    assert r.returncode != 0
    r = run("infer", "zoo:softmax", "--shape", "2,8,64", "--framework", "torch")
    assert r.returncode == 3
    assert "scaling the input by 4" in r.stdout


@pytest.mark.parametrize("args, words", [
    (("infer", "nonexistent.module:X", "--shape", "2,8,64"), "cannot import"),
    (("infer", "torch.nn:NoSuch", "--shape", "2,8,64"), "has no attribute"),
    (("infer", "torch.nn:LayerNorm", "--args", "[64", "--shape", "2,8,64"), "--args is not valid JSON"),
    (("infer", "torch.nn:LayerNorm", "--args", "[64]", "--shape", "2,8,x"), "--shape"),
    (("infer", "torch.nn:LayerNorm", "--args", "[64]", "--shape", "2,8,32"), "failed on"),
    (("infer", "zoo:seed_layer_norm", "--shape", "2,8,64"), "--framework"),
    (("infer", "missing.onnx", "--shape", "2,8,64"), "no such ONNX file"),
])
def test_infer_usage_errors_exit_2(args, words):
    r = run(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert words in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_check_pass_exit_0_and_junit(tmp_path):
    junit = tmp_path / "out.xml"
    r = run("check", "torch.nn:RMSNorm", "--args", "[64]", "--shape", "2,8,64", "--expect", "torch_rmsnorm",
            "--junit", str(junit), process=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and junit.is_file()
    assert r.stdout.splitlines()[0].startswith("torch module RMSNorm")  # no blank line left by the progress bar


def test_check_fail_exit_1_explains():
    r = run("check", "zoo:seed_layer_norm", "--framework", "numpy", "--shape", "2,8,64", "--expect",
            "torch_layernorm")
    assert r.returncode == 1
    assert "FAIL" in r.stdout
    assert "found ε outside √ (std+ε)" in r.stdout


def test_check_json_and_eps_override():
    r = run("check", "torch.nn:LayerNorm", "--kwargs", '{"normalized_shape": 64, "eps": 0.001}', "--shape",
            "2,8,64", "--expect", "torch_layernorm", "--eps", "1e-3", "--quick", "--json")
    data = json.loads(r.stdout)
    assert r.returncode == 0 and data["ok"] and data["schema"] == "normscope.check/1"


def test_check_unknown_preset_exit_2():
    r = run("check", "torch.nn:LayerNorm", "--args", "[64]", "--shape", "2,8,64", "--expect", "lama_rmsnorm")
    assert r.returncode == 2 and "llama_rmsnorm" in r.stderr


@pytest.mark.parametrize("target", [":", ":LayerNorm", "../x:y"])
def test_malformed_targets_exit_2(target):
    r = run("infer", target, "--shape", "2,8,64")
    assert r.returncode == 2 and "package.module:attr" in r.stderr


@pytest.mark.parametrize("args, words", [
    (("--seed", "-1"), "seed must be ≥ 0"),
    (("--dtypes", ","), "no dtype given"),
])
def test_bad_options_exit_2(args, words):
    r = run("infer", "torch.nn:LayerNorm", "--args", "[64]", "--shape", "2,8,64", *args)
    assert r.returncode == 2 and words in r.stderr


def test_explain_negative_exponent_and_extremes():
    assert run("explain", "1", "-2e3").returncode == 0
    r = run("explain", "1e308", "1e307")  # the variance overflows float64: refused, not printed as ∞
    assert r.returncode == 2 and "Traceback" not in r.stderr and "layernorm.variance overflows" in r.stderr
    r = run("explain", "1", "1", "1")
    assert r.returncode == 2 and "--eps" in r.stderr


def test_check_junit_path_is_validated_first(tmp_path):
    r = run("check", "torch.nn:LayerNorm", "--args", "[64]", "--shape", "2,8,64", "--expect", "torch_layernorm",
            "--junit", str(tmp_path / "missing" / "out.xml"))
    assert r.returncode == 2 and "--junit" in r.stderr


TINY_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 32, "rms_norm_eps": 1e-6}


def test_model_level_commands_have_a_timeout_and_refuse_inputs_beyond_memory(tmp_path, capsys):
    """scan told users to raise --timeout but rejected it; diff with ids:2,99999 ran for minutes without output."""
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    from normscope.cli import main  # in-process: the same function the console script calls

    # once without a limit first: the timer interrupts Python wherever it is, and in this process (unlike the
    # command's, which exits) what it interrupts must not be a first numba compile or cache load, whose state the
    # tests after this one share (a worker of the parallel suite crashed once)
    assert main(["scan", str(cfg)]) == 0
    capsys.readouterr()
    assert main(["scan", str(cfg), "--timeout", "0.01"]) == 4  # a scan runs many probe calls: far longer than 10 ms
    assert "did not finish within 0.01 s" in capsys.readouterr().err

    assert main(["diff", str(cfg), "--candidate-dtype", "bfloat16", "--inputs", "ids:2,99999"]) == 2
    err = capsys.readouterr().err
    assert "one forward needs about" in err and "ids:2,512" in err, err
    assert main(["gradflow", str(cfg), "--tokens", "2,100000"]) == 2
    assert "--tokens 2,512" in capsys.readouterr().err
    assert main(["scan", str(cfg), "--timeout", "-1"]) == 2
    assert "must be ≥ 0 seconds" in capsys.readouterr().err


def test_a_failure_the_deadline_caused_is_reported_as_the_timeout():
    """The timer interrupts Python wherever it is: work that turns the interruption into another error (a torch
    function mode's stack left half popped raised RuntimeError, which the scan reported as a failed forward, exit 2)
    is still late, exit 4."""
    import time

    from normscope.errors import TargetTimeout
    from normscope.model_options import deadline

    with pytest.raises(TargetTimeout, match="did not finish within"):
        with deadline(0.01, "scan"):
            try:
                time.sleep(1)
            except BaseException:
                raise RuntimeError("trying to pop from empty mode stack") from None
    with pytest.raises(ValueError, match="its own"):  # a failure before the deadline is the work's own
        with deadline(5, "scan"):
            raise ValueError("its own")
