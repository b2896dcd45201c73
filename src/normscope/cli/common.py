"""What the subcommands share: argument types, the parser class, the TARGET arguments, progress.

Imports are lazy: building the parser loads neither NumPy nor torch nor rich.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

from ..exitcodes import EXIT_USAGE
from ..model_options import timeout  # one argument type for every command's --timeout

TYPICAL_CALLS = {"infer": 40, "check --quick": 45, "check": 70}  # measured on torch LayerNorm/RMSNorm
SLOW_CALL_S = 0.25  # slower calls than this get an up-front time estimate on stderr


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the seed must be ≥ 0")
    return value


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        from ..inputs import shorten

        message = re.sub(r"'[^']{80,}'", lambda m: shorten(m.group(0)[1:-1], as_text=True), message)  # never echo 60 KB
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def add_target_args(p) -> None:
    # let "--shape -1,64" reach the shape check (one clear error) instead of reading "-1,64" as an option
    p._negative_number_matcher = re.compile(r"^-\d[\d,]*$")
    p.add_argument("target", metavar="TARGET",
                   help="package.module:attr (a module class, factory, instance or function) or a .onnx file; "
                        "the module is imported, so its top-level code runs")
    p.add_argument("--args", help="JSON list of positional arguments for a class or factory, e.g. '[64]'; "
                                  "'[]' calls a factory with none (default: a class is called with none, "
                                  "anything else is used as it is)")
    p.add_argument("--kwargs", help="JSON object of keyword arguments, e.g. '{\"eps\": 1e-6}' (default: none)")
    p.add_argument("--shape", required=True,
                   help="input shape to probe with, e.g. 2,8,64 (required; small leading sizes are enough)")
    p.add_argument("--framework", choices=("torch", "numpy", "jax", "onnx"),
                   help="needed for plain functions, which could take any framework's arrays "
                        "(default: from the object: torch modules, .onnx files)")
    p.add_argument("--dtypes", help="restrict the dtypes tried, e.g. float32,bfloat16 (default: float32, float16, "
                                    "bfloat16 for check; every dtype for infer); a dtype the target refuses is "
                                    "not run and is named with the refusal")
    p.add_argument("--timeout", type=timeout, default=60.0,
                   help="seconds one call of the target may take before it is reported as hung, exit 4 "
                        "(default: 60; 0 waits forever)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random probe inputs (default: 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def target_from_args(args):
    """The Target the command line names, with its per-call timeout."""
    from ..sources import load_target
    from ..targets import as_target

    t = as_target(load_target(args.target, args.args, args.kwargs), args.framework)
    t.timeout = args.timeout or None
    return t


def _progress(command: str, t, on_update: Callable[[str], None]) -> Callable[[str], None]:
    """A progress callback showing the section, the calls so far and the time per call.

    A slow target (more than SLOW_CALL_S per call) gets one line on stderr with the expected total,
    which also shows in CI logs where the live status line does not.
    """
    import time

    started, calls0, warned = time.perf_counter(), t.calls, []

    def update(msg: str) -> None:
        calls = t.calls - calls0
        per_call = (time.perf_counter() - started) / calls if calls else 0.0
        on_update(f"{command}: {msg} · {calls} calls, {per_call:.2f} s per call")
        if per_call > SLOW_CALL_S and calls >= 2 and not warned:
            warned.append(True)
            typical = TYPICAL_CALLS[command]
            print(f"normscope {command.split()[0]}: {t.description} takes {per_call:.2f} s per call; "
                  f"{command} usually makes about {typical} calls (≈ {per_call * typical:.0f} s)", file=sys.stderr)

    return update


def note_size(command: str, shape) -> None:
    from ..inputs import human_bytes, probe_bytes

    if probe_bytes(shape) > 2**30:
        print(f"normscope {command}: probing at shape {shape} needs about {human_bytes(probe_bytes(shape))} of "
              "memory and takes long; small leading sizes are enough, e.g. --shape 2,"
              f"{','.join(map(str, shape[1:]))}", file=sys.stderr)
