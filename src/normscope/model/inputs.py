"""The inputs a model is run on: the user's (copied, so nothing they passed is changed) or, for a Hugging Face
model, a small default batch of what its ``main_input_name`` and forward signature say it takes, sized from its
config; and their description for a result."""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import torch

from ..errors import InputError

#: the batch a non-text default input has (a text model's is 2 sequences of 8 tokens)
BATCH = 1
#: the default length of a sequence the config does not fix: frames of a spectrogram, steps of a latent sequence
FRAMES = 64
#: samples of raw audio (1 s at 16 kHz), rounded up to whole frames of the model's hop
SAMPLES = 16000
#: more channels than this at a raw-audio model's first convolution are a latent sequence's, not audio's
MAX_AUDIO_CHANNELS = 8
#: the side of an image whose config states no size (every patch size and stride in use divides it)
IMAGE_SIDE = 224
#: a keypoint matcher's images where the config states no size: its matching attends over the keypoints found,
#: whose number grows with the image (SuperGlue's default pair at 224²: 17 s of CPU; at 128²: 2 s, the same sites)
PAIR_SIDE = 128

_HOW = ("in Python pass them (scan/diff(model, inputs): a tensor, a tuple of positional arguments or a dict of "
        "keyword arguments), on the command line --inputs (scan, diff, gradflow; contract with --live)")


def vocabulary_size(model: torch.nn.Module, embeddings: bool = True) -> int | None:
    """How many token ids a model takes: its own or its config's ``vocab_size`` (a multimodal config's text
    config's), else — with ``embeddings`` — the first ``nn.Embedding``'s size; None when nothing states one."""
    config = getattr(model, "config", None)
    owners = [model, config]
    if config is not None and hasattr(config, "get_text_config"):
        owners.append(config.get_text_config())
    for owner in owners:
        v = getattr(owner, "vocab_size", None)
        if isinstance(v, int) and v >= 2:
            return v
    if embeddings:
        return next((m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return None


def default_inputs(model: torch.nn.Module, needed: bool = True) -> dict[str, Any]:
    """A small batch of what a Hugging Face model's ``main_input_name`` says it takes, with every other argument
    its forward requires, on the model's device (the meta device too):

    - ``input_ids``: token ids (2 × 8), an encoder–decoder's decoder ids too (:func:`token_inputs`);
    - images (``pixel_values``): channels × the config's ``image_size`` (an int, a (height, width) list or a dict;
      224² when none is stated), a pair for a keypoint matcher (128² unless stated), ``num_frames`` of them for a video model
      (``pixel_values_videos``, or a config stating ``num_frames``; one ``tubelet_size`` of them where its forward
      runs on that), flattened patches with their ``grid_thw`` /
      ``spatial_shapes`` for a model that takes images as patch sequences;
    - raw audio (``input_values``): 16000 samples rounded up to the hop of the config's strides, (batch, samples)
      or (batch, channels, samples) as the forward documents it; a spectrogram for a model stating ``num_mel_bins``
      and no convolutional feature encoder;
    - spectrograms (``input_features``): ``num_mel_bins`` (or ``input_feat_per_channel``, ``feature_size``, …) ×
      frames, channels first when the first convolution takes them so, as many frames as ``max_source_positions``
      and the strides demand where the model fixes the length;
    - time series (``past_values``): ``context_length`` (+ the largest lag) steps with their time features and
      observed mask;
    - any other documented tensor whose shape the config's fields give (``latents`` of (batch, hidden_size,
      frames), …).

    ``needed``: where the forward fails on these, run it again with the documented tensors it still needs (one
    forward more where it runs: pass False to leave that to the caller, who then runs the forward itself and
    asks again only where it fails). A model whose inputs the config cannot give raises :class:`InputError` naming
    what its forward needs and which config field is missing."""
    config = getattr(model, "config", None)
    if config is None:
        raise InputError(f"{type(model).__name__} needs inputs: {_HOW}; only Hugging Face models get inputs by "
                         "default")
    main, argument = _main_input(model)
    if main == "input_ids":
        # a model that hashes its ids into buckets (CANINE's code points) takes any id: the first 1000 are valid
        vocab = vocabulary_size(model, embeddings=False) or _int(config, "num_hash_buckets")
        if vocab is None:
            raise InputError(f"{type(model).__name__} needs inputs: its forward takes token ids and its config "
                             f"states no vocab_size; {_HOW}")
        g = torch.Generator().manual_seed(0)
        lo = min(4, vocab - 1)
        kwargs = token_inputs(model, torch.randint(lo, min(vocab, 1000), (2, 8), generator=g))
        return _Defaults(model, config, main, argument, needed).complete_tokens(kwargs)
    return _Defaults(model, config, main, argument, needed).build()


def _main_input(model: torch.nn.Module) -> tuple[str, str]:
    """What a model's input is and the argument it goes in. Its ``main_input_name`` names both where the forward
    takes that argument. A forward that does not takes it as its one required argument (VibeVoice's tokenizers:
    ``input_values`` passed as ``hidden_states``); a class that keeps the default ``input_ids`` its forward does
    not take (a vision tower taking ``pixel_values`` or ``hidden_states``) has its input named by that argument:
    the forward's first required one, else its first."""
    main = getattr(model, "main_input_name", "input_ids")
    if isinstance(main, list | tuple):
        main = main[0] if main else "input_ids"
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return main, main
    if main in params:
        return main, main
    named = [p for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not named:
        raise InputError(f"{type(model).__name__} has no forward of its own to run (its parts are models of their "
                         f"own: scan each of them); {_HOW}")
    required = [p.name for p in named if p.default is inspect.Parameter.empty]
    first = required[0] if required else named[0].name
    if main != "input_ids" and len(required) == 1:
        annotation = params[first].annotation
        if annotation is inspect.Parameter.empty or "Tensor" in str(annotation):
            return main, first
    return first, first


def token_inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """Token ids as a Hugging Face model takes them: ``input_ids=`` on its device, the first ids as the decoder's
    too for an encoder–decoder, and no KV cache."""
    device = _device(model)
    kwargs: dict[str, Any] = {"input_ids": ids.to(device)}
    params = inspect.signature(model.forward).parameters
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) and "decoder_input_ids" in params:
        kwargs["decoder_input_ids"] = ids[:, :4].to(device)
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return kwargs


# ------------------------------------------------------------------------------------------ non-text defaults
#: the largest optional tensor tried on its own where a forward fails (:meth:`_Defaults._documented_extras`)
MAX_TRIED = 1 << 20


class _Missing(Exception):
    """An argument the config does not give: ``what`` says which field (or which kind of value) is missing."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


_SEQUENCE_DIMS = {"sequence_length", "seq_length", "seq_len", "frames", "num_frames", "time_steps", "episode_length",
                  "num_samples", "audio_length", "length", "target_sequence_length", "num_tokens", "num_patches",
                  "feature_sequence_length", "num_latents", "max_length", "num_steps", "num_boxes"}
#: arguments a forward documents without ``*optional*`` that are alternatives or extras, never needed: another
#: form of an input (``inputs_embeds``), a mask, positions, a cache, labels, a cross-attention's memory
_ALTERNATIVE = re.compile(r"(embeds|labels|hidden_states|mask|masks|position_ids|cache_position|past_key_values)$")
_CHANNEL_KEYS = ("num_channels", "audio_channels", "channels", "in_channels", "input_channels")


def _names(error: str, argument: str) -> bool:
    """Whether an error's words name ``argument`` (a whole word, not part of a dotted path; "Bbox" names bbox)."""
    return re.search(rf"(?<![\w.]){re.escape(argument)}(?!\w)", error, re.I) is not None


class _Defaults:
    """The default batch of one non-text Hugging Face model (see :func:`default_inputs`)."""

    def __init__(self, model: torch.nn.Module, config: Any, main: str, argument: str, needed: bool = True):
        self.model, self.config, self.main = model, config, main
        self.device = _device(model)
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        try:
            self.params = dict(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            self.params = {}
        self.doc = inspect.getdoc(model.forward) or ""
        self.g = torch.Generator().manual_seed(0)
        self.kwargs: dict[str, Any] = {}
        self.model_type = getattr(config, "model_type", None)
        #: alternative layouts of the main input, tried in order (see :meth:`_pick`)
        self._options: list[tuple[torch.Tensor, int]] | None = None
        #: the arguments that come with the main input (its grid, its padding), kept for each alternative
        self._own: set[str] = set()
        #: the axis of the main input its steps (frames, samples, patches) are on
        self.steps_axis = 1
        #: the argument the main input is passed as (:func:`_main_input`)
        self.argument = argument
        #: the batch and the steps of a sequence whose length the config does not fix
        self.batch, self.steps = BATCH, FRAMES
        #: whether to run the forward to find the documented tensors it needs (:meth:`_documented_extras`)
        self.needed = needed

    # ------------------------------------------------------------------------------------------------ driver
    def build(self) -> dict[str, Any]:
        try:
            self._fill(self.main)
            self._own = set(self.kwargs) - {self.main}
            options = self._options or [self.kwargs[self.main]]
            for option in options:
                self._complete(option)
                if len(options) == 1 or self._reaches(self._called(self.kwargs)):
                    break
            else:  # no layout reached the first layer as it takes it: the first, as documented
                self._complete(options[0])
            self._width_the_error_names()
            self._documented_extras()
            self._fewer_frames()
        except _Missing as exc:
            raise InputError(f"{type(self.model).__name__} needs inputs: its forward takes {self._needs()}, and "
                             f"{exc.what}; {_HOW}") from None
        return self._called(self.kwargs)

    def _called(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.argument == self.main:
            return kwargs
        return {(self.argument if k == self.main else k): v for k, v in kwargs.items()}

    def _complete(self, main: tuple[torch.Tensor, int] | torch.Tensor) -> None:
        """``self.kwargs``: the main input (a tensor, or one with the axis its steps are on), every argument the
        forward requires, and the optional ones it needs (:meth:`_companions`)."""
        extra = {k: v for k, v in self.kwargs.items() if k in self._own}
        tensor, self.steps_axis = main if isinstance(main, tuple) else (main, self.steps_axis)
        self.kwargs = {self.main: tensor, **extra}
        for name in self._required():
            if name != self.argument:
                self._fill(name)
        self._companions()
        if "use_cache" in self.params:
            self.kwargs["use_cache"] = False

    def _required(self) -> list[str]:
        return [k for k, p in self.params.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    def _documented_extras(self) -> None:
        """Where the forward fails on the inputs so far, the tensors its docstring documents without
        ``*optional*`` though the signature defaults them to None (Decision Transformer's actions and rewards,
        BROS's boxes), or the documented tensors its error names (LXMERT's ``visual_feats``) — kept where with
        them it runs. A forward that fails every way (one that reads values, on the meta device) keeps the tensors
        its error named where with them it fails elsewhere, no longer asking for them; else the inputs as they
        were. A streamed model is not tried: one forward would read all its weights (its token inputs are given)."""
        from .streaming import is_streamed

        if not self.needed or is_streamed(self.model):
            return
        failure = self._failure(self._called(self.kwargs))
        if failure is None:
            return
        lines = {k: line.group(1) for k in self.params if k not in self.kwargs and k not in self._required()
                 and (line := re.search(rf"^\s*{re.escape(k)} \((.*)$", self.doc, re.M)) is not None}
        tensors = [k for k, line in lines.items() if "Tensor" in line and not _ALTERNATIVE.search(k)]
        documented = [k for k in tensors if "*optional*" not in lines[k]]
        # "either pixel_values or image_embeds": the alternatives were left out above, so the first is given; an
        # alternative the error asks for by name is given (a Q-Former's encoder_hidden_states, UDOP's "Bbox")
        named = ([k for k in tensors if _names(failure, k)]
                 or [k for k, line in lines.items() if "Tensor" in line and _names(failure, k)])
        # last, each optional tensor on its own: one the forward reads without saying so (X-MOD's lang_ids, whose
        # error asks for a default language instead), kept only where with it the forward runs — with values: on
        # the meta device a forward that reads them fails whatever it is given
        optional = [[k] for k in tensors if k not in documented and k not in named and self._plain(k)
                    and self.device.type != "meta"]
        tries = [t for t in (documented, named, list(dict.fromkeys(documented + named)), *optional) if t]
        before, further = dict(self.kwargs), None
        for names in dict.fromkeys(tuple(t) for t in tries):
            try:
                for name in names:
                    self._fill(name)
            except _Missing:
                self.kwargs = dict(before)
                continue
            now = self._failure(self._called(self.kwargs))
            if now is None:
                return
            if further is None and named and set(names) & set(named) and not any(_names(now, k) for k in named):
                further = dict(self.kwargs)  # it asks for them no more and fails later (on values, on meta)
            self.kwargs = dict(before)
        if further is not None:
            self.kwargs = further

    def _failure(self, kwargs: dict[str, Any]) -> str | None:
        """Why the forward fails on ``kwargs`` (its error's words), or None where it runs."""
        try:
            with torch.no_grad():
                self.model(**kwargs)
        except Exception as exc:
            return str(exc)
        return None

    def complete_tokens(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A text model's token inputs with the other tensors its forward needs (its required arguments, and
        :meth:`_documented_extras`), of the same batch and length."""
        ids = kwargs["input_ids"]
        self.batch, self.steps = ids.shape[0], ids.shape[-1]
        self.kwargs = dict(kwargs)
        try:
            for name in self._required():
                self._fill(name)
            self._documented_extras()
        except _Missing as exc:
            raise InputError(f"{type(self.model).__name__} needs inputs: its forward takes {self._needs()}, and "
                             f"{exc.what}; {_HOW}") from None
        return self.kwargs

    def _needs(self) -> str:
        """What the forward takes: its main input and the arguments it requires, each with its documented shape
        (or its type, when that is not a tensor)."""
        names = [k for k in self._required() if k != self.argument]
        if self.argument in self.params or not self.params:
            names.insert(0, self.argument)
        else:
            names.insert(0, f"(main input {self.main}: not an argument of its forward)")
        return ", ".join(n if n not in self.params and n != self.argument else
                         f"{n} ({self._documented(n) or self._kind(n) or 'no documented shape'})" for n in names)

    def _kind(self, name: str) -> str | None:
        """The type an argument is annotated with, when that is not a tensor (a video session, a cache)."""
        annotation = self.params[name].annotation if name in self.params else inspect.Parameter.empty
        if annotation is inspect.Parameter.empty:
            return None
        text = getattr(annotation, "__name__", None) or str(annotation)
        return None if "Tensor" in text else text

    def _fill(self, name: str) -> None:
        if name in self.kwargs:
            return
        how = self._how(name)
        if how == "patch_grid":
            self._patch_grid(name)  # images as one sequence of patches, whatever the argument is called
        elif how == "images":
            self._images(name)
        elif how == "audio":
            self._audio(name)
        elif how == "series":
            self._series()
        elif how == "ids":
            self.kwargs[name] = self._ids(name)
        elif how == "mask":
            self.kwargs[name] = self._mask(name)
        elif how == "grid":
            raise _Missing(f"{name} goes with images given as patch sequences, which {self.main} is not")
        elif how == "object":
            raise _Missing(f"{name} is a {self._kind(name)}, not a tensor sized by the config")
        elif how == "first_layer":
            self._by_first_layer(name)
        else:
            self.kwargs[name] = self._documented_tensor(name)

    def _how(self, name: str) -> str:
        """How :meth:`_fill` makes ``name``: "documented" for a tensor of its documented shape alone; the other
        kinds (images, audio, ids, masks, …) have layouts of their own, some tried by running the forward."""
        if name == self.main and any(k in self._required() for k in ("grid_thw", "image_grid_thw")):
            return "patch_grid"
        if name in ("pixel_values_videos", "pixel_values") or name.endswith("pixel_values"):
            return "images"
        if name in ("input_values", "input_features", "audio_mel"):
            return "audio"
        if name == "past_values":
            return "series"
        if name.endswith("input_ids") or name == "task_inputs":
            return "ids"
        if name.endswith(("mask", "masks", "padding")):
            return "mask"
        if name in ("grid_thw", "image_grid_thw", "spatial_shapes", "merge_sizes"):
            return "grid"
        if self._kind(name) is not None:
            return "object"
        if name == self.main and self._documented(name) is None:
            return "first_layer"
        return "documented"

    def _plain(self, name: str) -> bool:
        """Whether ``name`` is a tensor :meth:`_fill` makes from its documented shape alone (not an image, audio,
        ids or a mask, whose layouts are tried by running the forward), of at most :data:`MAX_TRIED` elements."""
        if self._how(name) != "documented":
            return False
        try:
            return math.prod(self._documented_dims(name)) <= MAX_TRIED
        except _Missing:
            return False

    def _companions(self) -> None:
        """Optional arguments the forward still needs: an encoder–decoder's decoder ids, a text-conditioned vision
        model's text, a time-series decoder's future time features."""
        cfg = self.config
        mask = f"{self.main}_mask"
        if (mask in self.params and mask not in self.kwargs  # often optional yet read (AudioFlamingo3's encoder)
                and self.kwargs[self.main].dim() <= 3):  # a sequence's: an image's mask has no shape to take
            self.kwargs[mask] = self._mask(mask)
        if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in self.params:
            self.kwargs.setdefault("decoder_input_ids", self._ids("decoder_input_ids", length=4))
        if ("input_ids" in self.params and "input_ids" not in self.kwargs and self.main != "input_ids"
                and self._vocab("input_ids") is not None and self._sub("text_config") is not None):
            self.kwargs["input_ids"] = self._ids("input_ids")
        if self.main == "past_values" and "future_time_features" in self.params and self._lags() is not None:
            steps = _int(cfg, "prediction_length")
            if steps:
                self.kwargs["future_time_features"] = self._randn(self.batch, steps, _int(cfg, "num_time_features") or 0)

    # -------------------------------------------------------------------------------------------------- images
    def _images(self, name: str) -> None:
        required = self._required()
        if name == self.main and any(k in required for k in ("grid_thw", "image_grid_thw")):
            return self._patch_grid(name)
        if name == self.main and "spatial_shapes" in required:
            return self._patch_batch(name)
        if self.main.endswith("pixel_values") or self.main == "pixel_values_videos":
            reference = self.kwargs.get(self.main)
            if reference is not None and name != self.main:  # a prompt image: the main image's shape
                self.kwargs[name] = self._randn(*reference.shape)
                return None
        h, w = self._image_hw()
        c = self._channels()
        if self._pairs():
            shape: tuple[int, ...] = (self.batch, 2, c, h, w)
        elif name == "pixel_values_videos" or self._frames() is not None:
            frames = self._frames()
            if frames is None:
                raise _Missing("the config states no num_frames (or frames_per_clip)")
            shape = (self.batch, frames, c, h, w)
        else:
            shape = (self.batch, c, h, w)
        self.kwargs[name] = self._randn(*shape)
        return None

    def _image_hw(self) -> tuple[int, int]:
        """(height, width): the config's (or its vision or backbone config's) ``image_size``, else 224² (128² for a
        keypoint matcher's pair); at least ``patch_size`` over the smallest of ``scaled_images_ratios`` for a model that
        cuts scaled copies into patches (DepthPro), and a whole number of windows for windowed attention
        (``num_windows`` a side)."""
        owners = self._owners(("vision_config", "backbone_config", "image_model_config", "encoder_config"))
        hw = next((hw for owner in owners for key in ("image_size", "crop_size", "input_size")
                   if (hw := _hw(getattr(owner, key, None))) is not None), None)
        if hw is None:
            side = PAIR_SIDE if self._pairs() else IMAGE_SIDE
            hw = (side, side)
        ratios = getattr(self.config, "scaled_images_ratios", None)
        patch = _int(self.config, "patch_size")
        if patch and isinstance(ratios, list | tuple) and ratios and all(isinstance(r, int | float) and r > 0
                                                                          for r in ratios):
            side = math.ceil(patch / min(ratios))
            hw = (max(hw[0], side), max(hw[1], side))
        for owner in owners:
            windows, patch = _int(owner, "num_windows"), _int(owner, "patch_size")
            if windows and patch:
                unit = windows * patch
                hw = (-(-hw[0] // unit) * unit, -(-hw[1] // unit) * unit)
                break
        return hw

    def _channels(self) -> int:
        for owner in self._owners(("vision_config", "backbone_config", "image_model_config")):
            for key in _CHANNEL_KEYS:
                v = _int(owner, key)
                if v:
                    return v
        return 3

    def _frames(self) -> int | None:
        if self.main not in ("pixel_values", "pixel_values_videos"):
            return None
        for owner in self._owners(("vision_config",)):
            for key in ("num_frames", "frames_per_clip"):
                v = _int(owner, key)
                if v:
                    return v
        return None

    def _width_the_error_names(self) -> None:
        """Where the forward refuses a float main input of (batch, steps, features) by the width it needs — a norm's
        ``normalized_shape=[768]`` (SpeechT5 without its pre-net takes hidden states), "doesn't correspond to
        config.d_model: 768" (Perceiver) — that many features, kept where the forward then no longer asks for it."""
        x = self.kwargs.get(self.main)
        if not (self.needed and isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() == 3):
            return
        failure = self._failure(self._called(self.kwargs))
        width = _named_width(failure) if failure else None
        if width is None or width == x.shape[-1]:
            return
        trial = {**self.kwargs, self.main: self._randn(*x.shape[:-1], width)}
        now = self._failure(self._called(trial))
        if now is None or _named_width(now) != width:
            self.kwargs = trial

    def _fewer_frames(self) -> None:
        """A video clip cut to one temporal patch (``tubelet_size`` frames, else one) where the forward runs on it:
        its norms see the same widths, while the config's clip can cost a forward of thousands of tokens (V-JEPA 2's
        64 frames at 256²: 8,192). Kept whole where the forward needs every frame (a position table of that many)."""
        x = self.kwargs.get(self.main)
        if not (isinstance(x, torch.Tensor) and x.dim() == 5 and self._frames()):
            return
        unit = next((v for owner in self._owners(("vision_config",))
                     if (v := _first_int(getattr(owner, "tubelet_size", None)))), 1)
        if x.shape[1] <= unit or x.shape[1] % unit:
            return
        trial = {**self.kwargs, self.main: x[:, :unit].contiguous()}
        if self._failure(self._called(trial)) is None:
            self.kwargs = trial

    def _pairs(self) -> bool:
        """A keypoint matcher takes pairs of images (batch, 2, channels, height, width)."""
        from transformers.models.auto import modeling_auto

        return self.model_type in getattr(modeling_auto, "MODEL_FOR_KEYPOINT_MATCHING_MAPPING_NAMES", {})

    def _patch_dim(self) -> int:
        """The size of one flattened patch: what the first layer (the patch embedding) takes."""
        for m in self.model.modules():
            if isinstance(m, torch.nn.Linear):
                return m.in_features
            if isinstance(m, torch.nn.Conv2d | torch.nn.Conv3d):
                return m.in_channels * math.prod(m.kernel_size)
        c, p = self._channels(), _int(self.config, "patch_size")
        if not p:
            raise _Missing("the config states no patch_size")
        return c * p * p

    def _patch_grid(self, name: str) -> None:
        """Images as one sequence of flattened patches with their (temporal, height, width) grid (Qwen2-VL-like
        vision encoders): a grid of 4 × 4 merged patches."""
        merge = next((v for k in ("spatial_merge_size", "merge_size") if (v := _int(self.config, k))), 1)
        side = 4 * merge
        self.kwargs[name] = self._randn(side * side, self._patch_dim())
        grid = torch.tensor([[1, side, side]], device=self.device)
        for key in ("grid_thw", "image_grid_thw"):
            if key in self.params:
                self.kwargs[key] = grid
        if "merge_sizes" in self.params:
            self.kwargs["merge_sizes"] = torch.tensor([merge], device=self.device)

    def _patch_batch(self, name: str) -> None:
        """Images as a batch of flattened patch sequences with their (height, width) in patches (Siglip2-like)."""
        n = _int(self.config, "num_patches") or 256
        side = math.isqrt(n) or 16
        self.kwargs[name] = self._randn(self.batch, side * side, self._patch_dim())
        self.kwargs["spatial_shapes"] = torch.tensor([[side, side]] * self.batch, device=self.device)
        for key in ("pixel_attention_mask",):
            if key in self.params:
                self.kwargs[key] = torch.ones(self.batch, side * side, dtype=torch.long, device=self.device)

    # --------------------------------------------------------------------------------------------------- audio
    def _audio(self, name: str) -> None:
        if name == "input_values" and self._first_layer(torch.nn.Conv1d) is None and self._mel_bins() is not None:
            return self._spectrogram(name)  # Audio Spectrogram Transformer: a spectrogram called input_values
        if name == "input_values":
            return self._waveform(name)
        return self._spectrogram(name)

    def _hop(self) -> int | None:
        """How many samples one frame of a convolutional audio encoder covers (the product of its strides)."""
        cfg = self.config
        for key in ("conv_stride", "downsampling_ratios", "upsampling_ratios", "patch_sizes", "strides"):
            v = getattr(cfg, key, None)
            if isinstance(v, list | tuple) and v and all(isinstance(s, int) and s > 0 for s in v):
                return math.prod(v)
        return _int(cfg, "hop_length")

    def _waveform(self, name: str) -> None:
        """Raw audio: (batch, samples) when the model adds the channel axis its first convolution takes, else
        (batch, channels, samples) — which of the two, the first convolution says (see :meth:`_reaches`)."""
        hop = self._hop() or 1
        samples = -(-SAMPLES // hop) * hop
        conv = self._first_layer(torch.nn.Conv1d)
        channels = conv.in_channels if conv is not None else self._channel_count() or 1
        if channels > MAX_AUDIO_CHANNELS:  # a decoder's latents (VibeVoice's): FRAMES steps of them
            samples = FRAMES
        flat, shaped = (self._randn(self.batch, samples), 1), (self._randn(self.batch, channels, samples), 2)
        candidates = [flat, shaped] if (self._documented_rank(name) or 2) == 2 else [shaped, flat]
        self._pick(name, candidates)

    def _pick(self, name: str, candidates: list[tuple[torch.Tensor, int]]) -> None:
        """Alternative layouts of the main input ``name`` (each with the axis of its steps): :meth:`build` uses the
        first that reaches the model's first layer in the layout that layer takes (:meth:`_reaches`), the first
        when none does."""
        self.kwargs[name], self.steps_axis = candidates[0]
        if len(candidates) > 1 and name == self.main:
            self._options = candidates

    def _reaches(self, kwargs: dict[str, Any]) -> bool:
        """Whether the forward on ``kwargs`` gets to the first layer it calls (a convolution or linear map) with an
        input that layer takes: channels at dim 1 of a batched input for a convolution, features last for a linear
        map. The forward stops there — nothing after it runs, so the check costs what comes before the first layer
        (a reshape or two; on the meta device, nothing) — and an error before it means the layout is not taken."""

        class Reached(Exception):
            pass

        def stop(module, args):
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor):
                raise Reached(False)
            if isinstance(module, torch.nn.Linear):
                raise Reached(x.dim() >= 2 and x.shape[-1] == module.in_features)
            raise Reached(x.dim() == len(module.kernel_size) + 2 and x.shape[1] == module.in_channels)

        layers = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear | torch.nn.modules.conv._ConvNd)]
        handles = [m.register_forward_pre_hook(stop) for m in layers]
        try:
            with torch.no_grad():
                self.model(**kwargs)
        except Reached as r:
            return bool(r.args[0])
        except Exception:
            return False
        finally:
            for h in handles:
                h.remove()
        return False

    def _by_first_layer(self, name: str) -> None:
        """An undocumented main input (``hidden_states``, ``image``, ``spectrogram``) shaped for the model's first
        layer: steps of its input features for a linear map, its channels by steps (or steps by channels) for a
        1-d convolution, an image of the config's size for a 2-d one — the layout that reaches that layer."""
        first = self._first_layer(torch.nn.Linear | torch.nn.Conv1d | torch.nn.Conv2d)
        if isinstance(first, torch.nn.Linear):
            candidates = [(self._randn(self.batch, FRAMES, first.in_features), 1),
                          (self._randn(FRAMES, first.in_features), 0)]
        elif isinstance(first, torch.nn.Conv1d):
            candidates = [(self._randn(self.batch, first.in_channels, FRAMES), 2),
                          (self._randn(self.batch, FRAMES, first.in_channels), 1)]
        elif isinstance(first, torch.nn.Conv2d):
            candidates = [(self._randn(self.batch, first.in_channels, *self._image_hw()), 2)]
        else:
            raise _Missing(f"it documents no shape for {self.argument}, and its first layer is not a linear map or "
                           "a convolution to shape it by")
        self._pick(name, candidates)

    def _first_layer(self, kind: type) -> Any:
        """The model's first layer (convolution or linear map, in registration order) when it is a ``kind``."""
        for m in self.model.modules():
            if isinstance(m, torch.nn.Linear | torch.nn.modules.conv._ConvNd):
                return m if isinstance(m, kind) else None
        return None

    def _mel_bins(self) -> int | None:
        """Features per frame of a spectrogram: the config's ``num_mel_bins`` (or a synonym), else what the
        model's first layers take (a Conv2d subsampling stack before a Linear: the width that leaves the
        Linear's input size)."""
        for owner in self._owners(("encoder_config", "audio_config", "feature_extractor_config")):
            for key in ("num_mel_bins", "input_feat_size", "feature_projection_input_dim", "input_feat_per_channel",
                        "n_mels", "mel_bins", "num_mel_filters", "input_dim", "feature_size"):
                v = _int(owner, key)
                if v:
                    if key == "input_feat_per_channel":
                        v *= _int(owner, "input_channels") or 1
                    return v
        return self._bins_from_layers()

    def _bins_from_layers(self) -> int | None:
        convs: list[torch.nn.Conv2d] = []
        for m in self.model.modules():
            if isinstance(m, torch.nn.Conv2d):
                convs.append(m)
            elif isinstance(m, torch.nn.Linear) and convs:
                if m.in_features % convs[-1].out_channels:
                    return None
                width = m.in_features // convs[-1].out_channels
                for bins in range(1, 4097):  # the width the stack makes of `bins` features
                    w = bins
                    for c in convs:
                        w = (w + 2 * c.padding[1] - c.dilation[1] * (c.kernel_size[1] - 1) - 1) // c.stride[1] + 1 \
                            if isinstance(c.padding, tuple) else w
                    if w == width:
                        return bins
                return None
            elif isinstance(m, torch.nn.Linear | torch.nn.Conv1d):
                return None
        return None

    def _spectrogram(self, name: str) -> None:
        """Spectrogram frames: (batch, frames, features), or (batch, features, frames) where the first layer is a
        Conv1d over the features that gets them so (Whisper: as many frames as ``max_source_positions`` and its
        strides demand); a first Linear taking a multiple of the features gets stacked frames."""
        bins = self._mel_bins()
        if bins is None:
            raise _Missing("the config states no num_mel_bins (nor input_feat_per_channel, feature_size, …): "
                           "how many features a frame has")
        frames = self._frames_per_chunk() or (_int(self.config, "max_length") if name == "input_values" else None)
        frames = frames or FRAMES
        candidates = [(self._randn(self.batch, frames, bins), 1)]
        conv = next((m for m in self.model.modules() if isinstance(m, torch.nn.Conv1d) and m.in_channels == bins),
                    None)
        candidates.append((self._randn(self.batch, bins, self._fixed_frames(conv) or frames), 2))
        image = self._first_layer(torch.nn.Conv2d)
        if image is not None:  # a spectrogram as an image of channels × frames × bins (CLAP's audio encoder)
            candidates.append((self._randn(self.batch, image.in_channels, frames, bins), 2))
        for m in self.model.modules():  # frames stacked into one vector (low frame rate features)
            if isinstance(m, torch.nn.Linear) and m.in_features % bins == 0 and m.in_features > bins:
                candidates.append((self._randn(self.batch, frames, m.in_features), 1))
                break
        self._pick(name, candidates)

    def _frames_per_chunk(self) -> int | None:
        """Frames of an encoder that reads its input in whole windows (``n_window``: windows of twice that)."""
        n = _int(self.config, "n_window")
        return 2 * n if n else None

    def _fixed_frames(self, first: torch.nn.Conv1d | None) -> int | None:
        """Frames of a channels-first spectrogram: ``max_source_positions`` × the strides of the first convolution
        and its sibling convolutions, where the config states the positions (Whisper requires exactly that many)."""
        positions = _int(self.config, "max_source_positions")
        if not positions or first is None:
            return None
        parent = next((m for m in self.model.modules() if any(c is first for c in m.children())), self.model)
        return positions * math.prod(m.stride[0] for m in parent.children() if isinstance(m, torch.nn.Conv1d))

    # ----------------------------------------------------------------------------------------------- time series
    def _lags(self) -> list[int] | None:
        lags = getattr(self.config, "lags_sequence", None)
        return list(lags) if isinstance(lags, list | tuple) and all(isinstance(v, int) for v in lags) else None

    def _series(self) -> None:
        cfg = self.config
        context = _int(cfg, "context_length")
        if not context:
            raise _Missing("the config states no context_length (nor prediction_length): how many steps the model "
                           "looks back")
        lags = self._lags()
        steps = context + (max(lags) if lags else 0)
        channels = next((v for k in ("num_input_channels", "input_size") if (v := _int(cfg, k))), 1)
        rank = self._documented_rank("past_values") or 2
        shape = (self.batch, steps, channels) if rank == 3 or channels > 1 else (self.batch, steps)
        values = self._randn(*shape)
        self.kwargs["past_values"] = values
        if "past_time_features" in self.params and lags is not None:
            self.kwargs["past_time_features"] = self._randn(self.batch, steps, _int(cfg, "num_time_features") or 0)
        if "past_observed_mask" in self.params:
            self.kwargs["past_observed_mask"] = torch.ones(shape, dtype=torch.bool, device=self.device)
        if "past_values_padding" in self.params:
            self.kwargs["past_values_padding"] = torch.zeros(self.batch, steps, dtype=self.dtype, device=self.device)
        if "freq" in self.params:
            self.kwargs["freq"] = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
        n = _int(cfg, "num_static_categorical_features")
        if n and "static_categorical_features" in self.params:
            self.kwargs["static_categorical_features"] = torch.zeros(self.batch, n, dtype=torch.long, device=self.device)
        n = _int(cfg, "num_static_real_features")
        if n and "static_real_features" in self.params:
            self.kwargs["static_real_features"] = self._randn(self.batch, n)

    # ------------------------------------------------------------------------------------------ other arguments
    def _vocab(self, name: str) -> int | None:
        """The vocabulary of token ids ``name`` (``qformer_input_ids``: the ``qformer_config``'s; ``input_ids``
        and ``decoder_input_ids``: the text or decoder config's, else the model's)."""
        prefix = name[: -len("input_ids")].rstrip("_") if name.endswith("input_ids") else ""
        prefix = "" if prefix == "decoder" else prefix
        owners = [self._sub(f"{prefix}_config")] if prefix else []
        if name == "task_inputs":
            owners.append(None)
            v = _int(self.config, "text_encoder_vocab_size")
            if v:
                return v
        owners += [self._sub("text_config"), self._sub("decoder_config"), self.config]
        for owner in owners:
            v = _int(owner, "vocab_size")
            if v and v >= 2:
                return v
        return None

    def _ids(self, name: str, length: int = 8) -> torch.Tensor:
        vocab = self._vocab(name)
        if vocab is None:
            raise _Missing(f"the config states no vocab_size for {name}")
        if name == "task_inputs":
            length = _int(self.config, "task_seq_len") or length
        return torch.randint(min(4, vocab - 1), min(vocab, 1000), (self.batch, length), generator=self.g).to(self.device)

    def _mask(self, name: str) -> torch.Tensor:
        """A mask of the argument it belongs to, every position kept: ones for an attention or observed mask,
        False for a boolean mask of what is masked out, zeros for a padding indicator; an image's shape for the
        masks of an image (``prompt_masks``), (batch, height, width) for ``pixel_mask``."""
        base = name.removesuffix("_mask").removesuffix("_masks").removesuffix("_padding")
        key = next((k for k in (base, f"{base}_values", f"{base}_ids", self.main) if k in self.kwargs), None)
        if key is None:
            raise _Missing(f"{name} belongs to an argument that was not given")
        partner = self.kwargs[key]
        if key == self.main and self._is_image(key):
            shape = tuple(partner.shape) if name.endswith("masks") else (*partner.shape[:-3], *partner.shape[-2:])
        elif key == self.main and partner.is_floating_point():
            shape = (partner.shape[0], partner.shape[self.steps_axis])
            if self.main == "past_values":
                shape = tuple(partner.shape)
        else:
            shape = tuple(partner.shape[:2])
        if name.endswith("masks") and self._is_image(key):
            return self._randn(*shape).gt(0).to(self.dtype)
        if name.endswith("_padding"):
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        annotation = str(self.params[name].annotation) if name in self.params else ""
        if "BoolTensor" in annotation and not any(w in name for w in ("observed", "attention")):
            return torch.zeros(shape, dtype=torch.bool, device=self.device)  # nothing masked out
        return torch.ones(shape, dtype=torch.long, device=self.device)

    def _is_image(self, name: str) -> bool:
        return name.endswith("pixel_values") or name == "pixel_values_videos"

    def _documented(self, name: str) -> str | None:
        name = self.argument if name == self.main else name
        m = re.search(rf"^\s*{re.escape(name)} \(`[^`]*`(?:[^)]*?)? of shape [`']?\(([^)]*)\)", self.doc, re.M)
        return f"({m.group(1)})" if m else None

    def _documented_rank(self, name: str) -> int | None:
        shape = self._documented(name)
        return len(shape.strip("()").split(",")) if shape else None

    def _documented_tensor(self, name: str) -> torch.Tensor:
        """A tensor of the shape the forward's docstring gives ``name``, each dimension named by a config field
        (``hidden_size``, ``state_dim``, …), the batch or a sequence length."""
        dims = self._documented_dims(name)
        name = self.argument if name == self.main else name
        if re.search(rf"^\s*{re.escape(name)} \(`'?torch\.(Long|Int|Bool)Tensor", self.doc, re.M):
            return torch.zeros(dims, dtype=torch.long, device=self.device)  # indices (time steps): the first
        return self._randn(*dims)

    def _documented_dims(self, name: str) -> list[int]:
        """The sizes of the shape the docstring gives ``name`` (see :meth:`_documented_tensor`)."""
        shape = self._documented(name)
        name = self.argument if name == self.main else name
        if shape is None:
            raise _Missing(f"it documents no shape for {name}")
        dims = []
        # "({0}, 4)": a docstring template's placeholder for the input's own (batch_size, sequence_length)
        for dim in (d.strip() for d in shape.strip("()").replace("{0}", "batch_size, sequence_length").split(",")):
            if dim in ("batch_size", "bs", "batch"):
                dims.append(self.batch)
            elif dim.isdigit():
                dims.append(int(dim))
            elif name.startswith("encoder_") and (v := _int(self.config, f"encoder_{dim}")):
                dims.append(v)  # an encoder's output of its own width (a Q-Former's encoder_hidden_size)
            elif (v := _int(self.config, dim)) or (dim == "channels" and (v := self._channel_count())):
                dims.append(v)
            elif dim in _SEQUENCE_DIMS or dim.endswith(("_length", "_len")) or dim.startswith("num_"):
                dims.append(self.steps)  # a length, or a count of items the config does not fix (LXMERT's boxes)
            else:
                raise _Missing(f"the config states no {dim} for {name}'s shape {shape}")
        return dims

    def _channel_count(self) -> int | None:
        return next((v for k in _CHANNEL_KEYS if (v := _int(self.config, k))), None)

    # ---------------------------------------------------------------------------------------------- helpers
    def _owners(self, subs: tuple[str, ...]) -> list[Any]:
        """The config, then its named sub-configs (and theirs), where a field may be stated."""
        out, todo = [], [self.config]
        while todo:
            owner = todo.pop(0)
            if owner is None or any(owner is o for o in out):
                continue
            out.append(owner)
            todo += [getattr(owner, s, None) for s in subs]
        return out

    def _sub(self, key: str) -> Any:
        v = getattr(self.config, key, None)
        return v if v is not None and not isinstance(v, dict | list | str | int | float) else None

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.g).to(device=self.device, dtype=self.dtype)


def _int(owner: Any, key: str) -> int | None:
    v = getattr(owner, key, None) if owner is not None else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _hw(size: Any) -> tuple[int, int] | None:
    """(height, width) of an image size as configs state it: an int, a [height, width] list or a dict."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size, size
    if isinstance(size, list | tuple) and size and all(isinstance(v, int) and v > 0 for v in size):
        return (size[0], size[-1])
    if isinstance(size, dict):
        if isinstance(size.get("height"), int) and isinstance(size.get("width"), int):
            return size["height"], size["width"]
        for key in ("shortest_edge", "longest_edge", "size"):
            if isinstance(size.get(key), int):
                return size[key], size[key]
    return None


def _device(model: torch.nn.Module) -> torch.device:
    """The model's device: the meta device where any of its parameters is there (a model built on the meta device
    whose weight-norm parametrizations were drawn on the CPU) and it is not offloaded, else its first parameter's
    (an offloaded model's first one off the meta device; a streamed one's, the CPU)."""
    from .copies import offloaded
    from .streaming import is_streamed

    devices = [p.device for p in model.parameters()]
    if is_streamed(model):  # its weights are read onto the CPU at each module's call
        return torch.device("cpu")
    if offloaded(model):  # accelerate loads each module's weights for its call: the inputs go where it runs
        return next((d for d in devices if d.type != "meta"), torch.device("cpu"))
    if any(d.type == "meta" for d in devices):
        return torch.device("meta")
    return devices[0] if devices else torch.device("cpu")


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, tuple | list):
        return type(obj)(_clone(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


def arguments(model, inputs) -> tuple[tuple, dict[str, Any]]:
    if inputs is None:
        return (), default_inputs(model)
    if isinstance(inputs, torch.Tensor):
        return (inputs.detach().clone(),), {}
    if isinstance(inputs, tuple):
        return _clone(inputs), {}
    if isinstance(inputs, dict):
        if not all(isinstance(k, str) for k in inputs):
            raise InputError("inputs as a dict are keyword arguments: its keys must be strings")
        return (), _clone(inputs)
    raise InputError(f"inputs must be a tensor (passed positionally), a tuple (positional arguments) or a dict "
                     f"(keyword arguments); got a {type(inputs).__name__}")


def describe(args, kwargs) -> dict[str, Any]:
    def one(v):
        if isinstance(v, torch.Tensor):
            return {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
        return repr(v)[:40]
    return {"args": [one(a) for a in args], "kwargs": {k: one(v) for k, v in kwargs.items()}}


def _first_int(v) -> int | None:
    """A positive int, or the first of a list of them (a tubelet's (frames, height, width)); else None."""
    if isinstance(v, list | tuple) and v:
        v = v[0]
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


_WIDTH_IN_ERROR = (re.compile(r"normalized_shape=\[(\d+)\], expected input with shape \[\*, \1\]"),
                   re.compile(r"(?:correspond|match)\w* to config\.\w+:? (\d+)"))


def _named_width(message: str) -> int | None:
    """The number of features a forward's error says its input needs, or None."""
    for pattern in _WIDTH_IN_ERROR:
        if (m := pattern.search(message)) is not None:
            return int(m.group(1))
    return None
