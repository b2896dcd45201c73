"""``normscope infer TARGET``: the contract of a black-box normalization, with evidence."""

from __future__ import annotations

import argparse

from ..exitcodes import EXIT_CODES, EXIT_NOT_NORM, EXIT_OK
from .common import _progress, add_target_args, note_size, target_from_args


def add_parser(sub) -> None:
    p = sub.add_parser(
        "infer",
        help="recover the complete contract of a black-box normalization, with evidence",
        description="Infer the NormSpec of an implementation by controlled experiments.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_args(p)
    p.add_argument("--brief", "-q", action="store_true", help="print the contract, how decisive its evidence is and "
                                                              "its validation only (default: each field's "
                                                              "experiment and numbers follow)")
    p.set_defaults(run=run)


def run(args, console) -> int:
    import json

    from ..errors import NotANormalization
    from ..loading import parse_shape
    from ..probe.infer import infer
    from ..report.console import render_inference

    shape = parse_shape(args.shape)
    t = target_from_args(args)
    note_size("infer", shape)
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
        render_inference(result, console, brief=args.brief)
    return EXIT_OK
