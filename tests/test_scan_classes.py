"""Classes of wrong answers ``scan`` gave on real architectures, each fixed at its cause.

- A non-finite input (NaN pixels, an ∞ in ``inputs_embeds``) reached every norm, and each was blamed for it
  (``activation_mismatch``, ``--strict`` exit 1). Nothing a contract says holds on NaN: the sites are not judged,
  and the scan is inconclusive, naming the input (exit 6 with ``--strict``), as ``diff`` is.
- A normalization class that applies more than its norm (BiT's ``BitGroupNormActivation``: ``group_norm`` then
  ReLU) was rejected as "not a normalization", and the norm it applies was not reported either: the ops inside a
  class site were never searched. The norm inside is the site when the class is no normalization as a whole.
- A gated RMSNorm module (``norm(x, gate)``: Mamba 2, Qwen3-Next) takes two tensors, so its call was no module site
  and its norm was reported as an inline site inside it. The module is the site, with where its gate enters.

Tiny random-weight models built from the installed transformers' config classes; the truth of each is read from its
modeling source (the class cited beside it).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from command_runner import run_command

from normscope import scan
from normscope.sites import command

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
T = transformers
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


# ---------------------------------------------------------------------------------------------- models
def tiny_vit():
    torch.manual_seed(0)
    return T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64)).eval()


def tiny_llama():
    torch.manual_seed(0)
    return T.LlamaModel(T.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      **IDS)).eval()


def tiny_bit(layer_type: str = "preactivation"):
    """BitModel: every ``BitGroupNormActivation`` is ``F.group_norm`` then ReLU (``apply_activation=False``: an
    Identity, the norm alone); its convolutions standardize their weights with ``F.batch_norm(w, None, None,
    training=True)``."""
    torch.manual_seed(0)
    bottleneck = layer_type == "bottleneck"
    return T.BitModel(T.BitConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                  layer_type=layer_type, num_groups=4, hidden_act="relu",
                                  global_padding="SAME" if bottleneck else None,
                                  embedding_dynamic_padding=bottleneck)).eval()


def tiny_dpt_hybrid():
    """DPT with a BiT backbone (``is_hybrid``): a ViT encoder on the BiT stages' features."""
    torch.manual_seed(0)
    cfg = T.DPTConfig(is_hybrid=True, image_size=64, patch_size=16, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, backbone_featmap_shape=[1, 32, 4, 4],
                      neck_hidden_sizes=[8, 8, 16, 16], fusion_hidden_size=16, backbone_out_indices=[0, 1],
                      reassemble_factors=[1, 1, 1, 0.5],
                      backbone_config=dict(embedding_size=8, hidden_sizes=[8, 16, 32], depths=[1, 1, 1],
                                           layer_type="bottleneck", global_padding="same", num_groups=4,
                                           out_features=["stage1", "stage2", "stage3"]))
    return T.DPTModel(cfg).eval()


def _cli(argv, capsys):
    return run_command(command, argv, capsys)


# ---------------------------------------------------------------------------------------------- a non-finite input
def _nan_pixels():
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    x[0, 0, 5, 7] = float("nan")
    return x


def _inf_embeds():
    e = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    e[0, 3, 5] = float("inf")
    return e


@pytest.mark.parametrize("build, inputs, named", [
    (tiny_vit, lambda: {"pixel_values": _nan_pixels()}, "pixel_values (1 NaN of 3072 values)"),
    (tiny_llama, lambda: {"inputs_embeds": _inf_embeds()}, "inputs_embeds (1 ±∞ of 512 values)"),
])
def test_a_non_finite_input_is_inconclusive_not_a_finding_against_the_norms(build, inputs, named):
    model = build()
    r = scan(model, inputs(), dtypes="float32", progress=False)
    assert r.findings == [] and r.verdict == "inconclusive" and not r.ok and not r.conclusive
    (why,) = r.inconclusive
    assert why.startswith(f"the input is not finite: {named}") and "what would decide it: finite inputs" in why, why
    first = r.sites[0]
    assert f"(first: {first.name})" in why
    # every contract is still inferred (on probe inputs); the sites the NaN reached are not judged on it
    assert all(s.spec is not None for s in r.sites)
    assert first.activation["input_finite"] is False and "not_measured" in first.activation
    assert json.loads(r.to_json())["verdict"] == "inconclusive"
    # the same model on a finite input passes
    finite = {k: torch.nan_to_num(v, nan=0.0, posinf=1.0) for k, v in inputs().items()}
    r = scan(model, finite, dtypes="float32", progress=False)
    assert r.verdict == "pass" and r.inconclusive == [] and r.findings == []


def test_a_forward_that_is_not_finite_before_its_first_norm_names_that_norm():
    """The inputs are finite token ids; an embedding row of ∞ makes the first norm's input not finite."""
    model = tiny_llama()
    with torch.no_grad():
        model.embed_tokens.weight[7, 3] = float("inf")
    ids = torch.tensor([[4, 5, 7, 9, 10, 11, 12, 13]])
    r = scan(model, {"input_ids": ids}, dtypes="float32", progress=False)
    assert r.findings == [] and r.verdict == "inconclusive"
    (why,) = r.inconclusive
    assert why.startswith("the forward is not finite before layers.0.input_layernorm: the model's inputs are finite")


@pytest.mark.parametrize("factory, make, saved", [
    ("test_scan_classes:tiny_vit", _nan_pixels, "tensor"),
    ("test_scan_classes:tiny_llama", _inf_embeds, "inputs_embeds"),
])
def test_cli_strict_exits_6_on_a_non_finite_input(tmp_path, capsys, factory, make, saved):
    path = tmp_path / "x.pt"
    torch.save(make() if saved == "tensor" else {saved: make()}, path)
    argv = ["scan", factory, "--inputs", str(path), "--dtypes", "float32"]
    code, out, _ = _cli(argv + ["--strict"], capsys)
    assert code == 6, out
    assert "inconclusive: the input is not finite" in " ".join(out.split()) and "finding" not in out
    code, out, _ = _cli(argv + ["--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["findings"] == [] and data["verdict"] == "inconclusive"


# ---------------------------------------------------------------------------------------------- a norm and more
@pytest.mark.parametrize("build, inputs, prefix", [
    (lambda: tiny_bit("preactivation"), (1, 3, 32, 32), ""),
    (lambda: tiny_bit("bottleneck"), (1, 3, 32, 32), ""),
    (tiny_dpt_hybrid, (1, 3, 64, 64), "embeddings.backbone.bit."),
])
def test_the_norm_inside_a_norm_class_that_also_activates_is_the_site(build, inputs, prefix):
    """BitGroupNormActivation: ``group_norm(x)`` then ReLU; with ``apply_activation=False`` (a bottleneck's norm3, the
    downsample's norm) an Identity, so the class itself is the norm."""
    model = build()
    acts = {n for n, m in model.named_modules() if type(m).__name__ == "BitGroupNormActivation"
            and not isinstance(m.activation, torch.nn.Identity)}
    plain = {n for n, m in model.named_modules() if type(m).__name__ == "BitGroupNormActivation"} - acts
    assert acts
    r = scan(model, torch.randn(*inputs, generator=torch.Generator().manual_seed(0)), dtypes="float32",
             progress=False)
    assert r.findings == [], r.findings
    by = {s.name: s for s in r.sites}
    for name in acts:  # the class is no site, the group_norm it applies is one
        assert name not in by
        s = by[f"{name}:group_norm#0"]
        assert s.kind == "functional" and s.spec.kind == "groupnorm" and s.spec.groups == 4, s.summary
        assert s.spec.gamma and s.spec.beta and s.activation["ok"], s.activation
    for name in plain:
        assert by[name].kind == "module" and by[name].spec.kind == "groupnorm"
    rejected = {x["name"]: x for x in r.rejected}
    assert set(rejected) >= acts and all(rejected[n]["sites_inside"] == [f"{n}:group_norm#0"] for n in acts)
    (note,) = [n for n in r.notes if n["kind"] == "norm_inside"]
    assert sorted(note["sites"]) == sorted(f"{n}:group_norm#0" for n in acts)
    # the convolutions' weight standardization (F.batch_norm without running statistics, in either mode) is a
    # normalization of each output channel's weights: inferred, not "failed in evaluation mode", with a role of its
    # own (it normalizes a parameter, not an activation)
    ws = [s for s in r.sites if s.name.endswith(":batch_norm#0")]
    assert ws and all(s.name.startswith(prefix) and s.spec is not None and s.activation["ok"] for s in ws)
    assert {s.role for s in ws} == {"weight"}


# ---------------------------------------------------------------------------------------------- gated norms
def tiny_mamba2(n_groups: int = 2):
    torch.manual_seed(0)
    return T.Mamba2Model(T.Mamba2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                                        n_groups=n_groups, head_dim=16, num_heads=4, conv_kernel=4, chunk_size=8,
                                        layer_norm_epsilon=3e-5, **IDS)).eval()


def tiny_bamba():
    torch.manual_seed(0)
    return T.BambaModel(T.BambaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1],
                                      mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                                      mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, rms_norm_eps=2e-5,
                                      max_position_embeddings=64, **IDS)).eval()


def tiny_qwen3_next():
    torch.manual_seed(0)
    return T.Qwen3NextModel(T.Qwen3NextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=64, rms_norm_eps=1e-6, **IDS)).eval()


# name → (build, the gated norms' paths, class, where the gate enters, ε, groups); from the modeling sources:
GATED = {
    # Mamba2Mixer: self.norm(scan_output, gate); MambaRMSNormGated: x · silu(gate), then RMS per group of
    # intermediate_size / n_groups
    "mamba2": (tiny_mamba2, ["layers.0.mixer.norm", "layers.1.mixer.norm"], "Mamba2RMSNormGated",
               "before the statistic", 3e-5, 2),
    # BambaMixer (layer 0; layer 1 is attention): the same gated norm
    "bamba": (tiny_bamba, ["layers.0.mamba.norm"], "BambaRMSNormGated", "before the statistic", 2e-5, None),
    # Qwen3NextGatedDeltaNet: self.norm(core_attn_out, z); Qwen3NextRMSNormGated: RMSNorm, γ, then · silu(gate)
    "qwen3_next": (tiny_qwen3_next, ["layers.0.linear_attn.norm"], "Qwen3NextRMSNormGated",
                   "after the normalization", 1e-6, None),
}


@pytest.mark.parametrize("name", list(GATED))
def test_a_gated_rmsnorm_module_is_the_site_with_its_gate_noted(name):
    build, paths, cls, applied, eps, groups = GATED[name]
    ids = torch.randint(4, 120, (2, 8), generator=torch.Generator().manual_seed(0))
    r = scan(build(), {"input_ids": ids}, dtypes="float32", progress=False)
    assert r.findings == [], r.findings
    by = {s.name: s for s in r.sites}
    assert not [n for n in by if ":inline#" in n], list(by)  # no site inside the gated module
    for path in paths:
        s = by[path]
        assert s.kind == "module" and s.cls == cls and not s.spec.center, (s.kind, s.cls, s.summary)
        assert s.summary.startswith("RMSNorm over [-1]" if groups is None else f"RMSNorm over [2] in {groups} groups")
        assert s.spec.eps == pytest.approx(eps, rel=0.01) and s.spec.groups == groups and s.spec.gamma
        assert s.activation["ok"], s.activation
        gate = s.evidence["gate"]["measured"]
        assert gate == {"gate": ["args[1]"], "applied": applied}
    (note,) = [n for n in r.notes if n["kind"] == "gated"]
    assert note["sites"] == paths and applied in note["message"]
