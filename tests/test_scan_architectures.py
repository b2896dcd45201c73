"""Roles and placement per residual stream, blocks shared across depths, gated and inline norms: real
architectures the scan was not written for.

Tiny random-weight models built from the installed transformers' config classes. The truth of each is read
from its modeling source (the class cited beside it); the scan never sees a name table.
"""

from __future__ import annotations

import io
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
    if name in ("doge", "beam"):
        small = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, **IDS)
        cls, config = (T.DogeModel, T.DogeConfig) if name == "doge" else (T.BeamModel, T.BeamConfig)
        return cls(config(**{k: v for k, v in small.items() if k != "decoder_start_token_id"})), {"input_ids": ids}
    img = torch.randn(2, 3, 64, 64)
    if name == "poolformer":
        cfg = T.PoolFormerConfig(depths=[1, 1], hidden_sizes=[16, 32], num_encoder_blocks=2, patch_sizes=[7, 3],
                                 strides=[4, 2], padding=[2, 1])
        return T.PoolFormerModel(cfg), {"pixel_values": img}
    if name == "resnet":
        cfg = T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[2, 2], layer_type="basic")
        return T.ResNetModel(cfg), {"pixel_values": img}
    if name == "regnet":
        return T.RegNetModel(T.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[2, 2], groups_width=8)), {
            "pixel_values": img}
    if name == "bit":
        cfg = T.BitConfig(embedding_size=8, hidden_sizes=[16, 32], depths=[2, 2], num_groups=4)
        return T.BitModel(cfg), {"pixel_values": img}
    if name == "hiera":
        cfg = T.HieraConfig(embed_dim=8, image_size=[64, 64], patch_size=[7, 7], patch_stride=[4, 4],
                            patch_padding=[3, 3], num_heads=[1, 2], depths=[1, 2], query_stride=[2, 2],
                            masked_unit_size=[4, 4], mlp_ratio=2.0, num_query_pool=1)
        return T.HieraModel(cfg), {"pixel_values": img}
    if name in ("wav2vec2", "hubert"):
        audio = dict(do_stable_layer_norm=True, feat_extract_norm="layer", hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                     conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
        cls, config = (T.Wav2Vec2Model, T.Wav2Vec2Config) if name == "wav2vec2" else (T.HubertModel, T.HubertConfig)
        return cls(config(**audio)), {"input_values": torch.randn(2, 1600)}
    raise KeyError(name)


def _every(pattern: str, role: str, stages=(0, 1), layers=(0, 1)) -> dict[str, str]:
    return {pattern.format(s=s, k=k): role for s in stages for k in layers}


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
    "mamba2": ({"layers.0.norm": "pre", "layers.0.mixer.norm": "other",
                "layers.1.mixer.norm": "other", "norm_f": "final"},
               {"layers": "pre"}, "pre"),
    # AlbertTransformer runs the one shared AlbertLayerGroup num_hidden_layers times; AlbertAttention and
    # AlbertLayer are post-LN (LayerNorm(x + sublayer)); AlbertEmbeddings.LayerNorm on the embeddings' sum.
    "albert": ({"embeddings.LayerNorm": "embedding",
                "encoder.albert_layer_groups.0.albert_layers.0.attention.LayerNorm": "post",
                "encoder.albert_layer_groups.0.albert_layers.0.full_layer_layer_norm#2": "post"},
               {"encoder.albert_layer_groups.0": "post"}, "post"),
    # scaled residuals: DogeDecoderLayer adds input_residual * residual + h (a learned scale of the stream, ones at
    # init); Beam's depth_scaled_residual_add scales both the stream and the branch by constants
    "doge": ({"layers.0.input_layernorm": "pre", "layers.0.post_attention_layernorm": "pre",
              "layers.1.post_attention_layernorm": "pre", "layers.0.self_attn.q_norm": "qk", "norm": "final"},
             {"layers": "pre"}, "pre"),
    "beam": ({"layers.0.input_layernorm": "pre", "layers.0.post_attention_layernorm": "branch",
              "layers.1.pre_feedforward_layernorm": "pre", "layers.1.post_feedforward_layernorm": "branch",
              "norm": "final"},
             {"layers": "sandwich"}, "sandwich"),
    # PoolFormerLayer: x + pool(before_norm(x)) − before_norm(x), then x + mlp(after_norm(x)): the token mixer is a
    # pooling (PoolFormerPooling), no linear map; each stage's patch embedding (a convolution) starts a stream
    "poolformer": ({"encoder.block.0.0.before_norm": "pre", "encoder.block.0.0.after_norm": "pre",
                    "encoder.block.1.0.before_norm": "pre", "encoder.block.1.0.after_norm": "pre"},
                   {"encoder.block.0.0": "pre", "encoder.block.1.0": "pre"}, "pre"),
    # ResNetBasicLayer: relu(shortcut(x) + layer(x)), layer = conv-BN-relu-conv-BN; the first block of stage 1 has
    # a projection shortcut (ResNetShortCut: 1×1 conv + BN); every block's last BN is on the branch
    "resnet": ({**_every("encoder.stages.{s}.layers.{k}.layer.0.normalization", "other"),
                **_every("encoder.stages.{s}.layers.{k}.layer.1.normalization", "branch"),
                "encoder.stages.1.layers.0.shortcut.normalization": "other",
                "embedder.embedder.normalization": "other"},
               {"encoder.stages": "reordered"}, "reordered"),
    # RegNetYLayer: relu(shortcut(x) + layer(x)), layer = conv-BN, grouped conv-BN, squeeze-excitation, conv-BN;
    # RegNetShortCut (1×1 conv + BN) on each stage's first block
    "regnet": ({**_every("encoder.stages.{s}.layers.{k}.layer.0.normalization", "other"),
                **_every("encoder.stages.{s}.layers.{k}.layer.1.normalization", "other"),
                **_every("encoder.stages.{s}.layers.{k}.layer.3.normalization", "branch"),
                **_every("encoder.stages.{s}.layers.0.shortcut.normalization", "other", layers=(0,)),
                "embedder.embedder.normalization": "other"},
               {"encoder.stages": "reordered"}, "reordered"),
    # BitPreActivationBottleneckLayer: p = norm1(x); shortcut = downsample(p) on a stage's first block, else x;
    # conv3(norm3(conv2(norm2(conv1(p))))) + shortcut; every convolution standardizes its kernel
    # (WeightStandardizedConv2d: F.batch_norm on the weight); BitModel.norm after the stages
    "bit": ({**_every("encoder.stages.{s}.layers.{k}.norm1:group_norm#0", "pre"),
             **_every("encoder.stages.{s}.layers.{k}.norm2:group_norm#0", "other"),
             **_every("encoder.stages.{s}.layers.{k}.norm3:group_norm#0", "other"),
             **_every("encoder.stages.{s}.layers.{k}.conv1:batch_norm#0", "weight"),
             **_every("encoder.stages.{s}.layers.0.downsample.conv:batch_norm#0", "weight", layers=(0,)),
             "embedder.convolution:batch_norm#0": "weight", "norm:group_norm#0": "final"},
            {"encoder.stages": "pre"}, "pre"),
    # HieraLayer: n = layernorm_before(x); a stage's first block widening the stream adds proj(n) (then a max over
    # the query stride) and attn(n); then h + mlp(layernorm_after(h)); HieraPooler.layernorm after the stages
    "hiera": ({"encoder.stages.0.layers.0.layernorm_before": "pre", "encoder.stages.1.layers.0.layernorm_before": "pre",
               "encoder.stages.1.layers.0.layernorm_after": "pre", "encoder.stages.1.layers.1.layernorm_before": "pre",
               "pooler.layernorm": "final"},
              {"encoder.stages": "pre"}, "pre"),
    # Wav2Vec2EncoderStableLayerNorm / HubertEncoderStableLayerNorm: x + pos_conv_embed(x) before the layers (an
    # add outside the layer list, no norm), pre-LN layers, encoder.layer_norm after them; the feature encoder's
    # norms are inside its convolution stack
    **{name: ({"encoder.layers.0.layer_norm": "pre", "encoder.layers.1.final_layer_norm": "pre",
               "encoder.layer_norm": "final", "feature_extractor.conv_layers.0.layer_norm": "other",
               "feature_extractor.conv_layers.1.layer_norm": "other", "feature_projection.layer_norm": "other"},
              {"encoder.layers": "pre"}, "pre") for name in ("wav2vec2", "hubert")},
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
    # x · silu(gate) and multiplies by its weight; Mamba2Block: residual + mixer(Mamba2RMSNorm(x)) (pre).
    # The module is the site (tests/test_scan_classes.py: more gated norms), its contract read on the gated input
    r = scans("mamba2")
    by = {s.name: s for s in r.sites}
    gated = [by[f"layers.{i}.mixer.norm"] for i in (0, 1)]
    for s in gated:
        assert s.kind == "module" and s.role == "other" and s.spec.kind == "rmsnorm", s
        assert s.cls == "Mamba2RMSNormGated" and s.evidence["gate"]["measured"]["applied"] == "before the statistic"
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


#: time-series models whose std scaler normalizes each channel over the observed time steps, written by hand:
#: μ = Σ(x·m) / Σm, σ² = Σ(((x − μ)·m)²) / Σm, (x − μ) / √(σ² + minimum_scale) (PatchTSTStdScaler and its copies)
TIME_SERIES = {
    "patchtst": lambda: transformers.PatchTSTModel(transformers.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=16, num_attention_heads=2,
        num_hidden_layers=2, ffn_dim=32, scaling="std")),
    "patchtsmixer": lambda: transformers.PatchTSMixerModel(transformers.PatchTSMixerConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=16, num_layers=2,
        scaling="std")),
}


@pytest.mark.parametrize("name", list(TIME_SERIES))
def test_statistics_written_by_hand_over_a_mask_are_found(name):
    """The scaler's mean is a sum over a count, its mask an input (PatchTST) or ``ones_like`` of the values
    (PatchTSMixer): an inline LayerNorm over the time axis, ε = minimum_scale inside the root, no affine."""
    from normscope.model import default_inputs

    torch.manual_seed(0)
    model = TIME_SERIES[name]().eval()
    r = scan(model, default_inputs(model), dtypes="float32", progress=False)
    scaler = [s for s in r.sites if s.kind == "inline"]
    assert len(scaler) == 1, [s.name for s in r.sites]
    spec = scaler[0].spec
    assert (spec.kind, spec.axes, spec.eps, spec.gamma, spec.beta) == ("layernorm", (-2,), pytest.approx(1e-5), False,
                                                                       False), spec.describe()
    assert r.findings == []


class _LaidOutInline(torch.nn.Module):
    """An inline RMSNorm that reads its input through a layout op (Qwen3-Next's gated norm on
    ``core_attn_out.reshape(-1, head_dim)``): rows flattened, or two axes swapped."""

    def __init__(self, layout: str, d=32):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.layout = layout

    def forward(self, x):
        h = self.inp(x)
        h = h.reshape(-1, h.shape[-1]) if self.layout == "reshape" else h.transpose(0, 1)
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        y = y.reshape(x.shape) if self.layout == "reshape" else y.transpose(0, 1)
        return x + self.out(y)


@pytest.mark.parametrize("layout", ["reshape", "transpose"])
def test_an_inline_norm_that_reads_through_a_layout_op_is_found(layout):
    """Its input was taken from before the layout op, whose shape the normalized value does not have, and the site
    was dropped: no site and no finding."""
    torch.manual_seed(0)
    r = scan(_LaidOutInline(layout), torch.randn(2, 5, 32), dtypes="float32", progress=False)
    assert [(s.kind, s.spec.kind, s.spec.eps, s.shape) for s in r.sites] == [
        ("inline", "rmsnorm", pytest.approx(1e-6, rel=0.01), (10, 32) if layout == "reshape" else (5, 2, 32))]
    assert r.findings == [] and r.sites[0].activation["ok"]


def test_an_inline_norms_casts_are_decided_at_a_dtype_where_they_act():
    """In a float32 forward Llama's upcast (``x.float()``) and its cast back return their input unchanged and leave
    no op to replay: the statistics' precision and the order of γ and the cast are not decided (they were reported
    as input-dtype statistics, decisive), and a note says how to decide them. In a bfloat16 forward the casts act:
    float32 statistics, cast then scale — and the replay casts back to the dtype it is probed at (it cast to the
    recorded bfloat16 at every probe, and the site was rejected as no normalization)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_InlineBlock(), _InlineBlock())
    r = scan(model, torch.randn(2, 5, 32), progress=False)
    rms = [s for s in r.sites if s.spec.kind == "rmsnorm"]
    assert len(rms) == 2 and all(s.evidence["stats_dtype"]["confidence"] == "not probed" for s in rms)
    # the contract line says so too: it printed "input-dtype statistics" beside the note that it was undecided
    assert all("statistics dtype undecided" in s.summary and "input-dtype" not in s.summary for s in rms), \
        [s.summary for s in rms]
    assert [n["sites"] for n in r.notes if "not decided" in n["message"]] == [[s.name] for s in rms]
    assert all(s.evidence["stats_dtype"]["confidence"] == "decisive" for s in r.sites if s.spec.kind == "layernorm")
    r = scan(model.bfloat16(), torch.randn(2, 5, 32).bfloat16(), progress=False)
    got = [(s.spec.kind, s.spec.stats_dtype, s.spec.affine_order, s.evidence["stats_dtype"]["confidence"])
           for s in r.sites]
    assert got == [("rmsnorm", "float32", "cast_then_scale", "decisive"), ("layernorm", "input", "scale_then_cast",
                                                                            "decisive")] * 2, got
    assert all("undecided" not in s.summary for s in r.sites)
    assert r.findings == [] and not [n for n in r.notes if "not decided" in n["message"]]


def test_the_implementation_of_a_norm_module_is_not_an_inline_site(scans):
    # LlamaRMSNorm computes exactly the inline pattern; its call is the site, its ops are not another
    assert all(s.kind == "module" for s in scans("t5").sites)


# ------------------------------------------------------------------------------ many architectures, one table
IMG = (1, 3, 32, 32)
D = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
         max_position_embeddings=64, **IDS)
S2S = dict(SEQ2SEQ, max_position_embeddings=64)


def _zoo(T):
    return {
        # name: (build, input kind, placement, role counts) — each from the modeling source named
        # MistralDecoderLayer / Qwen2DecoderLayer / Phi3DecoderLayer / StableLmDecoderLayer / Starcoder2DecoderLayer:
        # x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x)); the model's norm is final
        "mistral": (lambda: T.MistralModel(T.MistralConfig(**D, num_key_value_heads=2)), "ids", "pre",
                    {"pre": 4, "final": 1}),
        "qwen2": (lambda: T.Qwen2Model(T.Qwen2Config(**D, num_key_value_heads=2)), "ids", "pre", {"pre": 4, "final": 1}),
        "phi3": (lambda: T.Phi3Model(T.Phi3Config(**D, num_key_value_heads=2)), "ids", "pre", {"pre": 4, "final": 1}),
        "stablelm": (lambda: T.StableLmModel(T.StableLmConfig(**D, num_key_value_heads=4)), "ids", "pre",
                     {"pre": 4, "final": 1}),
        "starcoder2": (lambda: T.Starcoder2Model(T.Starcoder2Config(**D, num_key_value_heads=2)), "ids", "pre",
                       {"pre": 4, "final": 1}),
        # NemotronDecoderLayer: pre, NemotronLayerNorm1P (γ acts as 1 + w)
        "nemotron": (lambda: T.NemotronModel(T.NemotronConfig(**D, num_key_value_heads=2, head_dim=8)), "ids", "pre",
                     {"pre": 4, "final": 1}),
        # Gemma2DecoderLayer: pre and post norms around each sublayer
        "gemma2": (lambda: T.Gemma2Model(T.Gemma2Config(**D, num_key_value_heads=2, head_dim=8)), "ids", "sandwich",
                   {"pre": 4, "branch": 4, "final": 1}),
        # PersimmonAttention: q_layernorm/k_layernorm over head_dim when qk_layernorm
        "persimmon": (lambda: T.PersimmonModel(T.PersimmonConfig(**D, qk_layernorm=True)), "ids", "pre",
                      {"pre": 4, "qk": 4, "final": 1}),
        # OPTDecoderLayer with do_layer_norm_before (the default): pre; OPTDecoder.final_layer_norm
        "opt": (lambda: T.OPTModel(T.OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                               num_attention_heads=4, word_embed_proj_dim=32,
                                               max_position_embeddings=64, **IDS)), "ids", "pre",
                {"pre": 4, "final": 1}),
        # BloomModel.word_embeddings_layernorm on the embeddings; BloomBlock pre
        "bloom": (lambda: T.BloomModel(T.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4, **IDS)),
                  "ids", "pre", {"embedding": 1, "pre": 4, "final": 1}),
        # GPTJBlock / CodeGenBlock: x + attn(ln_1(x)) + mlp(ln_1(x)), one norm read by both sublayers
        "gptj": (lambda: T.GPTJModel(T.GPTJConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                                  n_positions=64, **IDS)), "ids", "parallel", {"pre": 2, "final": 1}),
        "codegen": (lambda: T.CodeGenModel(T.CodeGenConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4,
                                                           rotary_dim=4, n_positions=64, n_ctx=64, **IDS)),
                    "ids", "parallel", {"pre": 2, "final": 1}),
        # GPTNeoXLayer (use_parallel_residual): two norms, both reading the stream
        "gpt_neox": (lambda: T.GPTNeoXModel(T.GPTNeoXConfig(**D)), "ids", "parallel", {"pre": 4, "final": 1}),
        # FalconDecoderLayer (parallel_attn, not new_decoder_architecture): one input_layernorm for both
        "falcon": (lambda: T.FalconModel(T.FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=4, **IDS)), "ids", "parallel",
                   {"pre": 2, "final": 1}),
        # RobertaLayer / ElectraLayer / DebertaV2Layer / DistilBERT's TransformerBlock: LayerNorm(x + sublayer(x));
        # the embeddings' LayerNorm
        "roberta": (lambda: T.RobertaModel(T.RobertaConfig(**D)), "ids", "post", {"embedding": 1, "post": 4}),
        "electra": (lambda: T.ElectraModel(T.ElectraConfig(vocab_size=128, embedding_size=32, hidden_size=32,
                                                           intermediate_size=64, num_hidden_layers=2,
                                                           num_attention_heads=4, **IDS)), "ids", "post",
                    {"embedding": 1, "post": 4}),
        "deberta_v2": (lambda: T.DebertaV2Model(T.DebertaV2Config(**D)), "ids", "post", {"embedding": 1, "post": 4}),
        "distilbert": (lambda: T.DistilBertModel(T.DistilBertConfig(vocab_size=128, dim=32, hidden_dim=64, n_layers=2,
                                                                    n_heads=4, max_position_embeddings=64,
                                                                    pad_token_id=0)), "ids", "post",
                       {"embedding": 1, "post": 4}),
        # PegasusEncoderLayer/DecoderLayer: pre; each stack's layer_norm is final
        "pegasus": (lambda: T.PegasusModel(T.PegasusConfig(**S2S)), "seq2seq", "pre", {"pre": 10, "final": 2}),
        # MarianEncoderLayer/DecoderLayer: post, no embedding norm
        "marian": (lambda: T.MarianModel(T.MarianConfig(**S2S)), "seq2seq", "post", {"post": 10}),
        # MBartEncoder/Decoder: layernorm_embedding, pre layers, a final layer_norm per stack
        "mbart": (lambda: T.MBartModel(T.MBartConfig(**S2S)), "seq2seq", "pre",
                  {"embedding": 2, "pre": 10, "final": 2}),
        # ViTLayer / Dinov2Layer / CLIPEncoderLayer: pre; the model's final norm
        "vit": (lambda: T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=64)), "image", "pre",
                {"pre": 4, "final": 1}),
        "dinov2": (lambda: T.Dinov2Model(T.Dinov2Config(image_size=32, patch_size=8, hidden_size=32,
                                                        num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2)),
                   "image", "pre", {"pre": 4, "final": 1}),
        "clip_text": (lambda: T.CLIPTextModel(T.CLIPTextConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=2, num_attention_heads=4,
                                                               max_position_embeddings=64, **IDS)), "ids", "pre",
                      {"pre": 4, "final": 1}),
        # SwinLayer: pre; each stage a stream of its own (SwinPatchMerging's norm closes stage 0 before its
        # reduction, the final layernorm stage 1); SwinPatchEmbeddings' norm follows a convolution
        "swin": (lambda: T.SwinModel(T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
                                                  num_heads=[2, 2], window_size=4)), "image", "pre",
                 {"pre": 8, "final": 2, "other": 1}),
        # ConvNextLayer: x + γ·pwconv(act(pwconv(layernorm(dwconv(x))))): the norm is inside the sublayer
        "convnext": (lambda: T.ConvNextModel(T.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[2, 2],
                                                              num_stages=2, image_size=32)), "image", "none",
                     {"other": 5, "final": 2}),
        # MambaBlock: residual + mixer(norm(x)); FalconMambaMixer adds RMS norms on B, C and Δ inside the mixer
        "mamba": (lambda: T.MambaModel(T.MambaConfig(vocab_size=128, hidden_size=32, state_size=8,
                                                     num_hidden_layers=2, expand=2, conv_kernel=4, **IDS)), "ids",
                  "pre", {"pre": 2, "final": 1}),
        "falcon_mamba": (lambda: T.FalconMambaModel(T.FalconMambaConfig(vocab_size=128, hidden_size=32, state_size=8,
                                                                        num_hidden_layers=2, expand=2, conv_kernel=4,
                                                                        **IDS)), "ids", "pre",
                         {"pre": 2, "other": 6, "final": 1}),
    }


ZOO = sorted(_zoo(transformers))


def _zoo_inputs(kind):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 120, (2, 8), generator=g)
    if kind == "image":
        return torch.randn(*IMG, generator=g)
    if kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    return {"input_ids": ids}


@pytest.mark.parametrize("name", ZOO)
def test_every_architecture(name):
    build, kind, placement, roles = _zoo(transformers)[name]
    torch.manual_seed(0)
    r = scan(build().eval(), _zoo_inputs(kind), dtypes="float32", progress=False)
    assert r.placement == placement, (r.placement, r.streams)
    assert Counter(s.role for s in r.sites) == Counter(roles), [(s.name, s.role) for s in r.sites]
    assert r.findings == [], r.findings
    assert all(s.activation["ok"] for s in r.sites)


def test_names_fold_per_block_path_in_a_model_of_stages():
    """Swin numbers its blocks within each stage (encoder.layers.<stage>.blocks.<i>): the names were folded on the
    first number equal to the layer index, giving overlapping patterns (encoder.layers.*.blocks.0, …), so every
    site was listed twice. Each stage's blocks fold on their own index."""
    from rich.console import Console

    from normscope.sites.render import render_scan

    torch.manual_seed(0)
    model, inputs = _zoo(transformers)["swin"][0](), _zoo_inputs("image")
    r = scan(model.eval(), inputs, dtypes="float32", progress=False)
    buf = io.StringIO()
    render_scan(r, Console(file=buf, width=200, force_terminal=False))
    out = buf.getvalue()
    assert "encoder.layers.0.blocks.*.{layernorm_before, layernorm_after}" in out, out
    assert "encoder.layers.1.blocks.*.{layernorm_before, layernorm_after}" in out, out
    assert "encoder.layers.*" not in out, out


def test_a_shared_expert_moe_is_one_branch_of_a_sequential_block():
    """Qwen2-MoE's MLP sums a shared expert and the routed experts, both reading the post-attention norm's output:
    two terms reading one stream value, in the block's second residual add. That block is pre-norm (it was
    reported parallel); GPT-J's one add of attn + mlp stays parallel (the zoo above)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=16, max_position_embeddings=64, **IDS)
    r = scan(transformers.Qwen2MoeModel(cfg).eval(), _zoo_inputs("ids"), dtypes="float32", progress=False)
    assert r.placement == "pre", (r.placement, r.blocks)
    assert Counter(s.role for s in r.sites) == Counter({"pre": 4, "final": 1}) and r.findings == []
    assert all(b["sublayers_reading_one_stream"] == 2 for b in r.blocks if b["layer"] is not None)


@pytest.mark.parametrize("name", ZOO)
def test_the_static_contract_of_each_config_meets_its_live_scan(tmp_path, name):
    from normscope.artifacts import ModelContract, compare, contract

    build, kind, *_ = _zoo(transformers)[name]
    torch.manual_seed(0)
    model = build().eval()
    model.config.save_pretrained(tmp_path)
    static = contract(tmp_path / "config.json")
    live = ModelContract.from_scan(scan(model, _zoo_inputs(kind), dtypes="float32", progress=False))
    result = compare(live, static)
    assert result.ok and not result.mismatches, [i.message for i in result.items if i.status == "mismatch"]
    assert [s.name for s in live.sites] == [s.name for s in static.sites]


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning", "ignore::UserWarning")
@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt_neox"])
def test_an_onnx_export_meets_its_live_scan_and_an_edited_eps_is_found(tmp_path, name):
    from normscope.artifacts import ModelContract, compare, contract

    T = transformers
    cfg = dict(D, num_key_value_heads=2)
    model = {"llama": lambda: T.LlamaModel(T.LlamaConfig(**cfg)),
             "qwen3": lambda: T.Qwen3Model(T.Qwen3Config(**cfg, head_dim=8)),
             "gpt_neox": lambda: T.GPTNeoXModel(T.GPTNeoXConfig(**D))}[name]().eval()
    with torch.no_grad():  # γ away from its initial ones, so a lost γ would show
        for n, p in model.named_parameters():
            if "norm" in n and p.dim() == 1 and "bias" not in n:
                p.uniform_(0.5, 1.5)
    ids = _zoo_inputs("ids")["input_ids"]

    class Ids(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).last_hidden_state

    torch.onnx.export(Ids(model), (ids,), str(tmp_path / "m.onnx"), dynamo=False)
    exported = contract(tmp_path / "m.onnx")
    live = ModelContract.from_scan(scan(model, {"input_ids": ids}, dtypes="float32", progress=False))
    result = compare(live, exported)
    assert result.ok and not result.mismatches, [i.message for i in result.items if i.status == "mismatch"]
    assert exported.placement == live.placement == ("parallel" if name == "gpt_neox" else "pre")
    assert all(s.gamma for s in exported.sites)  # γ found through LlamaRMSNorm's Cast
    norm = model.norm if name != "gpt_neox" else model.final_layer_norm
    if hasattr(norm, "variance_epsilon"):
        norm.variance_epsilon = 1e-3
    else:
        norm.eps = 1e-3
    edited = ModelContract.from_scan(scan(model, {"input_ids": ids}, dtypes="float32", progress=False))
    (item,) = compare(edited, exported).mismatches
    assert item.site == "final_norm" and item.field == "eps"


def test_an_encoder_decoder_is_named_per_stream(scans):
    from normscope.artifacts import ModelContract

    c = ModelContract.from_scan(scans("t5"))
    assert [s.name for s in c.sites] == [
        "encoder.layers.0.attn_norm", "encoder.layers.0.ffn_norm", "encoder.layers.1.attn_norm",
        "encoder.layers.1.ffn_norm", "encoder.final_norm", "decoder.layers.0.attn_norm",
        "decoder.layers.0.cross_attn_norm", "decoder.layers.0.ffn_norm", "decoder.layers.1.attn_norm",
        "decoder.layers.1.cross_attn_norm", "decoder.layers.1.ffn_norm", "decoder.final_norm"]
    names = [s.name for s in ModelContract.from_scan(scans("bart")).sites]
    assert names[:2] == ["encoder.embed_norm", "encoder.layers.0.attn_post_norm"]
    assert "decoder.layers.1.cross_attn_post_norm" in names and len(set(names)) == len(names) == 12


def test_a_model_offloaded_to_disk_scans_with_each_modules_own_weights(tmp_path):
    # accelerate's device_map offload: the layers' weights stay on disk (meta parameters); each module's hook
    # loads them for its own call; the scan's private copies load only their module's tensors
    accelerate = pytest.importorskip("accelerate")
    T = transformers
    cfg = T.LlamaConfig(**dict(D, num_key_value_heads=2))
    torch.manual_seed(0)
    T.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    with accelerate.init_empty_weights():
        empty = T.LlamaForCausalLM(cfg)
    model = accelerate.load_checkpoint_and_dispatch(
        empty, str(tmp_path / "llama"), offload_folder=str(tmp_path / "offload"),
        device_map={"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu",
                    "model.rotary_emb": "cpu", "lm_head": "cpu"})
    meta_before = sum(p.is_meta for p in model.parameters())
    assert meta_before >= 16
    r = scan(model, dtypes="float32", progress=False)
    assert r.placement == "pre" and Counter(s.role for s in r.sites) == Counter({"pre": 4, "final": 1})
    assert all(s.activation["ok"] for s in r.sites) and r.findings == [] and r.notes == []
    assert sum(p.is_meta for p in model.parameters()) == meta_before  # nothing left materialized
