"""``normscope contract FILE [FILE2]``: the static contract of a model artifact, or every mismatch between two.

Exit codes: 0 the contract was read (one file) or every site stated on both sides was compared without a
mismatch (two files), 1 the two artifacts mismatch, 6 inconclusive (no mismatch, but a site is unverified or
nothing was compared: the reason names the sites), 2 bad input (one clear line on stderr).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is loaded when a command runs, not when the parser is built
    from rich.console import Console

from ..exitcodes import EXIT_CRASH, EXIT_OK


def add_parser(subparsers) -> None:
    from ..model_options import INPUTS_HELP

    p = subparsers.add_parser(
        "contract",
        help="the static norm contract of a checkpoint (HF config/dir, GGUF, ONNX) or every mismatch between two",
        description="Read every norm site's contract from a model artifact without running it; given two, list "
                    "every mismatch site by site. Exit 0 read / no mismatch, 1 mismatch, 6 inconclusive (a site "
                    "unverified or nothing compared), 2 bad input.",
    )
    p.add_argument("file", metavar="FILE", help="an HF config.json or model directory, a .gguf, an .onnx, or a "
                                                "saved contract JSON")
    p.add_argument("file2", metavar="FILE2", nargs="?", help="a second artifact to compare with the first")
    p.add_argument("--live", action="store_true",
                   help="run FILE (an HF model directory, a config.json or package.module:factory), scan it and "
                        "compare the measured contract with FILE2's static one (default: read FILE statically)")
    p.add_argument("--inputs", help="with --live: " + INPUTS_HELP)
    p.add_argument("--json", action="store_true",
                   help="print JSON (schema normscope.contract/1, or normscope.contract-diff/1 for two files)")
    p.set_defaults(run=run)


def run(args, console: Console) -> int:
    from ..results.verdict import exit_code
    from . import compare, contract
    from .render import render_contract, render_diff

    if args.live:
        if args.file2 is None:
            from ..errors import InputError

            raise InputError("--live compares a running model with a static artifact: give FILE2 (e.g. the .gguf)")
        a = _scanned(args.file, args.inputs)
    else:
        if args.inputs:
            from ..errors import InputError

            raise InputError("--inputs applies to --live (a model that runs); a static artifact is only read")
        a = contract(args.file)
    if args.file2 is None:
        if args.json:
            print(a.to_json())
        else:
            render_contract(a, console)
        return EXIT_OK
    b = contract(args.file2)
    diff = compare(a, b)
    if args.json:
        data = diff.to_dict()
        data["contracts"] = [a.to_dict(), b.to_dict()]
        print(json.dumps(data, indent=2))
    else:
        render_contract(a, console)
        render_contract(b, console)
        render_diff(diff, console)
    code = exit_code(diff.verdict)
    if code == EXIT_CRASH:  # never read an unknown verdict as a pass
        import sys

        print(f"normscope contract: internal error — the verdict {diff.verdict!r} is none of pass, fail, "
              "inconclusive; a bug in normscope, please report it", file=sys.stderr)
    return code


def _scanned(target: str, inputs: str | None = None):
    """The contract a live scan of TARGET measures (its real weights; random ones for a config.json)."""
    from ..model_options import model_inputs
    from ..sites.core import scan
    from ..sources import load_model
    from .model import ModelContract

    model, origin = load_model(target)
    x = model_inputs(inputs, model, "contract --live")
    out = ModelContract.from_scan(scan(model, x, progress=False), source=f"{target} (scanned: {origin})")
    return out.without_weights() if origin.startswith("random weights") else out  # γ/β drawn here: not stated
