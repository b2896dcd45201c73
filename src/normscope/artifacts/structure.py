"""The static contract of any architecture transformers knows, from its structure rather than a table.

The model is built from its config on the meta device (shapes, no memory, no weights) and scanned: one forward
on shapes gives the norm sites, their roles and the placement from the dataflow; each distinct kind of norm
module is inferred once on a materialized copy (drawn parameters, the ε its code set from the config). The
contract is then what that code does with this config — GPT-NeoX, Falcon, Starcoder2, Nemotron and every other
architecture transformers builds, with nothing written per architecture.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

from ..errors import InputError, NormscopeError
from ..extras import require
from .model import ModelContract

#: a model whose forward does not run on shapes alone (it reads a value: DeBERTa-v2's relative positions) is
#: built with random weights on the CPU instead, up to this many parameters (1 GiB in float32)
REAL_BUILD_PARAMS = 1 << 28
#: a reduced-depth build (:mod:`.depth`: each kind of layer once) may be larger: a 2.7 B encoder–decoder's four
#: layers at full width are 370 M parameters
REDUCED_BUILD_PARAMS = 1 << 29


def build_on_meta(config: dict[str, Any], config_path: Path, device: str = "meta"):
    """The base model of ``config`` (a config.json's dict) on the meta device (or ``device``).

    The class is :func:`~normscope.sources.model_class`'s base model (a composite's part, or a model only a task
    head maps, gets the class that builds it). On the meta device a mixture of experts runs its experts as batched
    matrix products (``experts_implementation="batched_mm"``): the grouped kernels and the per-expert loop read
    routing values, which shapes alone do not have."""
    transformers = require("transformers", "hf")
    import torch

    from ..sources import known_model_type, model_class

    model_type = config.get("model_type")
    known_model_type(transformers, model_type, config_path)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        try:
            cfg = transformers.AutoConfig.for_model(model_type, **fields)
        except (ValueError, KeyError) as exc:
            raise InputError(f"{config_path}: model_type {model_type!r} is not an architecture the installed "
                             f"transformers ({transformers.__version__}) knows ({exc})") from None
        try:
            cls = model_class(transformers, cfg, base=True)
        except NormscopeError:
            raise InputError(f"{config_path}: the installed transformers ({transformers.__version__}) has no model "
                             f"class for model_type {model_type!r}") from None
        if device == "meta":
            cfg._experts_implementation = "batched_mm"
        with torch.device(device):
            return cls.from_config(cfg) if cls.__name__.startswith("Auto") else cls._from_config(cfg)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{config_path}: transformers could not build {model_type!r} from this config "
                         f"({type(exc).__name__}: {_first_line(exc)})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, and — when it does not name what failed (a ``None`` where the
    code needed a value) — the line of the model's code that raised it, which names the config field."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = text if len(text) <= limit else text[:limit] + "…"
    while isinstance(exc, NormscopeError) and exc.__cause__ is not None:  # the model's own error, wrapped
        exc = exc.__cause__
    if isinstance(exc, AttributeError | TypeError | KeyError):
        import traceback

        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/transformers/models/" in f.filename]
        if frames and frames[-1].line:
            f = frames[-1]
            text += f", at {Path(f.filename).name}:{f.lineno}: {f.line.strip()[:160]}"
    return text


def read_structure(config: dict[str, Any], config_path: Path, source: str) -> ModelContract:
    """The contract of ``config`` from its architecture's structure (see the module's docstring)."""
    model = build_on_meta(config, config_path)
    label = repr(config.get("model_type"))
    parts, refused = _read_parts(model, config_path, label)
    out = ModelContract(source=source, kind="hf-config", sites=[], architecture=config.get("model_type"))
    for prefix, result, how in parts:
        part = ModelContract.from_scan(result, source=source).without_weights()  # drawn here: a config states none
        for site in part.sites:
            site.name, site.source = _under(prefix, site.name), _under(prefix, site.source)
        out.sites.extend(part.sites)
        out.notes.extend(f"{prefix}: {note}" if prefix else note for note in part.notes)
        if not prefix:
            out.stated_placement = result.placement
            stated = {k: v for k, v in result.config_eps.items() if "." not in k}
            keys = [k for s in result.sites for k in s.eps_keys or () if k in stated]  # the scan's rebuild experiment
            if keys:
                key = max(set(keys), key=keys.count)  # the key most sites read
                out.eps, out.eps_key = float(stated[key]), key
        what = f"{type(model.get_submodule(prefix)).__name__} (its {prefix})" if prefix else type(model).__name__
        out.notes.append(f"read from the structure of transformers' {what} built from this config {how}")
    if not out.sites:
        if refused:
            raise refused[0][1]
        tested = sum(result.stats.get("behaviour_candidates_tested", 0) for _, result, _ in parts)
        out.notes.append(f"the {label} architecture has no normalization site: nothing its forward on the default "
                         f"inputs met is a normalization class or behaves as one ({tested} calls shaped like one "
                         "tested by behaviour; a weight normalization is no site)")
    for prefix, exc in refused:
        if prefix.startswith("the whole "):
            out.notes.append(f"{prefix[len('the whole '):]} as a whole did not run on the default inputs, so its "
                             f"parts were read each on its own, and what lies outside them was not ({exc})")
        else:
            out.notes.append(f"not read: {prefix} ({exc})")
    out.n_layers = max((s.layer + 1 for s in out.sites if isinstance(s.layer, int)), default=None)
    for site in out.sites:
        if site.eps is not None and out.eps is not None and not math.isclose(site.eps, out.eps, rel_tol=0.01):
            site.notes.append(f"ε={site.eps:g} set by the code, not by {out.eps_key}")
    return out


def _under(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _read_parts(model, config_path: Path, label: str):
    """The scans that together cover the model: the whole model's, then — for each sub-model (a composite's text,
    vision or audio model) its forward did not reach, or each of them when the whole does not run — the
    sub-model's own. Returns ``[(prefix, scan, how)]`` and ``[(prefix, InputError)]`` for the parts not read."""
    parts, refused = [], []
    shape_failures: set[str] = set()  # the model's own shape checks its forward failed (see _read_one)
    try:
        result, how = _read_one(model, config_path, label, shape_failures)
        parts.append(("", result, how))
        reached = [s.name for s in result.sites]
        todo = [(p, m) for p, m in _submodels(model) if not any(n.startswith(p + ".") for n in reached)]
    except InputError as exc:
        todo = _submodels(model)
        if not todo:
            raise
        refused.append((f"the whole {type(model).__name__}", exc))
    for prefix, sub in todo:
        try:
            result, how = _read_one(sub, config_path, f"{label} part {prefix}", shape_failures)
        except InputError as exc:
            refused.append((prefix, exc))
            continue
        if result.sites:
            parts.append((prefix, result, how))
    return parts, refused


def _submodels(model) -> list[tuple[str, Any]]:
    """The outermost modules inside ``model`` that are transformers models with a config of another kind than the
    model's (a composite's text, vision or audio model; not an encoder–decoder's halves, which share its config)."""
    transformers = require("transformers", "hf")
    found: list[tuple[str, Any]] = []
    for path, module in model.named_modules():
        if not path or not isinstance(module, transformers.PreTrainedModel):
            continue
        if type(getattr(module, "config", None)) is type(model.config):
            continue
        if any(path.startswith(p + ".") for p, _ in found):
            continue
        found.append((path, module))
    return found


META = "on the meta device (one forward on shapes, each kind of norm inferred once)"


#: the words of a shape check an operator makes before it reads any value: raised on the meta device, it is raised
#: with values too (the meta kernels check the shapes the CPU kernels do)
SHAPE_CHECKS = ("expects split_sizes", "must match the size of tensor", "shapes cannot be multiplied",
                "is invalid for input of size", "size mismatch", "Sizes of tensors must match")


def _fails_on_shapes(meta_error: BaseException, inputs: dict, seen: set[str]) -> str | None:
    """The failure a forward would meet with values as well (None: building it with values may decide it): an
    operator's shape check on the inputs the forward with values gets too, or a failure a containing model's forward
    already met (``seen``: a composite's part fails as the whole did)."""
    cause = meta_error.__cause__
    if cause is None:
        return None
    text = f"{type(cause).__name__}: {_first_line(cause)}"
    if text in seen:
        return text
    # on the meta device a KV cache is turned on (the scan's mask building); without one the forward may differ
    if type(cause) is RuntimeError and any(w in str(cause) for w in SHAPE_CHECKS) and inputs.get("use_cache") is not False:
        seen.add(text)
        return text
    return None


def _read_one(model, config_path: Path, label: str, shape_failures: set[str]):
    """One model's scan and how it was read: on the meta device, else — when its forward reads values — with
    random weights on the CPU, at full depth up to :data:`REAL_BUILD_PARAMS` parameters, else at reduced depth
    (:mod:`.depth`). A forward that fails on the meta device in an operator's shape check is not built with values
    (it would fail there the same way; a full-size build costs seconds to minutes); ``shape_failures`` holds those
    met so far, so a composite's part that fails as the whole did is refused with it."""
    from ..model import default_inputs
    from ..model.draws import multiplied_in_pieces
    from ..sites import scan
    from . import depth

    # before any forward (default_inputs may run one), which may change a layer's settings (BigBird's attention)
    full = depth.block_lists(model)

    def inputs_of(needed: bool) -> dict:
        try:
            return default_inputs(model, needed=needed)
        except InputError as exc:
            raise InputError(f"{config_path}: the {label} architecture: {exc}") from None

    def meta_scan(inputs: dict):
        """The scan on the meta device and None, or None and why it failed."""
        try:
            return scan(model, inputs, dtypes="float32", progress=False), None
        except NormscopeError as exc:
            return None, exc

    # the scan's forward shows whether the inputs need more: asked again only where it fails (a forward fewer), and
    # not where it failed reading a value, which no input mends on the meta device
    inputs = inputs_of(needed=False)
    result, meta_error = meta_scan(inputs)
    if meta_error is not None and not _reads_values(meta_error):
        completed = inputs_of(needed=True)
        if _shapes(completed) != _shapes(inputs):
            inputs = completed
            result, meta_error = meta_scan(inputs)
    if meta_error is None:
        untested = result.stats.get("behaviour_candidates_untested", 0)
        if result.sites or not untested:
            return result, META
        # no norm class met, and only values tell whether a call shaped like a norm is one: built with values
        meta_error = NormscopeError(f"no normalization class met, {untested} calls shaped like one to test by "
                                    "behaviour")
        why_values = f"{untested} calls shaped like a norm are tested by behaviour, which needs values"
    else:
        why_values = "its forward reads values, so it does not run on the meta device"
        failure = _fails_on_shapes(meta_error, inputs, shape_failures)
        if failure is not None:
            raise InputError(f"{config_path}: the {label} architecture could not be scanned (its forward fails on the "
                             f"default inputs in a shape check its code makes before reading any value, {failure}: "
                             "so it was not built with random weights to fail there again)") from None
    size = sum(p.numel() for p in model.parameters())
    try:
        real, config, reduced, full, how = _built_with_values(model, full, size, why_values, meta_error, True,
                                                               config_path, label)
    except _CutVocabulary:
        # the vocabulary sizes another table too, which an id the config states must fit (Kyutai's audio padding
        # row, past its text and audio tokens): built with the whole vocabulary
        real, config, reduced, full, how = _built_with_values(model, full, size, why_values, meta_error, False,
                                                               config_path, label)
    def read(inputs: dict):  # a model built only to be read: no undo copies of its weights
        return scan(real, inputs, dtypes="float32", progress=False, restore=False)

    try:  # the forward the scan runs shows whether the inputs need more (a forward of real size is costly)
        with multiplied_in_pieces(real):
            plain = default_inputs(real, needed=False)
            result, failure = None, None
            smaller = _smaller_inputs(plain)
            if smaller is not None:
                try:  # the norms see the same widths; a forward that needs the config's size fails, read at it
                    result = read(smaller[0])
                    how += f"; {smaller[1]}, which it also takes"
                except NormscopeError:
                    pass
            if result is None:
                try:
                    result = read(plain)
                except NormscopeError as exc:
                    # kept without its traceback: its frames hold the failed forward's tensors
                    failure = _bare(exc)
            if failure is not None:
                completed = default_inputs(real)
                if _shapes(completed) == _shapes(plain):
                    raise failure
                result = read(completed)
    except NormscopeError as exc:
        raise InputError(f"{config_path}: the {label} architecture could not be scanned "
                         f"({_first_line(exc, limit=600)})") from None
    if config is reduced:
        result.sites = depth.extend(result.sites, full, depth.block_lists(real, full))
    return result, how


#: images with a side larger than this are read at a fraction of their size where the forward takes it
IMAGE_SIDE_READ = 512
#: …and time series longer than this many steps
SERIES_STEPS_READ = 1024


def _smaller_inputs(inputs: dict) -> tuple[dict, str] | None:
    """``inputs`` with its images cut to the largest whole fraction 1/2ⁿ of their height and width within
    :data:`IMAGE_SIDE_READ` (and whatever shares their height and width: a pixel mask), or its time series to
    such a fraction of their steps within :data:`SERIES_STEPS_READ` (and whatever shares their batch and steps:
    the padding, the observed mask), with what was cut for the note; None where nothing is that large. A forward
    of random weights on Step3's 728² images costs 22 s of CPU and 3.5 GiB, TimesFM 2.5's 16,384 steps 12 s (a
    loop over its patches); a norm's contract does not depend on how many positions it normalizes."""
    import torch

    def fraction(sizes: tuple[int, ...], limit: int) -> int:
        f = 1
        while max(sizes) // f > limit and all(n % (2 * f) == 0 for n in sizes):
            f *= 2
        return f

    def cut(lead: tuple[int, ...], dims: slice, cut_from: int, f: int) -> dict:
        """Each tensor whose dims ``dims`` are ``lead``, those from the ``cut_from``-th of them on cut to 1/f."""
        def one(v):
            if not isinstance(v, torch.Tensor) or v.dim() < len(lead) or tuple(v.shape[dims]) != lead:
                return v
            index = [slice(None)] * v.dim()
            for d in list(range(*dims.indices(v.dim())))[cut_from:]:
                index[d] = slice(0, v.shape[d] // f)
            return v[tuple(index)].contiguous()
        return {k: one(v) for k, v in inputs.items()}

    images = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() in (4, 5)]
    if images:
        hw = tuple(images[0].shape[-2:])
        f = fraction(hw, IMAGE_SIDE_READ)
        if f > 1:
            return cut(hw, slice(-2, None), 0, f), f"its images read at {hw[0] // f}×{hw[1] // f}, not the config's " \
                f"{hw[0]}×{hw[1]}"
    series = inputs.get("past_values")
    if isinstance(series, torch.Tensor) and series.is_floating_point() and series.dim() in (2, 3):
        lead = tuple(series.shape[:2])
        f = fraction(lead[1:], SERIES_STEPS_READ)
        if f > 1:
            return cut(lead, slice(0, 2), 1, f), f"its time series read at {lead[1] // f} steps, not {lead[1]}"
    return None


def _bare(exc: BaseException) -> BaseException:
    """``exc`` and the exceptions it was raised from, without their tracebacks."""
    seen = exc
    while seen is not None:
        seen.with_traceback(None)
        seen = seen.__cause__ or seen.__context__
    return exc


class _CutVocabulary(Exception):
    """transformers refused a build with the vocabulary cut."""


def _built_with_values(model, full, size: int, why_values: str, meta_error, cut_vocabulary: bool,
                       config_path: Path, label: str):
    """The model built with random weights on the CPU — at reduced depth and with fewer experts where its layers
    allow, with a vocabulary of 512 tokens where ``cut_vocabulary`` — with its config, the reduced config (None:
    built whole), its layer lists and the note; :class:`_CutVocabulary` where the cut vocabulary does not build."""
    import torch

    from . import depth

    config = copy.deepcopy(model.config)
    config._experts_implementation = None  # the default kernels with real values
    tokens = vocabulary = _fewer_tokens(config) if cut_vocabulary else ""

    def built(config, device: str):
        try:
            return _built(type(model), config, device, config_path, label)
        except InputError:
            if vocabulary:  # the vocabulary was cut (tokens grows with the experts' note below)
                raise _CutVocabulary() from None
            raise

    config, full, tokens = _fewer_experts(model, config, full, tokens, config_path, label)
    reduced = depth.reduced_config(config, full)
    shape = built(reduced, "meta") if reduced is not None else None
    small, why = None, "no layer list to cut"
    if reduced is not None:
        why, small = _reduced_fits(full, shape)
        moved = depth.reduced_config(config, full, move_indices=True)
        if why is None and moved is not None and moved.to_dict() != reduced.to_dict():
            # layer indices the cut dropped, moved onto added layers: used where only the lists grew
            try:
                other = _built(type(model), moved, "meta", config_path, label)
            except InputError:
                other = None
            if (other is not None and _reduced_fits(full, other)[0] is None
                    and depth.outside(other, full) == depth.outside(shape, full)):
                reduced, shape, small = moved, other, sum(p.numel() for p in other.parameters())
    if why is None:
        config = reduced
        kept = ", ".join(f"{len(r.kinds)} of {len(f.kinds)} layers in {f.path}"
                         for f, r in zip(full, depth.block_lists(shape, full), strict=True))
        how = (f"at reduced depth with random weights on the CPU ({kept}: each kind of layer at least once, the sites "
               f"found then given to every layer of that kind; {small:,} of {size:,} parameters{tokens}: {why_values})")
    else:
        built_size = sum(p.numel() for p in built(config, "meta").parameters())
        if built_size > REAL_BUILD_PARAMS:
            raise InputError(f"{config_path}: the {label} architecture does not run on the meta device "
                             f"({_first_line(meta_error)}), and at {size:,} parameters it is too large to build with "
                             f"random weights here, nor could it be read at reduced depth ({why}); scan a checkpoint "
                             "instead (normscope contract --live MODEL)") from None
        how = f"with random weights on the CPU ({built_size:,} parameters{tokens}: {why_values})"
    with torch.random.fork_rng(devices=[]):  # the weights drawn from seed 0; the caller's RNG left as it was
        torch.manual_seed(0)
        real = built(config, "cpu")
    return real, config, reduced, full, how


def _reads_values(error: BaseException) -> bool:
    """Whether a forward failed on the meta device for reading a value (``.item()``, a copy out, an operator with
    no meta kernel): more inputs cannot make it run there."""
    cause = error.__cause__
    return isinstance(cause, NotImplementedError) or (isinstance(cause, RuntimeError) and "meta" in str(cause))


def _shapes(inputs: dict) -> dict:
    """Each input's shape (a tensor's) or value: what tells two sets of inputs apart."""
    return {k: tuple(v.shape) if hasattr(v, "shape") else repr(v) for k, v in inputs.items()}


def _reduced_fits(full, shape) -> tuple[str | None, int]:
    """Why the reduced model (on the meta device) cannot stand for the full one (None: it can), and its size."""
    from . import depth

    try:
        why = depth.same_prefix(full, depth.block_lists(shape, full))
    except AttributeError:  # a list the reduced model does not have
        why = "its layer lists differ from the full model's"
    small = sum(p.numel() for p in shape.parameters())
    if why is None and small > REDUCED_BUILD_PARAMS:
        why = f"{small:,} parameters at the reduced depth"
    return why, small


def _fewer_experts(model, config, full, tokens: str, config_path: Path, label: str):
    """``config`` with fewer routed experts (:func:`.depth.fewer_experts`), the layer lists of that model read on
    the meta device, and the note — where the layers keep their pattern of kinds; else all three as they were."""
    from . import depth

    fewer = copy.deepcopy(config)
    cut = depth.fewer_experts(fewer)
    if not cut:
        return config, full, tokens
    try:
        lists = depth.block_lists(_built(type(model), fewer, "meta", config_path, label), full)
    except (InputError, AttributeError):
        return config, full, tokens
    if not depth.same_pattern(full, lists):
        return config, full, tokens
    return fewer, lists, f"{tokens}, {cut[0]}"


def _fewer_tokens(config, vocab: int = 512) -> str:
    """Cut the vocabulary of ``config`` and its sub-configs to ``vocab`` (in place; the norms never see it), and say
    so for the note."""
    from ..sources import cap_config

    notes = cap_config(vars(config), 0, vocab)
    for value in list(vars(config).values()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            notes += cap_config(vars(value), 0, vocab)
    return f", {notes[0]}" if notes else ""


def _built(cls, config, device: str, config_path: Path, label: str):
    import torch

    from ..model.draws import shared_draws

    try:  # random weights on the CPU: drawn when read, the large ones views of shared blocks (the build's memory)
        if device != "cpu":
            with torch.device(device):
                return cls._from_config(config)
        with shared_draws() as draws, torch.device(device):
            model = cls._from_config(config)
            draws.share(model)
            return model
    except Exception as exc:
        raise InputError(f"{config_path}: transformers could not build the {label} architecture "
                         f"({type(exc).__name__}: {_first_line(exc)})") from None
