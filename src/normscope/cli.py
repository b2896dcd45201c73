"""The ``normscope`` command line.

Exit codes (also in ``normscope --help``, the README and docs/usage.md):
0 success; 1 a check failed (and nothing else); 2 usage or input error (one line on stderr);
3 not a normalization (``infer``); 4 the target hung (a call ran past ``--timeout``);
130 interrupted (Ctrl-C); 141 the output pipe was closed (e.g. ``| head``).

Imports are lazy: ``--help`` and ``explain`` never load the probes, and torch is loaded only for a torch
target.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence

from .errors import InputError, NormscopeError, TargetTimeout

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_NORM, EXIT_TIMEOUT = 0, 1, 2, 3, 4
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141
EXIT_CODES = """exit codes:
  0    success (check: every finding passed)
  1    a check failed: a check finding, a contract mismatch between two
       artifacts, a scan finding with --strict (never used for anything else)
  2    usage or input error: one line on stderr names the problem and the fix
  3    infer: the target is not a normalization
  4    the target hung: one call ran longer than --timeout
  130  interrupted (Ctrl-C)
  141  the output pipe was closed early (e.g. normscope ... --json | head)"""
TYPICAL_CALLS = {"infer": 40, "check --quick": 45, "check": 70}  # measured on torch LayerNorm/RMSNorm
SLOW_CALL_S = 0.25  # slower calls than this get an up-front time estimate on stderr


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the seed must be ≥ 0")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _timeout(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the timeout must be ≥ 0 seconds (0 waits forever)")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        from .inputs import shorten

        message = re.sub(r"'[^']{80,}'", lambda m: shorten(m.group(0)[1:-1], as_text=True), message)  # never echo 60 KB
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_explain(sub) -> None:
    p = sub.add_parser(
        "explain",
        help="the worked LayerNorm/RMSNorm hand calculation, invariances and the ε gain cap",
        description="Step-by-step LayerNorm and RMSNorm of a small vector, with every intermediate.",
    )
    p.add_argument("values", nargs="*", type=_number, help="the input vector (default: 1 2 3)")
    # let "-2e3" be a value, not an option (argparse only recognises -2000 and -2.5 by default)
    p._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
    p.add_argument("--kind", choices=("layernorm", "rmsnorm", "both"), default="both",
                   help="which norm to work through (default: both)")
    p.add_argument("--eps", type=_number, default=0.0, help="ε for the hand calculation (default 0: ignored)")
    p.add_argument("--gamma", nargs="+", type=_number, help="γ: one number or one per value (default: none)")
    p.add_argument("--beta", nargs="+", type=_number, help="β: one number or one per value, LayerNorm only "
                                                           "(default: none)")
    p.add_argument("--json", action="store_true", help="print JSON (schema normscope.explain/1)")
    p.set_defaults(run=_run_explain)


def _run_explain(args, console) -> int:
    import json

    from .explain import explain
    from .report.console import render_explain

    data = explain(args.values or (1.0, 2.0, 3.0), kind=args.kind, eps=args.eps, gamma=args.gamma,
                   beta=args.beta)
    if args.json:
        print(json.dumps(data, indent=2, allow_nan=False))
    else:
        render_explain(data, console)
    return EXIT_OK


def _add_presets(sub) -> None:
    p = sub.add_parser("presets", help="the contracts of well-known implementations, with their knobs",
                       description="Built-in contracts. Use one with --expect NAME, and set its knobs with "
                                   "--expect NAME:knob=value,knob=value (e.g. torch_groupnorm:groups=32).")
    p.add_argument("--json", action="store_true", help="print JSON: name → NormSpec (defaults of the knobs)")
    p.set_defaults(run=_run_presets)


def _run_presets(args, console) -> int:
    import json

    from .presets import PRESETS, describe, knobs
    from .report.console import render_presets

    specs = {name: factory() for name, factory in PRESETS.items()}
    if args.json:
        print(json.dumps({name: spec.to_dict() for name, spec in specs.items()}, indent=2))
    else:
        render_presets([(n, s, describe(n), knobs(n)) for n, s in specs.items()], console)
    return EXIT_OK


def _add_target_args(p) -> None:
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
    p.add_argument("--timeout", type=_timeout, default=60.0,
                   help="seconds one call of the target may take before it is reported as hung, exit 4 "
                        "(default: 60; 0 waits forever)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random probe inputs (default: 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _add_infer(sub) -> None:
    p = sub.add_parser(
        "infer",
        help="recover the complete contract of a black-box normalization, with evidence",
        description="Infer the NormSpec of an implementation by controlled experiments.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target_args(p)
    p.set_defaults(run=_run_infer)


def _target(args):
    """The Target the command line names, with its per-call timeout."""
    from .loading import load_target
    from .targets import as_target

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


def _note_size(command: str, shape) -> None:
    from .inputs import human_bytes, probe_bytes

    if probe_bytes(shape) > 2**30:
        print(f"normscope {command}: probing at shape {shape} needs about {human_bytes(probe_bytes(shape))} of "
              "memory and takes long; small leading sizes are enough, e.g. --shape 2,"
              f"{','.join(map(str, shape[1:]))}", file=sys.stderr)


def _run_infer(args, console) -> int:
    import json

    from .errors import NotANormalization
    from .loading import parse_shape
    from .probe.infer import infer
    from .report.console import render_inference

    shape = parse_shape(args.shape)
    t = _target(args)
    _note_size("infer", shape)
    try:
        with console.status("inferring…") as status:
            result = infer(t, shape=shape, dtypes=args.dtypes, seed=args.seed,
                           progress=_progress("infer", t, status.update))
    except NotANormalization as exc:
        if args.json:
            print(json.dumps({"schema": "normscope.inference/1", "target": args.target,
                              "not_a_normalization": str(exc)}, indent=2))
        else:
            console.print(f"[bold red]not a normalization:[/] {exc}")
        return EXIT_NOT_NORM
    if args.json:
        print(result.to_json())
    else:
        render_inference(result, console)
    return EXIT_OK


def _add_check(sub) -> None:
    p = sub.add_parser(
        "check",
        help="run the acceptance battery of an implementation against an expected contract",
        description="Run the acceptance battery. The text output lists each section with its counts,\n"
                    "every failure and skip in full, and folds the passes (--verbose shows them).",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target_args(p)
    p.add_argument("--expect", required=True,
                   help="the expected contract: a preset name (see normscope presets), with knobs as "
                        "NAME:knob=value,... (e.g. torch_groupnorm:groups=32), a spec JSON file, or a saved "
                        "`infer --json` / `check --json` output (its spec is used)")
    p.add_argument("--eps", type=_number, help="override the expected ε (default: the contract's)")
    p.add_argument("--junit", metavar="PATH", help="also write JUnit XML, one testcase per finding "
                                                   "(default: none; the path is checked before anything runs)")
    p.add_argument("--quick", action="store_true", help="fewer grid points (default: the full battery)")
    p.add_argument("--verbose", action="store_true", help="list every finding, passes included "
                                                          "(default: passes folded into per-section counts)")
    p.set_defaults(run=_run_check)


def _writable(path_text: str) -> None:
    """Refuse a --junit path that cannot be written, before the battery runs."""
    import os
    from pathlib import Path

    path = Path(path_text)
    if path.is_dir() or not path.parent.is_dir():
        raise InputError(f"--junit {path_text}: not a file path in an existing folder")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise InputError(f"--junit {path_text}: cannot write there ({exc.strerror or exc})") from None
    if not existed:
        os.remove(path)


def _run_check(args, console) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .loading import parse_shape
    from .probe.checks import check, resolve_expected
    from .report.console import render_check
    from .targets.base import check_dtype_list

    if args.junit:
        _writable(args.junit)
    shape = parse_shape(args.shape)
    expected = resolve_expected(args.expect, args.eps, shape)
    t = _target(args)
    _note_size("check", shape)
    command = "check --quick" if args.quick else "check"
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=args.json) as bar:
        task = bar.add_task("checking…", total=None)
        report = check(t, expect=expected, shape=shape, dtypes=args.dtypes, quick=args.quick, seed=args.seed,
                       progress=_progress(command, t, lambda msg: bar.update(task, description=msg)))
    if args.junit:
        report.to_junit(args.junit)
    if args.json:
        print(report.to_json())
    else:
        asked = check_dtype_list(args.dtypes) or ("float32", "float16", "bfloat16")
        refused = {d: t.rejection(d) for d in asked if d not in report.dtypes}
        render_check(report, console, verbose=args.verbose, refused=refused)
        if args.junit:
            console.print(f"JUnit XML written to {args.junit}")
    return EXIT_OK if report.ok else EXIT_FAIL


def _add_scan(sub) -> None:
    from .sites.command import add_parser

    add_parser(sub)


def _add_contract(sub) -> None:
    from .artifacts.command import add_parser

    add_parser(sub)


COMMANDS: list[Callable] = [_add_explain, _add_presets, _add_infer, _add_check, _add_scan, _add_contract]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="normscope", description="Make normalization layers trustworthy: explain, state, "
                                                   "infer and check\nthe contract of a normalization layer.",
                     epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"normscope {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see EXIT_CODES). Nothing raises out of it."""
    import warnings

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors: argparse's own exit
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    from rich.console import Console

    console = Console(highlight=False)
    name = f"normscope {args.command}"
    try:
        with warnings.catch_warnings():  # NumPy/torch warnings from deliberate degenerate probes
            warnings.simplefilter("ignore")
            return args.run(args, console)
    except TargetTimeout as exc:
        print(f"{name}: the target hung: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    except NormscopeError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _silence_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so Python's final flush does not fail again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
