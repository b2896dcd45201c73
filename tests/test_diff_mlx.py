"""``diff`` against a model as MLX runs it (the ``mlx`` extra: MLX's CPU build and mlx-lm).

Tiny random-weight Hugging Face models (Llama, Gemma 3, Qwen 3) ported by mlx-lm from their own config and weights
— the port people deploy to Apple silicon, run here by MLX's CPU device. The clean ports pass with every norm site
judged on its own error; a fault put into the port (ε changed in an MLX norm, Gemma's ``1 + w`` applied twice, a
port that loses Gemma's embedding scale) is the first divergence, at its site, with the contract difference named.
Quantized ports (``mlx.nn.quantize``, 4 and 8 bits) are judged against the reference run with their own dequantized
weights, and the same faults are named among the quantization noise.
"""

from __future__ import annotations

import json

import pytest
import torch
from runtime_models import skip_without_mlx, tiny_causal_lm, token_ids

from normscope import diff
from normscope.errors import InputError

skip_without_mlx()
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

from normscope.divergence.runtimes.mlx import port  # noqa: E402


def _model(family: str):
    return tiny_causal_lm(family)


def _ids():
    return token_ids()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_a_clean_mlx_lm_port_passes_with_every_norm_judged(family):
    model = _model(family)
    d = diff(model, "mlx", _ids(), progress=False)
    assert d.verdict == "pass", d.summary()
    assert d.candidate.startswith("MLX ") and "ported by mlx-lm" in d.candidate
    norms = [s for s in d.sites if s.kind == "norm"]
    n_norms = sum(1 for m in model.modules() if "RMSNorm" in type(m).__name__)
    assert len(norms) == n_norms and all(s.status == "within" and s.elementwise for s in norms), \
        [(s.name, s.status, s.note) for s in norms]
    assert d.stats["alignment"] == "name"
    root = d.site("(model)")
    assert root.propagated["normalized"] < 1e-5


def test_gemma_embedding_scale_applied_after_the_embedding_is_a_regrouping_not_a_divergence():
    # mlx-lm's Gemma multiplies by √d after its embedding module; Hugging Face's embedding module returns it scaled
    d = diff(_model("gemma3"), "mlx", _ids(), progress=False)
    emb = d.site("model.embed_tokens")
    assert emb.status == "regrouped" and emb.factor == pytest.approx(1 / 8)
    assert "model.layers.0" in emb.note and "outside this module" in emb.note
    assert d.first_divergence is None


def test_a_port_that_loses_the_embedding_scale_diverges_at_the_embedding():
    model = _model("gemma3")
    port_ = port(model)
    port_.model.args.hidden_size = 1  # the port's scale √hidden_size becomes 1: the scale is lost, not moved
    d = diff(model, port_, _ids(), progress=False)
    assert d.first_divergence == "model.embed_tokens"
    assert d.site("model.embed_tokens").status == "diverged"


def test_eps_changed_in_an_mlx_norm_is_the_first_divergence_with_the_eps_named():
    model = _model("llama")
    port_ = port(model)
    port_.model.layers[1].post_attention_layernorm.eps = 1e-2
    d = diff(model, port_, _ids(), progress=False)
    assert d.first_divergence == "model.layers.1.post_attention_layernorm", d.summary()
    assert "expected ε=1e-05; found ε=0.01" in d.divergence["differences"]
    earlier = [s for s in d.sites if s.order < d.site(d.first_divergence).order and s.own is not None]
    assert earlier and all(s.status in ("within", "regrouped") for s in earlier)


def test_gemma_offset_applied_twice_is_named_as_a_gamma_off_by_one():
    model = _model("gemma3")
    port_ = port(model)
    norm = port_.model.layers[0].pre_feedforward_layernorm
    norm.weight = 1 + norm.weight  # the converter baked 1 + w into the weight; the port adds 1 again
    d = diff(model, port_, _ids(), progress=False)
    assert d.first_divergence == "model.layers.0.pre_feedforward_layernorm", d.summary()
    v = d.divergence
    assert "cannot be seen from outside" in v["offset_note"]
    (gamma,) = v["parameter_differences"]
    assert "effective γ differs at 64 of 64 channels" in gamma
    ref_w = model.model.layers[0].pre_feedforward_layernorm.weight.detach()
    i = int(gamma.split("channel ")[1].split(":")[0])
    assert f"{float(ref_w[i]) + 2:.4g} in the candidate vs {float(ref_w[i]) + 1:.4g} in the reference" in gamma


def test_the_mlx_forward_leaves_no_wrapper_behind_and_a_raising_port_is_a_failure():
    import mlx.nn as mnn

    model = _model("llama")
    port_ = port(model)
    classes = {type(m) for _, m in port_.named_modules()}
    before = {c: c.__dict__.get("__call__") for c in classes}
    port_.model.layers[1].mlp.down_proj = mnn.Linear(64, 64)  # a port whose MLP output has the wrong width
    d = diff(model, port_, _ids(), progress=False)
    assert {c: c.__dict__.get("__call__") for c in classes} == before
    assert d.verdict == "fail"
    assert "model.layers.1.mlp" in (d.divergence or {}).get("reason", "") or \
        (d.first_divergence or "").startswith("model.layers.1.mlp")


def test_mlx_candidates_are_refused_where_they_cannot_apply():
    with pytest.raises(InputError, match="no Hugging Face config"):
        diff(torch.nn.Sequential(torch.nn.Linear(4, 4)), "mlx", torch.randn(2, 4), progress=False)
    with pytest.raises(InputError, match="no backward"):
        diff(_model("llama"), "mlx", _ids(), grad=True, progress=False)


def test_an_mlx_norm_is_a_target_infer_reads():
    import mlx.nn as mnn

    from normscope import infer

    spec = infer(mnn.RMSNorm(64, eps=1e-5), shape=(2, 8, 64)).spec
    assert spec.kind == "rmsnorm" and spec.eps == pytest.approx(1e-5) and spec.axes == (-1,)
    spec = infer(mnn.LayerNorm(64, eps=1e-6), shape=(2, 8, 64)).spec
    assert spec.kind == "layernorm" and spec.eps == pytest.approx(1e-6)


def test_cli_diff_against_mlx(tmp_path, capsys):
    from normscope.cli import main

    model = _model("qwen3")
    model.save_pretrained(tmp_path / "qwen")
    capsys.readouterr()  # the test's own save
    code = main(["diff", str(tmp_path / "qwen"), "mlx"])
    out, err = capsys.readouterr()
    assert code == 0, out
    assert "PASS" in out and "MLX" in out
    assert "Writing model shards" not in err, err  # the port's own save_pretrained is normscope's, kept quiet


# ------------------------------------------------------------------------------------------ quantized ports
def _quantized(model, bits=4, predicate=None):
    import mlx.nn as mnn

    port_ = port(model)
    mnn.quantize(port_, group_size=32, bits=bits, class_predicate=predicate)
    return port_


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_a_quantized_port_passes_with_its_error_explained_by_its_own_dequantized_weights(family, bits):
    """Every site is judged against the reference run with the candidate's dequantized weights: the quantization
    explains nearly all of each projection's error, what it does not explain stays within float rounding, and the
    logits, far beyond any float bound, are accounted for."""
    model = _model(family)
    d = diff(model, _quantized(model, bits), _ids(), progress=False)
    assert d.verdict == "pass", d.summary()
    assert f"quantized: {bits}-bit, group 32" in d.candidate
    assert any(n.startswith("quantized candidate: ") for n in d.notes), d.notes
    projections = [s for s in d.sites if s.beyond_twin is not None and s.kind == "leaf"]
    assert len(projections) >= 14  # 7 per layer, the embedding and (untied) the logits
    least = 0.03 if bits == 4 else 2e-3  # 4-bit affine groups of 32: ~8 %; 8-bit: ~0.5 %
    for s in projections:
        if s.status == "regrouped":  # Gemma's embedding scale, applied after the module by mlx-lm (as unquantized)
            assert family == "gemma3" and s.name == "model.embed_tokens" and s.factor == pytest.approx(1 / 8)
            continue
        assert s.twin > least and s.beyond_twin <= s.bound < 1e-4 and s.status == "within", s
    norms = [s for s in d.sites if s.kind == "norm"]
    assert norms and all(s.status == "within" and s.elementwise for s in norms)  # float γ: the contract judges them
    assert d.site("(model)").propagated["normalized"] > 100 * max(s.bound for s in projections)


@pytest.mark.parametrize("fault", ["eps", "rope_base", "gamma_twice", "scales_swapped"])
def test_a_fault_in_a_quantized_port_is_named_at_its_site_among_the_quantization_noise(fault):
    family = "gemma3" if fault == "gamma_twice" else "llama"
    model = _model(family)
    port_ = _quantized(model)
    layers = port_.model.layers
    if fault == "eps":
        layers[1].post_attention_layernorm.eps = 1e-2
        site = "model.layers.1.post_attention_layernorm"
    elif fault == "rope_base":  # a wrong rotary base in one layer's attention
        layers[0].self_attn.rope.base = 2 * layers[0].self_attn.rope.base
        site = "model.layers.0.self_attn"
    elif fault == "gamma_twice":  # a norm that kept its float weights, with Gemma's 1 + w applied twice
        norm = layers[0].pre_feedforward_layernorm
        norm.weight = 1 + norm.weight
        site = "model.layers.0.pre_feedforward_layernorm"
    else:  # a conversion that mixed up two tensors' scales: the weights are no longer the reference's, quantized
        a, b = layers[0].mlp.down_proj, layers[1].mlp.down_proj
        a.scales, b.scales = b.scales, a.scales
        site = "model.layers.0.mlp.down_proj"
    d = diff(model, port_, _ids(), progress=False)
    assert d.verdict == "fail" and d.first_divergence == site, d.summary()
    reason = d.divergence["reason"]
    if fault == "eps":
        assert "expected ε=1e-05; found ε=0.01" in d.divergence["differences"]
    elif fault == "gamma_twice":
        assert "effective γ differs" in d.divergence["parameter_differences"][0]
    elif fault == "rope_base":
        s = d.site(site)
        assert "dequantized weights explain" in reason and s.twin > 100 * s.beyond_twin > 100 * s.bound, reason
    else:
        assert "not the reference's, quantized" in reason and "one quantization step" in reason, reason
    earlier = [s for s in d.sites if s.order < d.site(site).order and s.own is not None]
    assert earlier and all(s.status in ("within", "regrouped") for s in earlier)


def test_a_tensor_quantized_otherwise_than_its_peers_is_named():
    model = _model("llama")
    odd = "model.layers.1.self_attn.q_proj"

    def predicate(path, module):
        return hasattr(module, "to_quantized") and ({"group_size": 32, "bits": 8} if path == odd else True)

    d = diff(model, _quantized(model, 4, predicate), _ids(), progress=False)
    assert d.verdict == "pass", d.summary()
    named = [n for n in d.notes if n.startswith(odd)]
    assert named == [f"{odd} quantized at 8-bit, group 32 where the 1 other model.layers.*.self_attn.q_proj are at "
                     "4-bit, group 32"], d.notes
    assert d.site(odd).twin < 0.2 * d.site("model.layers.0.self_attn.q_proj").twin  # 8 bits err ~16× less


def test_cli_diff_against_a_quantized_port_and_an_mlx_lm_directory(tmp_path, capsys):
    """``mlx:4bit`` quantizes the port as ``mlx_lm.convert -q`` does; a directory mlx-lm wrote for a quantized model
    is read as it is; both pass, the table showing what the quantization explains."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    from normscope.cli import main

    model = _model("llama")
    model.save_pretrained(tmp_path / "llama")
    capsys.readouterr()
    code = main(["diff", str(tmp_path / "llama"), "mlx:4bit"])
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert "quantized: 4-bit, group 64" in out and "beyond" in out and "PASS" in out
    assert "the quantization explains" in out
    code = main(["diff", str(tmp_path / "llama"), "mlx:4bit", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0, out
    assert json.loads(out)["verdict"] == "pass"  # stdout is the JSON alone (mlx-lm's line kept out)

    port_ = port(model)
    port_, config = quantize_model(port_, port_.args.__dict__ | {"model_type": "llama"}, group_size=32, bits=8)
    save_model(tmp_path / "mlx8", port_)
    save_config(config, tmp_path / "mlx8" / "config.json")
    capsys.readouterr()  # mlx-lm's own lines, from the conversion made here
    code = main(["diff", str(tmp_path / "llama"), str(tmp_path / "mlx8"), "--json"])
    out, _ = capsys.readouterr()
    assert code == 0, out
    d = json.loads(out)
    assert "quantized: 8-bit, group 32" in d["candidate"] and str(tmp_path / "mlx8") in d["candidate"]


def test_a_bf16_port_that_loses_the_embedding_scale_is_not_a_pass():
    """At bfloat16 without a twin, 16·u·√n passes 1 over a long axis: the bound is capped, so a port that loses
    Gemma's embedding scale still fails; the clean bf16 port against a bf16 reference passes."""
    import mlx.core as mx

    model = _model("gemma3").to(torch.bfloat16)
    port_ = port(model)
    port_.set_dtype(mx.bfloat16)
    d = diff(model, port_, _ids(), progress=False)
    assert d.verdict == "pass", d.summary()
    assert d.site("model.embed_tokens").status == "regrouped"
    port_.model.args.hidden_size = 1
    d = diff(model, port_, _ids(), progress=False)
    assert d.first_divergence == "model.embed_tokens", d.summary()
