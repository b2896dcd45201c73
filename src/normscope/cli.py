"""The ``normscope`` command line.

Exit codes: 0 success, 1 a check failed, 2 usage error (one clear line on stderr), 3 not a normalization.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from .errors import NormscopeError

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_NORM = 0, 1, 2, 3


class UsageError(NormscopeError):
    """A command-line argument is wrong."""


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


COMMANDS: list[Callable] = [_add_explain, _add_presets]


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
