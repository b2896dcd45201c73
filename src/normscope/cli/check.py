"""``normscope check TARGET --expect CONTRACT``: the acceptance battery."""

from __future__ import annotations

import argparse
import sys

from ..errors import InputError
from ..exitcodes import EXIT_CODES, EXIT_CRASH
from ..model_options import number
from .common import _progress, add_target_args, note_size, target_from_args


def add_parser(sub) -> None:
    p = sub.add_parser(
        "check",
        help="run the acceptance battery of an implementation against an expected contract",
        description="Run the acceptance battery. The text output lists each section with its counts,\n"
                    "every failure and skip in full, and folds the passes (--verbose shows them).",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_args(p)
    p.add_argument("--expect", required=True,
                   help="the expected contract: a preset name (see normscope presets), with knobs as "
                        "NAME:knob=value,... (e.g. torch_groupnorm:groups=32), a spec JSON file, or a saved "
                        "`infer --json` / `check --json` output (its spec is used)")
    p.add_argument("--eps", type=number, help="override the expected ε (default: the contract's)")
    p.add_argument("--junit", metavar="PATH", help="also write JUnit XML, one testcase per finding "
                                                   "(default: none; the path is checked before anything runs)")
    p.add_argument("--quick", action="store_true", help="fewer grid points (default: the full battery)")
    p.add_argument("--verbose", action="store_true", help="list every finding, passes included "
                                                          "(default: passes folded into per-section counts)")
    p.add_argument("--brief", "-q", action="store_true", help="print the verdict and what explains it only "
                                                              "(default: the findings follow)")
    p.set_defaults(run=run)


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


def run(args, console) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..battery.check import check, resolve_expected
    from ..loading import parse_shape
    from ..report.console import render_check
    from ..results.verdict import exit_code

    if args.junit:
        _writable(args.junit)
    shape = parse_shape(args.shape)
    expected = resolve_expected(args.expect, args.eps, shape)
    t = target_from_args(args)
    note_size("check", shape)
    command = "check --quick" if args.quick else "check"
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True, disable=args.json or not console.is_terminal) as bar:
        task = bar.add_task("checking…", total=None)
        report = check(t, expect=expected, shape=shape, dtypes=args.dtypes, quick=args.quick, seed=args.seed,
                       progress=_progress(command, t, lambda msg: bar.update(task, description=msg)))
    if args.junit:
        report.to_junit(args.junit)
    if args.json:
        print(report.to_json())
    else:
        render_check(report, console, verbose=args.verbose, brief=args.brief)  # refused dtypes are findings of the report
        if args.junit:
            console.print(f"JUnit XML written to {args.junit}")
    code = exit_code(report.verdict)
    if code == EXIT_CRASH:  # never read an unknown verdict as a pass
        print(f"normscope check: internal error — the report's verdict {report.verdict!r} is none of pass, fail, "
              "inconclusive; a bug in normscope, please report it", file=sys.stderr)
    return code
