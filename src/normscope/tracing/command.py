"""``normscope diagnose RUN_DIR``: the command-line glue (``add_parser(subparsers)`` and ``run(args, console)``).

Reads the ``trace.jsonl`` that ``normscope.trace`` writes (also while the run is still going) and prints the first
incident, its first cause along the chain, the table of incidents and the drifts; ``--json`` prints the diagnosis
(schema ``normscope.diagnosis/2``), ``--html FILE`` writes a self-contained page with plots. Exit codes: 0
diagnosed, 1 an incident found with ``--strict``, 2 usage or input error, 6 with ``--strict``: no incident, but
part of the run could not be judged (too few recorded steps, a probe that failed, damaged lines).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the command line registers this parser without loading rich
    from rich.console import Console

from ..errors import InputError
from ..exitcodes import EXIT_FAIL as EXIT_FINDINGS
from ..exitcodes import EXIT_INCONCLUSIVE, EXIT_OK


def add_parser(subparsers) -> Any:
    p = subparsers.add_parser(
        "diagnose",
        help="the first stage, layer and head where a traced training run went wrong",
        description="Read RUN_DIR/trace.jsonl (written by normscope.trace, also while the run is going) and localize "
                    "its incidents (non-finite values, loss, gradient-norm and update spikes, learning-rate jumps) "
                    "and, for each, the first link of the residual chain that left its range: data → layer input → "
                    "norm → attention logits → sublayer → residual sum → loss → gradients → updates; drifts that "
                    "have not hurt yet are listed apart. Exit 0 diagnosed, 1 an incident (with --strict), 2 usage "
                    "or input error, 6 no incident but part of the run not judged (with --strict).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run_dir given to normscope.trace (or its trace.jsonl)")
    p.add_argument("--run", type=int, default=None, metavar="N", dest="run_number",
                   help="which training run of a folder that holds several (a tracer opened on it again with its "
                        "steps starting over): 1 the oldest, -1 the latest (default: the latest; the output says how "
                        "many there are)")
    p.add_argument("--json", action="store_true", help="print JSON (schema normscope.diagnosis/2)")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report with plots (default: none)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when there is an incident, 6 when none was found but part of the run could not be "
                        "judged (default: exit 0 whatever it finds)")
    p.add_argument("--window", type=int, default=20, help="recorded values a trend is fitted to (default 20)")
    p.add_argument("--min-history", type=int, default=8,
                   help="values a series needs before it is judged, at most --window (default 8)")
    p.add_argument("--z", type=float, default=8.0,
                   help="least robust σ of an incident or a cause, raised for the number of series (default 8)")
    p.add_argument("--lookback", type=int, default=3,
                   help="recorded steps before an incident searched for its cause (default 3)")
    p.set_defaults(run=run)
    return p


def run(args, console: Console) -> int:
    from .diagnosis import diagnose
    from .report import render_diagnosis, render_html

    d = diagnose(args.run_dir, window=args.window, min_history=args.min_history, z=args.z, lookback=args.lookback,
                 run=args.run_number)
    if args.html:
        out = Path(args.html)
        if out.parent and not out.parent.exists():
            raise InputError(f"--html {args.html}: folder {out.parent} does not exist")
        out.write_text(render_html(d), encoding="utf-8")
    if args.json:
        print(d.to_json())
    else:
        render_diagnosis(d, console)
        if args.html:
            console.print(f"[dim]HTML report: {args.html}[/]")
    if not args.strict or d.ok:
        return EXIT_OK
    return EXIT_FINDINGS if d.incidents else EXIT_INCONCLUSIVE
