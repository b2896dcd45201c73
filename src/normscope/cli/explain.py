"""``normscope explain``: the worked LayerNorm/RMSNorm hand calculation."""

from __future__ import annotations

import re

from ..exitcodes import EXIT_OK
from ..model_options import number


def add_parser(sub) -> None:
    p = sub.add_parser(
        "explain",
        help="the worked LayerNorm/RMSNorm hand calculation, invariances and the ε gain cap",
        description="Step-by-step LayerNorm and RMSNorm of a small vector, with every intermediate.",
    )
    p.add_argument("values", nargs="*", type=number, help="the input vector (default: 1 2 3)")
    # let "-2e3" be a value, not an option (argparse only recognises -2000 and -2.5 by default)
    p._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
    p.add_argument("--kind", choices=("layernorm", "rmsnorm", "both"), default="both",
                   help="which norm to work through (default: both)")
    p.add_argument("--eps", type=number, default=0.0, help="ε for the hand calculation (default 0: ignored)")
    p.add_argument("--gamma", nargs="+", type=number, help="γ: one number or one per value (default: none)")
    p.add_argument("--beta", nargs="+", type=number, help="β: one number or one per value, LayerNorm only "
                                                           "(default: none)")
    p.add_argument("--json", action="store_true", help="print JSON (schema normscope.explain/1)")
    p.set_defaults(run=run)


def run(args, console) -> int:
    import json

    from ..explain import explain
    from ..report.console import render_explain

    data = explain(args.values or (1.0, 2.0, 3.0), kind=args.kind, eps=args.eps, gamma=args.gamma,
                   beta=args.beta)
    if args.json:
        print(json.dumps(data, indent=2, allow_nan=False))
    else:
        render_explain(data, console)
    return EXIT_OK
