"""`contract` on configs as checkpoints state them: full size, composite, MoE, values the meta device lacks.

The property every case meets: a read at reduced depth (and with fewer experts) gives exactly the sites, names,
roles and contract fields a build at full depth with every expert gives; a composite config's parts are each
read; a full-size default config of an MoE or an encoder–decoder gives a contract for every layer.
"""

from __future__ import annotations

import json
import re

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from normscope.artifacts import contract, depth, structure  # noqa: E402
from normscope.errors import InputError, NormscopeError  # noqa: E402

FIELDS = ("name", "source", "layer", "role", "family", "center", "eps", "eps_placement", "axes", "size", "gamma",
          "beta", "gamma_offset", "groups")

#: layer patterns along depth: hybrid Mamba/attention with MoE every other layer, linear/full attention, dense
#: layers then MoE, sliding/full attention, an encoder–decoder
PATTERNS = {
    "jamba": lambda t: t.JambaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, num_experts=8, num_experts_per_tok=2, attn_layer_period=4, attn_layer_offset=2,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_expand=2, mamba_dt_rank=4),
    "qwen3_next": lambda t: t.Qwen3NextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16),
    "deepseek_v3": lambda t: t.DeepseekV3Config(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=2, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, vocab_size=64, n_group=1,
        topk_group=1),
    "gemma3_text": lambda t: t.Gemma3TextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, sliding_window_pattern=3),
    # a vision tower counted by ``depth``, with mergers run after the layers its index list names
    "qwen3_vl_vision": lambda t: t.Qwen3VLVisionConfig(
        depth=6, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=48,
        deepstack_visual_indexes=[1, 3, 5], num_position_embeddings=64),
    # its layers counted by ``num_self_attends_per_block``
    "perceiver": lambda t: t.PerceiverConfig(
        num_latents=4, d_latents=32, d_model=24, num_blocks=1, num_self_attends_per_block=5,
        num_self_attention_heads=2, num_cross_attention_heads=1),
    "bart": lambda t: t.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=5, decoder_layers=3, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32),
}


def _saved(config, folder):
    config.save_pretrained(folder)
    path = folder / "config.json"
    return json.loads(path.read_text()), path


def _read(data, path):
    return structure.read_structure(data, path, str(path))


@pytest.fixture
def values_only(monkeypatch):
    """Every model's forward refused on the meta device (as one that reads a value is) and every build counted
    as too large to build at full depth: the structure read takes its reduced-depth path."""
    import normscope.sites

    scan = normscope.sites.scan

    def no_meta(model, *args, **kwargs):
        if next(model.parameters()).is_meta:
            raise NormscopeError("the forward reads a value (refused here on the meta device)")
        return scan(model, *args, **kwargs)

    monkeypatch.setattr(normscope.sites, "scan", no_meta)
    return monkeypatch


@pytest.mark.parametrize("arch", sorted(PATTERNS))
def test_reduced_depth_gives_what_full_depth_gives(tmp_path, values_only, arch):
    data, path = _saved(PATTERNS[arch](transformers), tmp_path)
    reduced = _read(data, path)  # reduced wherever the layers allow it, with 4 experts where there are more
    values_only.setattr(depth, "reduced_config", lambda config, lists, move_indices=False: None)
    values_only.setattr(depth, "fewer_experts", lambda config, keep=4: [])
    full = _read(data, path)
    assert any("reduced depth" in n for n in reduced.notes), reduced.notes
    if arch in ("jamba", "deepseek_v3"):
        assert any("4 of 8 experts" in n for n in reduced.notes), reduced.notes
    assert not any("not called" in n for n in reduced.notes + full.notes)  # every norm module met
    assert not any("reduced depth" in n for n in full.notes), full.notes
    rows = [[tuple(getattr(s, f) for f in FIELDS) for s in c.sites] for c in (reduced, full)]
    if arch == "qwen3_vl_vision":  # a merger run after a moved layer index comes earlier in the reduced forward
        rows = [sorted(r, key=lambda row: row[1]) for r in rows]
    assert rows[0] == rows[1]
    assert (reduced.placement, reduced.n_layers, reduced.eps, reduced.eps_key) == \
        (full.placement, full.n_layers, full.eps, full.eps_key)


@pytest.mark.parametrize("arch", ["jamba", "gemma3_text", "deepseek_v3"])
def test_a_pattern_the_reduced_depth_would_break_is_read_at_full_depth_or_refused(tmp_path, values_only, arch):
    """Layer kinds read from the full model: a reduced model whose layers are not the full model's first ones (here:
    a config that cuts its pattern wrongly) is never extended; it is built whole where it fits, else refused."""
    data, path = _saved(PATTERNS[arch](transformers), tmp_path)
    lists = []
    values_only.setattr(depth, "same_prefix", lambda full, reduced: lists.append(1) or "its layers differ (test)")
    whole = _read(data, path)
    assert lists and not any("reduced depth" in n for n in whole.notes)
    values_only.setattr(structure, "REAL_BUILD_PARAMS", 1)
    with pytest.raises(InputError, match=r"nor could it be read at reduced depth \(its layers differ \(test\)\)"):
        _read(data, path)


def test_layer_indices_a_cut_drops_move_onto_added_layers_only_where_nothing_else_changes():
    """Qwen3-VL's deep-stack mergers run after the layers [8, 16, 24] name: a cut to 2 layers would never run them
    (their norms unmet). The indices move onto layers 2, 3, 4; a list of ints that is no index list (kernel sizes)
    would change parameters outside the layer lists, and the plain cut is kept."""
    fields = {"deepstack": [8, 16, 24], "sizes": [3, 3], "per_layer": list(range(27))}

    class Config:
        pass

    config = Config()
    vars(config).update(fields)
    assert depth._move_indices(vars(config), config, 27, 2) == 5
    assert config.deepstack == [2, 3, 4] and config.sizes == [3, 3]  # not increasing: no index list
    cfg = PATTERNS["qwen3_vl_vision"](transformers)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(cfg)
    lists = depth.block_lists(model)
    plain, moved = depth.reduced_config(cfg, lists), depth.reduced_config(cfg, lists, move_indices=True)
    assert (plain.depth, plain.deepstack_visual_indexes) == (2, [1, 3, 5])
    assert (moved.depth, moved.deepstack_visual_indexes) == (4, [1, 2, 3])


def test_a_norm_module_the_forward_never_calls_is_named(tmp_path):
    from normscope import scan

    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)
            self.spare = torch.nn.LayerNorm(16)  # built, never called

        def forward(self, x):
            return self.norm(x)

    result = scan(Unused(), torch.randn(2, 16), progress=False)
    assert [s.name for s in result.sites] == ["norm"]
    note = next(n for n in result.notes if n["kind"] == "not_called")
    assert note["sites"] == ["spare"] and "not called" in note["message"] and "spare" in note["message"]


def test_a_model_with_no_normalization_gives_an_empty_contract_backed_by_behaviour(tmp_path):
    """MobileBERT's NoNorm is an elementwise affine map: on the meta device no call can be tested by behaviour, so
    the model is built with values, its calls shaped like a norm are tested, and the contract says none is one."""
    cfg = transformers.MobileBertConfig(vocab_size=64, hidden_size=32, embedding_size=16, intra_bottleneck_size=16,
                                        num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                        num_feedforward_networks=1)
    data, path = _saved(cfg, tmp_path)
    c = _read(data, path)
    assert c.sites == []
    note = next(n for n in c.notes if "no normalization site" in n)
    tested = int(re.search(r"\((\d+) calls shaped like one tested by behaviour", note).group(1))
    assert tested > 0
    assert any("random weights on the CPU" in n and "tested by behaviour, which needs values" in n for n in c.notes)


def test_block_kinds_set_a_layers_index_aside():
    """BigBird's attention holds its layer's index as ``seed``; an index, whatever its name, is not a kind."""
    cfg = transformers.BigBirdPegasusConfig(vocab_size=64, d_model=32, encoder_layers=4, decoder_layers=4,
                                            encoder_attention_heads=2, decoder_attention_heads=2,
                                            encoder_ffn_dim=64, decoder_ffn_dim=64)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(cfg)
    lists = depth.block_lists(model)
    assert [(b.path, len(b.kinds), len(set(b.kinds))) for b in lists] == [("encoder.layers", 4, 1),
                                                                            ("decoder.layers", 4, 1)]
    assert any(p.endswith(":seed") for p in lists[0].positions)


def test_fewer_experts_are_used_only_where_the_layers_keep_their_pattern():
    """Fewer experts change the experts' shapes, not which layers are of one kind; a cut that merged or split
    kinds would make the extension wrong, so it is not used."""
    full = [depth.BlockList("layers", ["dense", "moe", "dense", "moe"])]
    assert depth.same_pattern(full, [depth.BlockList("layers", ["dense'", "moe'", "dense'", "moe'"])])
    assert not depth.same_pattern(full, [depth.BlockList("layers", ["one", "one", "one", "one"])])
    assert not depth.same_pattern(full, [depth.BlockList("decoder", ["dense", "moe", "dense", "moe"])])
    cfg = transformers.Qwen3MoeConfig(num_experts=128, num_experts_per_tok=8)
    assert depth.fewer_experts(cfg) == ["8 of 128 experts"] and cfg.num_experts == 8


# ----------------------------------------------------------------------------------- full-size default configs
@pytest.mark.parametrize("arch, layers", [("granitemoe", 32), ("bart", 12), ("bigbird_pegasus", 16)])
def test_a_full_size_default_config_gives_every_layer(tmp_path, arch, layers):
    """GraniteMoE (an MoE of 3 B parameters: its router's top-k ran no forward on the meta device), BART (400 M
    parameters, its forward reads values) and BigBird-Pegasus (577 M; a forward switches its layers' attention
    type, so its layer kinds are read before any forward runs) as their default configs state them."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    CONFIG_MAPPING[arch]().save_pretrained(tmp_path)
    c = contract(tmp_path / "config.json")
    assert c.n_layers == layers
    per_layer = {}
    for s in c.sites:
        if s.layer is not None:
            stem = re.sub(r"(^|\.)\d+(\.|:).*", "", s.source)  # the layer list's path
            per_layer.setdefault(stem, set()).add(s.layer)
    assert all(found == set(range(layers)) for found in per_layer.values()), per_layer


# ------------------------------------------------------------------------------------------ composite configs
def test_a_composite_config_reads_each_part(tmp_path):
    """CLIP's forward needs text and image together; its text and vision models are each read, under their paths."""
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16).save_pretrained(tmp_path)
    c = contract(tmp_path / "config.json")
    parts = {s.source.split(".", 1)[0] for s in c.sites}
    assert parts == {"text_model", "vision_model"}, parts
    assert sum(s.source.startswith("vision_model.") for s in c.sites) == 2 * 2 + 2  # pre-LN, final and embedding
    assert len({s.name for s in c.sites}) == len(c.sites)


def test_a_composite_whose_forward_runs_reads_the_parts_it_did_not_reach(tmp_path):
    """LLaVA's forward on token ids never runs its vision tower: the tower is read on its own."""
    text = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8)
    transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=3).save_pretrained(tmp_path)
    c = contract(tmp_path / "config.json")
    assert any(s.source.startswith("vision_tower.") for s in c.sites)
    assert any(s.source.startswith("language_model.") or s.source.startswith("layers.") for s in c.sites)
    assert any("vision_tower" in n for n in c.notes), c.notes


@pytest.mark.parametrize("model_type", ["glm4v", "glm_image"])
def test_a_forward_failing_an_operators_shape_check_on_meta_is_not_built_with_values(tmp_path, monkeypatch,
                                                                                      model_type):
    """The GLM-4V family's text model splits its rotary dimensions by the config's sections, which do not sum to half
    its head size: the meta forward fails in ``split_with_sizes``, as the forward with values would. The whole model
    and its text part are refused without a build on the CPU (a full-size GLM-Image spent 15 s of its 20 s drawing
    weights to fail there); the vision part is read."""
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64, pad_token_id=0, eos_token_id=1, vision_vocab_size=64)
    vision = dict(hidden_size=32, depth=2, num_heads=4, intermediate_size=64, out_hidden_size=32)
    transformers.AutoConfig.for_model(model_type, text_config=text, vision_config=vision).save_pretrained(tmp_path)
    built = []
    real_build = structure._built
    monkeypatch.setattr(structure, "_built", lambda cls, config, device, *a: (built.append((cls.__name__, device)),
                                                                              real_build(cls, config, device, *a))[1])
    c = contract(tmp_path / "config.json")
    assert {s.source.split(".", 1)[0] for s in c.sites} == {"visual"}
    assert [cls for cls, device in built if device == "cpu"] == [type_ for type_, _ in built if "Vision" in type_][-1:]
    text_note = next(n for n in c.notes if n.startswith("not read: language_model"))
    assert "split_with_sizes" in text_note and "not built with random weights" in text_note, text_note


def test_a_hybrid_whose_cache_fails_on_meta_is_read_there_without_one(tmp_path):
    """GraniteMoE-Hybrid of linear-attention layers only: on the meta device a KV cache (which spares Hugging Face's
    mask building a value read) makes transformers refuse ("get_mask_sizes can only be called on Attention layers");
    the scan then runs the forward as the inputs give it, without one, and it runs on shapes (the full-size default
    config: 38 B parameters, refused before as too large even at reduced depth)."""
    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, layer_types=["mamba", "mamba"],
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2,
        shared_intermediate_size=64)
    with torch.device("meta"):
        model = transformers.GraniteMoeHybridModel(cfg)
    with pytest.raises(ValueError, match="get_mask_sizes"), torch.no_grad():
        model(input_ids=torch.zeros(2, 8, dtype=torch.long, device="meta"), use_cache=True)
    cfg.save_pretrained(tmp_path)
    c = contract(tmp_path / "config.json")
    assert c.sites and c.n_layers == 2 and any("on the meta device" in n for n in c.notes), c.notes


@pytest.mark.parametrize("model_type, config", [
    ("align_text_model", lambda t: t.AlignTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, vocab_size=64)),
    ("blip_text_model", lambda t: t.BlipTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, vocab_size=64, encoder_hidden_size=32)),
])
def test_a_part_no_auto_class_maps_is_built_by_its_own_class(tmp_path, model_type, config):
    from normscope.sources import model_class

    cfg = config(transformers)
    assert type(cfg) not in transformers.AutoModel._model_mapping
    assert model_class(transformers, cfg, base=True).config_class is type(cfg)
    cfg.save_pretrained(tmp_path)
    c = contract(tmp_path / "config.json")
    assert c.architecture == model_type and c.n_layers == 2 and c.sites


# ---------------------------------------------------------------------------------- configs as transformers saves
def test_non_finite_floats_as_transformers_writes_them(tmp_path):
    """transformers writes ``inf`` as ``{"__float__": "Infinity"}`` (Mamba-2 hybrids' ``time_step_limit``)."""
    cfg = transformers.Mamba2Config(hidden_size=32, num_hidden_layers=2, vocab_size=64, state_size=8, head_dim=8,
                                    num_heads=8, n_groups=1, expand=2, time_step_limit=(0.0, float("inf")))
    cfg.save_pretrained(tmp_path)
    assert "__float__" in (tmp_path / "config.json").read_text()
    c = contract(tmp_path / "config.json")
    assert c.n_layers == 2 and c.sites


def test_per_stage_sizes_and_unset_values_are_not_refused(tmp_path):
    """A hierarchical model states its heads per stage (``num_attention_heads: [1, 2]``); a value transformers
    leaves unset (``vocab_size: null``) is not normscope's to refuse. A size it does use must still be sane."""
    from normscope.sources import check_config

    check_config({"num_attention_heads": [1, 2, 4], "vocab_size": None}, "c.json")
    check_config({"num_hidden_layers": {"language": 9, "vision": 5}, "head_dim": 0}, "c.json")  # LXMERT; unset
    with pytest.raises(InputError, match=r"num_hidden_layers\['vision'\] must be a positive integer"):
        check_config({"num_hidden_layers": {"language": 9, "vision": -1}}, "c.json")
    # an ε the model does not read may be null where each norm's ε is measured (Cohere2-MoE's rms_norm_eps)
    check_config({"rms_norm_eps": None}, "c.json", measured_eps=True)
    with pytest.raises(InputError, match="rms_norm_eps must be a finite number"):
        check_config({"rms_norm_eps": None}, "c.json")
    with pytest.raises(InputError, match=r"num_attention_heads\[1\] must be a positive integer"):
        check_config({"num_attention_heads": [1, 0]}, "c.json")
    with pytest.raises(InputError, match="hidden_size must be a positive integer"):
        check_config({"hidden_size": -3}, "c.json")


# ----------------------------------------------------------------------- Falcon-40B's two parallel LayerNorms
def _falcon40b(t):
    """Falcon-40B's block at a small width: ``new_decoder_architecture``, ``ln_attn`` and ``ln_mlp`` on one input."""
    return t.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                          new_decoder_architecture=True, vocab_size=64)


def test_falcon40b_gguf_pair_maps_to_the_configs_two_sites(tmp_path):
    """llama.cpp stores ``ln_attn`` as ``blk.N.attn_norm`` and ``ln_mlp`` as ``blk.N.attn_norm_2``; its falcon graph
    runs both on the block's input (parallel)."""
    import gguf
    import numpy as np

    from normscope.artifacts import compare

    _falcon40b(transformers).save_pretrained(tmp_path / "falcon")
    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), arch="falcon")
    w.add_block_count(2)
    w.add_layer_norm_eps(1e-5)
    rng = np.random.default_rng(0)
    for name in ("blk.0.attn_norm", "blk.0.attn_norm_2", "blk.1.attn_norm", "blk.1.attn_norm_2", "output_norm"):
        w.add_tensor(name + ".weight", rng.uniform(0.5, 1.5, 64).astype(np.float32))
        w.add_tensor(name + ".bias", rng.uniform(-0.1, 0.1, 64).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    file = contract(tmp_path / "falcon.gguf")
    assert [s.name for s in file.sites] == ["layers.0.attn_norm", "layers.0.ffn_norm", "layers.1.attn_norm",
                                            "layers.1.ffn_norm", "final_norm"]
    assert file.placement == "parallel"
    config = contract(tmp_path / "falcon" / "config.json")
    assert [s.source for s in config.sites[:2]] == ["h.0.ln_attn", "h.0.ln_mlp"] and config.placement == "parallel"
    result = compare(config, file)
    assert result.ok and len(result.matched) == 5, [i.message for i in result.items]


def test_falcon40b_onnx_pair_maps_to_the_configs_two_sites(tmp_path):
    from normscope.artifacts import compare

    cfg = _falcon40b(transformers)
    cfg.save_pretrained(tmp_path / "falcon")
    torch.manual_seed(0)
    model = transformers.FalconModel(cfg).eval()
    model.config.use_cache = False
    path = tmp_path / "falcon.onnx"
    ids = torch.randint(0, 64, (1, 6))
    torch.onnx.export(model, (ids, None, torch.ones_like(ids)), str(path), dynamo=False,
                      input_names=["input_ids", "attention_mask"])
    file = contract(path)
    names = [s.name for s in file.sites]
    assert {"layers.0.attn_norm", "layers.0.ffn_norm", "layers.1.attn_norm", "layers.1.ffn_norm"} <= set(names), names
    result = compare(contract(tmp_path / "falcon" / "config.json"), file)
    assert not result.mismatches and len(result.matched) == 5, [i.message for i in result.items]


def test_a_vocabulary_another_table_depends_on_is_kept_whole(tmp_path, values_only):
    """The vocabulary is cut to 512 tokens for a build with values, and ids past the cut are dropped; Kyutai's
    embedding also holds its audio codebooks after the text tokens, with its padding row last: cut, that row falls
    outside the table and transformers refuses the build. The read goes on with the whole vocabulary (and meets
    the next thing its forward needs: input ids with one column per codebook, which the default inputs lack)."""
    config = transformers.KyutaiSpeechToTextConfig(
        vocab_size=600, codebook_vocab_size=16, num_codebooks=2, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, ffn_dim=64, max_position_embeddings=64, sliding_window=16,
        audio_bos_token_id=15, audio_pad_token_id=632, pad_token_id=3, bos_token_id=599,
        codec_config={"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                      "num_key_value_heads": 2, "intermediate_size": 64, "codebook_size": 16,
                      "codebook_dim": 8, "num_filters": 4, "upsampling_ratios": [2, 2], "head_dim": 16})
    data, path = _saved(config, tmp_path)
    with pytest.raises(InputError) as refused:
        _read(data, path)
    assert "could not build" not in str(refused.value) and "could not be scanned" in str(refused.value)


def test_a_build_that_fails_with_fewer_experts_and_the_whole_vocabulary_is_refused_in_one_line(tmp_path, values_only):
    """DeepSeek-V3's vocabulary (64) needs no cut, its experts (8) are cut to 4: a build with values that fails
    then is transformers' refusal, not the retry meant for a cut vocabulary."""
    data, path = _saved(PATTERNS["deepseek_v3"](transformers), tmp_path)
    real = structure._built

    def no_cpu_build(cls, config, device, config_path, label):
        if device == "cpu":
            raise InputError(f"{config_path}: transformers could not build the {label} architecture (test)")
        return real(cls, config, device, config_path, label)

    values_only.setattr(structure, "_built", no_cpu_build)
    with pytest.raises(InputError, match=r"could not build the .* architecture \(test\)"):
        _read(data, path)


def _small_vision(t, model_type: str):
    return getattr(t, {"dinov2": "Dinov2Config", "vit": "ViTConfig"}[model_type])(
        image_size=1024, patch_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64)


def test_large_images_are_read_at_a_fraction_where_the_forward_takes_it(tmp_path, values_only):
    """A model built with values reads images within 512² where its forward takes them (DINOv2 interpolates its
    position table): the same sites and fields as at the configured 1024², and the note says so."""
    data, path = _saved(_small_vision(transformers, "dinov2"), tmp_path)
    cut = _read(data, path)
    assert any("images read at 512×512, not the config's 1024×1024" in n for n in cut.notes), cut.notes
    values_only.setattr(structure, "IMAGE_SIDE_READ", 4096)
    whole = _read(data, path)
    assert not any("images read at" in n for n in whole.notes), whole.notes
    rows = [[tuple(getattr(s, f) for f in FIELDS) for s in c.sites] for c in (cut, whole)]
    assert rows[0] == rows[1] and len(rows[0]) == 5


def test_images_stay_at_the_configured_size_where_the_forward_needs_it(tmp_path, values_only):
    """ViT's position table is added as it is (no interpolation by default): at 512² its forward fails, and the read
    goes on at the configured size."""
    data, path = _saved(_small_vision(transformers, "vit"), tmp_path)
    read = _read(data, path)
    assert not any("images read at" in n for n in read.notes), read.notes
    assert len(read.sites) == 5


def test_long_time_series_are_read_at_a_fraction_where_the_forward_takes_it(tmp_path, values_only):
    """TimesFM 2.5 takes any whole number of patches: 4096 steps are read at 1024 (its forward loops over the
    patches), with the same sites and fields as at the configured length."""
    config = transformers.TimesFm2_5Config(context_length=4096, hidden_size=32, intermediate_size=32, head_dim=8,
                                           num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                                           max_position_embeddings=4096, output_quantile_len=64)
    data, path = _saved(config, tmp_path)
    cut = _read(data, path)
    assert any("time series read at 1024 steps, not 4096" in n for n in cut.notes), cut.notes
    values_only.setattr(structure, "SERIES_STEPS_READ", 1 << 20)
    whole = _read(data, path)
    rows = [[tuple(getattr(s, f) for f in FIELDS) for s in c.sites] for c in (cut, whole)]
    assert rows[0] == rows[1] and rows[0]
