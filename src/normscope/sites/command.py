"""``normscope scan TARGET``: the command-line glue (``add_parser(subparsers)`` and ``run(args, console)``).

TARGET is ``package.module:factory`` (``--args``/``--kwargs`` JSON, as for infer), a local Hugging Face model
directory (its weights), or a ``config.json`` (random weights: an architecture-level scan, with the layer count
and vocabulary capped by ``--layers``/``--vocab``). Exit codes: 0 scanned, 1 findings with ``--strict``,
6 inconclusive with ``--strict`` (no finding, but sites that could not be judged: a non-finite input reaching
them), 2 usage or input error (one line on stderr).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is loaded when a command runs, not when the parser is built
    from rich.console import Console

from ..exitcodes import EXIT_OK


def add_parser(subparsers) -> Any:
    from ..model_options import INPUTS_HELP, MODEL_TARGET_HELP, add_model_args

    p = subparsers.add_parser(
        "scan",
        help="every norm site of a model: contract, role (pre/post/branch/qk/…) and block placement",
        description="Run one forward of a model, find every normalization (by class, by behaviour, functional "
                    "calls), infer each contract on its real input and classify its role from the dataflow. "
                    "Exit 0 scanned, 1 findings (with --strict), 6 inconclusive (with --strict: sites that could "
                    "not be judged, e.g. a non-finite input), 2 usage error.",
    )
    p.add_argument("target", metavar="TARGET", help=MODEL_TARGET_HELP)
    p.add_argument("--inputs", help=INPUTS_HELP)
    p.add_argument("--shape", help="the same as --inputs SHAPE: one float input of this shape, e.g. 2,8,64 "
                                   "(default: none)")
    p.add_argument("--dtypes", help="dtypes infer tries at each site (default float32,bfloat16,float16)")
    add_model_args(p, probes=True)
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when the scan has findings, 6 when it is inconclusive (default: exit 0 whatever "
                        "it finds)")
    p.add_argument("--all", action="store_true",
                   help="the complete view: one paragraph per group of sites with its γ statistics and its "
                        "real-activation error (default: the verdict, then each contract once with its sites)")
    p.add_argument("--json", action="store_true", help="print JSON (schema normscope.scan/1)")
    p.set_defaults(run=run)
    return p


def run(args, console: Console) -> int:
    """Scan the model TARGET names (resolved by normscope.sources)."""
    from ..errors import InputError
    from ..model_options import deadline, model_inputs
    from ..results.verdict import exit_code
    from ..sources import load_model
    from .core import scan
    from .render import render_scan

    if args.inputs and args.shape:
        raise InputError("give --inputs or --shape (the same as --inputs SHAPE), not both")
    model, origin = load_model(args.target, args.args, args.kwargs, args.layers, args.vocab)
    inputs = model_inputs(args.inputs or args.shape, model, "scan", "--shape" if args.shape else "--inputs")
    with deadline(args.timeout, "scan"):
        result = scan(model, inputs, dtypes=args.dtypes, progress=not args.json,
                      call_timeout=args.timeout if args.timeout else None)
    result.inputs["model"] = origin
    if args.json:
        print(result.to_json())
    else:
        console.print(f"[dim]{origin}[/]")
        render_scan(result, console, full=args.all)
    return exit_code(result.verdict) if args.strict else EXIT_OK
