"""What a command-line TARGET names, and the object it loads: one resolver for every subcommand.

:func:`resolve` classifies a TARGET string without running anything and refuses a bad one with one clear
:class:`~normscope.errors.InputError` (or :class:`~normscope.errors.TargetError` for a malformed
``package.module:attr``, as before):

=============  ==========================================================================================
kind           TARGET
=============  ==========================================================================================
python         ``package.module:attr`` — a module class, factory, instance or function (importing it runs
               its top-level code; ``--args``/``--kwargs`` are JSON, never evaluated)
onnx           a ``.onnx`` file
hf-dir         a local Hugging Face model directory (a folder with a ``config.json``; its weights)
hf-config      a Hugging Face ``config.json`` (the architecture, built with random weights)
gguf           a ``.gguf`` file (checked by its ``GGUF`` magic)
safetensors    a ``.safetensors`` file (checked by its header); next to a ``config.json`` it is that model
=============  ==========================================================================================

The loaders take a resolved :class:`Source`: :func:`load_target` gives infer and check their single
normalization (python or onnx), :func:`load_model` gives scan (and later diff and trace) a torch module
(python, hf-dir, hf-config, or a safetensors file inside a model directory). ``contract`` reads artifacts
(hf-dir, hf-config, gguf, onnx) itself, statically; :attr:`Source.path` is what it opens.
"""

from __future__ import annotations

import importlib
import inspect
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InputError, TargetError
from .extras import require
from .inputs import shorten
from .loading import parse_json, read_json_file, unreadable

__all__ = ["KINDS", "Source", "resolve", "load_target", "load_model", "is_onnx_path"]

KINDS = ("python", "onnx", "hf-dir", "hf-config", "gguf", "safetensors")

#: How each kind reads in a sentence ("TARGET x is ...").
DESCRIPTIONS = {
    "python": "a Python object", "onnx": "an ONNX file", "hf-dir": "a Hugging Face model directory",
    "hf-config": "a Hugging Face config.json", "gguf": "a GGUF file", "safetensors": "a safetensors file",
}

#: What infer and check accept, in the words of their error messages.
NORM_FORMS = "package.module:attr (e.g. torch.nn:LayerNorm) or a path ending in .onnx"
#: What scan accepts.
MODEL_FORMS = "package.module:factory, a Hugging Face model directory or a config.json file"

#: A config.json is a few KB of JSON; a file over this size is something else (weights, a dataset).
MAX_CONFIG_BYTES = 16 * 2**20
CONFIG_FILE = "a Hugging Face config.json"

_SAFETENSORS_HEADER_MAX = 100 * 2**20  # a larger JSON header than this is not a safetensors file


@dataclass(frozen=True)
class Source:
    """A resolved TARGET: its ``kind`` (one of :data:`KINDS`), the ``text`` given, and the file or folder."""

    kind: str
    text: str
    path: Path | None = None

    @property
    def description(self) -> str:
        return DESCRIPTIONS[self.kind]


def is_onnx_path(spec) -> bool:
    return str(spec).lower().endswith(".onnx")


def resolve(target: str | Source, forms: str = NORM_FORMS) -> Source:
    """The :class:`Source` a TARGET names; ``forms`` says in the error what the caller accepts."""
    if isinstance(target, Source):
        return target
    text = str(target)
    path = Path(text)
    lower = text.lower()
    if is_onnx_path(text):
        if not path.exists():
            raise TargetError(f"no such ONNX file: {text}")
        if not path.is_file():
            raise TargetError(f"{text} is not a file")
        return Source("onnx", text, path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"{text} is a folder without a config.json: not a Hugging Face model directory")
        return Source("hf-dir", text, path)
    if lower.endswith(".gguf"):
        _check_gguf(_existing_file(path, text, "GGUF"), text)
        return Source("gguf", text, path)
    if lower.endswith(".safetensors"):
        _check_safetensors(_existing_file(path, text, "safetensors"), text)
        return Source("safetensors", text, path)
    if lower.endswith(".json"):
        return Source("hf-config", text, _existing_file(path, text, "JSON"))
    if ":" in text:
        module_name, attr = text.split(":", 1)
        if not module_name or not attr or module_name.startswith(".") or "/" in module_name:
            raise TargetError(
                f"TARGET {text!r} must be package.module:attr with an importable module name (e.g. "
                "torch.nn:LayerNorm); put a file's folder on PYTHONPATH and name it by module")
        return Source("python", text)
    raise (TargetError if forms == NORM_FORMS else InputError)(f"TARGET {text!r} must be {forms}")


def _existing_file(path: Path, text: str, what: str) -> Path:
    if not path.exists():
        raise InputError(f"no such file: {text}")
    if not path.is_file():
        raise InputError(f"{text} is not a file (a {what} file was expected)")
    return path


def _head(path: Path, text: str, n: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except OSError as exc:
        raise unreadable(text, exc) from None


def _check_gguf(path: Path, text: str) -> None:
    if _head(path, text, 4) != b"GGUF":
        raise InputError(f"{text} does not start with the GGUF magic bytes: not a GGUF file (or a truncated one)")


def _check_safetensors(path: Path, text: str) -> None:
    """A safetensors file starts with an 8-byte little-endian header length and that many bytes of JSON."""
    head = _head(path, text, 9)
    size = path.stat().st_size
    length = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else -1
    if len(head) < 9 or head[8:9] != b"{" or not 2 <= length <= min(size - 8, _SAFETENSORS_HEADER_MAX):
        raise InputError(f"{text} does not start with a safetensors header (8-byte length, then JSON): not a "
                         "safetensors file (or a truncated one)")


def read_config(path: str | Path, model_type: bool = True) -> dict[str, Any]:
    """A Hugging Face config.json as a dict (read by :func:`~normscope.loading.read_json_file`, at most
    :data:`MAX_CONFIG_BYTES`); ``model_type``: one clear InputError when it names no architecture."""
    data = _special_floats(read_json_file(path, CONFIG_FILE, limit=MAX_CONFIG_BYTES, need_object=True))
    if model_type and not isinstance(data.get("model_type"), str):
        raise InputError(f"{path} has no \"model_type\": not {CONFIG_FILE}; give the config.json saved with the "
                         "model (its model_type names the architecture)")
    return data


#: how transformers writes a float JSON has no literal for (``save_pretrained``: ``{"__float__": "Infinity"}``)
_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _special_floats(obj: Any) -> Any:
    """A config's values with transformers' tagged non-finite floats read as floats, as its own loader does."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[obj["__float__"]]
        return {k: _special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_special_floats(v) for v in obj]
    return obj


#: the config keys that carry a norm's ε in Hugging Face configs
EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
_EPS_KEY = re.compile(r"[a-z0-9_]*(norm|rms|ln)[a-z0-9_]*_(eps|epsilon)")


def is_eps_key(key: str) -> bool:
    """A config key that states a normalization's ε: the common four, and any ``…norm…_eps``/``…_epsilon``
    (``norm_epsilon``, ``batch_norm_eps``, ``mixer_rms_eps``, …) — not a jitter's or an optimizer's ε."""
    return isinstance(key, str) and (key in EPS_KEYS or _EPS_KEY.fullmatch(key) is not None)
MAX_LAYERS = 100_000  # beyond any real model: a larger count is a corrupt or hostile config
MAX_WIDTH = 2**24
#: the structural sizes a config may state, each a positive integer up to its limit
CONFIG_SIZES = {"num_hidden_layers": MAX_LAYERS, "n_layer": MAX_LAYERS, "num_layers": MAX_LAYERS,
                "hidden_size": MAX_WIDTH, "n_embd": MAX_WIDTH, "d_model": MAX_WIDTH,
                "num_attention_heads": MAX_WIDTH, "n_head": MAX_WIDTH, "num_key_value_heads": MAX_WIDTH,
                "intermediate_size": MAX_WIDTH, "head_dim": MAX_WIDTH, "vocab_size": 2**31 - 1}


def config_int(config: dict[str, Any], keys: tuple[str, ...], where: str | Path, default: int | None = None) -> int:
    """The first of ``keys`` the config states, checked as a positive integer within its limit."""
    for key in keys:
        if key in config:
            value, limit = config[key], CONFIG_SIZES.get(key, MAX_WIDTH)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
                raise InputError(f"{where}: {key} must be a positive integer ≤ {limit}; got {value!r}")
            return value
    if default is not None:
        return default
    raise InputError(f"{where}: the config has none of {', '.join(keys)}")


def check_config(config: dict[str, Any], where: str | Path, measured_eps: bool = False) -> None:
    """The one validation of a config's numbers, for every command that reads one (scan builds the model from
    it, contract reads it): each size it states is a positive integer within its limit, each ε a finite
    number ≥ 0. A size may be null (transformers derives it, or the model does not use it), a list of sizes (one
    per stage of a hierarchical model) or an object of them (one per tower: LXMERT's layers); a ``head_dim`` of 0
    is unset, as the modelling code reads it (``head_dim or hidden_size // heads``). With ``measured_eps`` (a
    reader that measures the ε each norm really uses) an ε may be null too: a key the model does not read."""
    for key in CONFIG_SIZES:
        value = config.get(key)
        if isinstance(value, list | dict):
            for i, v in (value.items() if isinstance(value, dict) else enumerate(value)):
                config_int({f"{key}[{i!r}]": v}, (f"{key}[{i!r}]",), where)
        elif value is not None and not (key == "head_dim" and value == 0):
            config_int(config, (key,), where)
    for key in (k for k in config if is_eps_key(k)):
        eps = config[key]
        if not (eps is None and measured_eps) and (isinstance(eps, bool) or not isinstance(eps, int | float)
                                or not 0 <= eps < float("inf")):
            raise InputError(f"{where}: {key} must be a finite number ≥ 0; got {eps!r}")


def unstated_eps(stated: dict[str, Any], built: dict[str, Any], where: str | Path) -> None:
    """An InputError when the architecture reads a norm ε from its config (its defaults have one) and the file
    states none: transformers would silently use its default, and every ε measured would be that default's."""
    if any(is_eps_key(k) for k in stated):
        return
    defaults = [k for k in built if is_eps_key(k)]
    if defaults:
        raise InputError(f"{where}: no {defaults[0]}, the ε of its norms; transformers would silently use its "
                         f"default ({built[defaults[0]]!r}) — add the value the model was trained with")


# ---------------------------------------------------------------------------------------------- python
def import_attr(text: str):
    """The object ``package.module:attr`` names (the module is imported: its top-level code runs)."""
    module_name, attr = text.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        where = ("the current directory is not on the import path: run with PYTHONPATH=. (or the module's folder)"
                 if missing == module_name.split(".")[0] and Path(missing + ".py").exists() else
                 "is it installed in this environment, or is its folder on PYTHONPATH?")
        raise TargetError(f"cannot import {module_name!r}: no module named {missing!r}; {where}") from None
    except (ImportError, TypeError, ValueError) as exc:
        raise TargetError(f"cannot import {module_name!r}: {exc}; is it installed in this environment?") from None
    except SyntaxError as exc:
        raise TargetError(f"cannot import {module_name!r}: syntax error in {exc.filename}, line {exc.lineno}: "
                          f"{exc.msg}") from None
    except Exception as exc:  # the module's own top-level code failed
        raise TargetError(f"importing {module_name!r} ran its top-level code, which raised "
                          f"{type(exc).__name__}: {shorten(exc, 200, as_text=True)}") from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(f"{module_name!r} has no attribute {attr!r}") from None
    return obj


def _construct(text: str, obj, args_json: str | None, kwargs_json: str | None):
    """A class instantiated, or a factory called, with ``--args``/``--kwargs`` (when either is given)."""
    args = parse_json(args_json, list, "--args")
    kwargs = parse_json(kwargs_json, dict, "--kwargs")
    if inspect.isclass(obj) or args_json is not None or kwargs_json is not None:
        if not callable(obj):
            raise TargetError(f"{text} is a {type(obj).__name__}, which cannot be called with --args/--kwargs")
        try:
            obj = obj(*args, **kwargs)
        except Exception as exc:
            call = f"{text}(*{shorten(args)}, **{shorten(kwargs)})"
            raise TargetError(f"{call} failed: {type(exc).__name__}: {shorten(exc, 200, as_text=True)}") from None
    return obj


def load_target(spec: str | Source, args_json: str | None = None, kwargs_json: str | None = None):
    """The single normalization infer and check probe: a Python object, or an ONNX file's path.

    A class is instantiated with ``--args``/``--kwargs``; another attribute (a factory) is called with them
    whenever either is given, ``--args '[]'`` included. Any other kind of TARGET is one clear InputError
    pointing at the command that takes it.
    """
    parse_json(args_json, list, "--args")  # a malformed flag is named before anything is imported or read
    parse_json(kwargs_json, dict, "--kwargs")
    source = resolve(spec, NORM_FORMS)
    if source.kind == "onnx":
        if args_json is not None or kwargs_json is not None:
            raise TargetError("--args/--kwargs construct a class or call a factory; an ONNX file takes neither")
        return source.text
    if source.kind == "python":
        return _construct(source.text, import_attr(source.text), args_json, kwargs_json)
    command = "contract" if source.kind in ("gguf", "safetensors") else "scan"
    raise InputError(f"TARGET {source.text} is {source.description}; infer and check take one normalization: "
                     f"{NORM_FORMS} (for the whole model: normscope {command} {source.text})")


# ---------------------------------------------------------------------------------------------- models
def _transformers():
    return require("transformers", "hf")


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Silence transformers' progress bars ("Loading weights: 100%|███") and its logging while a model loads (and the
    warnings of the libraries it imports then), so they do not interleave with normscope's output; the user's
    settings come back afterwards. transformers is touched only when it is installed."""
    from importlib.util import find_spec

    if find_spec("transformers") is None:
        yield
        return
    import logging

    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # libraries transformers imports on the way where they are installed (torchao: its optional C++ ops it cannot
    # load here, and torch's pytree notes on the types it registers), at warning level, for the load only
    others = {name: logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")}
    levels = {name: lg.level for name, lg in others.items()}
    for lg in others.values():
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        for name, lg in others.items():
            lg.setLevel(levels[name])


def known_model_type(transformers, model_type: Any, where: str | Path) -> None:
    """An InputError naming the nearest model types where the installed transformers does not know ``model_type``
    (not its list of every architecture)."""
    import difflib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return
    near = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING_NAMES), n=4, cutoff=0.5)
    hint = f"the nearest it knows: {', '.join(near)}" if near else "none it knows is near that name"
    raise InputError(f"{where}: model_type {shorten(str(model_type), 60)!s} is not an architecture the installed "
                     f"transformers ({transformers.__version__}) knows ({hint}); fix model_type, or install a "
                     "transformers that has it")


def model_class(transformers, config, base: bool = False):
    """The transformers class that builds ``config``: with ``base``, the base model (``AutoModel``) before the
    class the config's ``architectures`` names; without, that class first, then the causal LM or the base model.
    A config no auto class maps (a composite's ``*_text_model`` or ``*_vision_model`` part, a model only a task
    head maps) gets the head an auto mapping names, else the class its own modeling module builds from it."""
    auto_classes = (transformers.AutoModel,) if base else (transformers.AutoModelForCausalLM, transformers.AutoModel)
    named = [getattr(transformers, a, None) for a in getattr(config, "architectures", None) or []]
    named = [c for c in named if isinstance(c, type)]
    if named and not base:
        return named[0]
    for auto in auto_classes:
        if type(config) in auto._model_mapping:
            names = getattr(auto._model_mapping, "_model_mapping", {}).get(config.model_type)
            first = names[0] if isinstance(names, tuple | list) else names
            if isinstance(first, str) and not isinstance(getattr(transformers, first, None), type):
                continue  # a class the mapping names and transformers does not have
            if isinstance(names, tuple | list):
                return getattr(transformers, first)  # the auto class would pick by ``architectures``
            return auto
    if named:
        return named[0]
    from transformers.models.auto import modeling_auto

    for mapping_name in sorted(n for n in dir(modeling_auto) if n.startswith("MODEL_") and n.endswith("_MAPPING_NAMES")):
        name = getattr(modeling_auto, mapping_name).get(config.model_type)
        name = name[0] if isinstance(name, tuple | list) else name
        if isinstance(name, str) and isinstance(getattr(transformers, name, None), type):
            return getattr(transformers, name)
    own = _own_model_class(transformers, config)
    if own is not None:
        return own
    raise TargetError(f"transformers has no model class for model_type {config.model_type!r}")


def _own_model_class(transformers, config):
    """The model class in the config's own modeling module whose ``config_class`` is exactly its type (a base
    ``…Model`` before a head)."""
    import importlib

    module_name = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except Exception:
        return None
    found = [c for c in vars(module).values()
             if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)
             and getattr(c, "config_class", None) is type(config) and not c.__name__.endswith("PreTrainedModel")]
    found.sort(key=lambda c: (not c.__name__.endswith("Model"), len(c.__name__)))
    return found[0] if found else None


def cap_config(data: dict[str, Any], layers: int, vocab: int) -> list[str]:
    """Cap a config's layer count and vocabulary in place (0 keeps them); the notes say what was capped."""
    notes = []
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        n = data.get(key)
        if isinstance(n, int) and layers and n > layers:
            for k, v in list(data.items()):  # per-layer lists (layer_types, …) follow the count
                if isinstance(v, list) and len(v) == n:
                    data[k] = v[:layers]
            data[key] = layers
            notes.append(f"{layers} of {n} layers")
    v = data.get("vocab_size")
    if isinstance(v, int) and vocab and v > vocab:
        data["vocab_size"] = vocab
        for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
            ids = data.get(k)
            if isinstance(ids, int) and ids >= vocab or isinstance(ids, list) and any(i >= vocab for i in ids):
                data[k] = None
        notes.append(f"vocabulary {vocab} of {v}")
    return notes


def _pretrained(folder: Path, text: str):
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        return model_class(transformers, config).from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        error = load_error(exc, text)
        if error is exc:
            raise
        raise error from None


def load_error(exc: Exception, text: str) -> Exception:
    """What loading the model in ``text`` raising ``exc`` means for the user (``exc`` itself: a bug to report)."""
    if type(exc).__module__.split(".")[0] == "safetensors":  # a truncated or corrupt weights file
        return InputError(f"could not read the weights in {text}: {exc} — the safetensors file is truncated or not "
                          "one; copy or download it again")
    if isinstance(exc, OSError | ValueError | KeyError):
        return TargetError(f"could not load the model in {text}: {type(exc).__name__}: {exc}")
    return exc


def _from_config(source: Source, layers: int, vocab: int):
    import torch

    data = read_config(source.path)
    check_config(data, source.text)
    text_config = data.get("text_config") if isinstance(data.get("text_config"), dict) else None
    if text_config is not None:
        check_config(text_config, f"{source.text} (text_config)")
    stated = dict(text_config or data)
    transformers = _transformers()
    notes = cap_config(data, max(layers, 0), max(vocab, 0))
    model_type = data.pop("model_type")
    known_model_type(transformers, model_type, source.text)
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as exc:
        raise TargetError(f"{source.text}: transformers cannot build a {model_type!r} config "
                          f"({shorten(str(exc), 300)})") from None
    built = config.get_text_config().to_dict() if hasattr(config, "get_text_config") else config.to_dict()
    unstated_eps(stated, built, source.text)
    cls = model_class(transformers, config)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        try:
            model = cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
        except Exception as exc:
            raise TargetError(f"{source.text}: building {cls.__name__} failed: {type(exc).__name__}: {exc}") from None
    return model, "random weights from " + source.text + (f" ({', '.join(notes)})" if notes else "")


def load_model(target: str | Source, args_json=None, kwargs_json=None, layers: int = 2, vocab: int = 512):
    """The torch module TARGET names, and a note on how it was built (scan, contract --live, gradflow, diff).

    ``layers``/``vocab`` cap a config.json's architecture (0 keeps the config's); a model directory and a
    safetensors file inside one load their real weights. transformers' logging and progress bars are silenced
    while it loads (:func:`quiet_libraries`); the user's settings come back afterwards.
    """
    source = resolve(target, MODEL_FORMS)
    with quiet_libraries():
        return _load_model(source, args_json, kwargs_json, layers, vocab)


def _load_model(source: Source, args_json, kwargs_json, layers: int, vocab: int):
    import torch

    if source.kind == "hf-dir":
        return _pretrained(source.path, source.text), f"weights from {source.text}"
    if source.kind == "safetensors":
        folder = source.path.parent
        if not (folder / "config.json").is_file():
            raise InputError(f"{source.text} holds weights without an architecture: put it in a folder with its "
                             "config.json and pass the folder (or the config.json for random weights)")
        return _pretrained(folder, str(folder)), f"weights from {folder}"
    if source.kind == "hf-config":
        return _from_config(source, layers, vocab)
    if source.kind == "python":
        obj = _construct(source.text, import_attr(source.text), args_json, kwargs_json)
        if callable(obj) and not isinstance(obj, torch.nn.Module) and not (args_json or kwargs_json):
            try:  # a factory without arguments (a factory is called only when arguments are given)
                obj = obj()
            except Exception as exc:
                raise TargetError(f"{source.text}() failed ({type(exc).__name__}: {exc}); TARGET must name a "
                                  "torch.nn.Module or a factory returning one") from None
        if not isinstance(obj, torch.nn.Module):
            raise TargetError(f"{source.text} gave a {type(obj).__name__}; scan takes a torch.nn.Module")
        return obj, source.text
    raise InputError(f"TARGET {source.text} is {source.description}, which holds no runnable torch model; "
                     f"give {MODEL_FORMS} (its static contract: normscope contract {source.text})")
