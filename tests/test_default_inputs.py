"""Default inputs for models whose input is not token ids, from the full-size default config transformers ships.

Cases are model types of the installed transformers, one or more per kind of input (images of a stated or unstated
size, image pairs, patch sequences, raw audio flat or with channels, spectrograms in each layout, an encoder–decoder's
decoder ids, time series, an input the forward documents no shape for). The model is built on the meta device (full
size, no memory). The property every case meets: the first layer the forward calls — a linear map or a convolution —
gets an input it takes (features last for a linear map, channels at dim 1 for a convolution), every tensor is on the
model's device, and where the forward runs on shapes alone the scan finds the model's norm sites.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from normscope.artifacts.structure import build_on_meta  # noqa: E402
from normscope.errors import InputError  # noqa: E402
from normscope.model import default_inputs  # noqa: E402
from normscope.sites import scan  # noqa: E402

#: model type → (the kind of input, whether the scan is run too: a few, for time; each runs on the meta device)
CASES = {
    "convnext": ("image, the config's size", True),
    "mgp-str": ("image, (height, width) not square", True),
    "efficientloftr": ("image pair of a keypoint matcher", False),
    "videomae": ("video frames", False),
    "hubert": ("raw audio, (batch, samples)", True),
    "dac": ("raw audio, (batch, channels, samples), a whole number of hops", False),
    "audio-spectrogram-transformer": ("a spectrogram named input_values", False),
    "gemma3n_audio": ("a spectrogram with its mask", True),
    "clap_audio_model": ("a spectrogram as a one-channel image", False),
    "whisper": ("a spectrogram, channels first, the frames the model fixes; decoder ids", False),
    "glmasr_encoder": ("a spectrogram, channels first", True),
    "time_series_transformer": ("a time series with lags, time features and mask", False),
    "patchtst": ("a multichannel time series", True),
    "granite_speech_encoder": ("undocumented hidden_states: what its first linear map takes", True),
    "fastspeech2_conformer_hifigan": ("undocumented spectrogram: the layout its first convolution takes", False),
    "bridgetower_vision_model": ("undocumented image: its first convolution's channels, the config's size", False),
}

#: fields a checkpoint's config states that the default config leaves unset
STATED = {"time_series_transformer": {"prediction_length": 24}}

#: model type → what the refusal names
REFUSED = {
    "bark": "no forward of its own",
    "edgetam_video": "EdgeTamVideoInferenceSession, not a tensor",
}


def _meta_model(model_type: str):
    config = transformers.AutoConfig.for_model(model_type, **STATED.get(model_type, {})).to_dict()
    return build_on_meta(config, Path(f"{model_type}/config.json"))


def _first_layer_input(model, inputs):
    """The first linear map or convolution the forward calls, and the input it gets (the forward stops there)."""

    class Reached(Exception):
        pass

    def stop(module, args):
        raise Reached(module, args[0] if args else None)

    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear | torch.nn.modules.conv._ConvNd)]
    handles = [m.register_forward_pre_hook(stop) for m in layers]
    try:
        with torch.no_grad():
            model(**inputs)
    except Reached as r:
        return r.args
    finally:
        for h in handles:
            h.remove()
    raise AssertionError("the forward called no linear map or convolution")


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_default_inputs_reach_the_first_layer_as_it_takes_them(model_type):
    model = _meta_model(model_type)
    inputs = default_inputs(model)
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    assert tensors and all(t.device.type == "meta" for t in tensors), inputs
    layer, x = _first_layer_input(model, inputs)
    assert isinstance(x, torch.Tensor), (model_type, layer)
    if isinstance(layer, torch.nn.Linear):
        assert x.shape[-1] == layer.in_features, (model_type, tuple(x.shape), layer)
    else:
        assert x.dim() == len(layer.kernel_size) + 2 and x.shape[1] == layer.in_channels, (
            model_type, tuple(x.shape), layer)
    if CASES[model_type][1]:
        result = scan(model, inputs, dtypes="float32", progress=False)
        assert result.sites, model_type


def test_the_case_table_covers_every_kind_of_input():
    """Each kind of input the defaults build has a case (the table above is the property's domain)."""
    kinds = " ".join(kind for kind, _ in CASES.values())
    for kind in ("image", "pair", "video", "raw audio", "spectrogram", "decoder ids", "time series",
                 "undocumented"):
        assert kind in kinds, kind


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_inputs_the_config_cannot_give_are_refused_naming_what_is_missing(model_type):
    with pytest.raises(InputError, match=REFUSED[model_type]) as info:
        default_inputs(_meta_model(model_type))
    assert "--inputs (scan, diff, gradflow; contract with --live)" in str(info.value)  # and how to give them


def test_token_ids_without_a_stated_vocabulary_are_refused():
    class Tokens(torch.nn.Module):
        config = types.SimpleNamespace(model_type="tokens")

        def forward(self, input_ids):
            return input_ids

    model = Tokens()
    with pytest.raises(InputError, match="states no vocab_size"):
        default_inputs(model)


def test_a_model_without_a_config_gets_no_defaults():
    with pytest.raises(InputError, match="needs inputs: .*only Hugging Face models"):
        default_inputs(torch.nn.Linear(4, 4))


def test_whisper_gets_the_frames_its_encoder_requires():
    model = _meta_model("whisper")
    inputs = default_inputs(model)
    cfg = model.config
    assert tuple(inputs["input_features"].shape) == (1, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    assert "decoder_input_ids" in inputs


@pytest.mark.parametrize("model_type", ["superglue", "lightglue", "efficientloftr"])
def test_a_keypoint_matcher_gets_a_pair_of_the_smaller_side_where_the_config_states_no_size(model_type):
    """A matcher attends over the keypoints it finds, whose number grows with the image: its pair is 128² unless the
    config states a size (SuperGlue at 224²: 17 s of CPU, at 128²: 2 s, the same 22 sites)."""
    from normscope.model.inputs import PAIR_SIDE

    model = _meta_model(model_type)
    x = default_inputs(model)["pixel_values"]
    assert tuple(x.shape[:2]) == (1, 2) and tuple(x.shape[-2:]) == (PAIR_SIDE, PAIR_SIDE)
    model.config.image_size = 96  # a stated size is kept
    assert tuple(default_inputs(model)["pixel_values"].shape[-2:]) == (96, 96)


@pytest.mark.parametrize("model_type, frames", [("vjepa2", 2), ("videomae", 16), ("vivit", 32)])
def test_a_video_clip_is_cut_to_one_temporal_patch_where_the_forward_runs_on_it(model_type, frames):
    """V-JEPA 2 (rotary positions) takes a clip of one tubelet (2 frames of its 64 at full size: 256 tokens instead
    of 8,192; it reads values, so it is built small here with real weights); VideoMAE and ViViT add a position table
    of the config's frame count, so their clip stays whole."""
    if model_type == "vjepa2":
        config = transformers.VJEPA2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2,
                                           frames_per_clip=8, crop_size=32, pred_hidden_size=32,
                                           pred_num_hidden_layers=1, pred_num_attention_heads=2)
        model = transformers.VJEPA2Model(config)
    else:
        model = _meta_model(model_type)
    x = next(v for v in default_inputs(model).values() if isinstance(v, torch.Tensor) and v.dim() == 5)
    assert x.shape[1] == frames


def test_a_main_input_gets_the_width_the_forwards_error_names():
    """Perceiver without a preprocessor takes inputs of ``d_model`` features, which no field named like an input width
    states; its error does ("doesn't correspond to config.d_model: 48")."""
    config = transformers.PerceiverConfig(num_latents=4, d_latents=32, d_model=48, num_blocks=1,
                                          num_self_attends_per_block=1, num_self_attention_heads=2,
                                          num_cross_attention_heads=1)
    model = transformers.PerceiverModel(config)
    inputs = default_inputs(model)
    assert inputs["inputs"].shape[-1] == 48
    with torch.no_grad():
        model(**inputs)


def test_a_vision_tower_taking_patch_sequences_gets_them_with_their_grid():
    """Qwen2-VL-like towers take images as one sequence of flattened patches and their (t, h, w) grid; the class
    names no input of its own (the default input_ids), the forward names it hidden_states. Built small on the CPU
    (its rotary positions read values), the forward runs and merges the grid's patches."""
    config = transformers.AutoConfig.for_model("glm4v_vision", depth=2, hidden_size=64, num_heads=4,
                                               intermediate_size=128, out_hidden_size=64)
    model = transformers.Glm4vVisionModel._from_config(config).eval()
    inputs = default_inputs(model)
    assert set(inputs) == {"hidden_states", "grid_thw"}
    patches, grid = inputs["hidden_states"], inputs["grid_thw"]
    assert patches.shape[0] == int(grid.prod())
    with torch.no_grad():
        out = model(**inputs)
    merge = config.spatial_merge_size
    assert out.pooler_output.shape[0] == patches.shape[0] // merge**2


@pytest.mark.parametrize("config, extras", [
    (lambda t: t.BrosConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64), {"bbox"}),
    (lambda t: t.DecisionTransformerConfig(state_dim=5, act_dim=3, hidden_size=32, n_layer=2, n_head=2),
     {"actions", "rewards", "returns_to_go", "timesteps"}),
    # the error names the tensor ("`visual_feats` cannot be `None`"); the count of boxes is no config field
    (lambda t: t.LxmertConfig(vocab_size=64, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                              l_layers=1, x_layers=1, r_layers=1, visual_feat_dim=16), {"visual_feats", "visual_pos"}),
    # "either pixel_values or image_embeds": the first, at the text's batch
    (lambda t: t.ViltConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, image_size=64, patch_size=16), {"pixel_values"}),
    # the error asks for an alternative by name; its width is the encoder's, not the Q-Former's
    (lambda t: t.Blip2QFormerConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    encoder_hidden_size=48), {"encoder_hidden_states"}),
    # the error asks for a default language, not for lang_ids: an optional tensor tried on its own
    (lambda t: t.XmodConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64), {"lang_ids"}),
    # no vocab_size: code points hashed into buckets, any id is valid
    (lambda t: t.CanineConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                              local_transformer_stride=4, downsampling_rate=4), {"input_ids"}),
])
def test_arguments_the_forward_documents_as_needed_are_given_where_it_fails_without_them(config, extras):
    """BROS's boxes and Decision Transformer's actions, rewards and returns default to None in the signature, yet
    the forward fails without them; the docstring documents them without *optional* (or the error names them).
    Given, the forward runs."""
    cfg = config(transformers)
    model = transformers.AutoModel.from_config(cfg).eval()
    inputs = default_inputs(model)
    assert extras <= set(inputs), inputs.keys()
    with torch.no_grad():
        model(**inputs)
    assert set(default_inputs(_meta_model("llama"))) == {"input_ids", "use_cache"}  # a forward that runs: as it was


def test_on_the_meta_device_a_tensor_the_error_names_is_kept_where_the_forward_then_fails_on_values():
    """AlignModel asks for pixel_values; given them, its forward on the meta device fails later (an ``.item()``):
    the inputs keep them, so the meta scan fails on what the values decide, not on a missing image."""
    model = _meta_model("align")
    inputs = default_inputs(model)
    assert {"input_ids", "pixel_values"} <= set(inputs) and inputs["pixel_values"].is_meta
    assert "pixel_values" not in default_inputs(model, needed=False)  # the caller asked for no forward
