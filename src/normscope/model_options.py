"""The command-line options of the commands that take a whole model (scan, diff, gradflow), and the guards every
one of them runs under: a ``--timeout`` for the whole command and an up-front estimate of the memory one forward
needs. A leaf module: each command module registers its parser with these without importing the ``cli`` package
(which imports them).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .errors import DeadlinePassed, InputError, TargetTimeout

#: the help of a TARGET that names a whole model (scan, gradflow; diff's REFERENCE)
MODEL_TARGET_HELP = ("package.module:factory, a local Hugging Face model directory, or a config.json "
                     "(random weights)")


#: the help of ``--inputs``, the one input flag of every model-level command
INPUTS_HELP = ("a shape for one float input (2,8,64), ids:B,T for token ids, or a .pt file (a tensor, tuple or dict "
               "saved with torch.save); default: a small input_ids batch for Hugging Face text models")


def add_model_args(p, what: str = "the factory", probes: bool = False) -> None:
    """The options of a TARGET that names a whole model (scan, diff, gradflow): factory arguments and the size cap
    of a config.json built with random weights. ``probes``: the command probes each site (scan), and each probe
    call gets the timeout too."""
    p.add_argument("--args", help=f"JSON list of positional arguments for {what}, e.g. '[64]' (default: none)")
    p.add_argument("--kwargs", help=f"JSON object of keyword arguments for {what} (default: none)")
    p.add_argument("--layers", type=count, default=2,
                   help="config.json only: number of layers built (default 2; 0 keeps the config's)")
    p.add_argument("--vocab", type=count, default=512,
                   help="config.json only: vocabulary cap (default 512; 0 keeps the config's)")
    p.add_argument("--timeout", type=timeout, default=0.0,
                   help="stop with exit 4 when the command runs longer than this many seconds (default 0: no "
                        "limit)" + ("; each probe call of a site gets this limit too" if probes else ""))


def count(text: str) -> int:
    """The argument type of a whole number ≥ 0 (``--layers``, ``--vocab``: 0 keeps the config's)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; give a count ≥ 0 (0 keeps the config's)")
    return value


def number(text: str) -> float:
    """The argument type of a finite number (every command's ε, γ, β, values, and the timeout below)."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def timeout(text: str) -> float:
    """The argument type of every command's ``--timeout``: a finite number of seconds ≥ 0 (0: no limit)."""
    import argparse

    value = number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the timeout must be ≥ 0 seconds (0 waits forever)")
    return value


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`TargetTimeout` (exit 4) in the command's thread when ``what`` runs past ``seconds`` (0: no
    limit). A POSIX interval timer: the signal interrupts Python between operations, so one long torch kernel
    finishes first."""
    usable = seconds > 0 and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    fired = []

    def expire(signum, frame):
        fired.append(True)
        raise DeadlinePassed  # not an Exception: no handler inside the work takes it for a site's own failure

    late = TargetTimeout(f"normscope {what} did not finish within {seconds:g} s; raise --timeout (0: no limit) or "
                         "give smaller inputs")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
        if fired:  # raised where Python ignores exceptions (a finalizer run by the garbage collector): late all the same
            raise late
    except DeadlinePassed:
        raise late from None
    except Exception:
        if fired:  # the interruption left the work in a state that failed otherwise (a torch mode stack half popped)
            raise late from None
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def memory_bytes() -> int | None:
    """This machine's physical memory (None where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def forward_bytes(model: Any, batch: int, length: int | None, elements: int) -> int:
    """About what one forward of ``model`` holds: activations of every layer (a dozen tensors of the hidden size
    per token) and, for a sequence, one layer's attention scores (batch × heads × length², float32)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    def size(keys: tuple[str, ...], default: int) -> int:
        return next((getattr(text, k) for k in keys if isinstance(getattr(text, k, None), int)), default)

    hidden = size(("hidden_size", "n_embd", "d_model"), 1024)
    layers = size(("num_hidden_layers", "n_layer", "num_layers"), 12)
    heads = size(("num_attention_heads", "n_head"), 16)
    if length is None:  # a float input: its elements through every layer
        return 4 * 12 * elements * max(layers, 1)
    return 4 * (12 * batch * length * hidden * max(layers, 1) + 2 * batch * heads * length * length)


def check_size(model: Any, what: str, batch: int, length: int | None, elements: int, smaller: str) -> None:
    """Refuse inputs whose forward needs more memory than this machine has (with the estimate and a smaller
    input to try); note on stderr those that need more than 2 GiB."""
    from .inputs import human_bytes

    need = forward_bytes(model, batch, length, elements)
    have = memory_bytes()
    if have is not None and need > 0.8 * have:
        raise InputError(f"{what}: one forward needs about {human_bytes(need)} (activations of every layer and one "
                         f"layer's attention scores), more than this machine's {human_bytes(have)}; give smaller "
                         f"inputs, e.g. {smaller}")
    if need > 2 * 2**30:
        print(f"normscope: {what}: one forward needs about {human_bytes(need)} of memory and takes a while",
              file=sys.stderr)


def check_plot_path(path: str, example: str) -> None:
    """Refuse a --plot path that could not be written, before minutes of measuring rather than after: its folder
    must exist, it must not be a folder, and its suffix must be a format matplotlib writes (``example``: a file
    name to suggest)."""
    from pathlib import Path

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    p = Path(path)
    if not p.parent.is_dir():
        raise InputError(f"--plot {path}: the folder {p.parent} does not exist; create it or pick another path")
    if p.is_dir():
        raise InputError(f"--plot {path} is a folder; give a file name such as {p / example}")
    formats = FigureCanvasAgg(Figure()).get_supported_filetypes()
    if p.suffix.lstrip(".").lower() not in formats:
        raise InputError(f"--plot {path}: the file name must end in one of .{', .'.join(sorted(formats))} "
                         "(e.g. .png)")


def model_inputs(text: str | None, model: Any, what: str, flag: str = "--inputs") -> Any:
    """``--inputs`` for ``model``: None (the model's default), a float tensor of a shape (at the dtype of the model's
    parameters), token ids ``ids:B,T``
    (below the model's vocabulary; a Hugging Face model gets them as ``input_ids=``), or what a ``.pt`` file
    holds. Refused up front (with the estimate) when one forward would not fit in memory."""
    import torch

    from .loading import parse_shape

    if text is None:
        return None
    g = torch.Generator().manual_seed(0)
    if text.endswith(".pt"):
        try:
            obj = torch.load(text, weights_only=True)
        except Exception as exc:
            raise InputError(f"--inputs {text}: could not load it with torch.load ({type(exc).__name__}: {exc})") \
                from None
        if not isinstance(obj, torch.Tensor | tuple | dict):
            raise InputError(f"--inputs {text} holds a {type(obj).__name__}; save a tensor, tuple or dict")
        return obj
    if text.startswith("ids:"):
        shape = parse_shape(text[4:], f"{flag} ids:")
        if len(shape) == 2:
            check_size(model, f"{what} --inputs {text}", shape[0], shape[1], shape[0] * shape[1],
                       f"ids:{shape[0]},{min(shape[1], 512)}")
        from .model import token_inputs, vocabulary_size

        hi = min(vocabulary_size(model) or 1000, 1000)  # token ids stay below the vocabulary
        ids = torch.randint(min(4, hi - 1), hi, shape, generator=g)
        if getattr(model, "config", None) is None:
            return ids

        return token_inputs(model, ids)  # as a Hugging Face model takes them (an encoder–decoder's decoder too)
    shape = parse_shape(text, flag)
    check_size(model, f"{what} --inputs {text}", shape[0], None, math.prod(shape),
               ",".join(map(str, (2, *shape[1:]))))
    x = torch.randn(shape, generator=g)
    # at the dtype of the model's parameters (a float64 or bfloat16 model would refuse a float32 input)
    params = model.parameters() if isinstance(model, torch.nn.Module) else ()
    dtype = next((p.dtype for p in params if p.is_floating_point()), None)
    return x.to(dtype) if dtype is not None else x
