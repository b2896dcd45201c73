"""normscope.sources: what a TARGET names, one clear error per bad one; and the cli package's wiring."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import normscope
from normscope import InputError, TargetError, cli
from normscope.sources import load_model, load_target, resolve

TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 32, "rms_norm_eps": 1e-6}


def _safetensors_bytes() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    return struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.0, 2.0)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("sources")
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text(json.dumps(TINY_LLAMA))
    (d / "empty").mkdir()
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    (d / "spec.json").write_text('{"kind": "layernorm"}')
    (d / "bad.json").write_text("{not json")
    (d / "m.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    (d / "fake.gguf").write_bytes(b"PK\x03\x04 a zip file")
    (d / "loose").mkdir()
    (d / "loose" / "loose.safetensors").write_bytes(_safetensors_bytes())
    (d / "model" / "model.safetensors").write_bytes(_safetensors_bytes())
    (d / "bad.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    (d / "ln.onnx").write_bytes(b"not parsed by resolve")
    (d / "folder.onnx").mkdir()
    return {p.name: p for p in d.iterdir()} | {"model/model.safetensors": d / "model" / "model.safetensors",
                                               "loose.safetensors": d / "loose" / "loose.safetensors"}


def test_each_kind_of_target_is_recognised(files):
    got = {name: resolve(str(files[name])).kind for name in
           ("model", "config.json", "m.gguf", "loose.safetensors", "ln.onnx")}
    assert got == {"model": "hf-dir", "config.json": "hf-config", "m.gguf": "gguf",
                   "loose.safetensors": "safetensors", "ln.onnx": "onnx"}
    python = resolve("torch.nn:LayerNorm")
    assert (python.kind, python.path, python.description) == ("python", None, "a Python object")
    assert resolve(python) is python


@pytest.mark.parametrize("name, error, words", [
    ("empty", InputError, "folder without a config.json: not a Hugging Face model directory"),
    ("fake.gguf", InputError, "does not start with the GGUF magic bytes"),
    ("bad.safetensors", InputError, "does not start with a safetensors header"),
    ("absent.gguf", InputError, "no such file"),
    ("absent.json", InputError, "no such file"),
    ("folder.onnx", TargetError, "is not a file"),
    ("absent.onnx", TargetError, "no such ONNX file"),
])
def test_each_bad_file_gets_one_clear_error(files, name, error, words):
    path = files.get(name) or next(iter(files.values())).parent / name
    with pytest.raises(error, match=words):
        resolve(str(path))


def test_bad_python_names_keep_their_errors():
    with pytest.raises(TargetError, match="must be package.module:attr with an importable module name"):
        resolve("./x:f")
    with pytest.raises(TargetError, match=r"must be package.module:attr \(e.g. torch.nn:LayerNorm\) or a path"):
        load_target("nothing_here")
    with pytest.raises(InputError, match="must be package.module:factory, a Hugging Face model directory"):
        load_model("nothing_here")


def test_infer_and_check_point_a_whole_model_to_scan_or_contract(files):
    with pytest.raises(InputError, match=r"is a Hugging Face model directory; .* \(for the whole model: normscope "
                                         r"scan .*model\)"):
        load_target(str(files["model"]))
    with pytest.raises(InputError, match=r"is a GGUF file; .*normscope contract"):
        load_target(str(files["m.gguf"]))
    with pytest.raises(TargetError, match="an ONNX file takes neither"):
        load_target(str(files["ln.onnx"]), "[1]")
    assert load_target(str(files["ln.onnx"])) == str(files["ln.onnx"])


def test_model_loading_by_kind(files):
    pytest.importorskip("transformers")
    with pytest.raises(InputError, match=r"has no \"model_type\""):
        load_model(str(files["spec.json"]))
    with pytest.raises(InputError, match="not valid JSON"):
        load_model(str(files["bad.json"]))
    with pytest.raises(InputError, match="holds weights without an architecture"):
        load_model(str(files["loose.safetensors"]))
    with pytest.raises(InputError, match="holds no runnable torch model; .*normscope contract"):
        load_model(str(files["m.gguf"]))
    model, origin = load_model(str(files["config.json"]), layers=1, vocab=32)
    assert type(model).__name__ == "LlamaForCausalLM" and len(model.model.layers) == 1
    assert origin.endswith("(1 of 3 layers, vocabulary 32 of 64)")
    # a safetensors file inside a model directory is that model, loaded from the directory
    model, origin = load_model(str(files["model/model.safetensors"]))
    assert type(model).__name__ == "LlamaForCausalLM" and origin == f"weights from {files['model']}"


# ---------------------------------------------------------------------------------------------- cli package
def test_cli_infer_names_the_command_for_a_whole_model(files, capsys):
    code = cli.main(["infer", str(files["config.json"]), "--shape", "2,16"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("normscope infer: error: TARGET") and "normscope scan" in err
    assert len(err.splitlines()) == 1


def test_commands_table_registers_each_once(monkeypatch, capsys):
    from normscope.artifacts.command import add_parser

    names = [a.dest for a in cli.build_parser()._subparsers._group_actions][0]
    assert names == "command"
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, add_parser])  # listed twice: still one "contract"
    choices = cli.build_parser()._subparsers._group_actions[0].choices
    assert list(choices) == ["explain", "presets", "infer", "check", "scan", "contract", "diff", "diagnose", "gradflow"]
    assert cli.main(["presets", "--json"]) == 0 and "torch_layernorm" in json.loads(capsys.readouterr().out)["presets"]


def test_python_dash_m_runs_the_package():
    src = str(Path(normscope.__file__).resolve().parents[1])
    for module in ("normscope", "normscope.cli"):
        r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True,
                           env={"PYTHONPATH": src, "PATH": ""})
        assert r.returncode == 0 and r.stdout.startswith("normscope "), (module, r.stderr)


def test_every_json_file_reader_says_the_same_thing(tmp_path):
    """check's --expect, normscope.load, contract, the model loader and Report.load read JSON files through one
    reader: a broken file, a file holding no object and an oversize config get one wording each, naming the file,
    the problem and the fix."""
    from normscope.artifacts import contract
    from normscope.battery.check import resolve_expected
    from normscope.results.check import Report

    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "llama",\n  oops}')
    where = re.escape(str(broken))
    for read in (resolve_expected, normscope.load, contract, load_model, Report.load):
        with pytest.raises(InputError, match=rf"{where} is not valid JSON \(Expecting property name enclosed in "
                                             r"double quotes at line 2, column 3\); fix it there, or give a"):
            read(str(broken))
    broken.write_text("[1, 2]")
    for read in (contract, load_model, Report.load):
        with pytest.raises(InputError, match=rf"{where} must hold a JSON object; got a list; give a"):
            read(str(broken))
    with open(broken, "wb") as fh:
        fh.truncate(16 * 2**20 + 1)  # a hole: no disk space
    for read in (contract, load_model):
        with pytest.raises(InputError, match=rf"{where} is 16,777,217 bytes .* limit for a Hugging Face config.json"):
            read(str(broken))


def test_loading_a_model_quiets_transformers_and_gives_the_users_settings_back(files, capfd):
    """The quieting belongs to the loader itself: whoever calls it (scan, gradflow, contract --live, diff, a user)
    sees no transformers logging while it loads, and the verbosity they set is theirs again afterwards."""
    hf_logging = pytest.importorskip("transformers.utils.logging")
    before = hf_logging.get_verbosity()
    seen = []
    hf_logging.set_verbosity_info()
    try:
        capfd.readouterr()
        with pytest.MonkeyPatch.context() as mp:  # the level in force while the model is being built
            import transformers

            mp.setattr(transformers.LlamaForCausalLM, "__init__", _spy(transformers.LlamaForCausalLM.__init__, seen,
                                                                       hf_logging.get_verbosity))
            model, origin = load_model(str(files["config.json"]), layers=1, vocab=32)
        assert type(model).__name__ == "LlamaForCausalLM" and origin.startswith("random weights")
        assert seen == [hf_logging.ERROR] and hf_logging.get_verbosity() == hf_logging.INFO
        assert capfd.readouterr().err == ""
    finally:
        hf_logging.set_verbosity(before)


def _spy(init, seen: list, level):
    def wrapped(self, *args, **kwargs):
        seen.append(level())
        init(self, *args, **kwargs)

    return wrapped


@pytest.mark.parametrize("change, words", [
    ({"num_hidden_layers": -3}, "num_hidden_layers must be a positive integer"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number ≥ 0"),
    ({"rms_norm_eps": None}, "rms_norm_eps must be a finite number ≥ 0"),
])
def test_one_validation_of_a_config_for_scan_and_contract(tmp_path, change, words):
    """scan (which builds the model from the config) and contract (which reads it) refuse the same configs
    with the same words: a negative layer count once scanned to 'placement none'."""
    from normscope.artifacts import contract

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, **change}))
    with pytest.raises(InputError, match=re.escape(words)):
        load_model(str(path))
    with pytest.raises(InputError, match=re.escape(words)):
        contract(str(path))


def test_a_config_without_the_eps_its_architecture_reads_is_refused_by_scan_too(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in TINY_LLAMA.items() if k != "rms_norm_eps"}))
    with pytest.raises(InputError, match="no rms_norm_eps.*silently use its default"):
        load_model(str(path))
