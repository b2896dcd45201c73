"""The ``normscope`` command line.

Exit codes: 0 success, 1 a check failed, 2 usage error (one clear line on stderr), 3 not a normalization.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from .errors import InputError, NormscopeError

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_NORM = 0, 1, 2, 3


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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
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
    p.add_argument("--kind", choices=("layernorm", "rmsnorm", "both"), default="both")
    p.add_argument("--eps", type=_number, default=0.0, help="ε for the hand calculation (default 0: ignored)")
    p.add_argument("--gamma", nargs="+", type=_number, help="γ: one number or one per value")
    p.add_argument("--beta", nargs="+", type=_number, help="β: one number or one per value (LayerNorm)")
    p.add_argument("--json", action="store_true", help="print JSON (schema normscope.explain/1)")
    p.set_defaults(run=_run_explain)


def _run_explain(args, console: Console) -> int:
    from .explain import explain
    from .report.console import render_explain

    data = explain(args.values or (1.0, 2.0, 3.0), kind=args.kind, eps=args.eps, gamma=args.gamma,
                   beta=args.beta)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        render_explain(data, console)
    return EXIT_OK


def _add_presets(sub) -> None:
    p = sub.add_parser("presets", help="the contracts of well-known implementations")
    p.add_argument("--json", action="store_true", help="print JSON: name → NormSpec")
    p.set_defaults(run=_run_presets)


def _run_presets(args, console: Console) -> int:
    from .presets import PRESETS, describe
    from .report.console import render_presets

    specs = {name: factory() for name, factory in PRESETS.items()}
    if args.json:
        print(json.dumps({name: spec.to_dict() for name, spec in specs.items()}, indent=2))
    else:
        render_presets([(n, s, describe(n)) for n, s in specs.items()], console)
    return EXIT_OK


def _add_target_args(p) -> None:
    p.add_argument("target", metavar="TARGET",
                   help="package.module:attr (a module class, factory, instance or function) or a .onnx file")
    p.add_argument("--args", help="JSON list of positional arguments for a class or factory, e.g. '[64]'")
    p.add_argument("--kwargs", help="JSON object of keyword arguments, e.g. '{\"eps\": 1e-6}'")
    p.add_argument("--shape", required=True, help="input shape to probe with, e.g. 2,8,64")
    p.add_argument("--framework", choices=("torch", "numpy", "jax", "onnx"),
                   help="needed for plain functions, which could take any framework's arrays")
    p.add_argument("--dtypes", help="restrict the dtypes tried, e.g. float32,bfloat16")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _add_infer(sub) -> None:
    p = sub.add_parser(
        "infer",
        help="recover the complete contract of a black-box normalization, with evidence",
        description="Infer the NormSpec of an implementation by controlled experiments. Exit 0 inferred, "
                    "3 not a normalization, 2 usage error.",
    )
    _add_target_args(p)
    p.add_argument("--seed", type=_seed, default=0)
    p.set_defaults(run=_run_infer)


def _run_infer(args, console: Console) -> int:
    from .errors import NotANormalization
    from .loading import load_target, parse_shape
    from .probe.infer import infer
    from .report.console import render_inference

    shape = parse_shape(args.shape)
    obj = load_target(args.target, args.args, args.kwargs)
    try:
        with console.status("inferring…") as status:
            result = infer(obj, shape=shape, framework=args.framework, dtypes=args.dtypes, seed=args.seed,
                           progress=lambda msg: status.update(msg))
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
        description="Exit 0 when every finding passes, 1 when any fails, 2 on a usage error.",
    )
    _add_target_args(p)
    p.add_argument("--expect", required=True, help="a preset name (normscope presets) or a spec JSON file")
    p.add_argument("--eps", type=_number, help="override the expected ε")
    p.add_argument("--junit", metavar="PATH", help="also write JUnit XML (one testcase per finding)")
    p.add_argument("--quick", action="store_true", help="fewer grid points (about 2 s)")
    p.add_argument("--verbose", action="store_true", help="show passing grid points too")
    p.add_argument("--seed", type=_seed, default=0)
    p.set_defaults(run=_run_check)


def _run_check(args, console: Console) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .loading import load_target, parse_shape
    from .probe.checks import check, resolve_expected
    from .report.console import render_check

    shape = parse_shape(args.shape)
    expected = resolve_expected(args.expect, args.eps)
    obj = load_target(args.target, args.args, args.kwargs)
    if args.junit:
        from pathlib import Path

        junit = Path(args.junit)
        if junit.is_dir() or not junit.parent.is_dir():
            raise InputError(f"--junit {args.junit}: not a file path in an existing folder")
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=args.json) as bar:
        task = bar.add_task("checking…", total=None)
        report = check(obj, expect=expected, shape=shape, framework=args.framework, dtypes=args.dtypes,
                       quick=args.quick, seed=args.seed,
                       progress=lambda msg: bar.update(task, description=f"checking: {msg}"))
    if args.junit:
        report.to_junit(args.junit)
    if args.json:
        print(report.to_json())
    else:
        render_check(report, console, verbose=args.verbose)
        if args.junit:
            console.print(f"JUnit XML written to {args.junit}")
    return EXIT_OK if report.ok else EXIT_FAIL


COMMANDS: list[Callable] = [_add_explain, _add_presets, _add_infer, _add_check]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="normscope", description="Make normalization layers trustworthy.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"normscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console(highlight=False)
    try:
        return args.run(args, console)
    except NormscopeError as exc:
        print(f"normscope {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
