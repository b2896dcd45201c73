"""``diff`` against a model as MLX runs it (the ``mlx`` extra: MLX's CPU build and mlx-lm).

Tiny random-weight Hugging Face models (Llama, Gemma 3, Qwen 3) ported by mlx-lm from their own config and weights
— the port people deploy to Apple silicon, run here by MLX's CPU device. The clean ports pass with every norm site
judged on its own error; a fault put into the port (ε changed in an MLX norm, Gemma's ``1 + w`` applied twice, a
port that loses Gemma's embedding scale) is the first divergence, at its site, with the contract difference named.
"""

from __future__ import annotations

import os

import pytest
import torch
from runtime_models import tiny_causal_lm, token_ids

from normscope import diff
from normscope.errors import InputError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("mlx.core", reason="the mlx extra is not installed: pip install 'normscope[mlx]'")
pytest.importorskip("mlx_lm", reason="the mlx extra is not installed: pip install 'normscope[mlx]'")
transformers.logging.set_verbosity_error()
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


def test_a_quantized_mlx_port_is_refused_with_the_reason():
    import mlx.nn as mnn

    model = _model("llama")
    port_ = port(model)
    mnn.quantize(port_, group_size=32, bits=8)
    with pytest.raises(InputError, match="quantized layers"):
        diff(model, port_, _ids(), progress=False)


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
