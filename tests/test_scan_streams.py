"""Roles and placement per residual stream, and blocks shared across depths, on real Hugging Face architectures.

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
    assert "other" not in got.values(), got
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
