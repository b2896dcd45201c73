"""Roles and placement per residual stream, blocks shared across depths, gated and inline norms: real
architectures the scan was not written for.

Tiny random-weight models built from the installed transformers' config classes. The truth of each is read
from its modeling source (the class cited beside it); the scan never sees a name table.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from normscope import scan

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
SEQ2SEQ = dict(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, **IDS)


def _build(name: str):
    T = transformers
    torch.manual_seed(0)
    ids = torch.randint(4, 120, (2, 8))
    if name == "bart":
        return T.BartModel(T.BartConfig(**SEQ2SEQ, max_position_embeddings=64)), {"input_ids": ids}
    if name == "t5":
        cfg = T.T5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                         num_heads=2, **IDS)
        return T.T5Model(cfg), {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    if name == "whisper":
        cfg = T.WhisperConfig(**SEQ2SEQ, num_mel_bins=8, max_source_positions=16, max_target_positions=32)
        return T.WhisperModel(cfg), {"input_features": torch.randn(2, 8, 32), "decoder_input_ids": ids[:, :5]}
    if name == "mamba2":
        cfg = T.Mamba2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, n_groups=1,
                             head_dim=16, num_heads=4, conv_kernel=4, chunk_size=8, layer_norm_epsilon=3e-5, **IDS)
        return T.Mamba2Model(cfg), {"input_ids": ids}
    if name == "albert":
        cfg = T.AlbertConfig(vocab_size=128, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                             num_attention_heads=2, intermediate_size=64, **IDS)
        return T.AlbertModel(cfg), {"input_ids": ids}
    raise KeyError(name)


@pytest.fixture(scope="module")
def scans():
    cache = {}

    def get(name):
        if name not in cache:
            model, inputs = _build(name)
            cache[name] = scan(model.eval(), inputs, dtypes="float32", progress=False)
        return cache[name]
    return get


# name → {site name: role}, placement per stream (path → placement); from the modeling sources:
TRUTH = {
    # BartEncoderLayer/BartDecoderLayer: hidden = LN(residual + sublayer(hidden)) after each sublayer (post);
    # BartEncoder/BartDecoder: layernorm_embedding on the embeddings' sum, no final norm.
    "bart": ({"encoder.layernorm_embedding": "embedding", "encoder.layers.0.self_attn_layer_norm": "post",
              "encoder.layers.1.final_layer_norm": "post", "decoder.layernorm_embedding": "embedding",
              "decoder.layers.0.encoder_attn_layer_norm": "post", "decoder.layers.1.final_layer_norm": "post"},
             {"encoder.layers": "post", "decoder.layers": "post"}, "post"),
    # T5LayerSelfAttention/T5LayerFF: x + dropout(sublayer(layer_norm(x))) (pre); T5Stack.final_layer_norm closes
    # the encoder's stream and the decoder's.
    "t5": ({"encoder.block.0.layer.0.layer_norm": "pre", "encoder.block.1.layer.1.layer_norm": "pre",
            "encoder.final_layer_norm": "final", "decoder.block.0.layer.1.layer_norm": "pre",
            "decoder.final_layer_norm": "final"},
           {"encoder.block": "pre", "decoder.block": "pre"}, "pre"),
    # WhisperEncoderLayer/WhisperDecoderLayer: pre norms; WhisperEncoder.layer_norm / WhisperDecoder.layer_norm final.
    "whisper": ({"encoder.layers.0.self_attn_layer_norm": "pre", "encoder.layer_norm": "final",
                 "decoder.layers.0.encoder_attn_layer_norm": "pre", "decoder.layer_norm": "final"},
                {"encoder.layers": "pre", "decoder.layers": "pre"}, "pre"),
    # Mamba2Block: residual + mixer(Mamba2RMSNorm(x)); the mixer's MambaRMSNormGated is inside the sublayer
    "mamba2": ({"layers.0.norm": "pre", "layers.0.mixer.norm:inline#0": "other",
                "layers.1.mixer.norm:inline#0": "other", "norm_f": "final"},
               {"layers": "pre"}, "pre"),
    # AlbertTransformer runs the one shared AlbertLayerGroup num_hidden_layers times; AlbertAttention and
    # AlbertLayer are post-LN (LayerNorm(x + sublayer)); AlbertEmbeddings.LayerNorm on the embeddings' sum.
    "albert": ({"embeddings.LayerNorm": "embedding",
                "encoder.albert_layer_groups.0.albert_layers.0.attention.LayerNorm": "post",
                "encoder.albert_layer_groups.0.albert_layers.0.full_layer_layer_norm#2": "post"},
               {"encoder.albert_layer_groups.0": "post"}, "post"),
}


@pytest.mark.parametrize("name", list(TRUTH))
def test_roles_and_placement_per_stream(scans, name):
    r = scans(name)
    roles, streams, placement = TRUTH[name]
    got = {s.name: s.role for s in r.sites}
    for site, role in roles.items():
        assert got.get(site) == role, (site, got.get(site), r.site(site).role_evidence if site in got else got)
    assert r.placement == placement, r.streams
    assert {s["path"]: s["placement"] for s in r.streams} == streams
    assert "other" not in {got[n] for n in got if n not in roles or roles[n] != "other"}, got
    assert r.findings == [], r.findings


def test_encoder_decoder_streams_number_their_layers_separately(scans):
    r = scans("bart")
    layers = Counter((s.name.split(".")[0], s.layer) for s in r.sites if s.layer is not None)
    assert layers == Counter({("encoder", 0): 2, ("encoder", 1): 2, ("decoder", 0): 3, ("decoder", 1): 3})
    assert [b["stream"] for b in r.blocks] == [0, 0, 1, 1]


def test_a_shared_block_is_one_block_at_several_depths(scans):
    r = scans("albert")
    inner = [s for s in r.sites if s.role == "post"]
    assert sorted(s.layer for s in inner) == [0, 0, 1, 1, 2, 2]  # three calls of one AlbertLayer
    assert [b["layer"] for b in r.blocks] == [0, 1, 2] and {b["placement"] for b in r.blocks} == {"post"}


def test_streams_are_rendered(scans):
    import io

    from rich.console import Console

    from normscope.sites.render import render_scan

    buf = io.StringIO()
    render_scan(scans("t5"), Console(file=buf, width=80, force_terminal=False))
    out = " ".join(buf.getvalue().split())
    assert "residual streams: encoder.block: pre over 2 blocks; decoder.block: pre over 2 blocks" in out
    buf = io.StringIO()
    render_scan(scans("albert"), Console(file=buf, width=80, force_terminal=False))
    out = " ".join(buf.getvalue().split())
    assert "role post, layers 0–2: encoder.albert_layer_groups.0.albert_layers.0.{attention.LayerNorm" in out \
        or "encoder.albert_layer_groups.0.albert_layers.0.attention.LayerNorm" in out, out
    assert "#1" not in out, out


def test_a_gated_norm_is_found_with_its_gate_held_fixed(scans):
    # Mamba2Mixer: y = self.norm(scan_output, gate): MambaRMSNormGated takes two tensors, normalizes
    # x · silu(gate) and multiplies by its weight; Mamba2Block: residual + mixer(Mamba2RMSNorm(x)) (pre)
    r = scans("mamba2")
    by = {s.name: s for s in r.sites}
    gated = [by[f"layers.{i}.mixer.norm:inline#0"] for i in (0, 1)]
    for s in gated:
        assert s.kind == "inline" and s.role == "other" and s.spec.kind == "rmsnorm", s
        assert s.spec.eps == pytest.approx(3e-5, rel=0.01) and s.spec.gamma and not s.spec.beta
        assert s.activation["ok"], s.activation
    assert [by[f"layers.{i}.norm"].role for i in (0, 1)] == ["pre", "pre"] and by["norm_f"].role == "final"
    assert r.placement == "pre" and r.findings == []


class _InlineBlock(torch.nn.Module):
    """A block whose norms are written inline: an RMSNorm before the sublayer, a LayerNorm on its output."""

    def __init__(self, d=32):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.g1 = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.g2 = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.b2 = torch.nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x):
        h = x.float()
        h = self.g1 * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        y = self.down(torch.relu(self.up(h)))
        m = y.mean(-1, keepdim=True)
        y = (y - m) / torch.sqrt((y - m).pow(2).mean(-1, keepdim=True) + 1e-5) * self.g2 + self.b2
        return x + y


def test_inline_norms_are_found_from_their_op_pattern():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_InlineBlock(), _InlineBlock())
    r = scan(model, torch.randn(2, 5, 32), dtypes="float32", progress=False)
    got = [(s.name, s.kind, s.role, s.layer, s.spec.kind, s.spec.eps, s.spec.gamma, s.spec.beta) for s in r.sites]
    assert got == [
        ("0:inline#0", "inline", "pre", 0, "rmsnorm", pytest.approx(1e-6, rel=0.01), True, False),
        ("0:inline#1", "inline", "branch", 0, "layernorm", pytest.approx(1e-5, rel=0.01), True, True),
        ("1:inline#0", "inline", "pre", 1, "rmsnorm", pytest.approx(1e-6, rel=0.01), True, False),
        ("1:inline#1", "inline", "branch", 1, "layernorm", pytest.approx(1e-5, rel=0.01), True, True),
    ]
    assert r.placement == "sandwich" and r.findings == []
    assert all(s.activation["ok"] and s.activation["parameters"]["gamma"].startswith("the module's parameter")
               for s in r.sites)
    assert float(model[0].g1.detach().min()) >= 0.5  # the model is untouched


def test_the_implementation_of_a_norm_module_is_not_an_inline_site(scans):
    # LlamaRMSNorm computes exactly the inline pattern; its call is the site, its ops are not another
    assert all(s.kind == "module" for s in scans("t5").sites)
