"""The ``normscope`` command line.

Exit codes (``normscope.exitcodes``; also in ``normscope --help``, the README and docs/usage.md):
0 success; 1 a check failed (and nothing else); 2 usage or input error (one line on stderr);
3 not a normalization (``infer``); 4 the target hung (a call ran past ``--timeout``); 5 ``diff``: the
candidate diverged; 6 inconclusive (``diff``, ``check``, ``contract``, ``scan --strict``, ``diagnose --strict``); 70 an
internal error (a bug, or a verdict a command does not know); 130 interrupted (Ctrl-C); 141 the output pipe was
closed (e.g. ``| head``).

Imports are lazy: ``--help`` and ``explain`` never load the probes, and torch is loaded only for a torch
target.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from ..artifacts import command as _contract
from ..divergence import command as _diff
from ..errors import NormscopeError, TargetTimeout
from ..exitcodes import (
    EXIT_BROKEN_PIPE,
    EXIT_CODES,
    EXIT_CRASH,
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_NOT_NORM,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_USAGE,
)
from ..gradient_flow import command as _gradflow
from ..sites import command as _scan
from ..tracing import command as _diagnose
from . import check, explain, infer, presets
from .common import Parser

__all__ = ["COMMANDS", "EXIT_BROKEN_PIPE", "EXIT_CODES", "EXIT_FAIL", "EXIT_INTERRUPTED", "EXIT_NOT_NORM", "EXIT_OK",
           "EXIT_TIMEOUT", "EXIT_USAGE", "build_parser", "main"]

#: The subcommands, in the order ``--help`` lists them: each module's ``add_parser(subparsers)`` registers the
#: subcommand and sets ``run(args, console) -> exit code`` as its default (scan and contract live with their code).
COMMANDS: list[Callable] = [explain.add_parser, presets.add_parser, infer.add_parser, check.add_parser,
                            _scan.add_parser, _contract.add_parser, _diff.add_parser,
                            _diagnose.add_parser, _gradflow.add_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="normscope", description="Make normalization layers trustworthy: explain, state, "
                                                   "infer and check\nthe contract of a normalization layer.",
                     epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"normscope {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=Parser, metavar="COMMAND")
    for add in dict.fromkeys(COMMANDS):  # a command listed twice is registered once
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

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # rich's own handling exits 1, which CI would read as "failed"
            self.quiet = True
            raise BrokenPipeError

    console = _Console(highlight=False)
    name = f"normscope {args.command}"
    interrupt = _InterruptRecorder()
    try:
        try:
            with interrupt, warnings.catch_warnings():  # NumPy/torch warnings from deliberate degenerate probes
                warnings.simplefilter("ignore")
                return args.run(args, console)
        finally:
            if interrupt.seen:  # Ctrl-C that native code swallowed: still an interrupt, whatever followed it
                raise KeyboardInterrupt
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
    except Exception:  # a bug in normscope: never read as a verdict (1) or a usage error (2)
        import traceback

        traceback.print_exc()
        print(f"{name}: internal error — a bug in normscope, not a verdict on what was checked; please report it "
              "with the traceback above", file=sys.stderr)
        return EXIT_CRASH


class _InterruptRecorder:
    """Record Ctrl-C while a command runs, then raise KeyboardInterrupt as Python's own handler would.

    Native code that calls back into Python (numba's and llvmlite's callbacks, OpenVINO's) can swallow the
    exception ("Exception ignored in …") and return normally; the record lets ``main`` still exit 130.
    Installed only on the main thread (the only one that receives signals) and restored on exit.
    """

    def __init__(self) -> None:
        self.seen = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def __enter__(self) -> _InterruptRecorder:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if previous is signal.default_int_handler:  # leave a caller's own handler (or SIG_IGN) alone
                self._previous = previous
                signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


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
