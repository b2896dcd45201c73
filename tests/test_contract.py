"""Static contracts: HF configs and checkpoints, GGUF files, ONNX graphs, their comparison and bad input."""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from normscope import NormSpec, cli
from normscope.artifacts import ModelContract, compare, contract
from normscope.errors import InputError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import readme_files  # noqa: E402  (the README's file writer: its GGUF converter is the one used here)

# torch's TorchScript ONNX exporter (dynamo=False, as the exports here need) warns that it is deprecated
pytestmark = pytest.mark.filterwarnings("ignore:.*(TorchScript|will be removed).*:DeprecationWarning")

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64)


def _configs():
    t = transformers
    return {
        "llama": t.LlamaConfig(**SMALL, rms_norm_eps=1e-5),
        "mistral": t.MistralConfig(**SMALL),
        "qwen2": t.Qwen2Config(**SMALL),
        "qwen3": t.Qwen3Config(**SMALL, head_dim=8),
        "gemma": t.GemmaConfig(**SMALL, head_dim=8),
        "gemma2": t.Gemma2Config(**SMALL, head_dim=8),
        "gemma3": t.Gemma3TextConfig(**SMALL, head_dim=8),
        "olmo2": t.Olmo2Config(**SMALL),
        "gpt2": t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64),
        "bert": t.BertConfig(**{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}),
        "phi": t.PhiConfig(**SMALL, qk_layernorm=True),
        "cohere": t.CohereConfig(**SMALL, use_qk_norm=True),
    }


# architecture → (placement, family, ε, γ offset, β, {canonical slot in block 0: (role, normalized size)})
EXPECTED = {
    "llama": ("pre", "rmsnorm", 1e-5, 0.0, False, {"attn_norm": ("pre", 32), "ffn_norm": ("pre", 32)}),
    "mistral": ("pre", "rmsnorm", 1e-6, 0.0, False, {"attn_norm": ("pre", 32), "ffn_norm": ("pre", 32)}),
    "qwen2": ("pre", "rmsnorm", 1e-6, 0.0, False, {"attn_norm": ("pre", 32), "ffn_norm": ("pre", 32)}),
    "qwen3": ("pre", "rmsnorm", 1e-6, 0.0, False,
              {"attn_norm": ("pre", 32), "ffn_norm": ("pre", 32), "q_norm": ("qk", 8), "k_norm": ("qk", 8)}),
    "gemma": ("pre", "rmsnorm", 1e-6, 1.0, False, {"attn_norm": ("pre", 32), "ffn_norm": ("pre", 32)}),
    "gemma2": ("sandwich", "rmsnorm", 1e-6, 1.0, False,
               {"attn_norm": ("pre", 32), "attn_branch_norm": ("branch", 32), "ffn_norm": ("pre", 32),
                "ffn_branch_norm": ("branch", 32)}),
    "gemma3": ("sandwich", "rmsnorm", 1e-6, 1.0, False,
               {"attn_norm": ("pre", 32), "attn_branch_norm": ("branch", 32), "ffn_norm": ("pre", 32),
                "ffn_branch_norm": ("branch", 32), "q_norm": ("qk", 8), "k_norm": ("qk", 8)}),
    # OLMo-2's qk norms span the whole projection: 4 heads × 8 for q, 2 kv heads × 8 for k
    "olmo2": ("reordered", "rmsnorm", 1e-5, 0.0, False,
              {"attn_branch_norm": ("branch", 32), "ffn_branch_norm": ("branch", 32), "q_norm": ("qk", 32),
               "k_norm": ("qk", 16)}),
    "gpt2": ("pre", "layernorm", 1e-5, 0.0, True, {"attn_norm": ("pre", 32), "ffn_norm": ("pre", 32)}),
    "bert": ("post", "layernorm", 1e-12, 0.0, True, {"attn_post_norm": ("post", 32), "ffn_post_norm": ("post", 32)}),
    "phi": ("parallel", "layernorm", 1e-5, 0.0, True,
            {"attn_norm": ("pre", 32), "q_norm": ("qk", 8), "k_norm": ("qk", 8)}),
    "cohere": ("parallel", "layernorm", 1e-5, 0.0, False,
               {"attn_norm": ("pre", 32), "q_norm": ("qk", 8), "k_norm": ("qk", 8)}),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    out = {}
    for name, cfg in _configs().items():
        cfg.save_pretrained(root / name)
        out[name] = root / name
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_hf_config_every_architecture(configs, arch):
    placement, family, eps, offset, beta, block = EXPECTED[arch]
    c = contract(configs[arch] / "config.json")
    assert c.kind == "hf-config" and c.placement == placement and c.n_layers == 2
    assert c.eps == pytest.approx(eps)
    layer0 = {s.name.split(".", 2)[2]: s for s in c.sites if s.layer == 0}
    assert {k: (s.role, s.size) for k, s in layer0.items()} == block
    for s in c.sites:
        assert (s.family, s.eps, s.eps_placement, s.gamma_offset, s.beta) == (family, pytest.approx(eps),
                                                                              "inside_sqrt", offset, beta)
        assert s.gamma_stats is None and "gamma_stats" not in s.known
    tops = {s.name: s.role for s in c.sites if s.layer is None}
    assert tops == ({"embed_norm": "embedding"} if arch == "bert" else {"final_norm": "final"})
    assert len(c.sites) == 2 * len(block) + 1


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_the_structure_gives_what_the_table_states(configs, arch):
    # the table is a fast path: the architecture built on the meta device and scanned must agree with it
    from normscope.artifacts.structure import read_structure

    path = configs[arch] / "config.json"
    table = contract(path)
    built = read_structure(json.loads(path.read_text()), path, str(path))
    fields = ("name", "layer", "role", "family", "center", "eps", "eps_placement", "axes", "size", "gamma", "beta",
              "gamma_offset")
    assert sorted(tuple(getattr(s, f) for f in fields) for s in built.sites) == \
        sorted(tuple(getattr(s, f) for f in fields) for s in table.sites)
    assert (built.placement, built.eps, built.eps_key, built.n_layers) == \
        (table.placement, table.eps, table.eps_key, table.n_layers)


# transformers' own classes, outside the table; the truth from their modeling sources
OUTSIDE_THE_TABLE = {
    # GPTNeoXLayer (use_parallel_residual): x + attn(input_layernorm(x)) + mlp(post_attention_layernorm(x))
    "gpt_neox": (lambda t: t.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, vocab_size=64),
                 "parallel", "layernorm", 1e-5, "layer_norm_eps", 0.0, ["attn_norm", "ffn_norm"]),
    # FalconDecoderLayer (parallel_attn, one input_layernorm): x + attn(n(x)) + mlp(n(x))
    "falcon": (lambda t: t.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64),
               "parallel", "layernorm", 1e-5, "layer_norm_epsilon", 0.0, ["attn_norm"]),
    # Starcoder2DecoderLayer: pre-LN with nn.LayerNorm(eps=config.norm_epsilon)
    "starcoder2": (lambda t: t.Starcoder2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                                norm_epsilon=3e-5),
                   "pre", "layernorm", 3e-5, "norm_epsilon", 0.0, ["attn_norm", "ffn_norm"]),
    # NemotronLayerNorm1P: F.layer_norm(x, weight + 1, bias)
    "nemotron": (lambda t: t.NemotronConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                            head_dim=8),
                 "pre", "layernorm", 1e-5, "norm_eps", 1.0, ["attn_norm", "ffn_norm"]),
}


@pytest.mark.parametrize("arch", sorted(OUTSIDE_THE_TABLE))
def test_any_architecture_transformers_knows(tmp_path, arch):
    build, placement, family, eps, key, offset, slots = OUTSIDE_THE_TABLE[arch]
    build(transformers).save_pretrained(tmp_path)
    c = contract(tmp_path / "config.json")
    assert c.kind == "hf-config" and c.architecture == arch and c.placement == placement
    assert (c.eps, c.eps_key, c.n_layers) == (pytest.approx(eps), key, 2)
    assert [s.name.split(".", 2)[2] for s in c.sites if s.layer == 0] == slots
    assert [s.name for s in c.sites if s.layer is None] == ["final_norm"]
    for s in c.sites:
        assert (s.family, s.eps, s.gamma_offset, s.size) == (family, pytest.approx(eps), offset, 32)
    assert any("meta device" in n for n in c.notes)


CONFIG_ONLY = {  # one built on the meta device, one whose forward reads values (built on the CPU, γ drawn)
    "gpt_neox": lambda t: t.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, vocab_size=64),
    "qwen3_next": lambda t: t.Qwen3NextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16),
}


@pytest.mark.parametrize("arch", sorted(CONFIG_ONLY))
def test_a_config_states_no_weights_and_matches_its_trained_checkpoint(tmp_path, arch):
    """A config has no weights: the γ of the model built to read its structure is drawn (Qwen3-Next builds on the
    CPU, γ = 0 at init) and was stated as known, so the config against its own trained checkpoint read 11
    mismatches; the checkpoint's sites read "γ has shape [32], the config implies []" besides."""
    from normscope.artifacts import compare

    cfg = CONFIG_ONLY[arch](transformers)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.2, 0.05)  # trained: far from the initial 1 and 0
    model.save_pretrained(tmp_path / "ckpt")
    cfg.save_pretrained(tmp_path / "cfg")
    config = contract(tmp_path / "cfg" / "config.json")
    assert all(s.gamma_stats is None and s.beta_stats is None for s in config.sites)
    assert not {"gamma_stats", "beta_stats"} & {f for s in config.sites for f in s.known}
    ckpt = contract(tmp_path / "ckpt")
    # every site's weight is found, the qwen3_next gated norms' (inline in their module) included
    assert all(s.gamma_stats["mean"] == pytest.approx(0.2, abs=0.05) for s in ckpt.sites), \
        [s.name for s in ckpt.sites if s.gamma_stats is None]
    assert not [n for s in ckpt.sites for n in s.notes if "implies" in n]
    result = compare(config, ckpt)
    assert result.ok and not result.mismatches, [i.message for i in result.items]


def test_gguf_states_a_parallel_block_and_matches_the_structure(tmp_path):
    import gguf

    from normscope.artifacts import compare

    cfg = OUTSIDE_THE_TABLE["gpt_neox"][0](transformers)
    cfg.save_pretrained(tmp_path / "neox")
    w = gguf.GGUFWriter(str(tmp_path / "neox.gguf"), arch="gptneox")
    w.add_block_count(2)
    w.add_layer_norm_eps(1e-5)
    w.add_bool("gptneox.use_parallel_residual", True)
    rng = np.random.default_rng(0)
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "blk.1.attn_norm", "blk.1.ffn_norm", "output_norm"):
        w.add_tensor(name + ".weight", rng.uniform(0.5, 1.5, 32).astype(np.float32))
        w.add_tensor(name + ".bias", rng.uniform(-0.1, 0.1, 32).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    file = contract(tmp_path / "neox.gguf")
    assert file.placement == "parallel" and any("use_parallel_residual" in n for n in file.notes)
    structure = contract(tmp_path / "neox" / "config.json")
    result = compare(structure, file)
    assert result.ok and not result.mismatches, [i.message for i in result.items]


def test_hf_weights_give_gamma_statistics_and_the_cohere_per_head_shape(configs, tmp_path):
    for arch, offset in (("gemma3", 1.0), ("cohere", 0.0)):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_configs()[arch])
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(torch.linspace(-0.5, 0.25, p.numel()).reshape(p.shape))
        model.save_pretrained(tmp_path / arch)
        c = contract(tmp_path / arch)
        assert c.kind == "hf-model" and not c.notes
        for s in c.sites:
            assert s.gamma_stats == pytest.approx({"mean": -0.125, "min": -0.5, "max": 0.25}, abs=1e-6)
            assert s.effective_gamma["mean"] == pytest.approx(offset - 0.125, abs=1e-6)
    q = contract(tmp_path / "cohere").site("layers.1.q_norm")
    assert q.param_shape == (4, 8) and q.size == 8


# ---------------------------------------------------------------- weights matched to their sites by structure

# a norm of each model: (its module path, the site it is)
EDITED = {"t5": ("decoder.block.1.layer.1.layer_norm", "decoder.layers.1.cross_attn_norm"),
          "vit": ("encoder.layer.1.layernorm_after", "layers.1.ffn_norm")}


def _tiny(kind: str):
    t = transformers
    if kind == "t5":
        return t.T5Model(t.T5Config(d_model=32, num_layers=2, num_heads=2, d_ff=64, d_kv=16, vocab_size=64))
    return t.ViTModel(t.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  image_size=32, patch_size=8))


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """A tiny T5 (encoder–decoder: two residual streams) and ViT (its block list stored as ``encoder.layer`` while
    transformers builds it as ``layers``), saved with trained-looking norm weights, and copies of each in which one
    norm's γ is zeroed, multiplied by 20, or missing."""
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for kind, (module, _) in EDITED.items():
        torch.manual_seed(0)
        model = _tiny(kind)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
        model.save_pretrained(root / kind)
        out[kind] = root / kind
        for change, edit in (("zero", lambda w: w * 0), ("x20", lambda w: w * 20), ("missing", None)):
            copy = out[f"{kind}-{change}"] = root / f"{kind}-{change}"
            shutil.copytree(root / kind, copy)
            tensors = load_file(copy / "model.safetensors")
            if edit is None:
                del tensors[module + ".weight"]
            else:
                tensors[module + ".weight"] = edit(tensors[module + ".weight"])
            save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("kind", sorted(EDITED))
def test_every_norm_weight_is_matched_to_its_site(tiny_checkpoints, kind):
    c = contract(tiny_checkpoints[kind])
    assert c.kind == "hf-model" and c.weights and len(c.sites) == (12 if kind == "t5" else 5)
    assert all(s.gamma_stats is not None for s in c.sites), [s.name for s in c.sites if s.gamma_stats is None]
    assert not [n for n in c.notes if "no weight found" in n or "outside the architecture" in n], c.notes
    module, site = EDITED[kind]
    assert c.site(site).source == module
    same = compare(c, contract(tiny_checkpoints[kind]))
    assert same.verdict == "pass" and same.ok and not same.items, [i.message for i in same.items]


@pytest.mark.parametrize("kind", sorted(EDITED))
@pytest.mark.parametrize("change", ["zero", "x20"])
def test_one_zeroed_or_scaled_gamma_is_a_mismatch_at_its_site(tiny_checkpoints, run_cli, kind, change):
    d = compare(contract(tiny_checkpoints[kind]), contract(tiny_checkpoints[f"{kind}-{change}"]))
    site = EDITED[kind][1]
    assert [(i.site, i.field, i.status) for i in d.items] == [(site, "gamma", "mismatch")]
    assert d.verdict == "fail" and not d.ok
    if change == "zero":
        assert "γ is 0 everywhere in B" in d.items[0].message
    rc, out, _ = run_cli(tiny_checkpoints[kind], tiny_checkpoints[f"{kind}-{change}"])
    assert rc == 1 and f"MISMATCH gamma at {site}" in out, out


@pytest.mark.parametrize("kind", sorted(EDITED))
def test_a_site_whose_weight_is_missing_is_unverified_never_skipped(tiny_checkpoints, run_cli, kind):
    d = compare(contract(tiny_checkpoints[kind]), contract(tiny_checkpoints[f"{kind}-missing"]))
    site = EDITED[kind][1]
    assert [(i.site, i.field, i.status) for i in d.items] == [(site, "gamma", "unverified")]
    assert d.verdict == "inconclusive" and not d.ok and site in d.undecided[0]
    rc, out, _ = run_cli(tiny_checkpoints[kind], tiny_checkpoints[f"{kind}-missing"], "--json")
    data = json.loads(out)
    assert rc == 6 and (data["verdict"], data["ok"], data["unverified"]) == ("inconclusive", False, 1)
    assert site in data["undecided"][0]


def test_unverified_sites_are_named_first_few_then_counted():
    from normscope.artifacts.model import ContractSite

    def sites(stats):
        return [ContractSite(name=f"layers.{i}.attn_norm", source=f"model.layers.{i}.input_layernorm",
                             family="rmsnorm", gamma=True, gamma_offset=0.0, gamma_stats=stats) for i in range(6)]

    read = {"mean": 1.0, "min": 1.0, "max": 1.0}
    lost = ModelContract(source="a", kind="hf-model", sites=sites(None), weights=True)  # holds weights, none matched
    d = compare(lost, ModelContract(source="b", kind="hf-model", sites=sites(read), weights=True))
    assert d.verdict == "inconclusive" and len(d.unverified) == 6 and len(d.undecided) == 1
    assert d.undecided[0].startswith("6 sites unverified: layers.0.attn_norm, layers.1.attn_norm, layers.2.attn_norm, "
                                     "layers.3.attn_norm and 2 more")
    assert "no weight of A (model.layers.0.input_layernorm) was matched" in d.unverified[0].message
    # a config states no weights: its γ is not part of its contract, and the checkpoint's were all read
    config = ModelContract(source="c", kind="hf-config", sites=sites(None))
    assert compare(config, ModelContract(source="b", kind="hf-model", sites=sites(read), weights=True)).ok
    # a contract JSON written before "weights" was stated: what its kind implies
    old = json.loads(lost.to_json())
    del old["weights"]
    assert ModelContract.from_dict(old).weights and not ModelContract.from_dict({**old, "kind": "hf-config"}).weights


def test_nothing_compared_is_inconclusive(run_cli, tmp_path):
    empty = ModelContract(source="empty", kind="scan", sites=[])
    d = compare(empty, empty)
    assert d.compared_fields == 0 and d.verdict == "inconclusive" and not d.ok
    assert d.undecided[0].startswith("nothing was compared")
    assert d.to_dict()["verdict"] == "inconclusive"
    path = tmp_path / "empty.json"
    path.write_text(empty.to_json())
    rc, out, _ = run_cli(path, path)
    assert rc == 6 and "INCONCLUSIVE" in out and "nothing was compared" in out


def test_match_paths_by_structure():
    from normscope.artifacts.names import match_paths

    # as it is; under a wrapper's prefix; without the base model's prefix
    assert match_paths(["encoder.block.0.layer.0.layer_norm"], ["encoder.block.0.layer.0.layer_norm"]) == \
        {"encoder.block.0.layer.0.layer_norm": "encoder.block.0.layer.0.layer_norm"}
    assert match_paths(["layernorm", "pooler.dense"], ["vit.layernorm", "vit.pooler.dense", "classifier"]) == \
        {"layernorm": "vit.layernorm", "pooler.dense": "vit.pooler.dense"}
    assert match_paths(["model.norm", "model.layers.0.input_layernorm"], ["norm", "layers.0.input_layernorm"]) == \
        {"model.norm": "norm", "model.layers.0.input_layernorm": "layers.0.input_layernorm"}
    # a block list stored under another name: index and path inside the block
    got = match_paths(["layers.0.layernorm_before", "layers.1.layernorm_before"],
                      ["encoder.layer.0.layernorm_before", "encoder.layer.1.layernorm_before"])
    assert got == {"layers.0.layernorm_before": "encoder.layer.0.layernorm_before",
                   "layers.1.layernorm_before": "encoder.layer.1.layernorm_before"}
    # two streams' block lists: each to the one that lines up strictly the most of its blocks; a tie is left out
    got = match_paths(["enc.layers.0.norm", "dec.layers.0.norm", "dec.layers.1.norm"],
                      ["encoder.block.0.norm", "decoder.block.0.norm", "decoder.block.1.norm"])
    assert got == {"dec.layers.0.norm": "decoder.block.0.norm", "dec.layers.1.norm": "decoder.block.1.norm",
                   "enc.layers.0.norm": "encoder.block.0.norm"}
    assert match_paths(["enc.layers.0.norm", "dec.layers.0.norm"], ["encoder.block.0.norm", "decoder.block.0.norm"]) \
        == {}
    assert match_paths(["norm"], ["a.norm", "b.norm"]) == {}  # two prefixes, one vote each
    assert match_paths(["layers.0.norm"], ["layers.1.norm", "final.norm"]) == {}


# ---------------------------------------------------------------- GGUF

to_gguf = readme_files.to_gguf  # a model's norm weights in a GGUF as llama.cpp's converter writes them


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A Llama-like and a Gemma3-like checkpoint with random norm weights, and GGUF files converted from them."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for arch in ("llama", "gemma3"):
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(_configs()[arch])
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.1 if arch == "gemma3" else 1.0, 0.05)
        model.save_pretrained(root / arch)
        out[arch] = root / arch
    out["llama.gguf"] = to_gguf(root / "llama", root / "llama.gguf", "llama", 1e-5, add_one=False)
    # llama.cpp's converter once wrote 1e-6 for every LLaMA: the ε of LLaMA-2 checkpoints (1e-5) was lost
    out["llama-eps.gguf"] = to_gguf(root / "llama", root / "llama-eps.gguf", "llama", 1e-6, add_one=False)
    out["llama-missing.gguf"] = to_gguf(root / "llama", root / "llama-missing.gguf", "llama", 1e-5, add_one=False,
                                        drop="blk.1.ffn_norm")
    out["gemma3.gguf"] = to_gguf(root / "gemma3", root / "gemma3.gguf", "gemma3", 1e-6, add_one=True)
    out["gemma3-lost.gguf"] = to_gguf(root / "gemma3", root / "gemma3-lost.gguf", "gemma3", 1e-6, add_one=False)
    return out


def test_gguf_contract(checkpoints):
    c = contract(checkpoints["gemma3.gguf"])
    assert (c.kind, c.architecture, c.n_layers, c.placement) == ("gguf", "gemma3", 2, "sandwich")
    assert c.eps_key == "gemma3.attention.layer_norm_rms_epsilon" and c.eps == pytest.approx(1e-6)
    assert len(c.sites) == 13
    hf = contract(checkpoints["gemma3"])
    for s in c.sites:
        assert s.family == "rmsnorm" and s.gamma_offset == 0.0 and s.beta is False
        # stored 1 + w: the GGUF's γ mean is the HF weight's mean plus one
        assert s.gamma_stats["mean"] == pytest.approx(hf.site(s.name).gamma_stats["mean"] + 1, abs=1e-6)
    assert c.site("layers.0.q_norm").size == 8 and c.site("layers.0.q_norm").role == "qk"


def test_matching_checkpoints_have_no_mismatch(checkpoints):
    for hf, gg in (("llama", "llama.gguf"), ("gemma3", "gemma3.gguf")):
        d = compare(contract(checkpoints[hf]), contract(checkpoints[gg]))
        assert d.ok and not d.items, [i.message for i in d.items]
        assert len(d.matched) == (5 if hf == "llama" else 13)
        assert d.compared_fields > 6 * len(d.matched)


def test_wrong_eps_in_gguf_is_a_mismatch_at_every_site(checkpoints):
    d = compare(contract(checkpoints["llama"]), contract(checkpoints["llama-eps.gguf"]))
    assert not d.ok
    assert {(i.site, i.field) for i in d.items} == {(n, "eps") for n in d.matched}
    item = d.items[0]
    assert item.a == pytest.approx(1e-5) and item.b == pytest.approx(1e-6)
    assert "ε=1e-05 in A, ε=1e-06 in B" in item.message
    assert d.to_dict()["schema"] == "normscope.contract-diff/1" and d.to_dict()["mismatches"] == 5


def test_lost_gemma_offset_is_a_gamma_mismatch(checkpoints):
    hf = contract(checkpoints["gemma3"])
    d = compare(hf, contract(checkpoints["gemma3-lost.gguf"]))
    assert {i.field for i in d.items} == {"gamma"} and len(d.mismatches) == 13
    assert all("γ offset" in i.message for i in d.items)
    # the effective γ is 1 + w in HF, w in the broken GGUF: means differ by exactly one
    for i in d.items:
        assert i.a["offset"] + i.a["mean"] - (i.b["offset"] + i.b["mean"]) == pytest.approx(1.0, abs=1e-6)


def test_offset_without_weights_on_one_side_is_unverified(checkpoints, configs):
    d = compare(contract(configs["gemma3"]), contract(checkpoints["gemma3-lost.gguf"]))
    assert len(d.unverified) == 13 and not d.mismatches
    assert d.verdict == "inconclusive" and not d.ok  # unverified is never a pass
    assert {i.field for i in d.items} == {"gamma_offset"}
    assert "cannot be told" in d.items[0].message


def test_missing_site_and_family_mismatch(checkpoints, configs):
    d = compare(contract(checkpoints["llama"]), contract(checkpoints["llama-missing.gguf"]))
    # block 1 lost its MLP norm: the site is missing and the block design no longer reads as pre-norm
    assert [(i.site, i.field, i.b) for i in d.items] == [("model", "placement", "mixed"),
                                                         ("layers.1.ffn_norm", "site", None)]
    assert "in A but not in B" in d.items[1].message
    d = compare(contract(configs["gpt2"]), contract(checkpoints["llama.gguf"]))
    fields = {i.field for i in d.items}
    assert fields == {"family", "beta"}  # LayerNorm with β vs RMSNorm without, both ε = 1e-5
    assert len(d.mismatches) == 2 * 5 and "layernorm in A, rmsnorm in B" in d.items[0].message


def test_from_scan_matches_the_static_contracts(checkpoints):
    hf = contract(checkpoints["gemma3"])
    w = {s.name: s.gamma_stats for s in hf.sites}
    spec = NormSpec.preset("gemma_rmsnorm", eps=1e-6)
    paths = {"attn_norm": "input_layernorm", "attn_branch_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "ffn_branch_norm": "post_feedforward_layernorm",
             "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
    sites = []
    for s in hf.sites:
        if s.layer is None:
            path, shape = "model.norm", (2, 5, 32)
        else:
            path = f"model.layers.{s.layer}.{paths[s.name.split('.', 2)[2]]}"
            shape = (2, 4, 5, 8) if "_norm" in s.name and s.name.endswith(("q_norm", "k_norm")) else (2, 5, 32)
        sites.append(SimpleNamespace(name=path, layer=s.layer, role=s.role, spec=spec, shape=shape, gamma=w[s.name]))
    scan = SimpleNamespace(sites=sites, config_eps=1e-6)
    live = ModelContract.from_scan(scan, source="live gemma3")
    assert [s.name for s in live.sites] == [s.name for s in hf.sites] and live.placement == "sandwich"
    assert compare(live, hf).ok and not compare(live, hf).items
    assert compare(live, contract(checkpoints["gemma3.gguf"])).ok
    lost = compare(live, contract(checkpoints["gemma3-lost.gguf"]))
    assert len(lost.mismatches) == 13 and {i.field for i in lost.items} == {"gamma"}
    # a measured ε that differs is a mismatch too
    wrong = ModelContract.from_scan(SimpleNamespace(sites=[
        SimpleNamespace(name=s.name, layer=s.layer, role=s.role, spec=spec.replace(eps=1e-5), shape=s.shape,
                        gamma=s.gamma) for s in sites]))
    assert {i.field for i in compare(wrong, hf).mismatches} == {"eps"}


def test_from_scan_resolves_names_by_role_and_keeps_functional_calls():
    rms = NormSpec.preset("llama_rmsnorm")
    sites = [
        SimpleNamespace(name="model.layers.0.post_attention_layernorm", layer=0, role="branch", spec=rms,
                        gamma=None),
        SimpleNamespace(name="model.layers.0.post_attention_layernorm", layer=0, role="branch", spec=rms,
                        gamma=None),
        SimpleNamespace(name="model.layers.1.post_attention_layernorm", layer=1, role="pre", spec=rms, gamma=None),
        SimpleNamespace(name="blocks.0:layer_norm#0", layer=0, role="other", spec=NormSpec(), gamma=None),
    ]
    # one residual stream: the structure names the sites (a lone pre norm is its block's attn_norm)
    c = ModelContract.from_scan(SimpleNamespace(sites=sites, streams=[{}]))
    assert [s.name for s in c.sites] == ["layers.0.attn_branch_norm", "layers.0.attn_branch_norm#2",
                                         "layers.1.attn_norm", "layers.0:layer_norm#0"]
    # a site of unknown role: the name tables, with the measured role deciding an ambiguous name
    c = ModelContract.from_scan(SimpleNamespace(sites=sites + [
        SimpleNamespace(name="model.norm", layer=None, role=None, spec=rms, gamma=None)], streams=[{}]))
    assert [s.name for s in c.sites] == ["layers.0.attn_branch_norm", "layers.0.attn_branch_norm#2",
                                         "layers.1.ffn_norm", "layers.0:layer_norm#0", "final_norm"]
    assert c.sites[3].family == "layernorm" and c.sites[3].role == "other"
    again = ModelContract.from_dict(json.loads(c.to_json()))
    assert again.to_dict() == c.to_dict() and c.to_dict()["schema"] == "normscope.contract/1"


# ---------------------------------------------------------------- ONNX


class _RMS(torch.nn.Module):  # Hugging Face style: x * rsqrt(mean(x²) + ε) * (offset + w)
    def __init__(self, d, eps, offset=0.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.eps, self.offset = eps, offset

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (self.offset + self.weight) if self.offset else x * self.weight


class _SeedLN(torch.nn.Module):  # the seed text's layer_norm: (x − mean) / (std + ε)
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True, unbiased=False) + 1e-6)


class _Block(torch.nn.Module):
    def __init__(self, first):
        super().__init__()
        self.attn_norm = first
        self.ffn_norm = _RMS(16, 1e-6)
        self.post = _SeedLN()

    def forward(self, x):
        return self.post(self.ffn_norm(self.attn_norm(x)))


class _Net(torch.nn.Module):
    def __init__(self, first):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(first)])
        self.norm = _RMS(16, 1e-5, offset=1.0)

    def forward(self, x):
        return self.norm(self.layers[0](x))


def _export(module, path, opset=None):
    # opset 17 also keeps ``1 + w`` as an Add (no constant folding): the offset is read from the graph
    kw = {} if opset is None else {"opset_version": opset, "do_constant_folding": False}
    torch.onnx.export(module.eval(), (torch.randn(2, 3, 16),), str(path), dynamo=False, **kw)
    return path


def test_onnx_gamma_after_a_cast_is_found(tmp_path):
    # LlamaRMSNorm.forward: weight * hidden_states.to(input_dtype): a Cast between x̂ and the γ multiply
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    path = _export(torch.nn.Sequential(torch.nn.Linear(16, 16), norm), tmp_path / "rms.onnx")
    (site,) = contract(path).sites
    assert site.family == "rmsnorm" and site.gamma and site.gamma_offset == 0.0
    assert site.gamma_stats["min"] == pytest.approx(float(norm.weight.min()))


@pytest.mark.parametrize("opset", [None, 17])
def test_onnx_fused_and_decomposed_norms(tmp_path, opset):
    ln = torch.nn.LayerNorm(16, eps=1e-5)
    with torch.no_grad():
        ln.weight.copy_(torch.linspace(-1, 1, 16))
    c = contract(_export(_Net(ln), tmp_path / "m.onnx", opset))
    got = {s.name: s for s in c.sites}
    assert set(got) == {"layers.0.attn_norm", "layers.0.ffn_norm", "layers.0.post", "final_norm"}
    a = got["layers.0.attn_norm"]
    assert (a.family, a.eps_placement, a.axes, a.size, a.beta) == ("layernorm", "inside_sqrt", (-1,), 16, True)
    assert a.eps == pytest.approx(1e-5, rel=1e-6) and a.gamma_stats == pytest.approx({"mean": 0, "min": -1, "max": 1},
                                                                                      abs=1e-6)
    f = got["layers.0.ffn_norm"]
    assert (f.family, f.eps_placement, f.axes, f.size, f.beta, f.gamma_offset) == ("rmsnorm", "inside_sqrt", (-1,),
                                                                                   16, False, 0.0)
    assert f.eps == pytest.approx(1e-6, rel=1e-6) and f.gamma_stats["mean"] == pytest.approx(1.0)
    p = got["layers.0.post"]  # std + ε: ε outside the square root, no affine
    assert (p.family, p.eps_placement, p.gamma, p.beta) == ("layernorm", "outside_sqrt", False, False)
    assert p.eps == pytest.approx(1e-6, rel=1e-6)
    n = got["final_norm"]
    assert (n.role, n.eps) == ("final", pytest.approx(1e-5, rel=1e-6))
    assert n.effective_gamma["mean"] == pytest.approx(2.0)  # 1 + w, w from 0.5 to 1.5
    assert n.gamma_offset == (0.0 if opset is None else 1.0)  # folded into the initializer, or an Add


def test_onnx_placement_and_family_mismatch(tmp_path):
    seed = contract(_export(_Net(_SeedLN()), tmp_path / "seed.onnx"))
    proper = contract(_export(_Net(torch.nn.LayerNorm(16, eps=1e-6, elementwise_affine=False)),
                              tmp_path / "ln.onnx"))
    d = compare(seed, proper)
    assert [(i.site, i.field) for i in d.items] == [("layers.0.attn_norm", "eps_placement")]
    assert "std+ε" in d.items[0].message and "sqrt(var+ε)" in d.items[0].message
    rms = contract(_export(_Net(_RMS(16, 1e-6)), tmp_path / "rms.onnx"))
    d = compare(seed, rms)
    assert {i.field for i in d.items if i.site == "layers.0.attn_norm"} >= {"family", "eps_placement", "gamma"}


def test_onnx_fused_node_types(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    def init(name, values):
        return numpy_helper.from_array(np.asarray(values, np.float32), name)

    nodes = [
        helper.make_node("GroupNormalization", ["x", "g", "b"], ["y1"], name="/gn/GroupNormalization", epsilon=1e-3,
                         num_groups=2),
        helper.make_node("InstanceNormalization", ["x", "c", "d"], ["y2"], name="/inorm/InstanceNormalization",
                         epsilon=1e-4),
        helper.make_node("BatchNormalization", ["x", "c", "d", "d", "c"], ["y3"], name="/bn/BatchNormalization",
                         epsilon=2e-5),
        helper.make_node("SimplifiedLayerNormalization", ["x", "s"], ["y4"], name="/layers.0/attn_norm/SLN",
                         axis=-1, epsilon=1e-6),
        helper.make_node("SkipLayerNormalization", ["x", "x", "s", "s"], ["y5"], name="/layers.0/ffn_norm/Skip",
                         domain="com.microsoft", epsilon=1e-5),
        helper.make_node("LayerNormalization", ["x", "s"], ["y6"], name="/final/LN", axis=2, epsilon=1e-5),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 6])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(1, 7)],
        [init("g", [1, 2]), init("b", [0, 0]), init("c", [1, 1, 1, 3]), init("d", [0] * 4), init("s", [2] * 6)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, tmp_path / "fused.onnx")
    got = {s.name: s for s in contract(tmp_path / "fused.onnx").sites}
    gn = got["gn"]
    assert (gn.family, gn.groups, gn.eps, gn.axes) == ("groupnorm", 2, pytest.approx(1e-3), (1, 2))
    assert "per group" in got["gn"].notes[0]
    assert (got["inorm"].family, got["inorm"].axes, got["inorm"].gamma_stats["max"]) == ("instancenorm", (2,), 3.0)
    assert (got["bn"].family, got["bn"].axes, got["bn"].eps) == ("batchnorm", (0, 2), pytest.approx(2e-5))
    sln = got["layers.0.attn_norm"]
    assert (sln.family, sln.beta, sln.size, sln.role) == ("rmsnorm", False, 6, "pre")
    assert got["layers.0.ffn_norm"].family == "layernorm" and "skip" in got["layers.0.ffn_norm"].notes[0]
    assert got["final"].axes == (-1,) and got["final"].size == 6  # axis=2 of a rank-3 input


# ---------------------------------------------------------------- bad input


def _gguf_header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(v)) + v


HOSTILE = {
    "lying tensor count": (_gguf_header(10**12, 0), "claims 1000000000000 tensors"),
    "lying metadata count": (_gguf_header(0, 2**40), "metadata entries"),
    "lying key length": (_gguf_header(0, 1) + struct.pack("<Q", 2**60) + b"x" * 16, "claims 1152921504606846976 bytes"),
    # an array of 2**40 bytes: gguf's reader would loop over it element by element
    "lying array length": (_gguf_header(0, 1) + struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 0, 2**40),
                           "claims 1099511627776 elements"),
    "wrong magic": (b"GGUX" + b"\0" * 40, None),
    "short": (b"GGUF\3\0\0\0", "shorter than a GGUF header"),
    "bad version": (b"GGUF" + struct.pack("<IQQ", 99, 0, 0), "version 99"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_gguf_headers(tmp_path, case):
    data, text = HOSTILE[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(InputError) as exc:
        contract(path)
    assert str(path) in str(exc.value)
    assert (text or "magic") in str(exc.value)
    assert path.read_bytes() == data


def test_truncated_gguf_and_gguf_without_eps(tmp_path, checkpoints):
    full = checkpoints["llama.gguf"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[:-100])
    with pytest.raises(InputError, match="past the end of the file"):
        contract(cut)
    w = gguf.GGUFWriter(str(tmp_path / "noeps.gguf"), arch="llama")
    w.add_block_count(1)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match="no llama.attention.layer_norm_rms_epsilon"):
        contract(tmp_path / "noeps.gguf")


def test_bad_configs_and_files(tmp_path):
    cases = {
        "noeps.json": ({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2},
                       "no rms_norm_eps"),
        "wrongeps.json": ({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                           "layer_norm_eps": 1e-5}, "it has layer_norm_eps, which llama does not read"),
        "unknown.json": ({"model_type": "no-such-model", "norm_eps": 1e-5},
                         "model_type 'no-such-model' is not an architecture the installed transformers"),
        "notype.json": ({"norm_eps": 1e-5}, "no model_type"),
        "list.json": ([1, 2, 3], "must hold a JSON object; got a list"),
        "huge.json": ({"model_type": "llama", "rms_norm_eps": 1e-6, "num_hidden_layers": 10**12, "hidden_size": 8,
                       "num_attention_heads": 2}, "num_hidden_layers must be a positive integer"),
    }
    for name, (data, text) in cases.items():
        (tmp_path / name).write_text(json.dumps(data))
        with pytest.raises(InputError, match=text) as exc:
            contract(tmp_path / name)
        assert str(tmp_path / name) in str(exc.value)
    (tmp_path / "broken.json").write_text("{ not json")
    with pytest.raises(InputError, match="not valid JSON"):
        contract(tmp_path / "broken.json")
    (tmp_path / "fake.onnx").write_bytes(b"this is not an onnx file\n" * 10)
    with pytest.raises(InputError, match="not an ONNX model"):
        contract(tmp_path / "fake.onnx")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="needs a config.json"):
        contract(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"\x00\x01" * 10)
    with pytest.raises(InputError, match="not a model artifact"):
        contract(tmp_path / "weights.bin")
    with pytest.raises(InputError, match="no such file"):
        contract(tmp_path / "absent.gguf")


def _sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that takes no disk space (a hole)."""
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def test_oversize_files_are_one_input_error_before_anything_is_read(tmp_path):
    """An ONNX graph over protobuf's 2 GiB and a config.json over 16 MiB are refused by size, in one wording."""
    oversize = r"is [\d,]+ bytes \(.*\), over the [\d,]+-byte \(.*\) limit for "
    (tmp_path / "model").mkdir()
    big_onnx = _sparse(tmp_path / "big.onnx", 2**31 + 1)
    big_config = _sparse(tmp_path / "model" / "config.json", 16 * 2**20 + 1)
    for target, path, words in [(big_onnx, big_onnx, "2,147,483,649 bytes"),
                                (big_config, big_config, "16,777,217 bytes"),
                                (tmp_path / "model", big_config, "limit for a Hugging Face config.json; is it")]:
        with pytest.raises(InputError, match=oversize) as exc:
            contract(target)
        assert str(path) in str(exc.value) and words in str(exc.value)
    assert "save the weights as external data" in str(pytest.raises(InputError, contract, big_onnx).value)


def test_reading_modifies_nothing(checkpoints):
    files = [checkpoints["gemma3.gguf"], checkpoints["gemma3"] / "config.json",
             checkpoints["gemma3"] / "model.safetensors"]
    before = [(_sha(f), f.stat().st_mtime_ns) for f in files]
    contract(checkpoints["gemma3.gguf"])
    contract(checkpoints["gemma3"])
    assert [(_sha(f), f.stat().st_mtime_ns) for f in files] == before


# ---------------------------------------------------------------- command line


@pytest.fixture
def run_cli(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "240")

    def run(*argv):
        rc = cli.main(["contract", *map(str, argv)])
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run


def test_cli_exit_codes_and_output(run_cli, checkpoints, configs, tmp_path):
    rc, out, err = run_cli(checkpoints["gemma3.gguf"])
    assert rc == 0 and "layers 0–1 attn_norm" in out and "sandwich" in out and "1.1" in out, out
    rc, out, _ = run_cli(checkpoints["llama"], checkpoints["llama.gguf"])
    assert rc == 0 and "no mismatch" in out
    rc, out, _ = run_cli(checkpoints["llama"], checkpoints["llama-eps.gguf"], "--json")
    data = json.loads(out)
    assert rc == 1 and data["mismatches"] == 5 and data["contracts"][1]["schema"] == "normscope.contract/1"
    rc, out, _ = run_cli(checkpoints["gemma3"], checkpoints["gemma3-lost.gguf"])
    assert rc == 1 and "MISMATCH" in out and "γ offset" in out
    rc, out, _ = run_cli(configs["gemma3"], checkpoints["gemma3-lost.gguf"])
    assert rc == 6 and "INCONCLUSIVE" in out and "13 sites unverified: layers.0.attn_norm" in out and "9 more" in out
    saved = tmp_path / "saved.json"
    rc, out, _ = run_cli(configs["olmo2"], "--json")
    saved.write_text(out)
    rc, out, _ = run_cli(saved, configs["olmo2"])
    assert rc == 0 and "no mismatch" in out
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(HOSTILE["lying tensor count"][0])
    rc, out, err = run_cli(bad)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err and str(bad) in err


def _names_every_site(c: ModelContract, out: str) -> None:
    """Every site of c is in out: by its name, or inside a 'layers i–j slot' run."""
    import re

    from normscope.artifacts.names import slot_of

    runs = [(int(a), int(b), slot) for a, b, slot in re.findall(r"^ *layers (\d+)–(\d+) (\S+)", out, re.M)]
    for s in c.sites:
        assert re.search(rf"^ *{re.escape(s.name)}\b", out, re.M) or any(
            a <= s.layer <= b and slot == slot_of(s.name) for a, b, slot in runs), (s.name, out)


def test_cli_output_at_80_columns(monkeypatch, capsys, checkpoints):
    monkeypatch.setenv("COLUMNS", "80")
    rc = cli.main(["contract", str(checkpoints["gemma3.gguf"])])
    out = capsys.readouterr().out
    assert rc == 0 and max(map(len, out.splitlines())) <= 80, out
    c = contract(checkpoints["gemma3.gguf"])
    _names_every_site(c, out)
    assert out.count("rmsnorm, ε=1e-06 inside √") == 7 and "(2 sites)" in out
    rc = cli.main(["contract", str(checkpoints["llama"]), str(checkpoints["llama-missing.gguf"])])
    out = capsys.readouterr().out
    assert rc == 1 and max(map(len, out.splitlines())) <= 80, out
    _names_every_site(contract(checkpoints["llama"]), out)
    flat = " ".join(line.strip() for line in out.splitlines())
    assert "MISMATCH site at layers.1.ffn_norm A: model.layers.1.post_attention_layernorm; B: —" in flat, flat
    rc = cli.main(["contract", str(checkpoints["llama"]), str(checkpoints["llama-eps.gguf"])])
    flat = " ".join(line.strip() for line in capsys.readouterr().out.splitlines())
    assert rc == 1 and ("MISMATCH eps at 5 sites: attn_norm in layers 0–1; ffn_norm in layers 0–1; final_norm "
                        "A: 1e-05; B: 1e-06") in flat, flat


def test_live_model_against_a_static_file(run_cli, checkpoints):
    # the Llama checkpoint is run and scanned; the GGUF written with ε 1e-6 instead of 1e-5 is read statically
    rc, out, err = run_cli("--live", checkpoints["llama"], checkpoints["llama-eps.gguf"])
    assert rc == 1, out + err
    assert "scanned" in out and "MISMATCH" in out and "1e-05" in out and "1e-06" in out
    rc, out, err = run_cli("--live", checkpoints["llama"], checkpoints["llama.gguf"])
    assert rc == 0, out + err
    rc, out, err = run_cli("--live", checkpoints["llama"])
    assert rc == 2 and "give FILE2" in err


class _AnnotatedLayerNorm(torch.nn.Module):
    """The Annotated Transformer's LayerNorm: γ before the division, the unbiased std, ε outside the root."""

    def __init__(self, d, eps=1e-6, gamma_first=True):
        super().__init__()
        self.a_2, self.b_2 = torch.nn.Parameter(torch.rand(d) + 0.5), torch.nn.Parameter(torch.rand(d))
        self.eps, self.gamma_first = eps, gamma_first

    def forward(self, x):
        mean, std = x.mean(-1, keepdim=True), x.std(-1, keepdim=True)
        if self.gamma_first:
            return self.a_2 * (x - mean) / (std + self.eps) + self.b_2
        return (x - mean) / (std + self.eps) * self.a_2 + self.b_2


class _LinearThen(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(16, 16), norm

    def forward(self, x):
        return self.norm(self.lin(x))


@pytest.mark.parametrize("gamma_first", [True, False])
def test_onnx_norm_found_whatever_the_order_of_its_affine_factors(tmp_path, gamma_first):
    c = contract(_export(_LinearThen(_AnnotatedLayerNorm(16, gamma_first=gamma_first)), tmp_path / "m.onnx"))
    (site,) = c.sites
    assert (site.family, site.eps_placement, site.gamma, site.beta, site.param_shape) == \
        ("layernorm", "outside_sqrt", True, True, (16,))
    assert site.eps == pytest.approx(1e-6, rel=1e-6)
    assert any("unbiased estimator" in n for n in site.notes)


def test_onnx_graph_with_matmuls_and_no_norm_says_so(tmp_path):
    c = contract(_export(_LinearThen(torch.nn.GELU()), tmp_path / "m.onnx"))
    assert not c.sites and any("MatMul/Gemm nodes but no norm site" in n for n in c.notes), c.notes


def test_a_structure_read_by_a_real_build_leaves_the_callers_rng_as_it_was(tmp_path):
    """BART's forward does not run on the meta device, so its structure is read from a build with random weights,
    drawn from seed 0 — which seeded the caller's torch RNG too. The draw is made in a forked RNG state."""
    import json

    import torch
    import transformers

    from normscope.artifacts import structure

    cfg = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=32)
    cfg.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    contract = structure.read_structure(json.loads(path.read_text()), path, str(path))
    assert contract.sites and "random weights" in json.dumps(contract.to_dict())
    assert torch.equal(torch.rand(3), expected)
