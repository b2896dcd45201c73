"""``normscope scan TARGET``: the command-line glue (``add_parser(subparsers)`` and ``run(args, console)``).

TARGET is ``package.module:factory`` (``--args``/``--kwargs`` JSON, as for infer), a local Hugging Face model
directory (its weights), or a ``config.json`` (random weights: an architecture-level scan, with the layer count
and vocabulary capped by ``--layers``/``--vocab``). Exit codes: 0 scanned, 1 findings with ``--strict``,
2 usage or input error (one line on stderr).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line registers this parser without loading rich
    from rich.console import Console

from ..errors import InputError, MissingExtraError, TargetError

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


def add_parser(subparsers) -> Any:
    p = subparsers.add_parser(
        "scan",
        help="every norm site of a model: contract, role (pre/post/branch/qk/…) and block placement",
        description="Run one forward of a model, find every normalization (by class, by behaviour, functional "
                    "calls), infer each contract on its real input and classify its role from the dataflow. "
                    "Exit 0 scanned, 1 findings (with --strict), 2 usage error.",
    )
    p.add_argument("target", metavar="TARGET",
                   help="package.module:factory, a local Hugging Face model directory, or a config.json "
                        "(random weights)")
    p.add_argument("--args", help="JSON list of positional arguments for the factory, e.g. '[64]' (default: none)")
    p.add_argument("--kwargs", help="JSON object of keyword arguments for the factory (default: none)")
    p.add_argument("--shape", help="input shape for a model that takes one float tensor, e.g. 2,8,64 "
                                   "(Hugging Face text models get a small input_ids batch by default)")
    p.add_argument("--dtypes", help="dtypes infer tries at each site (default float32,bfloat16,float16)")
    p.add_argument("--layers", type=int, default=2,
                   help="config.json only: number of layers built (default 2; 0 keeps the config's)")
    p.add_argument("--vocab", type=int, default=512,
                   help="config.json only: vocabulary cap (default 512; 0 keeps the config's)")
    p.add_argument("--strict", action="store_true", help="exit 1 when the scan has findings (default: exit 0 whatever it finds)")
    p.add_argument("--json", action="store_true", help="print JSON (schema normscope.scan/1)")
    p.set_defaults(run=run)
    return p


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MissingExtraError("transformers", "hf") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _model_class(transformers, config):
    """The class named by the config's ``architectures``, else the causal-LM or base auto class."""
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        if type(config) in auto._model_mapping:
            return auto
    raise TargetError(f"transformers has no model class for model_type {config.model_type!r}")


def _cap(data: dict[str, Any], layers: int, vocab: int) -> list[str]:
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


def load_model(target: str, args_json=None, kwargs_json=None, layers: int = 2, vocab: int = 512):
    """The torch module TARGET names, and a note on how it was built."""
    import torch

    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"{target} is a folder without a config.json: not a Hugging Face model directory")
        transformers = _transformers()
        try:
            config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
            model = _model_class(transformers, config).from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise TargetError(f"could not load the model in {target}: {type(exc).__name__}: {exc}") from None
        return model, f"weights from {target}"
    if target.endswith(".json"):
        if not path.is_file():
            raise InputError(f"no such file: {target}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{target} is not valid JSON ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
            raise InputError(f"{target} has no \"model_type\": not a Hugging Face config.json")
        transformers = _transformers()
        notes = _cap(data, max(layers, 0), max(vocab, 0))
        model_type = data.pop("model_type")
        try:
            config = transformers.AutoConfig.for_model(model_type, **data)
        except (ValueError, KeyError, TypeError) as exc:
            raise TargetError(f"{target}: transformers cannot build a {model_type!r} config ({exc})") from None
        cls = _model_class(transformers, config)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            try:
                model = cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
            except Exception as exc:
                raise TargetError(f"{target}: building {cls.__name__} failed: {type(exc).__name__}: {exc}") from None
        return model, "random weights from " + target + (f" ({', '.join(notes)})" if notes else "")
    if ":" in target:
        from ..loading import load_target

        obj = load_target(target, args_json, kwargs_json)
        if callable(obj) and not isinstance(obj, torch.nn.Module) and not (args_json or kwargs_json):
            try:  # a factory without arguments (load_target calls factories only when arguments are given)
                obj = obj()
            except Exception as exc:
                raise TargetError(f"{target}() failed ({type(exc).__name__}: {exc}); TARGET must name a torch.nn.Module "
                                  "or a factory returning one") from None
        if not isinstance(obj, torch.nn.Module):
            raise TargetError(f"{target} gave a {type(obj).__name__}; scan takes a torch.nn.Module")
        return obj, target
    raise InputError(f"TARGET {target!r} must be package.module:factory, a Hugging Face model directory or a "
                     "config.json file")


def run(args, console: Console) -> int:
    import torch

    from ..loading import parse_shape
    from .core import scan
    from .render import render_scan

    model, origin = load_model(args.target, args.args, args.kwargs, args.layers, args.vocab)
    inputs = None
    if args.shape:
        shape = parse_shape(args.shape)
        inputs = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    result = scan(model, inputs, dtypes=args.dtypes, progress=not args.json)
    result.inputs["model"] = origin
    if args.json:
        print(result.to_json())
    else:
        console.print(f"[dim]{origin}[/]")
        render_scan(result, console)
    return EXIT_FINDINGS if args.strict and result.findings else EXIT_OK
